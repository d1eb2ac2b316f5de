"""Restarts across nodes (decent_train.distributed.init_process_group_per_attempt): torchrun counts restarts per node
agent, so after a restart two nodes' ranks can join under different attempt numbers and wait for each other until
the store's timeout; torch's error named only a key ("wait timeout ... keys: /attempt1/0//cpu//0/1") after 30 min.
Two processes stand for two nodes of one rank each (GROUP_WORLD_SIZE=2, --max-restarts 1) at restart counts 0 and 1,
through the harness's command line (examples' decent_train.cli): each warns that restarts are one-node only, and
each exits 2 with one line naming its own attempt number and the likely cause."""
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from decent_train.distributed import init_process_group_per_attempt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the harness with a 3 s group timeout (the default is 30 min), so the mismatched attempts time out quickly
CHILD = """
import datetime
import decent_train.distributed as d
join = d.init_process_group_per_attempt
d.init_process_group_per_attempt = lambda backend, **kw: join(backend, timeout=datetime.timedelta(seconds=3), **kw)
from decent_train.workloads import lm
lm.main(["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--corpus-mb", "0.2", "--eval-tokens", "1024", "--no-progress", "--device", "cpu", "--steps", "2"])
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_at_different_attempts_say_so_in_one_line_each():
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DECENT_COMM_CUDA": "0",
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GROUP_WORLD_SIZE": "2",
               "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (rank, p.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        warnings = [line for line in err.splitlines() if "WARNING" in line and "one node only" in line]
        assert len(warnings) == 1 and "docs/restarts.md" in warnings[0], err[-3000:]
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1, err[-3000:]
        assert f"torchrun restart attempt {rank} " in errors[0], errors
        assert "restart counts may differ" in errors[0] and f"/attempt{rank}/" in errors[0], errors


class _Joined(Exception):
    pass


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_store_timeout_is_the_one_a_plain_init_sets(monkeypatch, backend):
    """A plain init_process_group opens the env:// store with the backend's default timeout (torch's
    _get_default_timeout: nccl 10 min); the per-attempt join opened it with 30 min for every backend."""
    seen = []

    def rendezvous(url, timeout):
        seen.append(timeout)
        raise _Joined
    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    with pytest.raises(_Joined):
        init_process_group_per_attempt(backend)
    assert seen == [c10d._get_default_timeout(backend)]


@pytest.mark.parametrize("kwarg", ["init_method", "store", "rank", "world_size"])
def test_what_the_env_rendezvous_decides_is_refused_by_name(monkeypatch, kwarg):
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("joined despite the refused argument"))
    with pytest.raises(ValueError, match=f"it takes no {kwarg}"):
        init_process_group_per_attempt("gloo", **{kwarg: None})
