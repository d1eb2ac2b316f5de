"""The default process group's store stops answering (its host cut off: a partition, or that machine crashed, so no
TCP reset arrives): every rank still raises within timeout + 5 s, and exits as usual (exit code 0, no signal).

The store runs in a process of its own, which a rank freezes (SIGSTOP) at the fault: its clients' requests then get
no answer and no error, as across a partition (add/set/get/check block until TCP gives up, ~15 min; only a wait
with a timeout is bounded). Before exchange.store_calls, the ranks blocked in the store calls of roster.blame (the
group all-reduce, BoundedAllReduce), of GossipExchange's told() (the point-to-point error path) and of the arrival
barrier. Each rank is a separate interpreter that exits through the usual finalization (atexit hooks included):
a call still outstanding there must neither hold up the exit nor abort it.

Timeline per case (TIMEOUT_S = 2, REPLY_S = 3 s for a request to answer): p2p, rank 2 freezes the store and exits:
the others' transfer fails at once, their look-up of the other ranks' reports gives up after REPLY_S; group /
global_average, rank 2 freezes the store and stays silent: the all-reduce times out after TIMEOUT_S, blame's first
look-up gives up REPLY_S later; construction, rank 2 freezes the store and then builds its optimizer: its own
arrival gives up after REPLY_S, the others' after TIMEOUT_S (their wait) + REPLY_S (their poison).
"""

import json
import os
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
TIMEOUT_S = 2.0
BOUND_S = TIMEOUT_S + 5  # the optimizer's promise: an error within timeout + 5 s on every live rank
DEADLINE_S = 150.0       # the launcher kills what still runs then (the old code blocked ~15 min)
WORLD = 3

_SERVE_STORE = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()  # until the test closes it (or dies)
"""


# ---- in each rank (a separate interpreter: `python -c`, see _launch) ----

def _freeze_store():
    """The fault: the store stops answering; records when (on the machine's clock, which the ranks share)."""
    os.kill(int(os.environ["STORE_PID"]), 19)  # SIGSTOP
    print(json.dumps({"fault_at": time.time()}), flush=True)


def _steps(model, opt, count):
    import torch
    for _ in range(count):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()


def _error_of(work, since=None):
    """Runs `work`; what it raised, and when relative to `since` (time.time(); None: its start)."""
    started = time.time() if since is None else since
    try:
        work()
        return {"kind": None, "msg": "no error"}
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"kind": type(exc).__name__, "msg": str(exc), "at": time.time(), "elapsed": time.time() - started}


def _scenario(case, rank):
    import decent_comm
    from optim_cases import make_model
    model = make_model(0)
    if case == "construction":  # rank 2 arrives after the store froze
        build = lambda: decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", timeout=TIMEOUT_S)  # noqa
        if rank == 2:  # once the others are in the optimizer's first arrival barrier (exchange.arrival's keys)
            import torch.distributed as dist
            store = dist.distributed_c10d._get_default_store()
            base = f"decent_comm/arrival/{dist.group.WORLD.group_name}/1"
            while not store.check([f"{base}/rank0", f"{base}/rank1"]):
                time.sleep(0.01)
            _freeze_store()
        return _error_of(build)
    topology = "complete" if case == "group" else "ring"  # complete on 3 ranks: one group all-reduce per step
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology=topology, timeout=TIMEOUT_S,
                           **({"exchange": "p2p"} if case == "p2p" else {}))
    _steps(model, opt, 3)
    if rank == 2:
        _freeze_store()
        if case != "p2p":
            time.sleep(TIMEOUT_S + 6)  # alive but silent: the others' all-reduce times out
        sys.stdout.flush()
        os._exit(0)  # the faulty rank is not judged
    if case == "global_average":
        return _error_of(lambda: opt.global_average().__enter__())
    return _error_of(lambda: _steps(model, opt, 50))


def _rank_main():
    import datetime
    import torch
    import torch.distributed as dist
    import decent_comm  # noqa: F401 - imported before the ranks meet: a slow import would make a rank late
    import optim_cases  # noqa: F401
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), WORLD, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    print(json.dumps(_scenario(os.environ["CASE"], rank)), flush=True)
    # the script ends here, as a training script's would: the interpreter's own exit, store still frozen


# ---- the launcher ----

def _launch(case):
    """Runs the ranks of `case`; per rank (exit code or None when killed at the deadline, its JSON lines, stderr)."""
    store = subprocess.Popen([sys.executable, "-c", _SERVE_STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    procs = []
    try:
        port = int(store.stdout.readline())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS]), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo", TORCH_DIST_INIT_BARRIER="1", STORE_PORT=str(port),
                   STORE_PID=str(store.pid), CASE=case)
        for rank in range(WORLD):
            procs.append(subprocess.Popen([sys.executable, "-c", "import test_store_unreachable as t; t._rank_main()"],
                                          env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + DEADLINE_S
        outcomes = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                code = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                code = None
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            outcomes.append((code, lines, err))
        return outcomes
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        store.kill()  # frozen or not (SIGKILL ends a stopped process)
        store.wait()
        store.stdin.close()
        store.stdout.close()


def _judged(outcomes, ranks):
    """The result of each judged rank, after checking that every rank exited 0 and none aborted."""
    fault_at = [line["fault_at"] for _, lines, _ in outcomes for line in lines if "fault_at" in line]
    results = {}
    for rank, (code, lines, err) in enumerate(outcomes):
        assert code == 0 and "terminate called" not in err, (rank, code, lines, err[-3000:])
        if rank in ranks:
            result = [line for line in lines if "kind" in line]
            assert len(result) == 1, (rank, lines, err[-3000:])
            results[rank] = dict(result[0], since_fault=result[0]["at"] - fault_at[0] if fault_at else None)
    return results


@pytest.mark.parametrize("case", ["p2p", "group", "global_average"])
def test_a_failure_path_meeting_an_unreachable_store_still_raises_in_time(case):
    results = _judged(_launch(case), ranks=(0, 1))
    for rank, r in results.items():
        assert r["kind"] == "ExchangeError" or r["kind"] == "ExchangeTimeout", (rank, r)
        assert r["since_fault"] < BOUND_S, (rank, r)
        assert "no answer from the default process group's store at 127.0.0.1:" in r["msg"], (rank, r)
        if case == "p2p":  # the transport's own words still name the peer
            assert "rank 2" in r["msg"], (rank, r)
        else:  # the timeout, and that the store could not say which member failed
            assert r["kind"] == "ExchangeTimeout" and f"{TIMEOUT_S * 1e3:.0f} ms" in r["msg"], (rank, r)
            assert "which members failed too is unknown" in r["msg"], (rank, r)


def test_the_construction_barrier_with_an_unreachable_store_raises_on_every_rank_in_time():
    results = _judged(_launch("construction"), ranks=(0, 1, 2))
    for rank, r in results.items():
        assert r["kind"] == "ExchangeError", (rank, r)
        assert "the store of the default process group failed while the ranks met: no answer from the default " \
               "process group's store at 127.0.0.1:" in r["msg"], (rank, r)
        assert r["elapsed"] < BOUND_S, (rank, r)


def test_a_store_call_past_its_deadline_fails_the_later_ones_at_once_until_it_answers(monkeypatch):
    """exchange.store_calls itself, in this process: the stuck call holds the client's connection, so a later call
    queued behind it would wait as long; it fails at once instead, and the store is usable again once it answers."""
    import datetime
    import signal
    import torch.distributed as dist
    from decent_comm.exchange import store_calls
    monkeypatch.setattr(store_calls, "REPLY_S", 0.5)
    server = subprocess.Popen([sys.executable, "-c", _SERVE_STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=60))
        store = store_calls.BoundedStore(dist.PrefixStore("prefix", client))
        assert store.add("n", 1) == 1
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=f"store at 127.0.0.1:{port} within 0.5 s \\(add"):
            store.add("n", 1)
        assert 0.5 <= time.monotonic() - started < 2.0
        started = time.monotonic()
        for call in (lambda: store.check(["n"]), lambda: store.wait(["n"], datetime.timedelta(seconds=5))):
            with pytest.raises(dist.DistStoreError, match="within 0.5 s \\(add"):  # the first call's error
                call()
        assert time.monotonic() - started < 0.5
        os.kill(server.pid, signal.SIGCONT)  # the stuck add is answered: the connection serves calls again
        deadline = time.monotonic() + 30
        while True:
            try:
                assert store.add("n", 1) == 3  # the stuck add was carried out too
                break
            except dist.DistStoreError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert store.get("n") == b"3" and store.check(["n"])
    finally:
        server.kill()
        server.wait()
        server.stdin.close()
        server.stdout.close()


def test_a_call_queued_behind_an_interrupted_wait_says_so_instead_of_blaming_the_store(monkeypatch):
    """Ctrl-C during a long wait (the construction barrier's, in a notebook) leaves the store call running in the
    call's thread; a later call queued behind it must not say the store's host is unreachable without saying why."""
    import datetime
    import signal
    import threading
    import torch.distributed as dist
    from decent_comm.exchange import store_calls
    monkeypatch.setattr(store_calls, "REPLY_S", 0.5)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    store = store_calls.BoundedStore(server)
    # a SIGINT to the main thread, as Ctrl-C sends (interrupt_main() would not wake the blocked wait)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        store.wait(["never"], datetime.timedelta(seconds=3))
    with pytest.raises(dist.DistStoreError, match=r"earlier store call \(wait\) has not returned yet"):
        store.add("n", 1)
    deadline = time.monotonic() + 10  # the wait ends at its own timeout: the store serves calls again
    while True:
        try:
            assert store.add("n", 1) == 2  # the add that gave up was carried out once the wait returned
            break
        except dist.DistStoreError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_exit_shutdown_cuts_only_the_connections_to_the_stores_host():
    """At exit with a call outstanding, the store's sockets are shut down; a connection to another host's service on
    the same port number is not the store's (127.0.0.2: another address of the loopback)."""
    import socket
    from decent_comm.exchange import store_calls
    listeners = [socket.create_server(("127.0.0.1", 0))]
    port = listeners[0].getsockname()[1]
    listeners.append(socket.create_server(("127.0.0.2", port)))
    clients = [socket.create_connection((host, port)) for host in ("127.0.0.1", "127.0.0.2")]
    accepted = [listener.accept()[0] for listener in listeners]
    try:
        store_calls._shut_down_connections("127.0.0.1", port)
        assert accepted[0].recv(1) == b""  # the store's: shut down (EOF at the other end)
        clients[1].sendall(b"x")  # the other host's: untouched
        assert accepted[1].recv(1) == b"x"
    finally:
        for s in clients + accepted + listeners:
            s.close()
