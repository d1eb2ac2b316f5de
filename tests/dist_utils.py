"""Runs a function on N local ranks joined by a gloo process group on 127.0.0.1, for multi-process tests.

    results = run_ranks(fn, world_size, *args, timeout=120)

Each child gets OMP_NUM_THREADS=1 / torch.set_num_threads(1), calls fn(rank, world_size, *args) with the
default group initialized, and sends back its return value. A child's exception is re-raised in the
parent with the child's traceback; on timeout every child is killed and the parent raises.

The group is rendezvoused through a TCPStore the parent serves on a port the OS picks, so concurrent test
runs on one machine never race for a port. A child that must die mid-test (to test what its peers do)
calls exit_now(result): it reports `result` and vanishes without any teardown, like a crashed process.

Children are forked from a multiprocessing fork server that imported torch and decent_comm once (started by the
first run_ranks of a test session): each child is still a new process with pristine module state, but starts in
~0.05 s instead of the 1.5-2 s a spawned child spent importing torch (6.6 s for 4 ranks on a 2-core machine: most
of the suite's time). Importing torch and decent_comm starts no thread, so the fork is safe. Environment variables
read at import (OMP_NUM_THREADS) are the server's, so it starts with the children's base environment; `env=` is
applied in each child before it runs, so it may only name variables read later (NCCL_*, ours).
"""

import contextlib
import datetime
import io
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set in each child, for exit_now().
_child_state = {}


def _report(queue, rank, ok, value):
    if ok:
        # Serialized to bytes: tensors put on a multiprocessing queue travel as shared-memory handles that
        # die with this process.
        buf = io.BytesIO()
        torch.save(value, buf)
        value = buf.getvalue()
    queue.put((rank, ok, value))


def exit_now(result=None):
    """In a child: report `result` as this rank's return value, then exit at once (no teardown at all)."""
    queue, rank = _child_state["queue"], _child_state["rank"]
    _report(queue, rank, True, result)
    queue.close()
    queue.join_thread()  # flush the queue's feeder thread before the process vanishes
    os._exit(0)


def _child(rank, world_size, store_port, pg_timeout, fn, args, queue, env):
    os.environ.update(env)
    torch.set_num_threads(1)
    _child_state.update(queue=queue, rank=rank)
    try:
        kwargs = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **kwargs)
        _report(queue, rank, True, fn(rank, world_size, *args))
    except BaseException:  # noqa: B902 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Skip the barrier-like teardown if a peer died: destroy_process_group does not block in gloo.
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _environ(overrides):
    """os.environ with `overrides` while the fork server starts: it keeps that environment, so its children see
    it before anything (OpenMP included) initializes."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Imported once, in the fork server; a child imports its test module itself (cheap once torch is loaded).
# torch._dynamo too: torch imports it lazily in a process's first torch.optim.Optimizer construction, 2.4 s on a
# loaded 2-core machine, which the tests' ranks paid inside their 2-4 s timeouts (test_optim_faults failed so, a
# different case from run to run). It starts no thread (the server forks its children).
_PRELOAD = ["torch", "torch.distributed", "decent_comm", "torch._dynamo"]
_context = []


def _fork_server_context(child_env):
    """The forkserver context, its server started (once per session) with `child_env` in its environment."""
    if not _context:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        with _environ(child_env):
            # The stdlib's one server per process: started here, not by the first Process.start(), so that it
            # inherits the children's environment whatever the caller's.
            import multiprocessing.forkserver as forkserver
            forkserver.ensure_running()
        _context.append(ctx)
    return _context[0]


def run_ranks(fn, world_size, *args, timeout=120, env=None, allow_failures=False, pg_timeout=None):
    """Returns [result of rank 0, ..., result of rank n-1]. With allow_failures, a failed rank's entry is
    the traceback text (a str) wrapped as ChildError instead of raising.

    fn must be a module-level function (children import it by name). env: extra environment variables of
    the children. pg_timeout: the process group's timeout in seconds (None: torch's default).
    """
    # TORCH_DIST_INIT_BARRIER: init_process_group returns only once every rank's has (torch's store barrier). Without
    # it a rank done at once (one outside the test's subgroup) destroyed the group while a peer's gloo was still
    # connecting to it: "connectFullMesh failed ... Connection closed by peer". Measured on a loaded 2-core machine,
    # 4 ranks returning at once: 13 of 450 runs failed so without it, 0 of 450 with it.
    base_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                "TORCH_DIST_INIT_BARRIER": "1"}
    child_env = {**base_env, **(env or {})}
    ctx = _fork_server_context(base_env)
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    procs = [ctx.Process(target=_child, args=(r, world_size, store.port, pg_timeout, fn, args, queue, child_env),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:  # forked by the server: the parent's environment is not theirs (_child applies child_env)
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for p in procs:  # kill first: a hung child would make every join below wait its timeout
                    p.kill()
                failed = "".join(f"\nrank {r} failed:\n{v.text}" for r, v in sorted(results.items())
                                 if isinstance(v, ChildError))
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within "
                                   f"{timeout} s (killed){failed}")
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                # A rank that exited without reporting died (os._exit, a signal, a crash); give its last
                # queued message a moment to arrive before declaring it.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        for r in dead:
                            results[r] = ChildError(r, f"rank {r} exited with code {procs[r].exitcode} "
                                                       "without reporting")
                continue
            results[rank] = torch.load(io.BytesIO(value), weights_only=False) if ok else ChildError(rank, value)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline + 5.0 - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
    errors = [v for v in results.values() if isinstance(v, ChildError)]
    if errors and not allow_failures:
        raise AssertionError("\n".join(f"rank {e.rank} failed:\n{e.text}" for e in errors))
    return [results[r] for r in range(world_size)]


class ChildError:
    def __init__(self, rank, text):
        self.rank, self.text = rank, text

    def __repr__(self):
        return f"ChildError(rank={self.rank})"
