"""What the exchange tests share: deterministic payloads, schedules, a checker that runs a schedule on one
rank, and the suite runner that runs many scenarios in one spawned group of ranks.

Every payload is a deterministic function of (sender, step, bucket), so each receiver checks what it got
on its own. Starting a rank costs ~2.5 s of CPU, so each world size's scenarios run in ONE spawned group
(Suite); the tests assert on the parts it returns.
"""
import random
import traceback

import pytest
import torch

from decent_comm.exchange import GossipExchange

from dist_utils import run_ranks

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


def errors(fn):
    """The exception `fn` raises: (type name, message); ('none', '') if it does not raise."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "none", ""


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


# In a child: the parts of its suite finished so far (a rank that exits mid-suite reports them).
finished_parts = {}


def run_suite(rank, world_size, scenarios):
    """In a child: runs [(name, fn, args)] in order, fn(rank, world_size, *args); stops at the first failure,
    since later parts would only hang on this rank's peers."""
    for name, fn, args in scenarios:
        try:
            finished_parts[name] = ("ok", fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported per part
            finished_parts[name] = ("error", traceback.format_exc())
            break
    return dict(finished_parts)


class Suite:
    """Scenarios per world size, each world size run once per session in one spawned group; part() gives a
    part's results by rank, or fails the calling test with that part's error."""

    def __init__(self, scenarios, timeout=300):
        self.scenarios, self.timeout, self.results = scenarios, timeout, {}

    def part(self, world_size, name):
        if world_size not in self.results:
            try:
                self.results[world_size] = run_ranks(run_suite, world_size, self.scenarios[world_size],
                                                     timeout=self.timeout)
            except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - every test of this suite reports
                # it, none reruns it. pytest.fail.Exception: pytest-timeout's per-test limit (a BaseException) cut the
                # first test while it ran the whole suite; uncached, every later test ran the suite again.
                self.results[world_size] = exc
        results = self.results[world_size]
        if isinstance(results, BaseException):
            pytest.fail(f"the world-size-{world_size} suite failed: {results}")
        values = []
        for rank, out in enumerate(results):
            status, value = out.get(name, ("error", f"not run: an earlier part failed ({list(out)})"))
            if status != "ok":
                pytest.fail(f"rank {rank}, part {name!r} of the world-size-{world_size} suite:\n{value}")
            values.append(value)
        return values


class Ring:
    """A GossipExchange over a point-to-point ring of `n` (default group, CPU) and its step: bucket 0, 100 elements,
    to and from both neighbours. `post()` issues it, `ring()` issues and waits for it."""

    def __init__(self, rank, n, timeout):
        self.ex = GossipExchange(None, torch.device("cpu"), timeout=timeout)
        self.x = torch.ones(100)
        self.peers = [(rank - 1) % n, (rank + 1) % n]

    def post(self):
        self.ex.exchange(0, self.x, [torch.empty(100), torch.empty(100)], send_to=self.peers, recv_from=self.peers)

    def __call__(self):
        self.post()
        self.ex.wait(0)
