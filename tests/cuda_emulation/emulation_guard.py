"""pytest plugin of run.py: refuses to run unless `decent_comm._C` is the emulated build (pyproject's pythonpath would
otherwise put the checkout, with its CPU build, first)."""
import os

import pytest


def pytest_sessionstart(session):
    import decent_comm._C

    expected = os.environ["DC_EMULATED_PACKAGE"]
    if not os.path.abspath(decent_comm._C.__file__).startswith(expected + os.sep):
        raise pytest.UsageError(f"decent_comm._C is {decent_comm._C.__file__}, not the emulated build in {expected}")
