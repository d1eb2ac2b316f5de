"""The bench/ scripts' command line: a bad value is refused at parsing (exit code 2, a line naming the flag, no
traceback) instead of failing after minutes of runs, hanging for an hour (a spawned rank that died left the parent
in queue.get(timeout=3600)) or being run as something else; a bare file name as --json is written to the working
directory instead of raising FileNotFoundError after the benchmark.

The refusals run in one process (this file run as a script, each case through runpy as `python bench/x.py` runs
it, bench/ on PYTHONPATH as a script's own directory is on sys.path): one torch import for all, not one a case.
"""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
CASE_LIMIT_S = 20  # a refusal takes well under a second once torch is imported; more: the script ran on

# (script, argv, what stderr's last line says)
CASES = [
    ("step.py", ["--world-sizes", "1", "--layers", "1", "--width", "16", "--steps", "0"],
     "argument --steps: must be at least 1, got 0"),  # the rank died (UnboundLocalError), the parent hung
    ("step.py", ["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    ("step.py", ["--candidates", "ddp,foo"], "argument --candidates: unknown ['foo']"),  # was timed as AdamW
    ("exchange.py", ["--world-sizes", "2", "--sizes-mb", "0.01", "--reps", "-1"],
     "argument --reps: must be at least 1, got -1"),  # StatisticsError in the ranks, the parent hung
    ("exchange.py", ["--reps", "0"], "argument --reps: must be at least 1, got 0"),  # ran 5
    ("exchange.py", ["--world-sizes", "2,x"], "argument --world-sizes: 'x': expected an integer"),
    ("mix_kernels.py", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),  # ran 5
    ("mix_kernels.py", ["--sizes", "1M,0"], "argument --sizes: '0': expected an element count >= 1"),
    ("int8_codec.py", ["--sizes", "0"], "argument --sizes: '0': expected an element count >= 1"),  # ZeroDivision
    ("int8_codec.py", ["--sizes", "abc"], "argument --sizes: 'abc': expected an element count"),
    ("int8_codec.py", ["--threads", "0"], "argument --threads: '0': must be at least 1, got 0"),
    ("int8_codec.py", ["--device", "foo"], "argument --device: expected cpu or cuda, got 'foo'"),
    ("int8_codec.py", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ("step_overhead.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),  # min() of nothing
    ("step_overhead.py", ["--shapes", "16"], "argument --shapes: '16': expected NxSIZE"),
    ("step_overhead.py", ["--shapes", "0x16"], "argument --shapes: '0x16': must be at least 1, got 0"),
    ("step_overhead.py", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    ("step_overhead.py", ["--modes", "foo"], "argument --modes: unknown ['foo']"),  # ran "keep"
    ("validate_model.py", ["--sim-steps", "0"], "argument --sim-steps: must be at least 1, got 0"),
    ("validate_model.py", ["--from-json", "missing.json"], "argument --from-json: cannot read 'missing.json'"),
    ("validate_model.py", ["--from-json", "other.json"], "argument --from-json: 'other.json' has no 'jobs' and 'meta'"),
    ("cluster.py", ["--target", "abc"], "argument --target: expected 'worst', 'ddp' or a loss > 0, got 'abc'"),
    ("cluster.py", ["--compute-bw", "fast"], "argument --compute-bw:"),
    ("cluster.py", ["--layouts", "4"], "argument --layouts: '4': expected NODESxRANKS_PER_NODE"),
    ("cluster.py", ["--workloads", "foo"], "argument --workloads: unknown ['foo']"),
    ("cluster.py", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),  # ran 60
    ("cluster.py", ["--eval-every", "0"], "argument --eval-every: must be at least 1, got 0"),
    ("cluster.py", ["--straggler-std", "nan"], "argument --straggler-std: must be >= 0, got nan"),
    ("cluster.py", ["--timeout", "-1"], "argument --timeout: must be > 0, got -1"),
    ("cluster.py", ["--optimizer", "foo"], "argument --optimizer: unknown optimizer 'foo'"),
    ("cluster.py", ["--topologies", "foo"], "argument --topologies: 'foo': unknown topology 'foo'"),
    ("time_to_target.py", ["--eval-every", "0"], "argument --eval-every: must be at least 1, got 0"),  # ran 25
    ("quality.py", ["--nprocs", "4,3"], "argument --nprocs: '3': must be even"),  # after every n = 4 run
    ("demo.py", ["--nproc", "3"], "argument --nproc: must be even"),
    ("demo.py", ["--nproc", "0"], "argument --nproc: must be at least 2, got 0"),
    ("exit_stress.py", ["--variants", "foo"], "argument --variants: unknown ['foo']"),  # "FAIL: 1 of 1 jobs"
    ("exit_stress.py", ["--jobs", "0", "--lm-jobs", "0"], "--jobs 0 and --lm-jobs 0: no job to run"),  # "PASS"
    ("adaptive.py", ["--runs", "complete,foo"], "--runs: unknown ['foo']"),
]
if not torch.cuda.is_available():
    CASES.append(("int8_codec.py", ["--device", "cuda"], "argument --device: cuda: torch sees no CUDA device"))


def _run_cases(cases):
    """Runner mode: each (script, argv) as __main__ in this process; prints [{code, stderr, seconds}] as JSON."""
    def too_long(*_):
        raise TimeoutError(f"still running after {CASE_LIMIT_S} s")
    signal.signal(signal.SIGALRM, too_long)
    results = []
    for script, argv in cases:
        err, code, start = io.StringIO(), 0, time.monotonic()
        sys.argv = [os.path.join(BENCH, script), *argv]
        signal.alarm(CASE_LIMIT_S)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else f"SystemExit: {e.code}"
        except BaseException as e:  # noqa: BLE001 - a traceback of the script is this case's outcome
            code = f"{type(e).__name__}: {e}"
        finally:
            signal.alarm(0)
        results.append({"code": code or 0, "stderr": err.getvalue(), "seconds": time.monotonic() - start})
    print(json.dumps(results))


def bench_env():
    # bench/ as a script's own directory; no network namespaces even should a case run on (root may make them)
    path = os.pathsep.join([ROOT, BENCH] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "DECENT_COMM_NETNS": "0"}


@pytest.fixture(scope="module")
def step_local(tmp_path_factory):
    """bench/step.py timing `local` only, with --json a bare file name, in a directory of its own: started here,
    so that its rank's spawn overlaps the refusals (outcomes asks for this first); (process, directory)."""
    cwd = tmp_path_factory.mktemp("step_local")
    argv = ["--world-sizes", "1", "--layers", "1", "--width", "8", "--batch", "2", "--steps", "1", "--warmup", "0",
            "--candidates", "local", "--json", "step.json"]
    proc = subprocess.Popen([sys.executable, os.path.join(BENCH, "step.py"), *argv], cwd=cwd, env=bench_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    yield proc, cwd
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@pytest.fixture(scope="module")
def outcomes(step_local, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("bench_cli")
    (cwd / "other.json").write_text(json.dumps({"rows": []}))  # valid JSON that another script wrote
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=cwd, env=bench_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps([c[:2] for c in CASES]), timeout=60 + CASE_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the refusals did not finish")
    finally:  # anything a case started that outlived it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_value_is_refused_at_parsing(outcomes, i):
    r, (_, _, says) = outcomes[i], CASES[i]
    assert r["code"] == 2 and "Traceback" not in r["stderr"], r
    assert says in r["stderr"].strip().splitlines()[-1], r["stderr"]
    assert r["seconds"] < 5, r  # refused before anything ran


def test_bare_json_name_and_no_ddp(step_local):
    """step.py with --json a bare file name (os.makedirs('') raised after the runs) and without ddp among the
    candidates (KeyError 'ddp' after the runs, nothing written): the JSON lands in the working directory."""
    proc, cwd = step_local
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    saved = json.loads((cwd / "step.json").read_text())
    assert list(saved["seconds"]) == ["1"] and list(saved["seconds"]["1"]) == ["local"]
    assert saved["seconds"]["1"]["local"] > 0
    assert "| 1 | " in out and "x)" not in out  # a time, no ratio to a DDP that did not run


def test_a_dead_rank_stops_the_wait_at_once():
    """bench_args.collect (step.py's and exchange.py's wait for rank 0's result): a rank that exited non-zero ends
    the wait within a poll, the others are stopped, and the error names the rank and its exit code."""
    import multiprocessing
    spec = importlib.util.spec_from_file_location("bench_args", os.path.join(BENCH, "bench_args.py"))
    bench_args = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_args)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=time.sleep, args=(120,)), ctx.Process(target=sys.exit, args=(3,))]
    for p in procs:
        p.start()
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"^bench/x.py: rank 1 exited with code 3; stopped the other ranks"):
        bench_args.collect(results, procs, "bench/x.py", limit_s=100)
    assert time.monotonic() - start < 30  # was the whole limit (3600 s)
    assert all(not p.is_alive() for p in procs) and procs[0].exitcode == -signal.SIGTERM


if __name__ == "__main__":
    _run_cases(json.load(sys.stdin))
