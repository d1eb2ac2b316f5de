"""Adaptive communication in one process: the noise model's closed forms, ConsensusControl's decisions, binding
an adaptive spec and its state, and an adaptive optimizer at world size 1 equal to torch."""

import numpy as np
import pytest
import torch

import decent_comm
from decent_comm import topology as T
from decent_comm.topology.noise import noise_model
from decent_comm.topology.policies import AdaptStats

from optim_cases import ADAM_HP, batch, flat_params, make_model

# ----------------------------------------------------------------------------------- single process

def test_noise_model_closed_forms():
    # complete graph: the update noise is all that remains, Xi^2 = (n - 1) / n per unit of noise; exact estimator
    for n in (2, 5, 8):
        gain, bias = noise_model(T.make("complete", n))
        assert gain == pytest.approx((n - 1) / n) and bias == pytest.approx(1.0)
    # two ranks mixing with weight w: delta = x1 - x2 follows delta' = (1 - 2w) delta + e, Var e = 2, so
    # Xi^2 = Var(delta) / 4 = 1 / (2 (1 - (1 - 2w)^2)); D/c = delta^2 / 2 makes the estimator exact too
    for w in (0.1, 0.25, 0.4):
        gain, bias = noise_model(T.from_matrix([[1 - w, w], [w, 1 - w]]))
        assert gain == pytest.approx(1 / (2 * (1 - (1 - 2 * w) ** 2)), rel=1e-6) and bias == pytest.approx(1.0)
        # noise autocorrelated across steps (AR(1), coefficient c): the AR(1)-filtered variance
        # Var(delta) = 2 (1 + a c) / ((1 - a^2) (1 - a c)), a = 1 - 2w
        for c in (0.5, 0.9):
            a = 1 - 2 * w
            gain, bias = noise_model(T.from_matrix([[1 - w, w], [w, 1 - w]]), correlation=c)
            assert gain == pytest.approx(0.5 * (1 + a * c) / ((1 - a * a) * (1 - a * c)), rel=1e-6)
            assert bias == pytest.approx(1.0)
    assert noise_model(T.make("complete", 8), correlation=0.9)[0] == pytest.approx(7 / 8)


def stats(step, q_times_gamma, step_sq=1.0, lr=1.0):
    return AdaptStats(step=step, lr=lr, consensus_sq=q_times_gamma, step_sq=step_sq, window=4)


def test_consensus_control_decisions():
    w = 0.1
    slow = T.from_matrix([[1 - w, w], [w, 1 - w]])  # gain 1 / (2 (1 - 0.64)) = 1.3889; complete: 0.5
    g_slow, g_complete = 1 / (2 * (1 - (1 - 2 * w) ** 2)), 0.5
    # independent steps (correlation 0): the closed-form gains above
    a = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(kappa=2.0, interval=5, min_dwell=5,
                                                                       correlation=0.0))
    assert a.names == ["custom", "complete"] and a.current_name == "complete"  # equal costs: given order kept
    assert a.costs == [1.0, 1.0]
    a.costs = [1.0, 2.0]  # as if complete were dearer: moves to a sparser graph must save bytes
    pol = a.policy
    # Gamma^2 = kappa * step_sq * lr_peak / lr; at the peak lr: Gamma^2 = 2. q = 0.45: comfortably below, but the
    # slow graph would give q * g_slow / g_complete = 1.25 > (low + high) / 2: stay
    assert not a.advance(5, lambda: stats(5, 0.9))
    assert pol.last[0] == pytest.approx(0.45)
    # q = 0.2 -> predicted 0.556 <= 0.75: go sparser
    assert a.advance(10, lambda: stats(10, 0.4)) and a.current_name == "custom"
    # within the band [0.5, 1]: stay; above: denser; the learning rate halves: Gamma^2 doubles
    assert not a.advance(15, lambda: stats(15, 1.9))
    assert a.advance(20, lambda: stats(20, 2.2)) and a.current_name == "complete"
    assert pol.last[0] == pytest.approx(1.1)
    assert not a.advance(25, lambda: stats(25, 1.2, lr=0.5))  # q = 1.2 / 4 = 0.3 -> predicted 0.83: stay
    assert a.advance(30, lambda: stats(30, 1.0, lr=0.5)) and a.current_name == "custom"  # 0.25 -> 0.69
    assert pol.lr_peak == 1.0
    # min_dwell: a decision right after a switch keeps the candidate whatever q is
    b = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(interval=1, min_dwell=3, correlation=0.0))
    b.costs = [1.0, 2.0]
    assert not b.advance(1, lambda: stats(1, 0.01)) and not b.advance(2, lambda: stats(2, 0.01))
    assert b.advance(3, lambda: stats(3, 0.01)) and b.current_name == "custom"
    assert not b.advance(4, lambda: stats(4, 100.0)) and not b.advance(5, lambda: stats(5, 100.0))
    assert b.advance(6, lambda: stats(6, 100.0)) and b.current_name == "complete"
    assert b.schedule() == [(0, "complete"), (3, "custom"), (6, "complete")]
    # a sparser graph that saves nothing is never taken; above the band the cheapest adequate one is
    c = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(interval=1, min_dwell=1, correlation=0.0))
    assert not c.advance(1, lambda: stats(1, 0.01))
    c.costs = [2.0, 1.0]  # complete cheaper and better: the slow graph is dominated
    c.force(2, "custom")
    assert c.advance(3, lambda: stats(3, 0.01)) and c.current_name == "complete"
    assert g_slow > g_complete


def test_adaptive_spec_binding_and_state():
    a = T.make("adaptive:consensus:complete,one-peer-exp,exp:kappa=2,interval=5", 8)
    assert a.names == ["one-peer-exp", "exp", "complete"]  # sorted by buffers sent per step
    assert a.costs == [1.0, 3.0, 7.0]
    assert a.policy.kappa == 2.0 and a.policy.interval == 5 and a.current_name == "complete"
    p = T.make("adaptive:phase:complete@0,one-peer-exp@10,complete@30", 8)
    for s in range(1, 40):
        p.advance(s)
    assert p.schedule() == [(0, "complete"), (10, "one-peer-exp"), (30, "complete")]
    assert p.topology_at(12).peers(0, 12) == T.make("one-peer-exp", 8).peers(0, 12)
    assert np.array_equal(p.matrix(35), T.make("complete", 8).matrix(35))
    # the fingerprint is the configuration, not the decisions; the state round-trips
    fresh = T.make("adaptive:phase:complete@0,one-peer-exp@10,complete@30", 8)
    assert fresh.fingerprint() == p.fingerprint() != a.fingerprint()
    fresh.load_state_dict(p.state_dict())
    assert fresh.schedule() == p.schedule() and fresh.decided == 39
    # an unbound spec; bind() gives independent copies
    spec = T.Adaptive(["ring", "complete"], T.PhaseSchedule({"complete": (0, 5), "ring": (5, None)}))
    with pytest.raises(RuntimeError, match="not bound"):
        spec.peers(0, 0)
    b1, b2 = spec.bind(4), spec.bind(4)
    b1.advance(5)
    assert b1.current_name == "ring" and b2.current_name == "complete" and b1.policy is not b2.policy
    with pytest.raises(ValueError, match="already decided"):
        b1.force(3, "complete")
    # parse errors: tests/test_topology_spec.py
    with pytest.raises(ValueError, match="contiguous"):
        T.PhaseSchedule({"complete": (0, 5), "ring": (6, None)})
    with pytest.raises(ValueError, match="not a candidate"):
        T.Adaptive(["ring"], T.PhaseSchedule([("complete", 0)]), world_size=4)


def test_index_at_follows_a_long_history():
    """index_at against a linear scan over 2,000 forced switches (it searches the history; it built the list
    of starts on every call, linear in the switches)."""
    a = T.Adaptive(["ring", "complete", "one-peer-exp"], T.PhaseSchedule([("ring", 0)]), world_size=8)
    rng = np.random.default_rng(0)
    step = 0
    for _ in range(2000):
        step += int(rng.integers(1, 4))
        a.force(step, int(rng.integers(0, 3)))
    hist = a.history
    for s in [-1, 0, 1, 2, 3, *rng.integers(0, step + 10, 300).tolist(), step, step + 5]:
        want = hist[0][1] if s < 0 else [i for start, i in hist if start <= s][-1]
        assert a.index_at(s) == want, s


def test_single_process_is_torch_with_adaptive_topology():
    model = make_model(0)
    twin = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), **ADAM_HP, topology="adaptive:consensus:ring,complete:interval=2")
    ref = torch.optim.AdamW(twin.parameters(), **ADAM_HP)
    for t in range(5):
        for m, o in ((model, opt), (twin, ref)):
            x, y = batch(0, t)
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    assert torch.allclose(flat_params(model), flat_params(twin), atol=1e-6)
    assert opt.last_disagreement == 0.0 and opt.bytes_sent == 0
    rv = opt.replica_variance()
    assert all(v["variance"] == 0.0 for v in rv.values()) and list(rv) == ["group0.param0", "group0.param1",
                                                                           "group0.param2", "group0.param3"]
