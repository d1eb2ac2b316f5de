"""What the tests that call the example harness's main() in-process share."""

import signal

import pytest


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """main() leaves SIGTERM (and after an interrupt SIGINT) ignored on its way out of the process, and after a
    refusal; not pytest's. Autouse in every module that imports it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
