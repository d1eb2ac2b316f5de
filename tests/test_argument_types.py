"""Numeric arguments of the public entry points, by type (decent_comm._args, the one rule they share): a bool is
not a number, numpy integers are integers, an integer option takes no float, a real option no string and no NaN.
Each case here was taken silently, truncated, or refused with another exception type (OverflowError,
AttributeError, IndexError, ZeroDivisionError) before. One process, no communication."""

import math

import numpy as np
import pytest
import torch

import decent_comm
from decent_comm import ops
from decent_comm import runtime_model as rm
from decent_comm import topology as T
from decent_comm.exchange.exchanger import _check_max_ctas

INF, NAN = float("inf"), float("nan")


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6))]


def _cluster(**kw):
    return rm.ClusterConfig(**{"nodes": 2, "ranks_per_node": 2, "inter_bandwidth": 1e9, "intra_bandwidth": 1e10,
                               **kw})


def _workload(**kw):
    return rm.Workload(**{"params": 1e6, "compute": rm.ComputeTime(0.1), **kw})


def _replica_variance(every):
    opt = decent_comm.DSGD(_params(), lr=0.1)
    return opt.replica_variance(every=every)


def _control(**kw):
    return T.ConsensusControl(**kw)


# (id, call, exception type, a pattern the message must hold: the argument's name)
REFUSED = [
    # A. integer options: inf overflowed, a bool was 1, 0.5 was truncated to 0
    *[(f"AccumAdamW(accum_steps={v!r})", lambda v=v: decent_comm.AccumAdamW(_params(), accum_steps=v), ValueError,
       "accum_steps must be an integer >= 1") for v in (INF, True)],
    ("replica_variance(every=inf)", lambda: _replica_variance(INF), ValueError, "every must be an integer >= 1"),
    *[(f"AdaptiveConsensus(start_step={v!r})", lambda v=v: decent_comm.AdaptiveConsensus(start_step=v), ValueError,
       "start_step must be an integer >= 0") for v in (INF, 0.5, np.float32(1.5), torch.tensor(0.5), True)],
    ("hparams(world_size=inf)", lambda: decent_comm.decentralized_adam_hparams(1e-3, world_size=INF), ValueError,
     "world_size must be an integer >= 1"),
    ("hparams(accum_steps=inf)", lambda: decent_comm.decentralized_adam_hparams(1e-3, 4, accum_steps=INF),
     ValueError, "accum_steps must be an integer >= 1"),
    *[(f"ConsensusControl(interval={v!r})", lambda v=v: _control(interval=v), ValueError,
       "interval must be an integer >= 1") for v in (INF, True)],
    *[(f"Workload(bytes_per_param={v!r})", lambda v=v: _workload(bytes_per_param=v), ValueError,
       "bytes_per_param must be a finite number > 0") for v in (INF, NAN, True)],
    # B. a bool taken as a number
    *[(f"{cls.__name__}(weight_decay=True)", lambda cls=cls: cls(_params(), lr=0.1, weight_decay=True), ValueError,
       "weight_decay must be a number, got True") for cls in (decent_comm.DSGD, decent_comm.DAdam)],
    *[(f"AdaptiveConsensus({k}=True)", lambda k=k: decent_comm.AdaptiveConsensus(**{k: True}), ValueError,
       f"{k} must be a") for k in ("p", "min_factor")],
    ("hparams(lr=True)", lambda: decent_comm.decentralized_adam_hparams(True, 4), ValueError, "lr must be a"),
    ("ClusterConfig(inter_bandwidth=True)", lambda: _cluster(inter_bandwidth=True), ValueError,
     r"inter_bandwidth \(bytes/s\) must be a number > 0, got True"),
    ("Workload(bucket_bytes=True)", lambda: _workload(bucket_bytes=True), ValueError, "bucket_bytes must be a"),
    # C. strings (float() parsed them) and the consensus factor's two doors agreeing
    ("DSGD(dampening='0.1')", lambda: decent_comm.DSGD(_params(), lr=0.1, momentum=0.9, dampening="0.1"),
     TypeError, "dampening must be a float"),
    *[(f"with_consensus(t, {a!r})", lambda a=a: T.with_consensus(T.make("ring", 4), a), ValueError,
       "consensus factor must be a number in \\[0, 1\\]") for a in ("0.1", True, torch.tensor(0.5, device="meta"))],
    # D. NaN taken
    ("AdaptiveConsensus(p=nan)", lambda: decent_comm.AdaptiveConsensus(p=NAN), ValueError, "p must be a finite"),
    ("simulate(warmup=-1)", lambda: rm.simulate(_cluster(), _workload(), "ring", steps=20, warmup=-1), ValueError,
     "warmup must be an integer >= 0"),
    ("simulate_allreduce(warmup=-1)", lambda: rm.simulate_allreduce(_cluster(), _workload(), steps=20, warmup=-1),
     ValueError, "warmup must be an integer >= 0"),
    # E. another exception type (AttributeError, IndexError, ZeroDivisionError) or a wrong result
    *[(f"predict(topology={type(t).__name__})", lambda t=t: rm.predict(_cluster(), _workload(), t), TypeError,
       "topology must be a built-in name or a decent_comm.topology.Topology")
      for t in (None, 3, [[1.0]], torch.eye(4))],
    *[(f"PhaseSchedule({p!r})", lambda p=p: T.PhaseSchedule(p), ValueError, "PhaseSchedule: ")
      for p in ("abc", [("ring", 0), "exp"], [("ring", 0.5)], {"ring": 0}, 7)],
    *[(f"int8_payload_nbytes(block={b})", lambda b=b: ops.int8_payload_nbytes(100, b), ValueError,
       "int8_payload_nbytes: block must be a multiple of 4 in \\[4, 8192\\]") for b in (0, -1, 3, 8196)],
    ("int8_payload_nbytes(numel=-5)", lambda: ops.int8_payload_nbytes(-5), ValueError, "numel must be >= 0"),
    ("int8_payload_views(list)", lambda: ops.int8_payload_views([0] * 516), ValueError, "payload must be a tensor"),
    ("int8_payload_views(block=-1)", lambda: ops.int8_payload_views(torch.zeros(516, dtype=torch.uint8), -1),
     ValueError, "block must be a multiple of 4"),
    *[(f"peers(rank={r!r})", lambda r=r: T.make("ring", 4).peers(r, 0), ValueError, "rank must be an integer")
      for r in (0.5, True)],
]


@pytest.mark.parametrize("call,error,pattern", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_with_the_argument_named(call, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        call()
    assert type(info.value) is error  # not a subclass standing in for it (UnitError, ...)


@pytest.mark.parametrize("key,value", [("lr", "0.1"), ("momentum", "0.9"), ("dampening", "0.1"),
                                       ("weight_decay", "0.1"), ("lr", None)])
def test_a_param_group_edited_to_a_string_is_torchs_type_error_not_a_float(key, value):
    """torch.optim.SGD raises TypeError at its step (`-lr`, `1 - dampening`); the kernels float()ed the string and
    trained. The group's parameters are left as they were."""
    params = _params()
    opt = decent_comm.DSGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(6)
    before = params[0].detach().clone()
    opt.param_groups[0][key] = value
    with pytest.raises(TypeError, match=f"param group 0\\): {key} must be a float or a 1-element tensor"):
        opt.step()
    assert torch.equal(params[0].detach(), before)
    with pytest.raises(TypeError):  # torch's own answer to the same edit (its momentum is read from step 2 on)
        tp = [torch.nn.Parameter(before.clone())]
        topt = torch.optim.SGD(tp, lr=0.1, momentum=0.9)
        tp[0].grad = torch.ones(6)
        topt.param_groups[0][key] = value
        topt.step()
        topt.step()


def test_adam_eps_edited_to_a_string_is_refused():
    params = _params()
    opt = decent_comm.DAdam(params, lr=0.1)
    params[0].grad = torch.ones(6)
    opt.param_groups[0]["eps"] = "1e-8"
    with pytest.raises(TypeError, match="eps must be a float"):
        opt.step()


# ------------------------------------------------------------------- numpy integers are integers, as Python's

def _train(**kw):
    params = _params()
    opt = decent_comm.DSGD(params, lr=0.1, momentum=0.9, **kw)
    for t in range(4):
        params[0].grad = torch.full((6,), float(t + 1))
        opt.step()
    return params[0].detach().clone()


@pytest.mark.parametrize("kw,same_as", [
    (dict(gossip_every=np.int64(2), warmup_steps=np.int64(1)), dict(gossip_every=2, warmup_steps=1)),
    (dict(bucket_cap_mb=np.int64(1)), dict(bucket_cap_mb=1)),
    (dict(bucket_cap_mb=np.float32(0.5)), dict(bucket_cap_mb=0.5)),
], ids=["cadence", "bucket_cap_mb-int64", "bucket_cap_mb-float32"])
def test_numpy_options_train_as_the_python_ones(kw, same_as):
    assert torch.equal(_train(**kw), _train(**same_as))


def test_numpy_integers_in_the_runtime_model_and_the_exchange():
    c = _cluster(nodes=np.int64(2), ranks_per_node=np.int64(2))
    assert c == _cluster() and type(c.nodes) is int
    assert rm.predict(c, _workload(), "ring") == rm.predict(_cluster(), _workload(), "ring")
    _check_max_ctas(np.int64(4))  # refused before ("must be a positive int")
    with pytest.raises(ValueError, match="nccl_max_ctas must be an integer >= 1, got True"):
        _check_max_ctas(True)


def test_the_helpers_results():
    """What the refusals above stand on: the rule itself, against Python's own notion of an integer and a real."""
    from decent_comm._args import integer, real
    assert integer(np.int64(7), "n") == 7 and type(integer(np.int64(7), "n")) is int
    assert integer(torch.tensor(3), "n") == 3
    assert real(np.float32(0.5), "x") == 0.5 and real(10 ** 400, "x", finite=False) == math.inf
    with pytest.raises(ValueError, match="x must be a finite number, got 1000"):
        real(10 ** 400, "x")
    with pytest.raises(ValueError, match=r"where: n must be an integer in \[1, 3\], got 4"):
        integer(4, "n", 1, 3, where="where")


def test_payload_arguments_without_copies_are_refused_as_with_them():
    """The mix ops check payload_block and payload_offset whatever copies= says (the doc said so: -1, 0 and 3 passed
    silently without copies), with the kernels' own RuntimeError and words, which the call with copies gives."""
    n = 8
    x = torch.zeros(n)
    copy = torch.zeros(n)
    payload = torch.zeros(ops.int8_payload_nbytes(n), dtype=torch.uint8)
    for bad in (dict(payload_block=-1), dict(payload_block=0), dict(payload_block=3), dict(payload_offset=-1)):
        with pytest.raises(RuntimeError) as with_copies:
            ops.gossip_mix_(x, [], 0.5, [0.5], copies=[copy], payloads=[payload], **bad)
        with pytest.raises(RuntimeError) as without:
            ops.gossip_mix_(x, [], 1.0, [], **bad)
        name = next(iter(bad))
        assert name in str(without.value)
        assert str(without.value).split("(")[0] == str(with_copies.value).split("(")[0], bad


# ------------------------------------------------ whole floats are integers; 0-d arrays and tensors are numbers

def _accum_train(**kw):
    params = _params()
    opt = decent_comm.AccumAdamW(params, lr=0.1, **kw)
    for t in range(5):
        params[0].grad = torch.full((6,), float(t + 1))
        opt.step()
    return params[0].detach().clone()



@pytest.mark.parametrize("whole", [4.0, np.float64(4.0), np.float32(4.0), np.array(4.0)],
                         ids=["float", "np.float64", "np.float32", "0-d array"])
def test_a_whole_float_is_the_integer_it_equals(whole):
    """argparse's type=float and arithmetic (n / 2) give 4.0 for an integer option; it was taken before the shared
    rule, refused by it, and is taken again, as the int it equals (4.5, NaN, inf, a string or a bool are not)."""
    from decent_comm._args import integer
    assert integer(whole, "n") == 4 and type(integer(whole, "n")) is int
    assert torch.equal(_accum_train(accum_steps=whole), _accum_train(accum_steps=4))
    assert decent_comm.decentralized_adam_hparams(1e-3, world_size=whole * 2, accum_steps=whole / 2) == \
        decent_comm.decentralized_adam_hparams(1e-3, world_size=8, accum_steps=2)
    assert vars(decent_comm.AdaptiveConsensus(start_step=whole * 25)) == \
        vars(decent_comm.AdaptiveConsensus(start_step=100))
    c = T.ConsensusControl(interval=whole, min_dwell=whole * 5)
    assert (c.interval, c.min_dwell, type(c.interval), type(c.min_dwell)) == (4, 20, int, int)
    s = T.PhaseSchedule([("ring", 0), ("one-peer-exp", whole * 25)])
    assert s.phases == T.PhaseSchedule([("ring", 0), ("one-peer-exp", 100)]).phases
    assert all(type(start) is int for _, start in s.phases)
    kw = dict(warmup=5, seed=0)
    assert rm.simulate(_cluster(), _workload(), "ring", steps=whole * 5, **kw) == \
        rm.simulate(_cluster(), _workload(), "ring", steps=20, **kw)
    assert T.make("ring", whole).peers(1, 0) == T.make("ring", 4).peers(1, 0)


@pytest.mark.parametrize("bad", [4.5, np.float32(4.5), NAN, INF, -INF, "4", True, np.bool_(True), np.array(True),
                                 torch.tensor(4.0)])
def test_no_fraction_nonfinite_string_bool_or_float_tensor_is_an_integer(bad):
    from decent_comm._args import integer
    with pytest.raises(ValueError, match="n must be an integer"):
        integer(bad, "n")
    with pytest.raises(ValueError, match="accum_steps must be an integer >= 1"):
        decent_comm.AccumAdamW(_params(), accum_steps=bad)


@pytest.mark.parametrize("cls", [decent_comm.DSGD, decent_comm.DAdamW])
def test_a_0d_numpy_lr_trains_as_torch_optim_does(cls):
    """np.array(0.1) (a numpy reduction's result, what a scheduler may write into a group) trains in torch.optim;
    the shared check refused it with a TypeError. A 1-element array of rank 1 stays refused, as torch refuses it."""
    def train(lr, edit=None):
        params = _params()
        opt = cls(params, lr=lr)
        for t in range(3):
            if t == 1 and edit is not None:
                opt.param_groups[0]["lr"] = edit
            params[0].grad = torch.full((6,), float(t + 1))
            opt.step()
        return params[0].detach().clone()
    assert torch.equal(train(np.array(0.1)), train(0.1))
    assert torch.equal(train(0.1, edit=np.array(0.05)), train(0.1, edit=0.05))
    with pytest.raises(TypeError, match="lr must be a float or a 1-element tensor"):
        cls(_params(), lr=np.array([0.1]))


def test_tensor_options_of_the_hparams_and_the_workload():
    """Taken as the optimizers take them (refused by the shared rule); hparams gives tensors back, as before it."""
    hp = decent_comm.decentralized_adam_hparams
    got = hp(torch.tensor(1e-3, dtype=torch.float64), 4, torch.tensor([0.9, 0.999], dtype=torch.float64),
             accum_steps=2)
    want = hp(1e-3, 4, (0.9, 0.999), accum_steps=2)
    assert isinstance(got["lr"], torch.Tensor) and math.isclose(float(got["lr"]), want["lr"], rel_tol=1e-15)
    assert [float(b) for b in got["betas"]] == pytest.approx(want["betas"], rel=1e-15)
    assert all(isinstance(b, torch.Tensor) for b in got["betas"])
    for bad in (torch.tensor([0.9, 1.0]), torch.tensor([0.9]), torch.tensor(0.9), [True, 0.9]):
        with pytest.raises(ValueError, match="betas must be two numbers"):
            hp(1e-3, 4, bad)
    assert rm.Workload(params=torch.tensor(1e6), compute=rm.ComputeTime(0.1)).params == 1e6


# -------------------------------------------------------------------- the rule applied where it was not yet

@pytest.mark.parametrize("call,pattern", [
    (lambda: ops.int8_payload_nbytes(True), "numel must be an integer, got True"),
    (lambda: ops.int8_payload_nbytes(10, True), "block must be an integer, got True"),
    (lambda: T.ConsensusControl(kappa=True), "kappa must be a finite number"),
    (lambda: T.ConsensusControl(low=True, high=2.0), "low must be a finite number"),
    (lambda: T.ConsensusControl(correlation=False), "correlation must be a finite number"),
    (lambda: rm.ComputeTime(True), "compute mean"),
    (lambda: rm.ComputeTime(0.1, std=True), "compute std"),
], ids=["nbytes-numel", "nbytes-block", "kappa", "low", "correlation", "mean", "std"])
def test_bools_refused_where_bare_comparisons_took_them(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("name", ["step", "accum_steps"])
def test_the_accum_op_refuses_a_bool_step(name):
    x, g, m, v, a = (torch.zeros(4) for _ in range(5))
    g += 1
    kw = {"step": 1, "accum_steps": 1, name: True}
    with pytest.raises(ValueError, match=f"mix_accum_adam_: {name} must be an integer, got True"):
        ops.mix_accum_adam_(x, [], 1.0, [], g, m, v, a, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, **kw)
    assert not x.any()


def test_a_param_groups_accum_steps_is_checked_as_the_constructors():
    """accum_steps=True in a group (an edit, a checkpoint) trained as 1; 2.0 is 2, as in the constructor."""
    params = _params()
    opt = decent_comm.AccumAdamW(params, lr=0.1, accum_steps=4)
    params[0].grad = torch.ones(6)
    before = params[0].detach().clone()
    opt.param_groups[0]["accum_steps"] = True
    with pytest.raises(ValueError, match=r"param group 0\): accum_steps must be an integer >= 1, got True"):
        opt.step()
    assert torch.equal(params[0].detach(), before)

    def edited(k):
        params = _params()
        opt = decent_comm.AccumAdamW(params, lr=0.1, accum_steps=4)
        opt.param_groups[0]["accum_steps"] = k
        for t in range(3):
            params[0].grad = torch.full((6,), float(t + 1))
            opt.step()
        return params[0].detach().clone()
    assert torch.equal(edited(2.0), edited(2))


@pytest.mark.parametrize("rank", [np.int64(1), torch.tensor(1), 1.0])
def test_ranks_and_world_sizes_come_back_as_python_ints(rank):
    """peers() checked an integer rank and then computed with the given object: tensor or np.int64 neighbour
    ranks; make() refused the tensor world size peers() took as a rank."""
    for name in ("ring", "one-peer-exp", "complete"):
        got, want = T.make(name, 4).peers(rank, 1), T.make(name, 4).peers(1, 1)
        assert got == want
        assert all(type(j) is int for j, _ in got.recv) and all(type(k) is int for k in got.send)
    t = T.make("ring", torch.tensor(4), local_world_size=np.int64(2))
    assert type(t.world_size) is int and t.world_size == 4 and t.local_world_size == 2


def test_the_consensus_factor_is_read_once():
    """Of a CUDA tensor each float() is a host synchronization, and the optimizer checks its factor every step."""
    from decent_comm.topology.consensus import check_consensus_factor

    class Counted(torch.Tensor):
        reads = 0

        def __float__(self):
            Counted.reads += 1
            return super().__float__()
    a = torch.tensor(0.5).as_subclass(Counted)
    assert check_consensus_factor(a) == 0.5 and Counted.reads == 1


def test_integer_and_real_build_no_message_unless_they_raise(monkeypatch):
    """The message's f-string cost 15% of Topology.peers(): it is built for a refusal only."""
    from decent_comm import _args

    def built(*a):
        raise AssertionError("message built")
    monkeypatch.setattr(_args, "_range", built)
    assert _args.integer(5, "n", low=1) == 5 and _args.integer(np.int64(5), "n", low=1) == 5
    assert _args.real(0.5, "x", 0, 1) == 0.5
    with pytest.raises(AssertionError, match="message built"):
        _args.integer(0, "n", low=1)
