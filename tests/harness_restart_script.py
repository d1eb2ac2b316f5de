"""Run by tests/test_torchrun_restart.py under `torchrun --max-restarts 1` (2 ranks): examples/train_lm.py with the
arguments given, and two faults a restart meets. In attempt 0, rank 1 is killed (SIGKILL) once the checkpoint of step
KILL_AFTER is committed (CHECKPOINT/latest names it). In attempt 1, rank 1 joins LATE_S seconds after rank 0, so that
rank 0 reads the process group's keys first: on keys shared across attempts it read rank 1's address of attempt 0, a
dead process, and gloo's connectFullMesh failed ("Connection refused"), as it did by chance in 3 of 4 restarts of the
harness. The script's own code is not changed: the kill wraps decent_train.loop's save_checkpoint."""
import os
import runpy
import signal
import sys
import time

from decent_train import loop  # the package: the test runs this script with PYTHONPATH at the repository root
from decent_train.distributed import restart_attempt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

attempt, rank = restart_attempt(), int(os.environ["RANK"])
KILL_AFTER, LATE_S = int(os.environ.get("KILL_AFTER", "-1")), float(os.environ.get("LATE_S", "0"))

if attempt == 0 and rank == 1 and KILL_AFTER >= 0:
    save = loop.save_checkpoint

    def save_then_die(root, env, model, strategy, scheduler, generator, progress, *more, **options):
        save(root, env, model, strategy, scheduler, generator, progress, *more, **options)
        if progress.step == KILL_AFTER:
            # rank 0 writes `latest` after the ranks' barrier: wait for it, so the commit is not cut short
            latest, name = os.path.join(root, "latest"), f"step_{KILL_AFTER:07d}"
            while not (os.path.exists(latest) and open(latest).read() == name):
                time.sleep(0.01)
            print(f"rank 1 killed after the commit of step {KILL_AFTER}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    loop.save_checkpoint = save_then_die
if attempt == 1 and rank == 1:
    time.sleep(LATE_S)
print(f"attempt {attempt} rank {rank}: started", flush=True)

script = os.path.join(ROOT, "examples", "train_lm.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
