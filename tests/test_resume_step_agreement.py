"""Ranks whose gossip schedules stand at different steps after a resume are stopped at their first step, on every
rank, naming each rank's step: each rank loads its own checkpoint, so one of another step (a save that did not finish
on every rank, a wrong path) or a refused load caught on one rank (it goes on from step 0) left them apart, and
before they gossiped with no error (rank 0 at schedule steps 3..7, rank 1 at 6..10: each mixed its neighbours'
parameters of other steps under its own topology phase) until a collective utility noticed. The check is one small
all-reduce at the first step after building the optimizer or loading a state_dict, none at the other steps; a resume
of every rank from the same step stays bit-exact."""

import io

import pytest
import torch

import decent_comm
from decent_comm.exchange import BoundedAllReduce
from decent_comm.optim.agreement import AGREE_STEP

from dist_utils import run_ranks
from optim_cases import make_model, train_steps

VARIANTS = {
    "DAdamW-awc": lambda m: decent_comm.DAdamW(m.parameters(), lr=0.01, topology="ring", timeout=10),
    "DAdamW-atc": lambda m: decent_comm.DAdamW(m.parameters(), lr=0.01, topology="ring", mode="atc", model=m,
                                               timeout=10),
    "DSGD-awc-int8": lambda m: decent_comm.DSGD(m.parameters(), lr=0.05, momentum=0.9, topology="ring",
                                                comm_dtype=torch.int8, timeout=10),
    "DAdamW-awc-gossip_every2": lambda m: decent_comm.DAdamW(m.parameters(), lr=0.01, topology="ring", gossip_every=2,
                                                             timeout=10),
    "Decentralized(Adam)": lambda m: decent_comm.Decentralized(torch.optim.Adam(m.parameters(), lr=0.01),
                                                               topology="ring", timeout=10),
}


def _count_agreements(calls):
    real = BoundedAllReduce.agree

    def counting(self, what, *args, **kwargs):
        if what == AGREE_STEP:
            calls.append(what)
        return real(self, what, *args, **kwargs)
    BoundedAllReduce.agree = counting


def _saved(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def _resume(rank, n, variant, plan):
    """A run of 6 steps saving at steps 3 and 6, then a new optimizer on each rank loading one of them: `plan`
    "same" (every rank step 3's), "different" (rank 0 step 3's, the others step 6's), "refused" (every rank step
    6's, but rank 1's names another rank: refused, caught, and rank 1 goes on with its new optimizer at step 0)."""
    calls = []
    _count_agreements(calls)
    build = VARIANTS[variant]
    model = make_model(0)
    opt = build(model)
    saved = {}
    for t in range(6):
        train_steps(rank, model, opt, 1, start=t)
        if t + 1 in (3, 6):
            saved[t + 1] = _saved(model, opt)
    opt.shutdown()  # ATC: the last step's mix applied (the saving state_dict() applied it here already)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    first_run_calls = len(calls)

    model2 = make_model(5)
    opt2 = build(model2)
    step = {"same": 3, "different": 3 if rank == 0 else 6, "refused": 6}[plan]
    ck = torch.load(io.BytesIO(saved[step]), weights_only=True)
    model2.load_state_dict(ck["model"])
    if plan == "refused" and rank == 1:
        ck["opt"]["param_groups"][0]["decentralized"]["rank"] = 0
    try:
        opt2.load_state_dict(ck["opt"])
    except ValueError as e:
        assert plan == "refused" and rank == 1 and "saved by rank 0" in str(e), str(e)
    before = [p.detach().clone() for p in model2.parameters()]
    try:
        train_steps(rank, model2, opt2, 3, start=step)
        outcome = ("ok", "")
    except RuntimeError as e:
        outcome = ("RuntimeError", str(e))
    resumed_calls = len(calls) - first_run_calls
    opt2.shutdown()  # ATC: as above
    after = [p.detach().clone() for p in model2.parameters()]
    return outcome, before, after, uninterrupted, first_run_calls, resumed_calls


def _assert_refused_everywhere(results, expected_sides):
    for rank, (outcome, before, after, _, _, _) in enumerate(results):
        kind, msg = outcome
        assert kind == "RuntimeError", (rank, outcome)
        assert "the ranks' gossip schedules stand at different steps" in msg, (rank, msg)
        for side in expected_sides:
            assert side in msg, (rank, side, msg)
        for a, b in zip(before, after):  # nothing of the step ran
            assert torch.equal(a, b), rank


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ranks_resumed_from_checkpoints_of_different_steps_are_stopped_on_every_rank(variant):
    n = 3 if variant == "DAdamW-awc" else 2
    results = run_ranks(_resume, n, variant, "different", timeout=180)
    _assert_refused_everywhere(results, ["rank 0: step 3, after load_state_dict",
                                         "rank 1: step 6, after load_state_dict"]
                               + (["rank 2: step 6, after load_state_dict"] if n == 3 else []))


@pytest.mark.parametrize("variant", ["DAdamW-awc", "Decentralized(Adam)"])
def test_a_refused_load_caught_on_one_rank_is_stopped_at_the_first_step(variant):
    results = run_ranks(_resume, 3, variant, "refused", timeout=180)
    _assert_refused_everywhere(results, ["rank 0: step 6, after load_state_dict",
                                         "rank 1: step 0, after a refused load_state_dict",
                                         "rank 2: step 6, after load_state_dict"])


def _mid_run(rank, n, variant):
    """3 steps, then every rank loads its own state_dict of that step, rank 1's edited to name another rank (refused,
    caught), and 2 more steps; beside the same 5 steps without the loads."""
    build = VARIANTS[variant]
    runs = []
    for load in (False, True):
        model = make_model(0)
        opt = build(model)
        train_steps(rank, model, opt, 3)
        refused = None
        if load:
            saved = torch.load(io.BytesIO(_saved(model, opt)), weights_only=True)["opt"]  # a copy, not live state
            if rank == 1:
                saved["param_groups"][0]["decentralized"]["rank"] = 0
            try:
                opt.load_state_dict(saved)
                refused = False
            except ValueError:
                refused = True
        try:
            train_steps(rank, model, opt, 2, start=3)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}"
        opt.shutdown()
        runs.append((outcome, refused, [p.detach().clone() for p in model.parameters()]))
    return runs


@pytest.mark.parametrize("variant", ["DAdamW-awc", "DAdamW-atc", "Decentralized(Adam)"])
def test_a_load_refused_on_one_rank_mid_run_is_named_on_every_rank_at_the_next_step(variant):
    """Every rank loads at step 3, rank 1's load refused and caught: the loads that went through restart the exchange
    in flight and the refused one keeps it, so the next step raises on every rank, naming rank 1's refused load,
    before anything of it runs. Before, rank 1 (which had stepped, so no agreement was due) went into the gossip
    exchange while the others waited in the first-step agreement: all timed out (30 min at gloo's default). The run
    without the loads trains on."""
    for rank, (plain, loaded) in enumerate(run_ranks(_mid_run, 3, variant, timeout=180)):
        assert plain[0] == "ok", (rank, plain[0])
        assert loaded[1] is (rank == 1), (rank, loaded[1])
        assert loaded[0].startswith("RuntimeError: ") and "was refused on some ranks" in loaded[0], (rank, loaded[0])
        assert "rank 1: step 3, after a refused load_state_dict" in loaded[0], (rank, loaded[0])
        assert "rank 0: step 3, after load_state_dict" in loaded[0], (rank, loaded[0])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_resume_of_every_rank_from_the_same_step_is_bit_exact_with_one_agreement_per_start(variant):
    n = 3 if variant in ("DAdamW-awc", "DSGD-awc-int8") else 2
    for rank, (outcome, _, after, uninterrupted, first, resumed) in enumerate(
            run_ranks(_resume, n, variant, "same", timeout=180)):
        assert outcome == ("ok", ""), (rank, outcome)
        for i, (a, b) in enumerate(zip(after, uninterrupted)):
            assert torch.equal(a, b), (rank, i, (a - b).abs().max())
        # one at the first step after construction and one at the first after the load: none at the other 8 steps
        assert (first, resumed) == (1, 1), (rank, first, resumed)
