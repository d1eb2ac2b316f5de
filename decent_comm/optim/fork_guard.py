"""An optimizer used in a forked child (``os.fork()`` while it lives: the copy-on-write asynchronous checkpoint) raises
instead of hanging.

Its exchange runs on the process group's threads (gloo's, NCCL's), which a fork does not copy: every wait of the child
(the pending ATC mix in a forward or model.state_dict() pre-hook, synchronize(), state_dict(), step(), a collective
utility, shutdown()) waited for a transfer nobody drives, past any timeout. Worse, what the child would send or
receive goes through sockets and an epoll instance it shares with the parent: a child that touched them took gloo's
loop down in the parent (SIGABRT, "epoll_ctl: No such file or directory"). So the schedule remembers the process that
built it, and every entry point that would use the exchange raises RuntimeError in any other process; the child's
exit leaves the parent's exchangers alone (decent_comm.exchange._closing). What stays usable in the child is what
reads the model's tensors only: model.state_dict() with no mix pending, a forward of buckets already mixed.
"""

import os

ATTRIBUTE = "_built_in"  # (pid, the optimizer's class name) on the schedule


def stamp(schedule, owner: str) -> None:
    """Marks `schedule` as built by this process for an optimizer of class `owner`."""
    setattr(schedule, ATTRIBUTE, (os.getpid(), owner))


def check(schedule, what: str) -> None:
    """RuntimeError when `schedule` was built in another process (this one is a fork of it), before `what` waits."""
    built = getattr(schedule, ATTRIBUTE, None)
    if built is None or built[0] == os.getpid():
        return
    pid, owner = built
    raise RuntimeError(
        f"decent_comm: {what}: this {owner} was built in process {pid}; this is a fork of it (pid {os.getpid()}). "
        "Its exchange runs on the parent's communication threads, which the fork did not copy, so it would wait "
        "forever here (and touching the parent's sockets could break its training). Call opt.synchronize() before "
        "forking and read only the model's tensors in the child (model.state_dict(), a copy of the optimizer's "
        "state_dict() taken before the fork); the child must not step, synchronize, save the optimizer or shut it "
        "down.")
