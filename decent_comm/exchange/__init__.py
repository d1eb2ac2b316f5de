"""The exchange layer: moves flat buffers between ranks and knows nothing of optimizers or topologies.

* ``Exchanger`` (C++ scheduler, csrc/comm): point-to-point - send a buffer to some ranks, receive one buffer
  from each of some others; NCCL on CUDA, any ProcessGroup (gloo) elsewhere.
* ``GroupAllReduce``: a buffer summed over a group of ranks with one all-reduce.
* ``GossipExchange``: both behind the one interface the gossip schedule uses.

Every path has the same methods - ``exchange``, ``wait``, ``wait_all``, ``synchronize``, ``bytes_sent``,
``shutdown`` - and raises the same errors: ``ExchangeError`` (a RuntimeError: a peer exited, a transport
failed; the object is unusable afterwards) and ``ExchangeTimeout`` (an ExchangeError and a TimeoutError).
Bad arguments raise ``ValueError`` and leave the object usable.
"""
from .exchanger import MAX_BUCKETS, ExchangeError, ExchangeTimeout, Exchanger, nccl_available
from .gossip_exchange import GossipExchange
from .group_allreduce import GroupAllReduce

__all__ = ["Exchanger", "GroupAllReduce", "GossipExchange", "ExchangeError", "ExchangeTimeout", "nccl_available",
           "MAX_BUCKETS"]
