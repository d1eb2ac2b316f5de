"""decent_comm and decent_train log to one logger per module (logging.getLogger(__name__)), children of their package's:
configuring "decent_comm" still configures every module's, and a user can quiet one module's lines (the per-mix
disagreement DEBUG line of decent_comm.optim.meter) while keeping another's (the construction line of
decent_comm.optim.tracing). Every module logged to the one "decent_comm" logger (and decent_train.cluster to
"netns_cluster", outside decent_train's), so neither was possible."""

import logging
import os
import re

import pytest

import decent_comm

from dist_utils import run_ranks
from optim_cases import make_model, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(rank, n):
    """(phase, logger name, message) of what decent_comm logs at DEBUG: at construction and 2 steps with the meter's
    logger at INFO ("quiet"), then 2 steps with it back at NOTSET ("loud")."""
    seen, phase = [], ["quiet"]
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append((phase[0], record.name, record.getMessage()))
    parent = logging.getLogger("decent_comm")
    parent.addHandler(handler)
    parent.setLevel(logging.DEBUG)
    meter = logging.getLogger("decent_comm.optim.meter")
    meter.setLevel(logging.INFO)
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", track_disagreement=True, timeout=30)
    train_steps(rank, model, opt, 2)
    phase[0] = "loud"
    meter.setLevel(logging.NOTSET)
    train_steps(rank, model, opt, 2, start=2)
    opt.shutdown()
    parent.removeHandler(handler)
    return seen


def test_a_modules_lines_can_be_quieted_apart_from_the_others():
    for rank, seen in enumerate(run_ranks(_records, 2, timeout=120)):
        setup = [(phase, name) for phase, name, msg in seen if f"rank {rank} of 2: topology ring" in msg]
        mixes = [(phase, name) for phase, name, msg in seen if "local disagreement" in msg]
        assert setup == [("quiet", "decent_comm.optim.tracing")], (rank, seen)
        # one line per mix, the loud phase's two steps
        assert mixes == [("loud", "decent_comm.optim.meter")] * 2, (rank, seen)


def _logger_calls():
    """(file, the argument) of every logging.getLogger call in the packages' sources."""
    calls = []
    for package in ("decent_comm", "decent_train"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        calls += [(os.path.relpath(path, ROOT), arg) for arg in re.findall(r"getLogger\(([^)]*)\)",
                                                                                         f.read())]
    return calls


def test_every_module_logs_to_its_own_logger_in_its_packages_hierarchy():
    calls = _logger_calls()
    assert len(calls) >= 10, calls  # (the scan finds them: 14 modules log)
    assert all(arg == "__name__" for _, arg in calls), [c for c in calls if c[1] != "__name__"]


@pytest.mark.parametrize("module", ["decent_comm.optim.schedule", "decent_comm.exchange._closing",
                                    "decent_train.loop", "decent_train.cluster.net"])
def test_module_loggers_are_children_of_the_packages_logger(module):
    """A record of the module's logger reaches a handler on the package's logger (so configuring "decent_comm" or
    "decent_train" configures them all), and carries the module's name."""
    import importlib
    log = importlib.import_module(module).log
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    package = logging.getLogger(module.split(".")[0])
    package.addHandler(handler)
    try:
        log.warning("a test record")
    finally:
        package.removeHandler(handler)
    assert [(r.name, r.getMessage()) for r in seen] == [(module, "a test record")]
