"""The exchange scheduler's agreement between peers, on real multi-process gloo groups: ranks that disagree on
a bucket's size, dtype or schedule both raise ExchangeError naming the bucket, the peer and both sides
(before, gloo aborted the receiving process, or fp16 met bf16 silently); agreed edges skip the handshake; a
size changed on one rank only times out on both without a crash; GroupAllReduce's members that disagree on the
dtype alone (fp16 / bf16) both raise, naming both sides; a construction refused on one rank (any exception type) raises
on every rank and leaves the next exchanger in sync; 33 exchangers on one group keep their messages apart.
"""
import time

import torch

from decent_comm import topology as T
from decent_comm.exchange import Exchanger

from exchange_support import Checker, Suite, errors as _errors, payload, topology_schedule

TIMEOUT_S = 3.0
SLACK_S = 3.0


def _construction(rank, world_size):
    """A construction refused on one rank raises on every rank and claims nothing anywhere: the next exchanger,
    built on all ranks, works (before, the refusing rank skipped a tag channel and the next exchanger timed
    out blaming a dead peer)."""
    peer = 1 - rank
    out = {}
    # Refused before (rank 1: bad timeout) and after (rank 0: bad wire dtype) where the transport is made.
    for case, bad_rank, bad in [("bad timeout on rank 1", 1, dict(timeout=-1)),
                                ("bad wire dtype on rank 0", 0, dict(wire_dtype=torch.int32))]:
        out[case] = _errors(lambda: Exchanger(**(bad if rank == bad_rank else dict(timeout=20))))
    # A refusal of another exception type (here a stand-in LookupError from an argument check on rank 0) is told
    # too: before, only ValueError/TypeError/RuntimeError were, and rank 1 timed out blaming a dead peer.
    from decent_comm.exchange import exchanger as exchanger_module
    check = exchanger_module._check_max_ctas

    def odd_refusal(value):
        raise LookupError("nccl_max_ctas: a stand-in refusal of another type")
    exchanger_module._check_max_ctas = odd_refusal if rank == 0 else check
    try:
        out["LookupError on rank 0"] = _errors(lambda: Exchanger(timeout=20))
    finally:
        exchanger_module._check_max_ctas = check
    with Exchanger(timeout=20) as ex:
        x, r = payload(rank, 0, 4, 1000), torch.empty(1000)
        ex.exchange(4, x, [r], [peer], [peer])
        ex.wait(4)
        out["next exchanger delivers"] = torch.equal(r, payload(peer, 0, 4, 1000))
    return out


def test_construction_refused_on_one_rank_raises_everywhere_and_desyncs_nothing():
    res = SUITE.part(2, "construction")
    for rank, out in enumerate(res):
        assert out["next exchanger delivers"] is True, out
        for case, bad_rank, own in [("bad timeout on rank 1", 1, "timeout"),
                                    ("bad wire dtype on rank 0", 0, "wire_dtype")]:
            kind, msg = out[case]
            assert kind == "ValueError", (rank, case, kind, msg)
            assert own in msg, (rank, case, msg)
            if rank != bad_rank:
                assert f"rank {bad_rank} of the group refused its arguments" in msg, (rank, case, msg)
        kind, msg = out["LookupError on rank 0"]
        assert kind == ("LookupError" if rank == 0 else "ValueError"), (rank, kind, msg)
        assert "stand-in refusal" in msg, (rank, msg)


# What each rank gives bucket 3 (numel, dtype, wire_dtype, send_to, recv_from as "peer" / "none"), and the
# words both ranks' ExchangeError must contain (every rank names the other and both sides).
DISAGREEMENTS = {
    "comm dtype": [(1000, torch.float32, None, "peer", "peer"), (1000, torch.float32, torch.bfloat16, "peer", "peer"),
                   ["1000 elements of Float", "1000 elements of BFloat16"]],
    "bucket layout": [(1000, torch.float32, None, "peer", "peer"), (1500, torch.float32, None, "peer", "peer"),
                      ["1000 elements of Float", "1500 elements of Float"]],
    "fp16 vs bf16": [(64, torch.float16, None, "peer", "peer"), (64, torch.bfloat16, None, "peer", "peer"),
                     ["64 elements of Half", "64 elements of BFloat16"]],
    "empty on one rank": [(0, torch.float32, None, "peer", "peer"), (10, torch.float32, None, "peer", "peer"),
                          ["0 elements of Float", "10 elements of Float"]],
    "schedule": [(10, torch.float32, None, "peer", "peer"), (10, torch.float32, None, "none", "peer"),
                 ["sends to and receives from", "receives from", "without sending to it",
                  "different schedules"]],
}


def _mismatches(rank, world_size):
    """Peers that disagree on bucket 3: never a dead process nor silently mixed bytes, but an ExchangeError on
    both ranks at once, naming the bucket, the peer and both sides; then the group still moves data."""
    peer = 1 - rank
    out = {}
    for case, spec in DISAGREEMENTS.items():
        numel, dtype, wire, send, recv = spec[rank]
        with Exchanger(timeout=20, wire_dtype=wire) as ex:
            send_to, recv_from = ([peer] if send == "peer" else []), ([peer] if recv == "peer" else [])
            x = torch.ones(numel, dtype=dtype)
            recvs = [torch.empty(numel, dtype=wire or dtype) for _ in recv_from]
            start = time.monotonic()
            kind, msg = _errors(lambda: (ex.exchange(3, x, recvs, send_to, recv_from), ex.wait(3)))
            out[case] = dict(kind=kind, msg=msg, elapsed=time.monotonic() - start,
                             later=_errors(lambda: ex.exchange(4, x, [], [], [])))
    with Exchanger(timeout=20) as ex:  # no message of the cases above is left to confuse a new exchange
        c = Checker(ex, rank, world_size, [(1000, torch.float32), (64, torch.float16)],
                    topology_schedule(T.make("ring", world_size), rank), 5)
        for t in range(3):
            c.step(t)
        c.finish()
        out["afterwards"] = c.checked
    return out


def test_peers_that_disagree_on_a_bucket_both_raise_naming_bucket_peer_and_both_sides():
    res = SUITE.part(2, "mismatches")
    for rank, out in enumerate(res):
        peer = 1 - rank
        assert out["afterwards"] > 0
        for case, spec in DISAGREEMENTS.items():
            r = out[case]
            assert r["kind"] == "ExchangeError", (rank, case, r)
            for text in ["bucket 3", f"this rank (rank {rank})", f"rank {peer}", "nothing was sent"] + spec[2]:
                assert text in r["msg"], (rank, case, text, r["msg"])
            assert r["elapsed"] < 10, (rank, case, r)  # at once, not by a timeout
            assert r["later"][0] == "ExchangeError" and "unusable" in r["later"][1], (rank, case, r)


def _group_allreduce(rank, world_size):
    """The group all-reduce's own agreement (through the store): fp16 on one rank, bf16 on the other, sizes and
    element sizes equal, so only the dtype tells them apart (gloo would sum the bytes as they come). Then, agreed,
    one sum and the bytes it sent."""
    from decent_comm.exchange import GroupAllReduce
    out = {}
    ga = GroupAllReduce([[0, 1]], timeout=20)
    dtype = torch.float16 if rank == 0 else torch.bfloat16
    x = torch.ones(64, dtype=dtype)
    out["fp16 vs bf16"] = _errors(lambda: (ga.exchange(3, x, [torch.empty_like(x)], [0, 1]), ga.wait(3)))
    ga.shutdown()
    ga = GroupAllReduce([[0, 1]], timeout=20)
    total = torch.empty(1000)
    ga.exchange(3, payload(rank, 0, 3, 1000), [total], [0, 1])
    ga.wait(3)
    out["sum"] = torch.equal(total, payload(0, 0, 3, 1000) + payload(1, 0, 3, 1000))
    out["bytes_sent"] = ga.bytes_sent
    ga.shutdown()
    return out


def test_group_allreduce_members_that_disagree_on_the_dtype_both_raise_and_agreed_ones_sum():
    for rank, out in enumerate(SUITE.part(2, "group all-reduce")):
        kind, msg = out["fp16 vs bf16"]
        assert kind == "ExchangeError", (rank, kind, msg)
        for text in ["bucket 3", "rank 0", "rank 1", "64 elements of torch.float16", "64 elements of torch.bfloat16",
                     "nothing was sent"]:
            assert text in msg, (rank, text, msg)
        assert out["sum"] is True, rank
        # an all-reduce among |G| ranks sends 2 (|G| - 1) / |G| buffers per rank: 1 buffer of 4000 bytes for 2
        assert out["bytes_sent"] == 2 * (2 - 1) * 1000 * 4 // 2, (rank, out["bytes_sent"])


def _agreement(rank, world_size):
    """Handshakes happen where an edge is new, not in the steady state: one-peer-exp on 4 ranks meets each
    bucket's peers within 2 steps, after which 10 more steps add none; a size change on every rank renegotiates
    once and delivers."""
    topo = T.make("one-peer-exp", world_size)
    buckets = [(4099, torch.float32), (10, torch.bfloat16), (0, torch.float32)]
    counts = {}
    with Exchanger(timeout=30) as ex:
        c = Checker(ex, rank, world_size, buckets, topology_schedule(topo, rank), 11)
        for t in range(12):
            c.step(t)
            counts[t] = ex.handshakes
        c.finish()
        counts["after finish"] = ex.handshakes
        resized = [(n + 5, dt) for n, dt in buckets]  # every rank rebuilds its buckets alike
        c2 = Checker(ex, rank, world_size, resized, topology_schedule(topo, rank), 12)
        c2.expected_bytes = ex.bytes_sent  # the same exchanger: its count goes on
        for t in range(4):
            c2.step(t)
        c2.finish()
        counts["after resize"] = ex.handshakes
    return dict(counts=counts, checked=c.checked + c2.checked)


def test_agreed_edges_skip_the_handshake():
    for out in SUITE.part(4, "agreement"):
        counts = out["counts"]
        assert out["checked"] > 0
        # one-peer-exp on 4 ranks: step 0 meets peers +-1 (one handshake per bucket), step 1 the peer +2.
        assert counts[1] == 2 * 3, counts
        assert counts[11] == counts["after finish"] == counts[1], counts
        assert counts["after resize"] == 2 * counts[1], counts


def _asymmetric_change(rank, world_size):
    """Rank 0 changes bucket 2's size after agreeing it; rank 1 keeps the agreed size and goes straight to the
    data path. No message of either kind meets the other (the handshake has its own tags): both time out,
    no process dies."""
    ex = Exchanger(timeout=TIMEOUT_S)
    peer = 1 - rank
    x, r = torch.ones(100), torch.empty(100)
    ex.exchange(2, x, [r], [peer], [peer])
    ex.wait(2)
    n = 150 if rank == 0 else 100
    start = time.monotonic()
    kind, msg = _errors(lambda: (ex.exchange(2, torch.ones(n), [torch.empty(n)], [peer], [peer]), ex.wait(2)))
    return dict(kind=kind, msg=msg, elapsed=time.monotonic() - start)


def test_a_size_changed_on_one_rank_only_times_out_on_both_without_a_crash():
    for rank, r in enumerate(SUITE.part(2, "asymmetric")):
        assert r["kind"] == "ExchangeTimeout" and "bucket 2" in r["msg"], (rank, r)
        assert ("size/dtype handshake" in r["msg"]) == (rank == 0), (rank, r)
        assert r["elapsed"] < TIMEOUT_S + SLACK_S, (rank, r)


def _many_exchangers(rank, world_size):
    """33 exchangers alive on one group, the 1st and the 33rd stepped in opposite orders on the two ranks: each
    gets its own peer's data (with 32 tag channels the two shared tags, and each received the other's)."""
    peer = 1 - rank
    exchangers = [Exchanger(timeout=20) for _ in range(33)]
    try:
        got = {k: torch.empty(500) for k in (0, 32)}
        for step, order in enumerate([(0, 32), (0, 32) if rank == 0 else (32, 0)]):  # the first: the handshakes
            for k in order:
                exchangers[k].exchange(1, payload(rank, step, k, 500), [got[k]], [peer], [peer])
            for k in (0, 32):
                exchangers[k].wait(1)
        return {k: torch.equal(r, payload(peer, 1, k, 500)) for k, r in got.items()}
    finally:
        for ex in exchangers:
            ex.shutdown()


def test_many_exchangers_on_one_group_never_share_messages():
    for rank, out in enumerate(SUITE.part(2, "many exchangers")):
        assert out == {0: True, 32: True}, (rank, out)


# ------------------------------------------------------------------------------------------- suites

# One spawned group per world size; the scenario that leaves its group damaged (timeouts) runs last.
SUITE = Suite({
    2: [("construction", _construction, ()), ("mismatches", _mismatches, ()), ("many exchangers", _many_exchangers, ()),
        ("group all-reduce", _group_allreduce, ()), ("asymmetric", _asymmetric_change, ())],
    4: [("agreement", _agreement, ())],
})
