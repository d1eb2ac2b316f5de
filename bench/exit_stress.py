"""Exit stress test: many consecutive torchrun jobs, each of which must end with exit code 0 on every rank and
no C++ warning or "terminate called" on stderr (issue #14.1: ranks aborting with SIGABRT at exit).

    python bench/exit_stress.py                       # 100 user-script jobs + 30 train_lm jobs
    python bench/exit_stress.py --jobs 20 --lm-jobs 0 --variants none,ddp
    python bench/exit_stress.py --cores               # keep core dumps of failing ranks (see below)

(a) bench/exit_user_script.py, a minimal user script, --jobs jobs in all, the variants taking turns (so a load
    change on the machine hits every variant alike): none (no shutdown(), no destroy_process_group(); the
    optimizer dies when main() returns), global (the same with the optimizer alive until exit), average (global
    ending with opt.global_average(), as the README's script: 3 of 66 such runs aborted before the whole-group
    all-reduces waited for gloo's worker to let go of their tensors), shutdown,
    both (shutdown() then destroy_process_group()), ddp (plain torch DDP, decent_comm never imported);
    --variants picks others (see the script: destroy, ddp-destroy).
(b) examples/train_lm.py with a tiny model and a few steps, --lm-jobs jobs in all, alternating
    --optimizer allreduce (DDP, 2 ranks) and --optimizer dadamw --topology one-peer-exp (4 ranks), spread
    evenly among the jobs of (a).

Every job: torchrun --standalone, gloo on loopback, OMP_NUM_THREADS=1, its own working directory. A job fails
when torchrun exits non-zero (a rank's exit code or signal is read from torchrun's error report), when it
times out, or when its output has "terminate called" or a C++ warning ("[W<date> <time> file.cpp:line]").
Prints one line per job and a table per variant; the exit code is 1 when any job failed. With --cores the
ranks run with an unlimited core size in the job's directory, which is kept for failing jobs: a core file
appears there when /proc/sys/kernel/core_pattern is a plain file name (e.g. "core").
"""
import argparse
import collections
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench_args import count, names, number  # bench/, this script's directory
from exit_user_script import VARIANTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_SCRIPT = os.path.join(ROOT, "bench", "exit_user_script.py")
TRAIN_LM = os.path.join(ROOT, "examples", "train_lm.py")
LM_TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
           "--corpus-mb", "0.3", "--eval-tokens", "1024", "--no-progress"]

# c10's TORCH_WARN / LOG(WARNING) line prefix, e.g. "[rank0]:[W1126 13:44:58.367696914 exchanger.cpp:47]"
CPP_WARNING = re.compile(r"\[W\d{4} [\d:.]+ [\w./-]+:\d+\]")
TERMINATE = "terminate called"
# torchrun's failure report names the rank and how it ended: "exitcode  : -6 (pid: 1234)"
RANK_EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?\n.*?exitcode\s*:\s*(-?\d+)", re.S)


def user_job(variant: str, nproc: int, steps: int):
    # interactive: the script under python -i (its REPL then reads the end of its input, stdin being closed)
    launch = ["--no-python", sys.executable, "-i", USER_SCRIPT] if variant == "interactive" else [USER_SCRIPT]
    return nproc, [*launch, variant, "--steps", str(steps)]


LM_VARIANTS = ("lm-allreduce", "lm-dadamw")


def lm_job(variant: str, steps: int):
    if variant == "lm-allreduce":
        return 2, [TRAIN_LM, "--optimizer", "allreduce", "--steps", str(steps), "--eval-every", str(steps), *LM_TINY]
    return 4, [TRAIN_LM, "--optimizer", "dadamw", "--topology", "one-peer-exp", "--steps", str(steps),
               "--eval-every", str(steps), *LM_TINY]


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def run_job(nproc: int, script_args, workdir: str, timeout: float, cores: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def allow_cores():
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=allow_cores if cores else None, stdin=subprocess.DEVNULL)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    seconds = time.monotonic() - start
    ranks = {int(r): int(c) for r, c in RANK_EXIT.findall(out)}
    if rc is None:
        outcome = "timeout"
    elif rc == 0:
        outcome = "exit 0"
    elif ranks:  # the first failing rank's code, as torchrun reports it
        outcome = "rank " + ", ".join(f"{r}: {describe_code(c)}" for r, c in sorted(ranks.items()))
    else:
        outcome = f"torchrun {describe_code(rc)}"
    terminate = out.count(TERMINATE)
    warnings = [line for line in out.splitlines() if CPP_WARNING.search(line)]
    return dict(rc=rc, outcome=outcome, seconds=seconds, terminate=terminate, warnings=warnings, output=out,
                ok=rc == 0 and terminate == 0 and not warnings)


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=count(0), default=100, help="user-script jobs in all (variants take turns)")
    p.add_argument("--lm-jobs", type=count(0), default=30, help="train_lm jobs in all (allreduce and dadamw take turns)")
    p.add_argument("--variants", default="none,global,average,shutdown,both,ddp", type=names(VARIANTS),
                   help=f"user-script variants, comma-separated ({', '.join(VARIANTS)})")
    p.add_argument("--lm-variants", type=names(LM_VARIANTS), default=",".join(LM_VARIANTS))
    p.add_argument("--nproc", type=count(1), default=2, help="ranks of a user-script job")
    p.add_argument("--steps", type=count(1), default=5, help="steps of a user-script job")
    p.add_argument("--lm-steps", type=count(1), default=6, help="steps of a train_lm job")
    p.add_argument("--timeout", type=number(0.0, strictly=True), default=600,
                   help="seconds before a job counts as hung")
    p.add_argument("--log-dir", default=None, help="where failing jobs' output is kept (default: a new temp dir)")
    p.add_argument("--cores", action="store_true", help="unlimited core size; keep failing jobs' directories")
    args = p.parse_args(argv)
    if args.jobs + args.lm_jobs == 0:  # passed, having run nothing
        p.error("--jobs 0 and --lm-jobs 0: no job to run")

    variants, lm_variants = args.variants, args.lm_variants
    user = [(variants[i % len(variants)], user_job(variants[i % len(variants)], args.nproc, args.steps))
            for i in range(args.jobs)]
    lm = [(lm_variants[i % len(lm_variants)], lm_job(lm_variants[i % len(lm_variants)], args.lm_steps))
          for i in range(args.lm_jobs)]
    # train_lm jobs spread evenly among the user-script jobs: every part of the run sees every kind of job
    plan = [job for _, job in sorted([((i + 0.5) / len(user), j) for i, j in enumerate(user)] +
                                     [((i + 0.5) / len(lm), j) for i, j in enumerate(lm)], key=lambda x: x[0])]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="exit_stress.")
    os.makedirs(log_dir, exist_ok=True)
    print(f"{len(plan)} jobs; failing jobs' output under {log_dir}; load average (1 min) at start {load()}, "
          f"{os.cpu_count()} cores", flush=True)

    stats = collections.OrderedDict()
    t0 = time.monotonic()
    # SIGTERM (like Ctrl-C) stops after the job in progress and still prints the table of the jobs run so far
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_plan(plan, stats, log_dir, args)
    except KeyboardInterrupt:
        print("interrupted: the table counts the jobs that completed", flush=True)
    ran = sum(s["jobs"] for s in stats.values())

    minutes = (time.monotonic() - t0) / 60
    print(f"\n{ran} of {len(plan)} jobs in {minutes:.1f} min; load average (1 min) at the end {load()}")
    head = f"{'variant':12s} {'jobs':>5s} {'ok':>5s} {'nonzero':>8s} {'terminate':>10s} {'warned':>7s} {'s/job':>6s}  outcomes"
    print(head)
    print("-" * len(head))
    failed = 0
    for variant, s in stats.items():
        outcomes = ", ".join(f"{k} x{n}" for k, n in s["outcomes"].most_common())
        print(f"{variant:12s} {s['jobs']:5d} {s['ok']:5d} {s['nonzero']:8d} {s['terminate']:10d} {s['warned']:7d} "
              f"{s['seconds'] / s['jobs']:6.1f}  {outcomes}")
        failed += s["jobs"] - s["ok"]
    if not failed and args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(f"\n{'FAIL' if failed else 'PASS'}: {failed} of {ran} jobs failed (non-zero exit, timeout, "
          "'terminate called' or a C++ warning)")
    return 1 if failed or ran < len(plan) else 0


def run_plan(plan, stats, log_dir, args):
    for i, (variant, (nproc, script_args)) in enumerate(plan, 1):
        workdir = tempfile.mkdtemp(prefix=f"job{i:03d}.", dir=log_dir)
        r = run_job(nproc, script_args, workdir, args.timeout, args.cores)
        s = stats.setdefault(variant, dict(jobs=0, ok=0, nonzero=0, terminate=0, warned=0, seconds=0.0,
                                           outcomes=collections.Counter()))
        s["jobs"] += 1
        s["ok"] += r["ok"]
        s["nonzero"] += r["rc"] != 0
        s["terminate"] += r["terminate"] > 0
        s["warned"] += bool(r["warnings"])
        s["seconds"] += r["seconds"]
        s["outcomes"][r["outcome"]] += 1
        note = "" if r["ok"] else f"  FAILED -> {workdir}"
        if r["warnings"]:
            note += f"  warning: {r['warnings'][0].strip()[:160]}"
        print(f"[{i:3d}/{len(plan)}] {variant:12s} {r['outcome']:22s} {r['seconds']:6.1f} s  load {load():>5s}{note}",
              flush=True)
        if r["ok"]:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            with open(os.path.join(workdir, "output.txt"), "w") as f:
                f.write(r["output"])



if __name__ == "__main__":
    sys.exit(main())
