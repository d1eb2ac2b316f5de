"""``python -m decent_comm <subcommand> ...``: the command line.

``main(argv=None) -> int`` builds an argparse parser with one subparser per
registered subcommand (``registry.SUBCOMMANDS``, filled by importing
``registry.BUILTIN_MODULES``) and returns the exit code: 0 on success, 2 on
bad input: one line ``python -m decent_comm plan: error: ...`` on stderr
naming the flag (argparse's code; no usage dump, never a traceback).  It does
not call ``sys.exit``; ``decent_comm/__main__.py`` does.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys

from .registry import BUILTIN_MODULES, SUBCOMMANDS, Subcommand, register

__all__ = ["main", "build_parser", "register", "Subcommand", "SUBCOMMANDS"]


def _load_builtins() -> None:
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit code 2): ``--help`` shows the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    _load_builtins()
    parser = OneLineErrorParser(prog="python -m decent_comm",
                                     description="decent_comm command line tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in sorted(SUBCOMMANDS):
        cmd = SUBCOMMANDS[name]
        p = sub.add_parser(name, help=cmd.help, description=cmd.description or cmd.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_subcommand=cmd, _subparser=p)
    return parser


#: what follows the minus sign of a negative value: a digit or "." (-5ms, -.5), or a float spelling of infinity or
#: NaN in any case (-inf, -Infinity, -nan, -INFms), which argparse also took for a flag
_NEGATIVE_VALUE = re.compile(r"-(?:[0-9.]|inf|nan)", re.IGNORECASE)


def _glued_negative_values(argv):
    """``--flag -5ms`` as ``--flag=-5ms``: argparse takes a token starting with "-" and not a plain number for a
    flag, so a negative value with a unit (or -inf, -nan) got "expected one argument" instead of the flag's own
    range message."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_VALUE.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv=None) -> int:
    """Run the command line; returns the exit code (2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(_glued_negative_values(sys.argv[1:] if argv is None else list(argv)))
        sub_parser = args._subparser
        try:
            return int(args._subcommand.run(args, sub_parser) or 0)
        except ValueError as e:  # bad input found past parsing: argparse-style message, exit 2
            sub_parser.error(str(e))
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
