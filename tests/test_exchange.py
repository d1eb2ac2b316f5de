"""The exchange scheduler (decent_comm.exchange.Exchanger) on real multi-process gloo groups: data, ordering,
wire casts, leaks, timeouts, dead peers and bad input; and the NCCL transport where a GPU exists.

Every payload is a deterministic function of (sender, step, bucket), so each receiver checks what it got
on its own. Each test body runs in one spawned group of ranks (tests/dist_utils.py) and returns what the
parent asserts on; as few groups as possible are spawned, since starting a rank costs ~2.5 s of CPU.
"""
import random
import time

import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm import topology as T
from decent_comm.exchange import Exchanger

from dist_utils import exit_now, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 1000, 4099, 30000]


def payload(sender, step, bucket, numel, dtype=torch.float32, fractional=False):
    """What `sender` sends for `bucket` at `step`: values k/8 (exact in bf16 and fp16) shifted by an
    offset that differs between senders, steps and buckets; `fractional` adds bits bf16 cannot hold."""
    offset = (sender * 7919 + step * 104729 + bucket * 1299709) % 251
    x = ((torch.arange(numel, dtype=torch.float64) + offset) % 251) / 8 - 15
    if fractional:
        x = x + torch.arange(numel, dtype=torch.float64).remainder(97) * 1e-4 + 1e-3
    return x.to(dtype)


def random_buckets(rng, count):
    """[(numel, dtype)] shared by every rank (same rng seed)."""
    return [(rng.choice(SIZES), rng.choice(DTYPES)) for _ in range(count)]


def topology_schedule(topo, rank):
    def at(step, bucket):
        p = topo.peers(rank, step)
        return list(p.send), [r for r, _ in p.recv]
    return at


def random_schedule(world_size, rank, seed):
    """A random directed graph per (step, bucket), identical on every rank: rank i sends to j with p=0.4."""
    def at(step, bucket):
        rng = random.Random(seed * 1_000_003 + step * 1009 + bucket)
        edges = {(i, j) for i in range(world_size) for j in range(world_size) if i != j and rng.random() < 0.4}
        return sorted(j for i, j in edges if i == rank), sorted(i for i, j in edges if j == rank)
    return at


class Checker:
    """Runs a schedule on one rank: exchanges, waits in a random order, checks every received buffer."""

    def __init__(self, ex, rank, world_size, buckets, schedule, seed, wire_dtype=None):
        self.ex, self.rank, self.buckets, self.schedule = ex, rank, buckets, schedule
        self.wire_dtype = wire_dtype
        self.rng = random.Random(seed * 31 + rank)  # per rank: wait orders differ between ranks
        self.send = [torch.empty(n, dtype=dt) for n, dt in buckets]
        self.recv = [[torch.empty(n, dtype=wire_dtype or dt) for _ in range(world_size - 1)] for n, dt in buckets]
        self.pending = {}  # bucket -> (step, recv_from)
        self.expected_bytes = 0
        self.checked = 0

    def exchange(self, step, b):
        n, dt = self.buckets[b]
        send_to, recv_from = self.schedule(step, b)
        self.send[b].copy_(payload(self.rank, step, b, n, dt, fractional=self.wire_dtype is not None))
        self.ex.exchange(b, self.send[b], self.recv[b][:len(recv_from)], send_to, recv_from)
        wire_size = torch.empty(0, dtype=self.wire_dtype or dt).element_size()
        self.expected_bytes += n * wire_size * len(send_to)
        self.pending[b] = (step, recv_from)

    def wait(self, b):
        self.ex.wait(b)
        step, recv_from = self.pending.pop(b)
        n, dt = self.buckets[b]
        for i, src in enumerate(recv_from):
            want = payload(src, step, b, n, dt, fractional=self.wire_dtype is not None)
            if self.wire_dtype is not None:
                want = want.to(self.wire_dtype)  # received == the wire cast of what was sent
            got = self.recv[b][i]
            assert torch.equal(got, want), (f"rank {self.rank} step {step} bucket {b} from rank {src}: "
                                            f"got {got[:5].tolist()} want {want[:5].tolist()}")
            self.checked += 1

    def step(self, step):
        order = list(range(len(self.buckets)))
        mode = self.rng.choice(["all-then-random", "all-then-reverse", "pipelined"])
        if mode == "pipelined":  # what the optimizer does: wait for a bucket's previous exchange, then reissue
            for b in order:
                if b in self.pending:
                    self.wait(b)
                self.exchange(step, b)
            return
        for b in order:
            if b in self.pending:
                self.wait(b)
        for b in order:
            self.exchange(step, b)
        waits = order[::-1] if mode == "all-then-reverse" else self.rng.sample(order, len(order))
        for b in waits[:self.rng.randint(0, len(waits))]:  # the rest stay in flight into the next step
            self.wait(b)

    def finish(self):
        for b in sorted(self.pending, key=lambda _: self.rng.random()):
            self.wait(b)
        assert self.ex.in_flight == []
        self.ex.synchronize()
        assert self.ex.bytes_sent == self.expected_bytes, (self.ex.bytes_sent, self.expected_bytes)


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
    results = part(world_size, "schedules")
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
    for warm, end in part(2, "rss"):
        assert end - warm < 2.0, f"RSS grew from {warm:.1f} MB to {end:.1f} MB over the steady-state steps"


def _errors(fn):
    """The exception `fn` raises: (type name, message); ('none', '') if it does not raise."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "none", ""


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
    "int send with wire dtype": ("ValueError", ["Int", "floating point buffers only"]),
    "recv not in wire dtype": ("ValueError", ["recvs[0]", "BFloat16", "wire_dtype"]),
    "after shutdown": ("RuntimeError", ["shut down"]),
}


def test_bad_inputs_raise_clear_errors_and_world_size_one_is_a_no_op():
    for rank, out in enumerate(part(2, "bad_inputs")):
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
    """Rank 0 sends bucket 0 to rank 1, which never posts that receive; rank 1 waits for bucket 1 from rank 0,
    which never sends it. Both must time out, naming the bucket and the peer, not hang."""
    ex = Exchanger(timeout=TIMEOUT_S)
    x = torch.ones(1000)
    # A healthy bucket first: the failure must not depend on a never-used connection.
    r = torch.empty(1000)
    ex.exchange(5, x, [r], [1 - rank], [1 - rank])
    ex.wait(5)
    start = time.monotonic()
    if rank == 0:
        ex.exchange(0, x, [], [1], [])
        kind, msg = _errors(lambda: ex.wait(0))
    else:
        ex.exchange(1, x, [torch.empty(1000)], [], [0])
        kind, msg = _errors(ex.wait_all)
    elapsed = time.monotonic() - start
    later = {name: _errors(fn) for name, fn in {
        "exchange": lambda: ex.exchange(7, x, [], [], []),
        "wait": lambda: ex.wait(0),
        "wait_all": ex.wait_all,
        "synchronize": ex.synchronize,
    }.items()}
    ex.shutdown()  # after a failure: releases without waiting, no raise
    return dict(kind=kind, msg=msg, elapsed=elapsed, later=later)


def test_mismatched_schedule_times_out_naming_bucket_and_peer():
    res = part(2, "mismatch")
    for rank, (bucket, peer, op) in enumerate([(0, 1, "send to rank 1"), (1, 0, "receive from rank 0")]):
        r = res[rank]
        assert r["kind"] == "ExchangeTimeout", r
        assert "timed out" in r["msg"] and f"bucket {bucket}" in r["msg"] and op in r["msg"], r
        assert "Timed out" in r["msg"], r  # gloo's own text is passed on
        assert TIMEOUT_S - 0.5 <= r["elapsed"] < TIMEOUT_S + SLACK_S, r
        for call, (kind, msg) in r["later"].items():
            assert kind == "ExchangeError" and "unusable after an earlier error" in msg, (call, kind, msg)
            assert f"bucket {bucket}" in msg, (call, msg)  # the original error is quoted


def _peer_exits(rank, world_size):
    """Rank 2 exits (no teardown) while ranks 0 and 1 exchange a bucket with it."""
    ex = Exchanger(timeout=TIMEOUT_S)
    ring = T.make("ring", world_size)
    c = Checker(ex, rank, world_size, [(5000, torch.float32), (3, torch.bfloat16)], topology_schedule(ring, rank), 3)
    for t in range(5):
        c.step(t)
    c.finish()
    if rank == 2:
        exit_now({**_done, "peer_exit": ("ok", "exited")})  # like a crash: no teardown at all
    x = torch.ones(100)
    start = time.monotonic()

    def step():
        ex.exchange(9, x, [torch.empty(100)], [2], [2])
        ex.wait(9)

    kind, msg = _errors(step)
    elapsed = time.monotonic() - start
    return dict(kind=kind, msg=msg, elapsed=elapsed, later=_errors(lambda: ex.exchange(10, x, [], [], [])))


def test_peer_exit_mid_step_raises_naming_it_within_the_timeout():
    res = part(3, "peer_exit")
    assert res[2] == "exited"
    for r in res[:2]:
        assert r["kind"] in ("ExchangeError", "ExchangeTimeout"), r
        assert "bucket 9" in r["msg"] and "rank 2" in r["msg"], r
        assert r["msg"].split("failed: ", 1)[-1].strip() or r["kind"] == "ExchangeTimeout", r
        assert r["elapsed"] < TIMEOUT_S + SLACK_S, r
        assert r["later"][0] == "ExchangeError" and "unusable" in r["later"][1], r


# ------------------------------------------------------------------------------------------- suites

# Each world size's scenarios run in ONE spawned group, since starting a rank costs ~2.5 s of CPU; the tests
# above assert on their parts. Scenarios that leave the group damaged (a timeout, a dead rank) run last.
SUITES = {
    2: [("schedules", _schedules, (24, 1236)), ("bad_inputs", _bad_inputs, ()), ("rss", _steady_state_rss, (1000,)),
        ("mismatch", _mismatched, ())],
    3: [("schedules", _schedules, (16, 1237)), ("peer_exit", _peer_exits, ())],
    4: [("schedules", _schedules, (12, 1238))],
    8: [("schedules", _schedules, (4, 1242))],  # world size 8: a short run only
}

_done = {}  # in a child: the parts finished so far (a rank that exits mid-suite reports them)


def _suite(rank, world_size):
    import traceback
    for name, fn, args in SUITES[world_size]:
        try:
            _done[name] = ("ok", fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported per part; later parts would only hang on this rank's peers
            _done[name] = ("error", traceback.format_exc())
            break
    return dict(_done)


_suite_results = {}


def part(world_size, name):
    """The results (by rank) of part `name` of the world size's suite, which runs once per session."""
    if world_size not in _suite_results:
        try:
            _suite_results[world_size] = run_ranks(_suite, world_size, timeout=300)
        except Exception as exc:  # noqa: BLE001 - every test of this suite reports it, none reruns it
            _suite_results[world_size] = exc
    results = _suite_results[world_size]
    if isinstance(results, Exception):
        pytest.fail(f"the world-size-{world_size} suite failed: {results}")
    values = []
    for rank, out in enumerate(results):
        status, value = out.get(name, ("error", f"not run: an earlier part failed ({list(out)})"))
        if status != "ok":
            pytest.fail(f"rank {rank}, part {name!r} of the world-size-{world_size} suite:\n{value}")
        values.append(value)
    return values


# ------------------------------------------------------------------------------------------- NCCL (GPU)

def _nccl_ready():
    return torch.cuda.is_available() and decent_comm.exchange.nccl_available()


def _nccl_solo(rank, world_size):
    with Exchanger(device="cuda") as ex:
        x = torch.ones(10, device="cuda")
        ex.exchange(0, x, [], [], [])
        ex.wait(0)
        ex.synchronize()
        return ex.transport, ex.world_size, _errors(lambda: ex.exchange(1, x, [], [1], []))[0]


@pytest.mark.skipif(not _nccl_ready(), reason="needs a GPU and the NCCL transport")
def test_nccl_world_size_one_is_a_no_op():
    transport, world_size, err = run_ranks(_nccl_solo, 1, timeout=120)[0]
    assert (transport, world_size, err) == ("nccl", 1, "ValueError")


def _nccl_pair(rank, world_size, wire):
    torch.cuda.set_device(0)
    peer = 1 - rank
    buckets = [(1 << 20, torch.float32), (4099, torch.bfloat16), (0, torch.float32), (7, torch.float16)]
    with Exchanger(device="cuda", timeout=60, wire_dtype=wire, nccl_max_ctas=4) as ex:
        assert ex.transport == "nccl"
        recv = [torch.empty(n, dtype=wire or dt, device="cuda") for n, dt in buckets]
        sends = [torch.empty(n, dtype=dt, device="cuda") for n, dt in buckets]
        for t in range(20):
            for b, (n, dt) in enumerate(buckets):
                # Written by a kernel on the current stream just before the exchange: the comm stream
                # must wait for it.
                sends[b].copy_(payload(rank, t, b, n, dt, fractional=wire is not None).cuda(non_blocking=True))
                ex.exchange(b, sends[b], [recv[b]], [peer], [peer])
            for b in reversed(range(len(buckets))):
                ex.wait(b)
                n, dt = buckets[b]
                want = payload(peer, t, b, n, dt, fractional=wire is not None)
                got = recv[b].clone().cpu()  # ordered after the wait on the current stream
                assert torch.equal(got, want.to(wire) if wire else want), (t, b)
        ex.synchronize()
    return True


@pytest.mark.skipif(not _nccl_ready() or (decent_comm._native.nccl_version() or (0,)) < (2, 30),
                    reason="needs a GPU and NCCL >= 2.30 (two ranks on one GPU)")
@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_nccl_two_ranks_on_one_gpu(wire):
    assert run_ranks(_nccl_pair, 2, wire, timeout=240, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) == [True, True]


def _nccl_timeout(rank, world_size):
    torch.cuda.set_device(0)
    ex = Exchanger(device="cuda", timeout=TIMEOUT_S)
    # 64 MB: more than NCCL's p2p buffer, so an unmatched send cannot complete into the peer's FIFO.
    x = torch.ones(16 << 20, device="cuda")
    ex.exchange(5, x, [torch.empty_like(x)], [1 - rank], [1 - rank])  # connects the pair
    ex.synchronize()
    dist.barrier()

    def unmatched():  # rank 1 never posts the receive
        ex.exchange(0, x, [], [1], [])
        ex.wait(0)  # a stream wait: returns at once
        ex.synchronize()

    start = time.monotonic()
    kind, msg = _errors(unmatched) if rank == 0 else ("none", "")
    elapsed = time.monotonic() - start
    dist.barrier()  # rank 1 stays until rank 0 has seen its timeout
    later = _errors(lambda: ex.exchange(1, x, [], [], []))
    shutdown = _errors(ex.shutdown)  # rank 0: the communicator was aborted, nothing to wait for
    return dict(kind=kind, msg=msg, elapsed=elapsed, later=later, shutdown=shutdown)


@pytest.mark.skipif(not _nccl_ready() or (decent_comm._native.nccl_version() or (0,)) < (2, 30),
                    reason="needs a GPU and NCCL >= 2.30 (two ranks on one GPU)")
def test_nccl_unmatched_send_times_out_and_aborts():
    r = run_ranks(_nccl_timeout, 2, timeout=240, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})[0]
    assert r["kind"] == "ExchangeTimeout" and "bucket 0" in r["msg"] and "send to rank 1" in r["msg"], r
    assert r["elapsed"] < TIMEOUT_S + SLACK_S, r
    assert r["later"][0] == "ExchangeError" and "unusable" in r["later"][1], r
    assert r["shutdown"] == ("none", ""), r
