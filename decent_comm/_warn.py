"""Warnings the user should act on (change the code, the order of calls, how a checkpoint is saved) go through
warnings.warn, so that ``python -W error``, ``pytest.warns``, ``warnings.catch_warnings`` and filterwarnings see
them, as the logging HOWTO advises; what needs no action (an event worth noting) is logged, to each module's
logging.getLogger(__name__)."""

import os
import sys
import warnings
from typing import Optional

import torch

# The library's frames: decent_comm's own, and torch's between the user's call and ours (the optimizer's step
# wrapper, torch.distributed.checkpoint's set_state_dict, a module's __call__ running a forward pre-hook).
_LIBRARY = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def warn_user(message: str, rank: Optional[int] = None) -> None:
    """warnings.warn(UserWarning), "decent_comm: rank R: " (the rank where a process group runs) before `message`.

    Attributed (its stacklevel) to the innermost frame outside decent_comm and torch: the user's line that made the
    call (``opt.step()``, ``opt.load_state_dict(...)``, the optimizer's construction), whatever the depth of the
    library's frames between, which differs by path (torch's step wrapper and step hooks, DCP's set_state_dict).
    Called from a thread or a finalizer, the first frame outside is the standard library's (threading.py,
    weakref.py), which the warning then names; no caller does so now. A stack of library frames only: the caller's
    line here."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn_user's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY):
        frame, level = frame.f_back, level + 1
    warnings.warn(who(rank) + message, UserWarning, stacklevel=level if frame is not None else 2)


def job_rank(owner) -> Optional[int]:
    """The rank a warning names for `owner` (an optimizer or its schedule): its rank in a job of several, else None."""
    return owner.rank if owner.world_size > 1 else None


def who(rank: Optional[int] = None) -> str:
    """The prefix of a warning or log line: "decent_comm: rank R: " where a process group runs, else "decent_comm: "."""
    return "decent_comm: " if rank is None else f"decent_comm: rank {rank}: "
