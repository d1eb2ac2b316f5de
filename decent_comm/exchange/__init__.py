"""The exchange layer: moves flat buffers between ranks and knows nothing of optimizers or topologies.

* ``Exchanger`` (C++ scheduler, csrc/comm): point-to-point - send a buffer to some ranks, receive one buffer
  from each of some others; NCCL on CUDA, any ProcessGroup (gloo) elsewhere.
* ``GroupAllReduce``: a buffer summed over a group of ranks with one all-reduce.
* ``GossipExchange``: both behind the one interface the gossip schedule uses.

Every path has the same method names - ``exchange`` (whose peer arguments are each path's own), ``wait``,
``wait_all``, ``synchronize``, ``bytes_sent``, ``shutdown`` - and raises the same errors: ``ExchangeError``
(a RuntimeError: a peer exited, a transport failed; the object is unusable afterwards) and ``ExchangeTimeout``
(an ExchangeError and a TimeoutError).
Bad arguments raise ``ValueError`` and leave the object usable.

Imported here for decent_comm.optim, which uses them, but not public API (not in ``__all__``, nor on docs/api.md or docs/api_lowlevel.md):
``BoundedAllReduce`` (the optimizers' whole-group all-reduces, held to the same timeout; ``CollectiveMismatch`` when
the ranks are not at the same call) and ``broadcast_from_rank0`` (their start-up copy of rank 0's parameters), the
start-up barrier and the store exchange it rests on (``wait_for_ranks``, ``swap``), the wording of errors
(``ranks_text``, ``in_global_ranks``, ``timeout_s``), the check of a `process_group` argument
(``check_process_group``), an error kept for later without its frames (``detached``), the
reading of a `timeout` option (``timeout_seconds``), and closing what nobody shut down (``track_owner`` registers an
owner of exchangers, shut down before them at exit; ``close_on_collect`` for its finalizer).
"""
from ._closing import close_on_collect, track_owner
from .arrival import check_process_group, detached, in_global_ranks, ranks_text, timeout_s, wait_for_ranks
from .bounded import BoundedAllReduce, CollectiveMismatch, broadcast_from_rank0
from .exchanger import MAX_BUCKETS, ExchangeError, ExchangeTimeout, Exchanger, nccl_available
from .gossip_exchange import GossipExchange
from .group_allreduce import GroupAllReduce
from .roster import swap
from .timeouts import timeout_seconds

__all__ = ["Exchanger", "GroupAllReduce", "GossipExchange", "ExchangeError", "ExchangeTimeout", "nccl_available",
           "MAX_BUCKETS"]
