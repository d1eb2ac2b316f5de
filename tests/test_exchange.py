"""The exchange scheduler (decent_comm.exchange.Exchanger) on real multi-process gloo groups: data, ordering,
wire casts, leaks, timeouts, dead peers and bad input. Peers that disagree on a bucket and constructions
refused on one rank: test_exchange_agreement.py; the NCCL transport: test_exchange_nccl.py.

Each test body runs as a part of one spawned group per world size (exchange_support.Suite) and returns what
the parent asserts on.
"""
import datetime
import random
import time

import pytest
import torch
import torch.distributed as dist

from decent_comm import topology as T
from decent_comm.exchange import Exchanger

from dist_utils import exit_now
from exchange_support import (Checker, Suite, errors as _errors, finished_parts, random_buckets, random_schedule,
                              topology_schedule)


def _schedules(rank, world_size, steps, seed):
    rng = random.Random(seed)  # same on every rank
    names = ["one-peer-exp", "exp", "ring", "base-k"] + (["aer"] if world_size % 2 == 0 else [])
    checked = {}
    for name in names + ["random"]:
        if name == "random":
            schedule = random_schedule(world_size, rank, seed)
        else:
            kwargs = {"local_world_size": 2} if name == "aer" else {}
            schedule = topology_schedule(T.make(name, world_size, **kwargs), rank)
        buckets = random_buckets(rng, rng.randint(3, 7))
        with Exchanger(timeout=30) as ex:
            assert (ex.transport, ex.rank, ex.world_size) == ("process_group", rank, world_size)
            c = Checker(ex, rank, world_size, buckets, schedule, seed)
            for t in range(steps):
                c.step(t)
            c.finish()
        checked[name] = c.checked
    # Wire precision: fp32 (and fp16) buffers travel as bf16.
    buckets = [(n, dt) for n, dt in random_buckets(rng, 5)]
    with Exchanger(wire_dtype=torch.bfloat16, timeout=30) as ex:
        c = Checker(ex, rank, world_size, buckets, random_schedule(world_size, rank, seed + 1), seed,
                    wire_dtype=torch.bfloat16)
        for t in range(steps):
            c.step(t)
        c.finish()
    checked["bf16-wire"] = c.checked
    dist.barrier()
    return checked


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_random_schedules_deliver_exact_data(world_size):
    results = SUITE.part(world_size, "schedules")
    for name in results[0]:
        assert sum(r[name] for r in results) > 0, f"{name}: nothing was received at all"


# ----------------------------------------------------------------------------- leaks, world size 1, bad input

def _rss_mb():
    import psutil
    return psutil.Process().memory_info().rss / 2**20


def _steady_state_rss(rank, world_size, steps):
    # Small buckets: what could leak is per call (Work handles, stashes), and many steps find it sooner.
    buckets = [(4096, torch.float32), (999, torch.bfloat16), (7, torch.float16), (1, torch.float32)]
    with Exchanger(wire_dtype=None, timeout=30) as ex:
        c = Checker(ex, rank, world_size, buckets, topology_schedule(T.make("one-peer-exp", world_size), rank), 7)
        rss = []
        for t in range(steps):
            c.step(t)
            if t in (steps // 4, steps - 1):
                c.finish()  # nothing in flight when measuring
                rss.append(_rss_mb())
        dist.barrier()
    return rss


def test_hundreds_of_steps_do_not_leak():
    for warm, end in SUITE.part(2, "rss"):
        assert end - warm < 2.0, f"RSS grew from {warm:.1f} MB to {end:.1f} MB over the steady-state steps"


def _bad_inputs(rank, world_size):
    peer = 1 - rank
    out = {}
    # World size 1 (a one-rank subgroup): exchanges without peers are no-ops; any peer is an error.
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    with Exchanger(solo) as ex1:
        assert (ex1.rank, ex1.world_size) == (0, 1)
        x = torch.ones(5)
        ex1.exchange(0, x, [], [], [])
        assert ex1.in_flight == [0]
        ex1.wait(0)
        ex1.exchange(0, x, [], [], [])
        ex1.wait_all()
        ex1.synchronize()
        assert ex1.bytes_sent == 0
        out["solo peer"] = _errors(lambda: ex1.exchange(1, x, [], [1], []))
        out["solo self"] = _errors(lambda: ex1.exchange(1, x, [torch.ones(5)], [], [0]))

    ex = Exchanger(timeout=20)
    x, r = torch.ones(10), torch.empty(10)
    cases = {
        "reuse in flight": lambda: ex.exchange(0, x, [r], [peer], [peer]),
        "unknown bucket": lambda: ex.wait(12345),
        "rank out of range": lambda: ex.exchange(1, x, [r], [world_size], [peer]),
        "negative rank": lambda: ex.exchange(1, x, [r], [peer], [-1]),
        "self": lambda: ex.exchange(1, x, [r], [rank], [peer]),
        "duplicate": lambda: ex.exchange(1, x, [r, torch.empty(10)], [peer], [peer, peer]),
        "length mismatch": lambda: ex.exchange(1, x, [r, torch.empty(10)], [peer], [peer]),
        "recv size": lambda: ex.exchange(1, x, [torch.empty(9)], [peer], [peer]),
        "recv dtype": lambda: ex.exchange(1, x, [torch.empty(10, dtype=torch.float64)], [peer], [peer]),
        "recv device": lambda: ex.exchange(1, x, [torch.empty(10, device="meta")], [peer], [peer]),
        "send device": lambda: ex.exchange(1, torch.ones(10, device="meta"), [r], [peer], [peer]),
        "recv non-contiguous": lambda: ex.exchange(1, x, [torch.empty(20)[::2]], [peer], [peer]),
        "send non-contiguous": lambda: ex.exchange(1, torch.ones(20)[::2], [r], [peer], [peer]),
        "recv aliases send": lambda: ex.exchange(1, x, [x], [peer], [peer]),
        "negative bucket": lambda: ex.exchange(-1, x, [r], [peer], [peer]),
        "huge bucket": lambda: ex.exchange(1 << 30, x, [r], [peer], [peer]),
    }
    ex.exchange(0, x, [r], [peer], [peer])
    for name, fn in cases.items():
        out[name] = _errors(fn)
    ex.wait(0)  # every error above left the exchanger usable
    assert torch.equal(r, torch.ones(10))
    out["wait again"] = _errors(lambda: ex.wait(0))  # completed: allowed, a no-op on CPU
    ex.exchange(3, x, [r], [peer], [peer])
    ex.synchronize()
    out["wait after synchronize"] = _errors(lambda: ex.wait(3))
    out["bad wire dtype"] = _errors(lambda: Exchanger(wire_dtype=torch.int32))
    out["bad timeout"] = _errors(lambda: Exchanger(timeout=0))
    out["timeout string"] = _errors(lambda: Exchanger(timeout="30"))  # float() took it
    out["infinite timeout"] = _errors(lambda: Exchanger(timeout=float("inf")))  # overflowed the milliseconds
    out["huge timeout"] = _errors(lambda: Exchanger(timeout=1e10))  # overflowed the deadline: every wait timed out
    out["self exchange on gloo"] = _errors(lambda: Exchanger(_allow_self_exchange=True))
    with Exchanger(wire_dtype=torch.bfloat16) as exw:
        out["int send with wire dtype"] = _errors(
            lambda: exw.exchange(0, torch.ones(4, dtype=torch.int32), [torch.empty(4, dtype=torch.int32)], [peer],
                                 [peer]))
        out["recv not in wire dtype"] = _errors(lambda: exw.exchange(0, torch.ones(4), [torch.empty(4)], [peer],
                                                                     [peer]))
    ex.shutdown()
    ex.shutdown()  # idempotent
    out["after shutdown"] = _errors(lambda: ex.exchange(0, x, [r], [peer], [peer]))
    dist.barrier()
    return out


BAD_INPUTS = {
    # case: (exception type, substrings the message must contain)
    "solo peer": ("ValueError", ["send_to[0] = 1", "world size 1"]),
    "solo self": ("ValueError", ["recv_from[0] = 0", "itself"]),
    "reuse in flight": ("RuntimeError", ["bucket=0", "still in flight", "wait(0)"]),
    "unknown bucket": ("RuntimeError", ["wait(bucket=12345)", "unknown bucket 12345", "never exchanged"]),
    "rank out of range": ("ValueError", ["bucket=1", "send_to[0] = 2", "world size 2"]),
    "negative rank": ("ValueError", ["recv_from[0] = -1"]),
    "self": ("ValueError", ["send_to[0]", "itself"]),
    "duplicate": ("ValueError", ["recv_from lists rank", "twice"]),
    "length mismatch": ("ValueError", ["2 recv buffers for 1 ranks"]),
    "recv size": ("ValueError", ["recvs[0]", "9 elements", "send has 10"]),
    "recv dtype": ("ValueError", ["recvs[0]", "Double", "Float"]),
    "recv device": ("ValueError", ["recvs[0]", "meta"]),
    "send device": ("ValueError", ["send is on meta"]),
    "recv non-contiguous": ("ValueError", ["recvs[0]", "contiguous"]),
    "send non-contiguous": ("ValueError", ["send must be contiguous"]),
    "recv aliases send": ("ValueError", ["recvs[0] (from rank", "overlaps send"]),
    "negative bucket": ("ValueError", ["bucket=-1", "bucket ids"]),
    "huge bucket": ("ValueError", ["bucket ids must be in"]),
    "wait again": ("none", []),
    "wait after synchronize": ("none", []),
    "bad wire dtype": ("ValueError", ["wire_dtype", "floating"]),
    "bad timeout": ("ValueError", ["timeout"]),
    "timeout string": ("ValueError", ["Exchanger: timeout must be a positive number of seconds", "'30'"]),
    "infinite timeout": ("ValueError", ["Exchanger: timeout must be a positive number of seconds", "inf"]),
    "huge timeout": ("ValueError", ["Exchanger: timeout must be at most 1e+08 s", "10000000000.0"]),
    "self exchange on gloo": ("ValueError", ["_allow_self_exchange", "NCCL"]),
    "int send with wire dtype": ("ValueError", ["Int", "floating point buffers only"]),
    "recv not in wire dtype": ("ValueError", ["recvs[0]", "BFloat16", "wire_dtype"]),
    "after shutdown": ("RuntimeError", ["shut down"]),
}


def test_bad_inputs_raise_clear_errors_and_world_size_one_is_a_no_op():
    for rank, out in enumerate(SUITE.part(2, "bad_inputs")):
        assert set(out) == set(BAD_INPUTS)
        for case, (kind, parts) in BAD_INPUTS.items():
            got_kind, msg = out[case]
            assert got_kind == kind, (rank, case, got_kind, msg)
            for text in parts:
                assert text in msg, (rank, case, text, msg)


# ------------------------------------------------------------------------------------------- failures

TIMEOUT_S = 3.0
SLACK_S = 3.0


def _mismatched(rank, world_size):
    """Two unmatched exchanges at once, both must time out naming the bucket and the peer, not hang: rank 0
    exchanges bucket 5 (agreed with rank 1 just before, so straight to the data path) which rank 1 never
    posts; rank 1 receives bucket 1 from rank 0 (a new edge: the size/dtype handshake) which rank 0 never
    sends."""
    ex = Exchanger(timeout=TIMEOUT_S)
    x = torch.ones(1000)
    # A healthy bucket first: the failure must not depend on a never-used connection.
    r = torch.empty(1000)
    ex.exchange(5, x, [r], [1 - rank], [1 - rank])
    ex.wait(5)
    start = time.monotonic()
    if rank == 0:
        kind, msg = _errors(lambda: (ex.exchange(5, x, [r], [1], [1]), ex.wait(5)))
    else:
        kind, msg = _errors(lambda: (ex.exchange(1, x, [torch.empty(1000)], [], [0]), ex.wait_all()))
    elapsed = time.monotonic() - start
    later = {name: _errors(fn) for name, fn in {
        "exchange": lambda: ex.exchange(7, x, [], [], []),
        "wait": lambda: ex.wait(0),
        "wait_all": ex.wait_all,
        "synchronize": ex.synchronize,
    }.items()}
    # Both ranks time out (equal deadlines): the first to shut down would close the connection under the other's
    # receive, which then failed with gloo's "Connection closed by peer" instead of its timeout (1 suite in ~30).
    store = dist.distributed_c10d._get_default_store()
    if store.add("test_exchange/mismatch/timed_out", 1) == 2:
        store.set("test_exchange/mismatch/both", "1")
    else:
        store.wait(["test_exchange/mismatch/both"], datetime.timedelta(seconds=30))
    ex.shutdown()  # after a failure: releases without waiting, no raise
    return dict(kind=kind, msg=msg, elapsed=elapsed, later=later)


def test_mismatched_schedule_times_out_naming_bucket_and_peer():
    res = SUITE.part(2, "mismatch")
    for rank, (bucket, op, stage) in enumerate([(5, "receive from rank 1", ""),
                                                 (1, "receive from rank 0", "size/dtype handshake")]):
        r = res[rank]
        assert r["kind"] == "ExchangeTimeout", r
        assert "timed out" in r["msg"] and f"bucket {bucket}" in r["msg"] and op in r["msg"], r
        assert stage in r["msg"], r
        assert "Timed out" in r["msg"], r  # gloo's own text is passed on
        assert TIMEOUT_S - 0.5 <= r["elapsed"] < TIMEOUT_S + SLACK_S, r
        for call, (kind, msg) in r["later"].items():
            assert kind == "ExchangeError" and "unusable after an earlier error" in msg, (call, kind, msg)
            assert f"bucket {bucket}" in msg, (call, msg)  # the original error is quoted


def _peer_exits(rank, world_size):
    """Rank 2 exits (no teardown) while ranks 0 and 1 exchange with it: bucket 0, agreed with it before (the
    data path), on one exchanger; a new bucket (the handshake) on another."""
    ex, ex_new = Exchanger(timeout=TIMEOUT_S), Exchanger(timeout=TIMEOUT_S)
    ring = T.make("ring", world_size)
    c = Checker(ex, rank, world_size, [(5000, torch.float32), (3, torch.bfloat16)], topology_schedule(ring, rank), 3)
    for t in range(5):
        c.step(t)
    c.finish()
    if rank == 2:
        exit_now({**finished_parts, "peer_exit": ("ok", "exited")})  # like a crash: no teardown at all
    out = {}
    for name, exchanger, bucket in [("data", ex, 0), ("handshake", ex_new, 9)]:
        x = torch.ones(5000)
        start = time.monotonic()

        def step():
            exchanger.exchange(bucket, x, [torch.empty(5000)], [2], [2])
            exchanger.wait(bucket)

        kind, msg = _errors(step)
        elapsed = time.monotonic() - start
        out[name] = dict(kind=kind, msg=msg, elapsed=elapsed, bucket=bucket,
                         later=_errors(lambda: exchanger.exchange(10, x, [], [], [])))
    return out


def test_peer_exit_mid_step_raises_naming_it_within_the_timeout():
    res = SUITE.part(3, "peer_exit")
    assert res[2] == "exited"
    for r in [out[path] for out in res[:2] for path in ("data", "handshake")]:
        assert r["kind"] in ("ExchangeError", "ExchangeTimeout"), r
        assert f"bucket {r['bucket']}" in r["msg"] and "rank 2" in r["msg"], r
        assert r["msg"].split("failed: ", 1)[-1].strip() or r["kind"] == "ExchangeTimeout", r
        assert r["elapsed"] < TIMEOUT_S + SLACK_S, r
        assert r["later"][0] == "ExchangeError" and "unusable" in r["later"][1], r


# ------------------------------------------------------------------------------------------- suites

# Scenarios that leave the group damaged (a timeout, a dead rank) run last.
SUITE = Suite({
    2: [("schedules", _schedules, (24, 1236)), ("bad_inputs", _bad_inputs, ()), ("rss", _steady_state_rss, (1000,)),
        ("mismatch", _mismatched, ())],
    3: [("schedules", _schedules, (16, 1237)), ("peer_exit", _peer_exits, ())],
    4: [("schedules", _schedules, (12, 1238))],
    8: [("schedules", _schedules, (4, 1242))],  # world size 8: a short run only
})
