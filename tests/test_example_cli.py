"""The training scripts' command line (decent_train/cli.py, flags.py): bad input is one line and exit code 2, not a
traceback on every rank; flags that cannot apply are refused, not ignored; --help states every default; and
Ctrl-C stops a 2-rank run with one line per rank and exit code 130. Single-process and fast except the last."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from decent_train import data
from decent_train.flags import resolve_defaults
from decent_train.workloads import digits, lm, synthetic
from harness_support import signal_handlers_restored  # noqa: F401 (autouse)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--corpus-mb", "0.2",
        "--eval-tokens", "1024", "--no-progress"]


def refused(argv, capsys, parse=lm.parse_args):
    """parse(argv) must exit 2 with one line on stderr; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err  # was the whole usage, 20+ lines per rank
    return err


@pytest.mark.parametrize("argv, says", [
    (["--betas", "a,b"], "argument --betas: expected BETA1,BETA2: two numbers in [0, 1), got 'a,b'"),  # "<lambda>"
    (["--betas", "0.9"], "argument --betas: expected BETA1,BETA2"),   # reached the optimizer: traceback
    (["--straggler-ms", "x"], "argument --straggler-ms: expected MEAN,STD in milliseconds"),
    (["--straggler-ms", "1,-2"], "argument --straggler-ms: expected MEAN,STD"),
    (["--heads", "3"], "--heads 3 does not divide --d-model 128"),  # raised by the model: traceback per rank
    (["--optimizer", "allreduce", "--int8-wire"], "--int8-wire: for the decentralized optimizers only"),
    (["--resume", "/nonexistent/ck"], "--resume /nonexistent/ck: no such directory"),
    (["--resume", "auto"], "--resume auto resumes from --checkpoint's latest committed step: give --checkpoint DIR"),
    (["--min-lr-ratio", "2"], "argument --min-lr-ratio: must be in [0, 1], got 2"),  # was accepted
    (["--lr", "-1"], "argument --lr: must be >= 0, got -1"),  # a negative value is the flag's, not "expected one"
])
def test_bad_values_are_one_line_naming_the_flag(argv, says, capsys):
    assert says in refused(argv, capsys)


def test_the_error_is_printed_by_local_rank_zero_only(capsys, monkeypatch):
    """Every rank of a torchrun job parses the same command line: one line per node, not one per rank."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        lm.parse_args(["--betas", "0.9"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_a_negative_straggler_mean_parses_as_a_value():
    """argparse took "-5,1" for a flag ("expected one argument"); max(0, N(-5, 1)) is a valid setting."""
    assert lm.parse_args(["--straggler-ms", "-5,1"]).straggler_ms == (-5.0, 1.0)
    assert lm.parse_args(["--straggler-ms", "3"]).straggler_ms == (3.0, 0.0)


@pytest.mark.parametrize("argv, says", [
    (["--local-world-size", "3"], "--local-world-size 3 does not divide the 1 ranks"),
    (["--topology", "adaptive:foo"], "adaptive spec 'adaptive:foo' is not of the form"),
    (["--mode", "atc", "--delayed-mix"], "delayed_mix=True needs mode='awc'"),
])
def test_set_up_errors_are_one_line_and_exit_code_2(argv, says, capsys):
    """Values refused past parsing (the world size, the topology spec, the optimizer's own checks) gave a traceback
    on every rank; now main() says them in one line, like a parse error."""
    with pytest.raises(SystemExit) as exit_info:
        lm.main([*TINY, "--steps", "2", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[W")]  # gloo's own warnings
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{os.path.basename(sys.argv[0])}: error: ") and says in lines[0], err


def test_a_set_up_error_known_from_the_flags_is_said_by_local_rank_zero(capsys, monkeypatch):
    # torchrun's variables of a 2-rank job; refused before joining: no process group is created
    for name, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    for local_rank, expected in (("1", ""), ("0", "--local-world-size 3 does not divide the 2 ranks")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("RANK", local_rank)
        with pytest.raises(SystemExit):
            lm.main([*TINY, "--local-world-size", "3"])
        err = capsys.readouterr().err
        assert (expected in err) if expected else err == ""


@pytest.mark.parametrize("name, why", [("allreduce-lbfgs", "needs a closure"), ("decentralized-lbfgs", "closure"),
                                       ("allreduce-sparseadam", "sparse gradients only"),
                                       ("decentralized-muon", "2-D parameters only")])
def test_optimizers_the_loop_cannot_drive_are_refused_with_the_reason(name, why, capsys):
    """They were accepted and failed at the first step (LBFGS: step() missing closure) or at construction."""
    err = refused(["--optimizer", name], capsys)
    assert f"argument --optimizer: '{name}': the training loop cannot drive torch.optim." in err and why in err
    assert lm.parse_args(["--optimizer", "decentralized-rmsprop"]).optimizer == "decentralized-rmsprop"


def test_too_little_data_is_refused_naming_the_flag_and_the_minimum(capsys):
    """--eval-tokens below --seq-len logged val NaN (and bare NaN in log.json); too small a --corpus-mb held no file
    out and failed in torch.frombuffer."""
    assert "--eval-tokens 8 is less than --seq-len 16" in refused(["--eval-tokens", "8", "--seq-len", "16"], capsys)
    err = refused(["--corpus-mb", "0.0001"], capsys)
    least = float(re.search(r"give --corpus-mb ([0-9.]+) or more", err).group(1))
    corpus = data.load_stdlib_corpus(int(least * 1e6))  # the minimum it names is enough: one file held out
    assert len(corpus.val_files) == 1 and len(corpus.val) > 0
    with pytest.raises(ValueError, match="every 10th file is held out"):
        data.load_stdlib_corpus(data.min_corpus_bytes() - 1)
    args = resolve_defaults(lm.parse_args(["--corpus-mb", str(least), "--seq-len", "100000", "--eval-tokens",
                                           "100000", "--d-model", "8", "--heads", "1"]), lm.LR_DEFAULTS)
    with pytest.raises(ValueError, match="--seq-len 100000 is longer than the held-out text"):
        lm.build_task(args, None)


@pytest.mark.parametrize("flags", [["--topology", "ring"], ["--mode", "atc"], ["--consensus", "0.5"],
                                   ["--local-world-size", "1"], ["--gossip-every", "2"]])
def test_decentralized_flags_given_to_allreduce_are_refused(flags, capsys):
    """DDP ignored them silently (only the cadence flags were refused); given to a decentralized run they apply."""
    from decent_train.flag_sets import extra_flags_for
    assert f"{flags[0]}: for the decentralized optimizers only" in refused(["--optimizer", "allreduce", *flags], capsys)
    assert resolve_defaults(lm.parse_args(["--optimizer", "dadamw", *flags]), lm.LR_DEFAULTS) is not None
    # not given: still the defaults, and a benchmark passing them to every run drops them for its baseline
    d = resolve_defaults(lm.parse_args(["--optimizer", "allreduce"]), lm.LR_DEFAULTS)
    assert (d.topology, d.mode, d.consensus, d.momentum) == ("one-peer-exp", "awc", 1.0, 0.9)
    argv = ["--steps", "3", *flags, "--delayed-mix", f"{flags[0]}={flags[-1]}", "--lr", "1"]
    assert extra_flags_for("allreduce", argv) == ["--steps", "3", "--lr", "1"] and extra_flags_for("dsgd", argv) == argv


@pytest.mark.parametrize("argv, says", [
    (["--optimizer", "dadamw", "--momentum", "0.5"], "--momentum: --optimizer dadamw does not take it"),
    (["--optimizer", "dsgd", "--betas", "0.8,0.9"], "--betas: --optimizer dsgd does not take it"),
    (["--lr-schedule", "constant", "--warmup", "5"], "--warmup 5: --lr-schedule constant has no warmup"),
    (["--profile", "trace", "--steps", "5"], "--profile records steps 6-9 of a run: --steps 5 would record nothing"),
])
def test_flags_that_would_do_nothing_are_refused(argv, says, capsys):
    assert says in refused(argv, capsys)
    assert lm.parse_args(["--profile", "trace", "--steps", "6"]).profile == "trace"
    assert lm.parse_args(["--lr-schedule", "cosine", "--warmup", "5"]).warmup == 5  # cosine warms up too


def test_paths_that_are_files_are_refused_before_the_run(tmp_path, capsys):
    """--out naming a file failed at the first evaluation, on rank 0 only, with FileExistsError."""
    f = tmp_path / "file"
    f.write_text("")
    for flag in ("--out", "--checkpoint", "--profile"):
        assert f"{flag} {f}: it exists and is not a directory" in refused([flag, str(f), "--steps", "9"], capsys)
    assert lm.parse_args(["--out", str(tmp_path / "new")]).out == str(tmp_path / "new")


def test_resume_auto_starts_afresh_then_goes_on_from_the_commit(tmp_path, capsys):
    """One command line for every attempt of torchrun --max-restarts (tests/test_torchrun_restart.py runs it there):
    `--resume DIR` refused a DIR not there yet, and a DIR without checkpoints ("no checkpoint for rank 0")."""
    ck = str(tmp_path / "ck")
    flags = [*TINY, "--checkpoint", ck, "--resume", "auto", "--eval-every", "2", "--lr-schedule", "constant"]
    assert lm.main([*flags, "--steps", "2"])["steps"] == 2
    err = capsys.readouterr().err  # the run's log (decent_train's handler writes to stderr)
    assert f"--resume auto: no committed checkpoint in {ck}" in err and "resumed" not in err, err
    assert lm.main([*flags, "--steps", "4"])["steps"] == 4
    err = capsys.readouterr().err
    assert f"--resume auto: resuming from {ck}/step_0000002" in err, err
    assert f"resumed from {ck}/step_0000002 at step 2" in err and "no committed" not in err, err
    assert sorted(os.listdir(ck)) == ["latest", "step_0000002", "step_0000004"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_device_cuda_without_a_gpu_is_refused(capsys):
    assert "--device cuda: no CUDA device is available here" in refused(["--device", "cuda"], capsys)


@pytest.mark.parametrize("module", [lm, digits, synthetic])
def test_help_states_every_default(module, capsys):
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = capsys.readouterr().out
    blocks = re.split(r"\n  (?=-)", text.split("\noptions:", 1)[1])[1:]  # one per flag, wrapped lines joined
    assert len(blocks) > 30
    missing = [b.split()[0] for b in blocks if "default" not in b and not b.startswith("-h")]
    assert missing == []
    assert "(default: 0.1)" in " ".join(text.split())  # --min-lr-ratio, as argparse formats it


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_stops_both_ranks_with_one_line_and_exit_code_130(tmp_path):
    """SIGINT to the job's process group (what Ctrl-C does) gave each rank a KeyboardInterrupt traceback and, at
    exit, "Exchanger destroyed ... without shutdown()". The workers are started as torchrun starts them (its
    environment), without torchrun, whose own exit on SIGINT (a SignalException traceback) is not the script's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), *TINY, "--steps", "1000000",
           "--eval-every", "5", "--mode", "atc"]
    procs, logs = [], []
    for rank in range(2):
        logs.append(open(tmp_path / f"rank{rank}.err", "w+"))
        group = {"process_group": 0 if rank == 0 else procs[0].pid}  # a group of their own, as a terminal job
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=tmp_path,
                                      stdout=subprocess.DEVNULL, stderr=logs[-1], **group))
    try:
        deadline = time.monotonic() + 120
        while "step 10 |" not in (tmp_path / "rank0.err").read_text():  # training, past two evaluations
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "rank0.err").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(procs[0].pid, signal.SIGINT)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(tmp_path / f"rank{rank}.err").read_text() for rank in range(2)]
    assert codes == [130, 130], outs
    for rank, out in enumerate(outs):
        assert re.search(rf"\[rank {rank}\] WARNING decent_train\.loop: interrupted at step \d+ of 1000000", out)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out and "Exchanger destroyed" not in out, out


def test_sigterm_inside_a_step_is_held_as_ctrl_c_is():
    """decent_comm's step() holds Ctrl-C until every bucket is launched (optim/interrupts.HeldInterrupt); the
    examples' SIGTERM handler raised at once, between two buckets. Now SIGTERM is held there too, and raised as
    Ctrl-C once the block is done; outside a step it still raises at once."""
    from decent_comm.optim.interrupts import HeldInterrupt
    from decent_train.cli import _terminate
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            launched = []
            with pytest.raises(KeyboardInterrupt):
                with HeldInterrupt():
                    launched.append("bucket 0")
                    os.kill(os.getpid(), sig)
                    for _ in range(1000):  # bytecode boundaries, where Python runs signal handlers
                        pass
                    launched.append("bucket 1")
            assert launched == ["bucket 0", "bucket 1"], (signal.Signals(sig).name, launched)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_in_a_step_that_then_fails_is_still_interrupted_with_exit_code_130(monkeypatch, capsys):
    """The rank whose step held Ctrl-C while it waited for a peer that, interrupted outside its step, shut down: the
    wait raised ExchangeError, HeldInterrupt dropped the Ctrl-C, and that rank ended in a traceback and exit code 1
    (1 two-rank run in 8) where the others logged "interrupted at step N" and exited 130. Here step 3's block gets a
    real SIGINT and then raises the ExchangeError such a wait raises."""
    import decent_comm.optim.base as base
    from decent_comm.exchange import ExchangeError
    real, calls = base.written, [0]

    def written(buckets):  # inside step()'s HeldInterrupt, once the buckets are updated and launched
        real(buckets)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # bytecode boundaries, where Python runs signal handlers: held
                pass
            raise ExchangeError("rank 1 shut down")
    monkeypatch.setattr(base, "written", written)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (restored by signal_handlers_restored)
    with pytest.raises(SystemExit) as exit_info:
        lm.main([*TINY, "--steps", "6", "--eval-every", "6"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130, err
    assert calls[0] == 3, err
    assert "WARNING decent_train.loop: interrupted at step 2 of 6 (the call it was held in failed meanwhile: " \
        "ExchangeError: rank 1 shut down)" in err, err
    assert "Traceback" not in err, err


def test_a_new_lr_on_resume_scales_the_adaptive_consensus_reference():
    """--consensus adaptive resumed with --lr: the AdaptiveConsensus reference (the checkpoint's peak lr) scales with
    the lr, so the factor at the new schedule's point is the old schedule's (kept, a peak of 2e-3 under --lr 1e-4
    made the factor 1.25e-4 where a fresh run at 1e-4 has 1.0: gossip nearly off)."""
    import argparse

    import decent_comm
    from decent_train.checkpoint import apply_resumed_hyperparameters
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=2e-3, weight_decay=0.01)  # the checkpoint's groups, as loaded
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    consensus = decent_comm.AdaptiveConsensus()
    consensus.load_state_dict({"lr_at_start": 2e-3})
    fresh = decent_comm.AdaptiveConsensus()
    fresh.factor(0, 1e-4)  # its peak from its first step at the new lr
    args = argparse.Namespace(optimizer="dadamw", lr=1e-4, weight_decay=None, betas=None)
    changed = apply_resumed_hyperparameters(args, {"lr"}, opt, scheduler, consensus)
    assert changed == ["--lr 0.002 -> 0.0001"]
    assert consensus.lr_peak == pytest.approx(1e-4)
    assert consensus.factor(1000, 1e-4) == pytest.approx(fresh.factor(1000, 1e-4)) == pytest.approx(1.0)
    assert consensus.factor(1000, 5e-5) == pytest.approx(fresh.factor(1000, 5e-5))
