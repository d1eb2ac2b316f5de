"""The command line of the training scripts (examples/train_lm.py, train_classifier.py, bench/synthetic_train.py):
bad input is one line and exit code 2, as `python -m decent_comm` answers it, never a traceback on every rank.

    parser = make_parser(__doc__)        # argparse: one-line errors, every flag's default in --help
    args = parse(parser, argv, check)    # "--flag -5,1" is a value; flags.check_flags and the script's `check`
    main(parse_args, build_task, LR_DEFAULTS, argv)

main() runs decent_train.loop.run: a value refused while the run is set up (SetupError: --local-world-size not
dividing the ranks, a topology spec, a checkpoint that cannot be read or was written by another world size,
topology, --optimizer or model, ...) is one line "train_lm.py: error: ..." and exit code 2;
Ctrl-C (SIGINT, which torchrun also forwards to its workers), or SIGTERM, stops the run where it is (decent_comm's
step() finishes launching and updating its buckets first), logs "interrupted at step N" on every rank, shuts the
optimizer down (bounded: decent_train.loop.RELEASE_TIMEOUT_S) and exits 130.

Every rank of a torchrun job parses the same command line, so a parse error is printed by local rank 0 only (one
line per node), as is a set-up error found from the flags and the world size alone; one found later is printed by
every rank that meets it (a checkpoint file may be bad on one rank only).
"""

import argparse
import os
import signal
import sys

from decent_comm.cli import OneLineErrorParser, _glued_negative_values

from .flags import check_flags
from .loop import Interrupted, SetupError, ignore_further_interrupts, run


def _local_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The script's docstring as written, and each flag's default after its help (a help that speaks of its
    default itself, as those whose default depends on other flags do, is left as it is)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        return text + (" (default: off)" if action.nargs == 0 and action.default is False else " (default: %(default)s)")


class Parser(OneLineErrorParser):
    """decent_comm's one-line-error parser (exit code 2); on ranks other than local rank 0 the error line is left
    out, as those ranks parsed the same command line."""

    def exit(self, status=0, message=None):
        super().exit(status, message if status == 0 or _local_rank_zero() else None)


def make_parser(description: str) -> argparse.ArgumentParser:
    return Parser(description=description, formatter_class=HelpFormatter)


def parse(parser: argparse.ArgumentParser, argv=None, check=None) -> argparse.Namespace:
    """Parses argv (sys.argv[1:] when None), then flags.check_flags and the script's own `check(args)`: a ValueError
    from either is the parser's one-line error."""
    args = parser.parse_args(_glued_negative_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        check_flags(args)
        if check is not None:
            check(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def _terminate(signum, frame):
    # SIGTERM (torchrun's second request to stop, or a scheduler's) as Ctrl-C: the run logs the step and shuts the
    # optimizer down instead of dying in the middle of an exchange. SIGINT keeps Python's own handler (loop.py).
    # Inside decent_comm's step(), which holds Ctrl-C until every bucket is launched and updated (its SIGINT handler
    # then is HeldInterrupt's), SIGTERM is held the same way: raised at once, it stopped the step between two buckets,
    # each rank at another, and the shutdown then waited on exchanges no peer had posted.
    held = signal.getsignal(signal.SIGINT)
    if held is not signal.default_int_handler and callable(held):
        held(signal.SIGINT, frame)
        return
    raise KeyboardInterrupt("SIGTERM")


def main(parse_args, build_task, lr_defaults, argv=None) -> dict:
    """parse_args(argv), then decent_train.loop.run; exits 2 (set-up error) or 130 (interrupted) with one line."""
    prog = os.path.basename(sys.argv[0])
    args = parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    exiting = False
    try:
        return run(args, build_task, lr_defaults)
    except SetupError as e:
        # Exiting: torchrun's SIGTERM, sent when another rank exited first, would make this rank's code -15, not 2.
        exiting = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _local_rank_zero() or not e.same_on_every_rank:
            who = "" if e.rank == 0 else f" (rank {e.rank})"
            print(f"{prog}{who}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt as e:  # run() logged the step on every rank; before it started, say it once here
        exiting = True
        ignore_further_interrupts()
        if not isinstance(e, Interrupted) and _local_rank_zero():
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        if isinstance(e, Interrupted) and not e.released:  # a thread still waits in the shutdown: do not join it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        sys.exit(130)
    finally:
        if not exiting and previous == signal.SIG_DFL:  # kept when exiting: a signal on its way would raise late
            signal.signal(signal.SIGTERM, previous)
