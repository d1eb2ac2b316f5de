"""Claims of README.md and docs/ that can drift from the code, checked against the code (or the doc's own table).

Each test reads the number or name the doc states and computes it from what the code does, so a change to either
side that leaves them disagreeing fails here."""
import importlib
import json
import os
import re
import shlex

import pytest
import torch

import decent_comm
from decent_comm.optim import startup
from decent_comm.optim.hparams import decentralized_adam_hparams
from dist_utils import run_ranks
import test_plan_cli as plan_cli  # a module, so that its tests are not collected here again

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def one_line(text):
    return " ".join(text.split())


PUBLIC_MODULES = ["decent_comm", "decent_comm.topology", "decent_comm.exchange", "decent_comm.runtime_model",
                  "decent_comm.optim"]


def _ops_public_names():
    """decent_comm.ops has no __all__: its public names are the functions and constants it defines."""
    ops = decent_comm.ops
    return [n for n, v in vars(ops).items() if not n.startswith("_") and
            (getattr(v, "__module__", None) == ops.__name__ or (n.isupper() and isinstance(v, (int, float))))]


def test_every_public_name_is_on_an_api_page():
    """api.md says "Everything public": every name a public module exports is on it, api_lowlevel.md, api_names.md
    or state.md."""
    text = read("docs/api.md") + read("docs/api_lowlevel.md") + read("docs/api_names.md") + read("docs/state.md")
    exported = [(m, n) for m in PUBLIC_MODULES for n in importlib.import_module(m).__all__]
    exported += [("decent_comm.ops", n) for n in _ops_public_names()]
    assert len(exported) > 60
    missing = [f"{m}.{n}" for m, n in exported if not re.search(r"\b%s\b" % re.escape(n), text)]
    assert not missing, missing


def test_the_documented_build_variables_and_cli_alias_exist():
    """The build variables and the plan alias api_names.md lists are read where it says."""
    names = read("docs/api_names.md")
    assert 'os.environ.get("DECENT_COMM_NCCL") == "0"' in read("setup.py") and "`DECENT_COMM_NCCL=0`" in names
    assert 'os.environ.get("NCCL_HOME")' in read("build_tools/nccl.py") and "`NCCL_HOME`" in names
    assert 'os.environ.get("CUDA_PATH")' in read("build_tools/cuda_home.py") and "`CUDA_PATH`" in names
    base = ["plan", "--nodes", "2", "--params", "1M", "--inter-bw", "1Gbit", "--intra-bw", "10Gbit",
            "--compute", "10ms", "--no-sim", "--json"]
    assert plan_cli.run_cli(base + ["--ranks-per-node", "2"]) == plan_cli.run_cli(base + ["--gpus-per-node", "2"])


def test_periodic_averaging_range_is_the_tables():
    """README and time_to_target.md quote periodic averaging's range of 'x DDP's' from the table's periodic rows."""
    doc = read("docs/time_to_target.md")
    result = doc.split("\n## Result: ")[1].split("\n## ")[0]  # the comm-bound race's section
    rows = [row.split("|") for row in result.splitlines() if re.match(r"\| \d x \d \| periodic8/s400 \|", row)]
    ratios = [float(x) for cells in rows for x in cells[7].split("/")]  # the "x DDP's" column, seeds 0 / 1
    assert len(ratios) == 4
    stated = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    assert f"periodic averaging ({stated})" in doc
    assert f"takes {stated}" in one_line(read("README.md"))


def test_exit_stress_endings_in_the_docs():
    """bench/exit_stress.py's default user-script variants: named in reliability.md, counted in benchmarks.md."""
    defaults = re.search(r'"--variants", default="([^"]+)"', read("bench/exit_stress.py")).group(1).split(",")
    words = {5: "five", 6: "six", 7: "seven"}
    assert f"({words[len(defaults)]} ways to end it)" in read("docs/benchmarks.md")
    reliability = one_line(read("docs/reliability.md"))
    assert f"takes turns over {words[len(defaults)]}" in reliability
    assert all(f"`{v}`" in reliability for v in defaults), defaults


def test_accum_adam_lr_rule_as_documented():
    """docs: sqrt(max(1, n/K)) L; the function never scales the lr below L (K > n)."""
    assert "sqrt(max(1, n/K)) L" in read("docs/api.md") and "sqrt(max(1, n/K))" in read("README.md")
    for n, k in ((2, 4), (8, 2), (4, 4), (1, 1)):
        assert decentralized_adam_hparams(1.0, n, accum_steps=k)["lr"] == pytest.approx(max(1.0, n / k) ** 0.5)


def test_planner_bad_input_count():
    """planner.md: how many bad inputs tests/test_plan_cli.py runs."""
    negative = plan_cli.test_cli_negative_and_unitless_values_get_their_own_message.pytestmark[0].args[1]
    stated = int(re.search(r"`tests/test_plan_cli.py` runs (\d+) such inputs", one_line(read("docs/planner.md")))
                 .group(1))
    assert stated == len(plan_cli.BAD) + len(negative)


def test_time_to_target_planner_command_runs_and_picks_the_hypercube():
    """time_to_target.md's 2 nodes x 2 GPUs command is complete (exit 0) and ranks the hypercube's int8 recipe first."""
    doc = one_line(read("docs/time_to_target.md"))
    flags = re.search(r"For 2 nodes x 2 GPUs \(`(--nodes 2 [^`]+)`", doc).group(1)
    code, out, err = plan_cli.run_cli(["plan", *shlex.split(flags), "--json"])
    assert code == 0, err
    first = json.loads(out)["time_to_quality"][0]
    assert (first["topology"], first["mode"], first["wire"], first["gossip_every"]) == ("one-peer-hypercube", "awc",
                                                                                       "int8", 1)


def test_demo_prints_the_command_of_its_own_race(monkeypatch, capsys):
    """Without network namespaces bench/demo.py prints a command running the race it would have run."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    demo = importlib.import_module("demo")

    class Args:
        no_cluster, seed, quick, out = True, 3, False, "unused"
    demo.cluster_race(Args)
    printed = capsys.readouterr().out
    command = shlex.split(printed.split(": ", 1)[1])
    assert "--quick" not in command
    for flag, value in (("--configs", demo.CLUSTER_CONFIGS), ("--seeds", "3"), ("--layouts", "4x1"),
                        ("--links", "comm")):
        assert command[command.index(flag) + 1] == value


_CALLS = []


def _consensus(step):
    _CALLS.append(step)
    return 1.0


def _count_consensus_calls(rank, world_size):
    _CALLS.clear()
    opt = decent_comm.DAdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1, consensus=_consensus, timeout=30)
    opt.shutdown()
    return len(_CALLS)


def test_consensus_callable_call_count_as_documented():
    """api.md: with several ranks the callable is called N times at construction (the compared steps and step
    0's check), alone once."""
    stated = int(re.search(r"with several ranks it is called (\d+) times at construction",
                           one_line(read("docs/api.md"))).group(1))
    assert stated == len(startup._CONSENSUS_COMPARED_AT) + 1
    assert run_ranks(_count_consensus_calls, 2, timeout=120) == [stated, stated]
    assert _count_consensus_calls(0, 1) == 1


def test_the_test_extra_has_what_requirements_dev_installs():
    """pip install .[test] gets what `make` installs from requirements-dev.txt (psutil for the leak tests, the
    decent_train harness's scikit-learn, tqdm and matplotlib), less what the project already depends on or builds
    with."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    def names(specs):
        return {re.split(r"[<>=!~ \[;]", spec.strip(), maxsplit=1)[0].lower() for spec in specs if spec.strip()}
    dev = names(line.split("#")[0] for line in read("requirements-dev.txt").splitlines())
    already = names(project["project"]["dependencies"] + project["build-system"]["requires"])
    assert dev - already <= names(project["project"]["optional-dependencies"]["test"]), dev - already


def test_the_world_size_refusal_names_the_section_that_says_how_to_resume():
    """load_state_dict's refusal of another world size points to a section of docs/state.md by its title, and the
    README's checkpoint paragraph links it: a renamed section must rename both."""
    opt = decent_comm.DAdamW(torch.nn.Linear(2, 1).parameters(), lr=0.01)
    saved = opt.state_dict()
    saved["param_groups"][0]["decentralized"]["world_size"] = 3
    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(saved)
    title = re.search(r"docs/state\.md '([^']+)'", str(refused.value)).group(1)
    assert f"\n## {title}\n" in read("docs/state.md")
    assert f"(docs/state.md#{title.lower().replace(' ', '-')})" in read("README.md")


def test_the_errors_the_readme_says_to_catch_are_top_level():
    """README's Troubleshooting tells users to catch ExchangeTimeout / ExchangeError; they were importable only from
    decent_comm.exchange, which no page named."""
    import decent_comm
    from decent_comm import exchange

    assert decent_comm.ExchangeTimeout is exchange.ExchangeTimeout and decent_comm.ExchangeError is exchange.ExchangeError
    assert issubclass(decent_comm.ExchangeTimeout, (decent_comm.ExchangeError)) and issubclass(
        decent_comm.ExchangeTimeout, TimeoutError) and issubclass(decent_comm.ExchangeError, RuntimeError)
    assert "`decent_comm.ExchangeTimeout` / `decent_comm.ExchangeError`" in one_line(read("README.md"))


@pytest.mark.parametrize("script", sorted(n for n in os.listdir(os.path.join(ROOT, "scripts")) if n.endswith(".py")))
def test_the_doc_generating_scripts_start(script):
    """scripts/ regenerate docs/ tables; nothing ran them, so a moved import (make_topology) broke one unseen."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
