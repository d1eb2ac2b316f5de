"""Runs a function on N local ranks joined by a gloo process group on 127.0.0.1, for multi-process tests.

    results = run_ranks(fn, world_size, *args, timeout=120)

Each child gets OMP_NUM_THREADS=1 / torch.set_num_threads(1), calls fn(rank, world_size, *args) with the
default group initialized, and sends back its return value. A child's exception is re-raised in the
parent with the child's traceback; on timeout every child is killed and the parent raises.
"""

import io
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, queue, env):
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialized to bytes: tensors put on a multiprocessing queue travel as shared-memory handles that
        # die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: B902 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Skip the barrier-like teardown if a peer died: destroy_process_group does not block in gloo.
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size, *args, timeout=120, env=None, allow_failures=False):
    """Returns [result of rank 0, ..., result of rank n-1]. With allow_failures, a failed rank's entry is
    the traceback text (a str) wrapped as ChildError instead of raising."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                 **(env or {})}
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, child_env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within "
                                   f"{timeout} s")
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
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [v for v in results.values() if isinstance(v, ChildError)]
    if errors and not allow_failures:
        raise AssertionError("\n".join(f"rank {e.rank} failed:\n{e.text}" for e in errors))
    return [results[r] for r in range(world_size)]


class ChildError:
    def __init__(self, rank, text):
        self.rank, self.text = rank, text

    def __repr__(self):
        return f"ChildError(rank={self.rank})"
