"""Starts the ranks of one faulty job and collects, per rank, what it recorded, its exit code and its stderr.

    outcomes = launch(world_size, ["--scenario", "dead", ...], deadline_s=60)            # own launcher
    outcomes = launch(world_size, [...], deadline_s=60, torchrun=True)                  # a real torchrun job

The own launcher gives each rank torchrun's worker environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE=True) and, like torchrun's agent, serves the TCPStore itself, so
the store outlives any rank; `dist.init_process_group("gloo")` in the worker rendezvouses exactly as under
torchrun. Unlike torchrun it keeps every rank's exit code and stderr apart and never kills the other ranks when
one fails, which is what the matrix must observe. A rank still running at the deadline is killed and marked hung.
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional

from .. import REPO_ROOT

WORKER = "decent_train.faults.worker"


@dataclass
class RankOutcome:
    rank: int
    returncode: Optional[int]          # None: killed at the deadline (hung); < 0: died of that signal
    stderr: str
    record: dict = field(default_factory=dict)  # what the rank wrote (decent_train.faults.worker), {} if nothing
    exited_at: float = 0.0              # time.time() when it exited (or was killed): the records' clock

    @property
    def hung(self) -> bool:
        return self.returncode is None


def _child_env(extra: dict) -> dict:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env.update({"PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _wait(procs, deadline: float):
    """Waits for every process until `deadline` (monotonic) and kills the rest. Returns, per process, its exit
    code (None: killed, it hung) and the time.time() it exited at."""
    codes, times = [None] * len(procs), [None] * len(procs)
    while any(t is None for t in times) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if times[i] is None and p.poll() is not None:
                codes[i], times[i] = p.returncode, time.time()
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if times[i] is None:
            p.kill()
            p.wait()
            times[i] = time.time()
    return codes, times


def _read_record(out_dir: str, rank: int) -> dict:
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def launch(world_size: int, args: List[str], *, deadline_s: float, torchrun: bool = False) -> List[RankOutcome]:
    """Runs `python -m decent_train.faults.worker <args> --out DIR` on `world_size` ranks."""
    with tempfile.TemporaryDirectory(prefix="decent_faults_") as out_dir:
        argv = ["-m", WORKER, *args, "--out", out_dir]
        deadline = time.monotonic() + deadline_s
        if torchrun:
            return _torchrun(world_size, argv, out_dir, deadline)
        import torch.distributed as dist  # the launcher side needs torch only to serve the store

        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=deadline_s))
        procs, errs = [], []
        for rank in range(world_size):
            err = open(os.path.join(out_dir, f"stderr{rank}.txt"), "w+")
            env = _child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                              "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
            procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                          stderr=err))
            errs.append(err)
        codes, times = _wait(procs, deadline)
        outcomes = []
        for rank, (code, at, err) in enumerate(zip(codes, times, errs)):
            err.seek(0)
            outcomes.append(RankOutcome(rank, code, err.read(), _read_record(out_dir, rank), at))
            err.close()
        del store
        return outcomes


def _torchrun(world_size: int, argv: List[str], out_dir: str, deadline: float) -> List[RankOutcome]:
    """A real `torchrun --standalone` job: its exit code and stderr (every rank's, interleaved) go to every rank's
    outcome; torchrun reports a rank's signal death in its own exit code and stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", *argv]
    with open(os.path.join(out_dir, "stderr.txt"), "w+") as err:
        proc = subprocess.Popen(cmd, env=_child_env({}), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err)
        codes, times = _wait([proc], deadline)
        err.seek(0)
        text = err.read()
    return [RankOutcome(r, codes[0], text, _read_record(out_dir, r), times[0]) for r in range(world_size)]
