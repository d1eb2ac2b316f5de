"""Adaptive spec strings (decent_comm.topology.spec.parse, reached through make("adaptive:...")): what they
build, and that every error quotes the whole spec and the offending token and says what is expected."""
import pytest

from decent_comm import topology as T
from decent_comm.topology.spec import OPTIONS, parse

CONSENSUS = "adaptive:consensus:ring,complete"

# (spec, offending token, what the message must say is expected)
BAD_SPECS = [
    # form and policy
    ("adaptive:consensus", "adaptive:consensus", "adaptive:phase:<topology>@<first step>"),
    ("adaptive:nope:ring", "nope", "'consensus' or 'phase'"),
    ("adaptive::ring", "", "'consensus' or 'phase'"),
    # phase items
    ("adaptive:phase:complete@abc,ring@10", "complete@abc", "expected an integer >= 0"),
    ("adaptive:phase:complete@0,ring@-5", "ring@-5", "expected an integer >= 0"),
    ("adaptive:phase:complete@0,ring@2.5", "ring@2.5", "expected an integer >= 0"),
    ("adaptive:phase:complete@0,ring", "ring", "<topology>@<first step>"),
    ("adaptive:phase:ring@3", "ring@3", "must start at step 0"),
    ("adaptive:phase:complete@0,ring@10,exp@10", "exp@10", "increasing order"),
    ("adaptive:phase:complete@0,@5", "@5", "empty topology name"),
    ("adaptive:phase:complete@0,hypercube@5", "hypercube@5", "one of complete, ring"),
    ("adaptive:phase:complete@0,ring@5:kappa=1", "kappa=1", "takes none"),
    # consensus candidates
    ("adaptive:consensus:ring,bogus", "bogus", "one of complete, ring"),
    ("adaptive:consensus:ring,,complete", "", "empty topology name"),
    ("adaptive:consensus:ring,Ring", "Ring", "candidates must be distinct"),
    # consensus options
    (CONSENSUS + ":kappa", "kappa", "key=value"),
    (CONSENSUS + ":kappa=", "kappa=", "key=value"),
    (CONSENSUS + ":=2", "=2", "key=value"),
    (CONSENSUS + ":kappa=1,", "", "key=value"),
    (CONSENSUS + ":foo=1", "foo=1", "valid options: kappa, low, high, interval"),
    (CONSENSUS + ":target=1", "target=1", "valid options"),
    (CONSENSUS + ":kappa=abc", "kappa=abc", "kappa must be a finite number > 0"),
    (CONSENSUS + ":kappa=inf", "kappa=inf", "kappa must be a finite number > 0"),
    (CONSENSUS + ":interval=0", "interval=0", "interval must be an integer >= 1"),
    (CONSENSUS + ":interval=2.5", "interval=2.5", "interval must be an integer >= 1"),
    (CONSENSUS + ":min_dwell=-1", "min_dwell=-1", "min_dwell must be an integer >= 0"),
    (CONSENSUS + ":calibrate=maybe", "calibrate=maybe", "true or false"),
    (CONSENSUS + ":kappa=1,kappa=2", "kappa=2", "a second time"),
    (CONSENSUS + ":kappa=-1", "kappa=-1", "kappa must be > 0"),
    (CONSENSUS + ":low=2,high=1", "low=2,high=1", "need 0 < low < high"),
    (CONSENSUS + ":correlation=1", "correlation=1", "correlation must be in [0, 1)"),
    (CONSENSUS + ":initial=exp", "initial=exp", "'densest', 'sparsest' or one of the candidates (ring, complete)"),
]


@pytest.mark.parametrize("spec,token,expected", BAD_SPECS)
def test_every_parse_error_quotes_spec_and_token(spec, token, expected):
    with pytest.raises(ValueError) as e:
        T.make(spec, 4)
    msg = str(e.value)
    assert repr(spec) in msg, msg
    assert repr(token) in msg or token == spec, msg
    assert expected in msg, msg
    with pytest.raises(ValueError) as unbound:  # the same message without a world size
        parse(spec)
    assert str(unbound.value) == msg


def test_the_reported_example():
    with pytest.raises(ValueError) as e:
        T.make("adaptive:phase:complete@abc,ring@10", 4)
    assert str(e.value) == ("adaptive spec 'adaptive:phase:complete@abc,ring@10': 'complete@abc' has first step"
                            " 'abc'; expected an integer >= 0, as in <topology>@<first step> (e.g. one-peer-exp@100)")


def test_errors_of_binding_name_the_spec():
    with pytest.raises(ValueError) as e:
        T.make("adaptive:consensus:aer,complete", 12, local_world_size=4)
    assert "'adaptive:consensus:aer,complete'" in str(e.value) and "3 nodes" in str(e.value)
    with pytest.raises(ValueError, match="not of the form"):
        parse("consensus:ring,complete")
    with pytest.raises(ValueError, match="MAX_WORLD_SIZE"):
        T.make(CONSENSUS, 10 ** 18)


def test_options_are_typed_and_names_canonical():
    a = T.make("adaptive:consensus:One_Peer_Exp,COMPLETE:kappa=2,interval=5,min_dwell=0,initial=one_peer_exp,"
               "correlation=0.5,hold_while_lr_rises=false,calibrate=0,low=0.25,high=2", 8)
    p = a.policy
    assert a.names == ["one-peer-exp", "complete"] and a.current_name == "one-peer-exp"
    assert (p.kappa, p.interval, p.min_dwell, p.correlation, p.low, p.high) == (2.0, 5, 0, 0.5, 0.25, 2.0)
    assert type(p.kappa) is float and type(p.interval) is int and type(p.min_dwell) is int
    assert p.hold_while_lr_rises is False and p.calibrate is False and p.initial_choice == "one-peer-exp"
    assert set(OPTIONS) <= set(T.ConsensusControl.__init__.__code__.co_varnames)
    for spelled, meant in (("Densest", "densest"), ("SPARSEST", "sparsest")):  # any case, as the names (refused)
        assert T.make(f"adaptive:consensus:ring,complete:initial={spelled}", 4).policy.initial_choice == meant
    phase = T.make("adaptive:phase: Complete@0 , one_peer_exp@ 10", 8)
    assert phase.policy.phases == [("complete", 0), ("one-peer-exp", 10)]
    assert T.make("adaptive:phase:complete@0", 4).schedule() == [(0, "complete")]
