"""Subcommand registry for ``python -m decent_comm``.

A subcommand is a module that calls ``register(Subcommand(...))`` at import
time and is listed in ``BUILTIN_MODULES`` (imported lazily by ``main``):

    register(Subcommand(name="plan", help="...", add_arguments=fn(parser),
                        run=fn(args, parser) -> int))

``run`` returns the exit code; bad input should call ``parser.error(msg)``
(exit code 2, argparse style) or raise ``ValueError`` (turned into the same).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

#: modules that register the built-in subcommands (add yours here)
BUILTIN_MODULES = ("decent_comm.cli.info", "decent_comm.cli.plan")

SUBCOMMANDS: dict = {}


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """``name``, one-line ``help``, ``add_arguments(parser)``, ``run(args, parser) -> int``;
    ``description``: the longer text of ``--help`` (defaults to ``help``)."""

    name: str
    help: str
    add_arguments: Callable
    run: Callable
    description: str = ""


def register(cmd: Subcommand) -> Subcommand:
    """Add ``cmd`` (a name may be registered once)."""
    if cmd.name in SUBCOMMANDS and SUBCOMMANDS[cmd.name] is not cmd:
        raise ValueError(f"subcommand {cmd.name!r} is already registered")
    SUBCOMMANDS[cmd.name] = cmd
    return cmd
