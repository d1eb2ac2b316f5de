"""A torchrun job whose script never calls opt.shutdown() nor dist.destroy_process_group() exits 0 on every
rank with nothing on stderr from C++ (issue #14.1): decent_comm drains and closes the exchanger when the
optimizer is collected (variant none: it dies when main() returns) or at interpreter exit (variant global: a
module global keeps it alive until then). bench/exit_stress.py runs the same script many times."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "exit_user_script.py")
# c10's TORCH_WARN / LOG(WARNING) prefix, e.g. "[rank0]:[W1126 13:44:58.367696914 exchanger.cpp:47]"
CPP_WARNING = re.compile(r"\[W\d{4} [\d:.]+ [\w./-]+:\d+\]")


@pytest.mark.parametrize("variant", ["none", "global"])
def test_job_without_shutdown_exits_cleanly(variant):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-6000:]}"
    for rank in (0, 1):
        assert f"rank {rank} done ({variant})" in proc.stdout, out[-6000:]
    assert "terminate called" not in out, out[-6000:]
    assert not CPP_WARNING.search(out), f"a C++ warning on stderr:\n{out[-6000:]}"
    assert "Exchanger destroyed" not in out, out[-6000:]
