"""delayed_mix: each gossip round's exchange stays in flight for the whole interval and is mixed in at the next
round as a correction. Against the float64 dense simulation of all ranks (tests/optim_reference.py): every
optimizer, point-to-point and group (all-reduce) rounds in tests/test_cadence.py, a bf16 wire here. Bytes move only
at rounds; the option is checked like every other (mode, agreement across ranks) and a checkpoint resumes exactly,
the round in flight included."""


import io

import pytest
import torch

import decent_comm
from decent_comm import topology as T

from dist_utils import run_ranks
from optim_cases import make_model, resumed_vs_straight, run_against_reference, train_steps


def _bf16_wire(rank, n):
    return [run_against_reference(rank, n, "dadamw", T.make(name, n), "awc", steps=9, delayed_mix=True,
                                  gossip_every=2, comm_dtype=torch.bfloat16, consensus=0.7)
            for name in ("ring", "one-peer-exp", "complete")]  # complete: group rounds, summed in float32


def test_delayed_mix_bf16_wire_matches_dense_simulation():
    for r, errs in enumerate(run_ranks(_bf16_wire, 4, timeout=300)):
        assert max(errs) < 1e-5, (r, errs)


def _delayed_differs_from_plain(rank, n):
    """The correction really is delayed: with one round in flight the result differs from the plain schedule."""
    out = []
    for delayed in (False, True):
        model = make_model(rank)
        opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", gossip_every=2, delayed_mix=delayed,
                               timeout=30, broadcast_init=False)
        sent = []
        train_steps(rank, model, opt, 8, after_step=lambda t: (opt.synchronize(), sent.append(opt.bytes_sent)))
        out.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), sent))
        opt.shutdown()
    (plain, _), (delayed, sent) = out
    return (plain - delayed).abs().max().item(), sent


def test_delayed_rounds_move_bytes_at_round_steps_only():
    for diff, sent in run_ranks(_delayed_differs_from_plain, 3, timeout=120):
        assert diff > 1e-4
        grew = [t for t in range(1, 8) if sent[t] > sent[t - 1]]
        assert sent[0] > 0 and grew == [2, 4, 6], sent  # launched at the end of each round's own step


def test_delayed_mix_needs_awc():
    with pytest.raises(ValueError, match="delayed_mix=True needs mode='awc'"):
        decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), mode="atc", delayed_mix=True)
    with pytest.raises(ValueError, match="delayed_mix must be True or False"):
        decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), delayed_mix=1)


def _mismatch(rank, n):
    model = make_model(0)
    try:
        decent_comm.DAdamW(model.parameters(), gossip_every=2, delayed_mix=rank == 1, timeout=30)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_delayed_mix_mismatch_named_on_every_rank():
    for msg in run_ranks(_mismatch, 3, timeout=120):
        assert "delayed_mix" in msg, msg


def _resume(rank, n, optimizer, stop):
    """Train 12 steps straight; and `stop` steps, torch.save / torch.load of the state_dicts, a fresh optimizer
    (on other initial parameters) that loads them, a second checkpoint right away, and the remaining steps."""
    def build(model):
        kw = dict(topology="one-peer-exp", gossip_every=3, warmup_steps=2, delayed_mix=True, timeout=30)
        if optimizer == "wrapped-adam":
            return decent_comm.Decentralized(torch.optim.Adam(model.parameters(), lr=0.02), **kw)
        return decent_comm.DAdamW(model.parameters(), lr=0.02, **kw)

    def pending(opt):
        return opt.state_dict()["param_groups"][0]["decentralized"]["delayed_pending"]

    err, (opt_sd, _), again = resumed_vs_straight(rank, build, 12, stop, serialize=True, on_load=pending)
    plain = decent_comm.DAdamW(make_model(rank).parameters(), topology="one-peer-exp", gossip_every=3, warmup_steps=2,
                               timeout=30)
    try:
        plain.load_state_dict(opt_sd)
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    plain.shutdown()
    return err, opt_sd["param_groups"][0]["decentralized"]["delayed_pending"], again, msg


# Rounds at steps 2, 5, 8, 11: after 7 steps round 5's exchange is in flight; after 2 none has been launched.
@pytest.mark.parametrize("optimizer", ["dadamw", "wrapped-adam"])
@pytest.mark.parametrize("stop, in_flight", [(7, True), (2, False)])
def test_delayed_mix_resumes_exactly(optimizer, stop, in_flight):
    for err, pending, again, msg in run_ranks(_resume, 3, optimizer, stop, timeout=180):
        assert err < 1e-6
        assert pending is in_flight and again is in_flight  # a restored correction is saved again until mixed
        assert "delayed_mix=True" in msg, msg


def _bf16_vector_run(rank, p, opt, steps, start=0):
    for t in range(start, start + steps):
        a = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * rank + t))
        p.grad = (a + 0.3 * p.detach().float()).to(p.dtype)
        opt.step()


def _resume_wrapped_bf16(rank, n):
    """12 steps straight, and 7 steps (round 5's exchange in flight), torch.save / torch.load, a new optimizer and
    parameter that load them, 5 steps: the largest difference of the final parameters. One parameter of 1000
    elements: in the tests' small model the correction's bf16 rounding happened to change no parameter."""
    def build(p):
        return decent_comm.Decentralized(torch.optim.Adam([p], lr=0.01), topology="ring", gossip_every=3,
                                         delayed_mix=True, broadcast_init=False, timeout=30)
    init = (torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 3).bfloat16()
    p = torch.nn.Parameter(init.clone())
    opt = build(p)
    _bf16_vector_run(rank, p, opt, 12)
    opt.synchronize()
    straight = p.detach().clone()
    opt.shutdown()
    p = torch.nn.Parameter(init.clone())
    opt = build(p)
    _bf16_vector_run(rank, p, opt, 7)
    buf = io.BytesIO()
    torch.save((p.detach().clone(), opt.state_dict()), buf)
    opt.shutdown()
    buf.seek(0)
    saved_p, saved_sd = torch.load(buf, weights_only=True)
    p = torch.nn.Parameter(torch.zeros_like(init))
    opt = build(p)
    with torch.no_grad():
        p.copy_(saved_p)
    opt.load_state_dict(saved_sd)
    _bf16_vector_run(rank, p, opt, 5, start=7)
    opt.synchronize()
    opt.shutdown()
    return (p.detach().float() - straight.float()).abs().max().item()


def test_wrapped_resume_over_bf16_is_exact():
    """The correction is float32 whatever the parameters' dtype: torch's load of the wrapped optimizer cast it to
    bf16, and the resumed run left the straight one (4.9e-4 apart); loaded beside it, the resume is exact."""
    assert max(run_ranks(_resume_wrapped_bf16, 3, timeout=120)) == 0.0


def _correction_after_checkpoint(rank, n, optimizer):
    model = make_model(rank)
    kw = dict(topology="one-peer-exp", delayed_mix=True, timeout=30)
    opt = decent_comm.Decentralized(torch.optim.Adam(model.parameters(), lr=0.02), **kw) \
        if optimizer == "wrapped-adam" else decent_comm.DAdamW(model.parameters(), lr=0.02, **kw)
    key = "delayed_mix_correction"
    train_steps(rank, model, opt, 3)
    sd = opt.state_dict()
    at_save = ([key in st for st in sd["state"].values()], [key in b.state for b in opt._buckets])
    train_steps(rank, model, opt, 1, start=3)
    after = ([key in st for st in opt.state.values()], [key in b.state for b in opt._buckets])
    opt.shutdown()
    return at_save, after


@pytest.mark.parametrize("optimizer", ["dadamw", "wrapped-adam"])
def test_checkpoint_correction_is_let_go_after_the_next_step(optimizer):
    """state_dict() with a round in flight puts its correction into every bucket (for a run resumed from it);
    this run mixes that round from what it received, so the buffer goes at the next step (it stayed for the rest
    of the run: one more buffer of every bucket). As torch's, a state_dict holds the live per-parameter dicts:
    save it before stepping on (test_delayed_mix_resumes_exactly resumes from one)."""
    for at_save, after in run_ranks(_correction_after_checkpoint, 2, optimizer, timeout=120):
        assert all(at_save[0]) and all(at_save[1])
        assert not any(after[0]) and not any(after[1])
