"""Smoke tests of the training examples: a few steps each with 2 ranks launched by torchrun (the way users
run them), the logs/plot/checkpoints they write, and that a resumed train_lm run continues exactly where
the interrupted one was."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from decent_train.flags import consensus_value, optimizer_family, optimizer_name, resolve_defaults, topology_name
from decent_train.lr_schedule import make_lr_scheduler
from decent_train.workloads import lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tiny model and data: the tests check plumbing, not learning.
LM_TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
           "--corpus-mb", "0.3", "--eval-tokens", "1024", "--no-progress"]


def torchrun(script, args, nproc=2, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "examples", script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.json")) as f:
        return json.load(f)


def test_flag_parsing():
    assert optimizer_name("DAdamW") == "dadamw"
    assert optimizer_name("decentralized-adamw") == "decentralized-adamw"
    assert optimizer_name("allreduce-sgd") == "allreduce-sgd"
    for bad in ("adamw", "decentralized-nope", "allreduce-"):
        with pytest.raises(argparse.ArgumentTypeError):
            optimizer_name(bad)
    assert consensus_value("adaptive") == "adaptive"
    assert consensus_value("0.5") == 0.5
    with pytest.raises(argparse.ArgumentTypeError):
        consensus_value("1.5")
    assert optimizer_family("dsgd") == "sgd" and optimizer_family("allreduce") == "adam"
    assert topology_name("One_Peer_Exp") == "one-peer-exp" and topology_name("adaptive:phase:ring@0").startswith("ad")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown topology 'foo'"):
        topology_name("foo")


@pytest.mark.parametrize("flag, value, says", [
    ("--steps", "0", "must be at least 1, got 0"),          # ran nothing and reported success
    ("--gossip-every", "-2", "must be at least 1, got -2"),
    ("--warmup-steps", "x", "expected an integer, got 'x'"),
    ("--local-world-size", "0", "must be at least 1, got 0"),
    ("--lr", "nan", "must be >= 0, got nan"),
    ("--grad-clip", "-1", "must be >= 0, got -1"),
    ("--corpus-mb", "0", "must be > 0, got 0"),
    ("--heads", "0", "must be at least 1, got 0"),
])
def test_counts_and_amounts_out_of_range_are_named_by_the_parser(flag, value, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


def test_local_world_size_must_divide_the_ranks():
    assert _defaults(["--local-world-size", "2"], 4).local_world_size == 2
    with pytest.raises(ValueError, match="--local-world-size 3 does not divide the 2 ranks of this job"):
        _defaults(["--local-world-size", "3"], 2)


def _defaults(argv, world_size):
    return resolve_defaults(lm.parse_args(argv), lm.LR_DEFAULTS, world_size)


def test_decentralized_adam_defaults_follow_the_lr_rule():
    # All-reduce keeps the example's lr and AdamW's betas at any world size.
    a = _defaults(["--optimizer", "allreduce"], 8)
    assert (a.lr, a.betas, a.weight_decay, a.warmup) == (3e-3, (0.9, 0.999), 0.01, 90)
    # DAdamW on n ranks: sqrt(n) x the all-reduce lr, same betas.
    for name in ("dadamw", "dadam", "decentralized-adamw"):
        d = _defaults(["--optimizer", name], 8)
        assert d.lr == pytest.approx(3e-3 * math.sqrt(8)) and d.betas == (0.9, 0.999)
    # AccumAdamW with K = 4: sqrt(n / K) (never below 1) and per-window betas.
    for n, factor in ((2, 1.0), (4, 1.0), (16, 2.0)):
        c = _defaults(["--optimizer", "accumadamw"], n)
        assert c.lr == pytest.approx(3e-3 * factor)
        assert c.betas == pytest.approx((0.9 ** 4, 0.999 ** 4))
    c = _defaults(["--optimizer", "accumadamw", "--accum-steps", "2"], 8)
    assert c.lr == pytest.approx(3e-3 * 2.0) and c.betas == pytest.approx((0.81, 0.999 ** 2))
    # Flags given on the command line win; SGD-family runs are not scaled.
    e = _defaults(["--optimizer", "dadamw", "--lr", "1e-3", "--betas", "0.8,0.99", "--warmup", "5"], 8)
    assert (e.lr, e.betas, e.warmup) == (1e-3, (0.8, 0.99), 5)
    s = _defaults(["--optimizer", "dsgd"], 8)
    assert (s.lr, s.weight_decay) == (0.3, 0.0)
    r = _defaults(["--optimizer", "decentralized-rmsprop"], 8)
    assert r.lr == 3e-3


def test_lr_schedules():
    for kind, first, last in (("constant", 1.0, 1.0), ("cosine", 1.0, 0.1), ("warmup-cosine", 0.25, 0.1)):
        args = argparse.Namespace(steps=20, warmup=4 if kind == "warmup-cosine" else 0, min_lr_ratio=0.1, lr_schedule=kind)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make_lr_scheduler(opt, args)
        lrs = []
        for _ in range(20):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert lrs[0] == pytest.approx(first)
        assert opt.param_groups[0]["lr"] == pytest.approx(last)


def test_train_lm_decentralized_logs_and_resume(tmp_path):
    """6 steps of DAdamW with checkpoints at steps 3 and 6, then a second job resumed from step 3: it must
    reproduce steps 4-6 of the first exactly (same replicas, optimizer state, data streams, gossip phase), with
    the first job's --lr and --betas, which it is not given again, recorded in its config as the ones used."""
    out, ck = str(tmp_path / "run"), str(tmp_path / "ck")
    flags = ["--optimizer", "dadamw", "--steps", "6", "--eval-every", "3", "--log-every", "1", *LM_TINY]
    torchrun("train_lm.py", [*flags, "--out", out, "--checkpoint", ck, "--checkpoint-every", "3", "--lr", "2e-3",
                             "--betas", "0.8,0.99"])
    full = read_log(out)
    assert full["summary"]["steps"] == 6 and full["config"]["world_size"] == 2
    assert [r["step"] for r in full["rows"]] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in full["rows"] if "val_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(math.isfinite(r["val_loss"]) and r["consensus_distance"] >= 0 for r in evals)
    for name in ("log.csv", "log.json", "loss.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    for step in ("step_0000003", "step_0000006"):
        assert sorted(os.listdir(os.path.join(ck, step))) == ["rank0.pt", "rank1.pt"]
    assert open(os.path.join(ck, "latest")).read() == "step_0000006"

    resumed_out = str(tmp_path / "resumed")
    torchrun("train_lm.py", [*flags, "--out", resumed_out, "--resume", os.path.join(ck, "step_0000003")])
    resumed = read_log(resumed_out)
    key = ("step", "train_loss", "val_loss", "consensus_distance")
    assert [[r.get(k) for k in key] for r in resumed["rows"]] == [[r.get(k) for k in key] for r in full["rows"]]
    # bytes_sent_mb counts the whole job, the run before the resume included (it restarted from 0): the resumed
    # optimizer's first step exchanges x^3 once more (the neighbours' copies are not in a checkpoint), one round
    # more than the uninterrupted run.
    sent = {r["step"]: r["bytes_sent_mb"] for r in full["rows"] if r.get("bytes_sent_mb") is not None}
    again = {r["step"]: r["bytes_sent_mb"] for r in resumed["rows"] if r.get("bytes_sent_mb") is not None}
    assert sorted(sent) == sorted(again) == [3, 6] and again[3] == sent[3] > 0
    per_round = (sent[6] - sent[3]) / 3
    assert again[6] == pytest.approx(sent[6] + per_round) and resumed["summary"]["bytes_sent_mb"] == again[6]
    # What the resumed run used, not its own defaults (3e-3 * sqrt(2), 0.9,0.999), is what its config says.
    assert (resumed["config"]["lr"], resumed["config"]["betas"]) == (2e-3, [0.8, 0.99])

    # --lr and --weight-decay given on resume replace the checkpoint's (they were restored over the flags
    # silently, while the config named the flags), on the same warmup-cosine schedule.
    changed_out = str(tmp_path / "changed")
    proc = torchrun("train_lm.py", [*flags, "--out", changed_out, "--resume", os.path.join(ck, "step_0000003"),
                                    "--lr", "1e-4", "--weight-decay", "0.05"])
    assert "--lr 0.002 -> 0.0001; --weight-decay 0.01 -> 0.05" in proc.stderr
    changed = read_log(changed_out)
    c = changed["config"]
    assert (c["lr"], c["weight_decay"], c["betas"]) == (1e-4, 0.05, [0.8, 0.99])
    args = argparse.Namespace(steps=6, warmup=1, min_lr_ratio=0.1, lr_schedule="warmup-cosine")  # the run's
    factor = make_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), args).lr_lambdas[0]
    lrs = {r["step"]: r["lr"] for r in changed["rows"]}
    assert [lrs[s] for s in (1, 2, 3)] == [r["lr"] for r in full["rows"][:3]]  # the first job's rows
    assert [lrs[s] for s in (4, 5, 6)] == pytest.approx([1e-4 * factor(s - 1) for s in (4, 5, 6)], rel=1e-12)
    assert changed["rows"][-1]["val_loss"] != full["rows"][-1]["val_loss"]


def test_train_lm_allreduce(tmp_path):
    out = str(tmp_path / "run")
    torchrun("train_lm.py", ["--optimizer", "allreduce", "--steps", "4", "--eval-every", "2", "--bf16-wire",
                             "--out", out, *LM_TINY])
    s = read_log(out)["summary"]
    assert s["topology"] == "allreduce" and s["final_consensus_distance"] == 0.0
    assert math.isfinite(s["final_val_loss"]) and s["tokens_per_s"] > 0


def test_train_classifier_wrapper_atc(tmp_path):
    pytest.importorskip("sklearn")
    out = str(tmp_path / "run")
    torchrun("train_classifier.py", ["--optimizer", "decentralized-adamw", "--mode", "atc", "--topology", "ring",
                                     "--consensus", "adaptive", "--bf16-wire", "--steps", "6", "--eval-every", "3",
                                     "--width", "4", "--no-progress", "--out", out])
    log = read_log(out)
    assert 0.0 <= log["summary"]["final_val_acc"] <= 1.0
    assert log["summary"]["topology"] == "ring"


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_train_lm_profile_trace(tmp_path, mode):
    """--profile writes each rank's trace with the training phases and decent_comm's exchange ranges, and the
    job still exits 0: the exchange is in flight when the profiler stops (a c10d profiler range left open on
    gloo's thread then used to crash the process at exit with SIGSEGV)."""
    out = tmp_path / "trace"
    torchrun("train_lm.py", ["--optimizer", "dadamw", "--topology", "ring", "--mode", mode, "--steps", "12",
                             "--eval-every", "12", "--profile", str(out), *LM_TINY])
    for rank in (0, 1):
        with open(out / f"trace_rank{rank}.json") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}
        expected = {"train::forward", "train::backward", "train::optimizer_step", "decent_comm::exchange_launch",
                    "decent_comm::exchange_wait"}
        assert expected <= names, sorted(n for n in names if "::" in str(n))[:40]


@pytest.mark.parametrize("optimizer", ["dadamw", "decentralized-adamw"])
def test_cadence_flags_reach_the_optimizer(optimizer):
    """--gossip-every / --warmup-steps / --delayed-mix build the optimizer's communication interval (fused and
    wrapper)."""
    from decent_train.distributed import DistEnv
    from decent_train.strategy import build_strategy

    args = resolve_defaults(lm.parse_args(["--optimizer", optimizer, "--gossip-every", "3", "--warmup-steps", "2",
                                           "--mode", "awc", "--delayed-mix"]), lm.LR_DEFAULTS, 1)
    opt = build_strategy(args, torch.nn.Linear(3, 2), DistEnv()).optimizer
    cadence = opt._schedule.cadence
    assert (cadence.gossip_every, cadence.warmup_steps, cadence.delayed_mix) == (3, 2, True)
    defaults = lm.parse_args([])
    assert (defaults.gossip_every, defaults.warmup_steps, defaults.delayed_mix) == (1, 0, False)


@pytest.mark.parametrize("flags", [["--gossip-every", "2"], ["--warmup-steps", "3"], ["--delayed-mix"],
                                   ["--int8-wire"]])
def test_decentralized_flags_are_refused_for_allreduce(flags, capsys):
    """Not ignored: DDP would run as if they had not been given, and a comparison of recipes would not know it.
    The command line refuses them (tests/test_example_cli.py: the other decentralized-only flags too), and so does
    build_strategy for flags parsed without its checks."""
    from decent_train.distributed import DistEnv
    from decent_train.flags import add_common_args
    from decent_train.strategy import build_strategy

    with pytest.raises(SystemExit):
        lm.parse_args(["--optimizer", "allreduce", *flags])
    said = capsys.readouterr().err
    assert f"{flags[0]}: for the decentralized optimizers only" in said
    assert ("8-bit" in said) == (flags[0] == "--int8-wire")  # its advice was given for every flag
    parser = add_common_args(argparse.ArgumentParser(), steps=4, batch_size=2, eval_every=2)
    args = resolve_defaults(parser.parse_args(["--optimizer", "allreduce", *flags]), lm.LR_DEFAULTS, 1)
    with pytest.raises(ValueError, match=f"{flags[0]}: for the decentralized optimizers only") as refused:
        build_strategy(args, torch.nn.Linear(3, 2), DistEnv())
    assert ("8-bit" in str(refused.value)) == (flags[0] == "--int8-wire")


def test_race_specs_build_what_they_say():
    """bench/ttt_configs.py's specs (the races of docs/time_to_target.md) become train_lm flags that build the
    optimizer they name: the README's slow-link recipe and periodic averaging."""
    import importlib.util

    from decent_train.distributed import DistEnv
    from decent_train.strategy import build_strategy

    spec = importlib.util.spec_from_file_location("ttt_configs", os.path.join(ROOT, "bench", "ttt_configs.py"))
    ttt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttt)
    for text, want in [("one-peer-exp/awc/k2/bf16/delayed/s400", ("one-peer-exp", "awc", 2, True, torch.bfloat16)),
                       ("one-peer-hypercube/awc/k2/int8/delayed", ("one-peer-hypercube", "awc", 2, True, torch.int8)),
                       ("periodic8", ("complete", "atc", 8, False, None))]:
        cfg = ttt.parse(text, 300)
        args = resolve_defaults(lm.parse_args(list(cfg.flags) + ["--steps", str(cfg.steps)]), lm.LR_DEFAULTS, 1)
        opt = build_strategy(args, torch.nn.Linear(3, 2), DistEnv()).optimizer
        c = opt._schedule.cadence
        assert (opt.topology.name, opt.mode, c.gossip_every, c.delayed_mix, opt.comm_dtype) == want, text
    with pytest.raises(ValueError, match="unknown token 'delay'"):
        ttt.parse("one-peer-exp/delay", 300)
