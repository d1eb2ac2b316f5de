"""The exchange engine: moves flat buffers to and from the current step's gossip neighbours, off the Python
thread, and says exactly when each bucket's data has arrived.

    ex = Exchanger(process_group=None, device=None, *, timeout=None, wire_dtype=None, nccl_max_ctas=None)
    ex.exchange(bucket, send, recvs, send_to, recv_from)   # enqueue; returns at once
    ex.wait(bucket)        # CPU: block until done; CUDA: the current stream waits (no host sync);
                           # again after completion: allowed (no-op); for a never-exchanged id: an error
    ex.wait_all(); ex.synchronize(); ex.shutdown()         # or: with Exchanger(...) as ex: ...

``exchange`` sends ``send`` to every rank of ``send_to`` and receives ``recvs[i]`` from ``recv_from[i]``
(ranks of the process group). Every rank issues the buckets of a step in the same order. Until
``wait(bucket)``, ``send`` must not be modified and ``recvs`` not read; a bucket id can be exchanged again
once waited for. ``recvs[i]`` must be contiguous, on the exchanger's device, with ``send.numel()``
elements of the wire dtype (``wire_dtype`` if given, else ``send``'s dtype).

Peers must agree on a bucket: the same number of elements and the same wire dtype. The first time a bucket
meets a peer in a direction, and again after its size or wire dtype changed, ``exchange`` swaps a small header
with that peer before posting any data (so that call blocks until the peer reached the same exchange); a
difference raises ``ExchangeError`` on both ranks, naming the bucket, the peer and both sides, and nothing
is sent. Later exchanges of an agreed bucket cost nothing extra.

The transport: NCCL (its own non-blocking communicator, a high-priority comm stream, per-bucket events)
when ``device`` is CUDA and the extension was built with NCCL; otherwise the process group's own
send/recv (gloo on CPU; CUDA buffers without the NCCL transport are refused with a ValueError: gloo's
send/recv take host memory only, and NCCL's, posted one by one, deadlock on a two-way edge). A transfer not complete
``timeout`` seconds after it was issued (default: the timeout the process group was created with) raises
``ExchangeTimeout`` naming the bucket and the peers; a peer that exits raises ``ExchangeError``. Either makes
the exchanger unusable: every later call raises ``ExchangeError`` quoting the first error. Bad arguments
raise ``ValueError`` (or ``RuntimeError`` for a bucket that is or is not in flight) and leave it usable.

Construction is collective over the group: the ranks first agree that every rank accepted its arguments,
so a refused construction raises on every rank (on the others a ``ValueError`` naming the refusing rank)
and leaves no rank with an exchanger, or a tag channel used up, that another rank lacks.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .._args import integer
from .._native import _C
from . import _closing, timeouts
from .arrival import check_process_group, wait_for_ranks

__all__ = ["Exchanger", "ExchangeError", "ExchangeTimeout", "nccl_available", "MAX_BUCKETS"]

#: Bucket ids are 0 .. MAX_BUCKETS - 1: the ProcessGroup transport derives message tags from them
#: (csrc/comm/transport.h, kMaxBucketId).
MAX_BUCKETS = 1 << 16

#: A transfer failed (a peer exited, a transport error); a RuntimeError.
ExchangeError = _C.ExchangeError
#: A transfer did not complete within the timeout; an ExchangeError and a TimeoutError.
ExchangeTimeout = _C.ExchangeTimeout


def nccl_available() -> bool:
    """True when this build of the extension has the NCCL transport."""
    return hasattr(_C, "_nccl_transport")


def _check_wire_dtype(wire_dtype):
    if wire_dtype is not None and not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
        raise ValueError(f"Exchanger: wire_dtype must be a floating point dtype (e.g. torch.bfloat16), got "
                         f"{wire_dtype!r}")


def _check_max_ctas(nccl_max_ctas) -> Optional[int]:
    """nccl_max_ctas as a Python int (an np.int64 taken, a bool not), for the C++ transport's int argument."""
    if nccl_max_ctas is None:
        return None
    return integer(nccl_max_ctas, "nccl_max_ctas", low=1, where="Exchanger")


def _agree_on_arguments(group, problem: Optional[Exception], timeout_ms: int, device=None) -> Optional[str]:
    """Raises on every rank of `group` if any rank refused its arguments (`problem`): construction is all or
    nothing, so no rank keeps an exchanger (or has used up a tag channel) that another rank lacks. The ranks
    first meet within the timeout (ms; <= 0: the group's own), or all raise ExchangeTimeout naming the absent.
    Returns the construction's store namespace (wait_for_ranks; None on one rank)."""
    world_size = dist.get_world_size(group)
    namespace = None
    if world_size > 1:
        namespace = wait_for_ranks(group, timeout_ms / 1000.0 if timeout_ms > 0 else None, "creating an Exchanger")
        verdicts = [None] * world_size
        # Over a NCCL group the objects travel on torch's current CUDA device: this exchanger's, not cuda:0 on
        # every rank where the script put its parameters on cuda:k without torch.cuda.set_device (review GH). Only a
        # device that resolved without a problem is entered (a refused one may not exist).
        on = device if problem is None and isinstance(device, torch.device) and device.type == "cuda" else None
        with torch.cuda.device(on) if on is not None else contextlib.nullcontext():
            dist.all_gather_object(verdicts, None if problem is None else f"{type(problem).__name__}: {problem}",
                                   group=group)
    if problem is not None:
        raise problem
    if world_size > 1:
        refused = [(r, text) for r, text in enumerate(verdicts) if text is not None]
        if refused:
            rank, text = refused[0]
            raise ValueError(f"Exchanger: rank {rank} of the group refused its arguments, so no rank creates this "
                             f"exchanger: {text}")
    return namespace


def _resolve_device(device, group) -> torch.device:
    if device is None:
        if "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and not device.index < torch.cuda.device_count():
        raise ValueError(f"Exchanger: device {device} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return device


def _transport_problem(device_type: str, nccl_transport: bool) -> Optional[str]:
    """Why the exchange cannot move `device_type` buffers, or None. CUDA buffers travel by our NCCL transport only
    (an extension built with NCCL: `nccl_transport`). A process group's own send/recv cannot stand in: gloo's hand
    the tensor's pointer to its host-side transport (a CUDA pointer there is read and written as host memory: a
    crash or garbage), and ProcessGroupNCCL runs each send and recv, posted one by one as the process-group
    transport posts them, as its own kernel on the one stream it keeps per pair of ranks, so on a two-way edge each
    rank's receive waits for a send queued behind the peer's own receive: a deadlock until the timeout (torch's
    batch_isend_irecv groups them for that reason). MPI's and UCC's take CUDA memory only in some builds."""
    if device_type != "cuda" or nccl_transport:
        return None
    return ("Exchanger: CUDA buffers need the NCCL transport, which this build of decent_comm's extension lacks "
            "(built without NCCL, e.g. DECENT_COMM_NCCL=0). A process group's own send/recv cannot stand in (gloo's "
            "take host memory only; NCCL's, posted one by one, deadlock on a two-way edge). Rebuild the extension "
            "with NCCL, or keep the parameters (device) on the CPU")


def _nccl_transport(group, device, timeout_ms, max_ctas):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if timeout_ms <= 0:
        timeout_ms = _C._process_group_timeout_ms(group, device)
    # Rank 0 of the group creates the communicator's id; the group itself carries it to the others (on CPU
    # unless the group can only move CUDA tensors).
    uid = torch.empty(128, dtype=torch.uint8)
    if rank == 0:
        uid.copy_(torch.frombuffer(bytearray(_C._nccl_unique_id()), dtype=torch.uint8))
    if world_size > 1:
        on = device if str(dist.get_backend(group)) == "nccl" else torch.device("cpu")
        shared = uid.to(on)
        dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
        uid = shared.cpu()
    return _C._nccl_transport(bytes(uid.tolist()), rank, world_size, device.index, timeout_ms, max_ctas or 0)


class Exchanger(_C._Exchanger):
    """See the module docstring. Methods (C++): exchange, wait, wait_all, synchronize, shutdown.
    Properties: rank, world_size, transport ('nccl' | 'process_group'), device, timeout (s), wire_dtype,
    bytes_sent (bytes put on the wire so far), in_flight (bucket ids, issue order), closed.

    process_group: default the default group. device: default the current CUDA device when the group's
    backend is NCCL, else CPU. timeout: seconds or timedelta. wire_dtype: e.g. torch.bfloat16 sends
    floating buffers in that dtype (recvs must have it). nccl_max_ctas: cap on the CTAs (SMs) NCCL may use
    (NCCL transport only; ignored otherwise). Creating one is collective over the group.
    _allow_self_exchange: tests only (NCCL transport): a rank may list itself as a peer, so that one GPU
    drives the whole transport (a loopback through a one-rank communicator).
    """

    def __init__(self, process_group=None, device=None, *, timeout=None, wire_dtype: Optional[torch.dtype] = None,
                 nccl_max_ctas: Optional[int] = None, _allow_self_exchange: bool = False):
        check_process_group(process_group, "Exchanger: ")  # before torch takes it: it has no group to tell peers on
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Exchanger: torch.distributed is not initialized (call dist.init_process_group)")
        group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        transport, problem, timeout_ms = None, None, -1
        try:  # everything that can refuse this rank's arguments, before any rank commits to anything
            device = _resolve_device(device, group)
            timeout_ms = timeouts.timeout_ms(timeouts.timeout_seconds(timeout, "Exchanger: "))
            _check_wire_dtype(wire_dtype)
            nccl_max_ctas = _check_max_ctas(nccl_max_ctas)
            use_nccl = device.type == "cuda" and nccl_available()
            if _allow_self_exchange and not use_nccl:
                raise ValueError("Exchanger: _allow_self_exchange needs the NCCL transport (a CUDA device and an "
                                 "extension built with NCCL); gloo has no loopback")
            refusal = _transport_problem(device.type, use_nccl)
            if refusal is not None:  # refused here, so that every rank hears it (_agree_on_arguments)
                raise ValueError(refusal)
            if not use_nccl:  # local: its tag channel is claimed only once the exchanger is built
                transport = _C._process_group_transport(group, device)
        except Exception as exc:  # noqa: BLE001 - any refusal, of any type, is told to every rank before it is raised
            problem = exc
        namespace = _agree_on_arguments(group, problem, timeout_ms, device)
        if use_nccl:  # collective itself, so only once every rank is known to get here
            transport = _nccl_transport(group, device, timeout_ms, nccl_max_ctas)
        super().__init__(transport, timeout_ms, wire_dtype, _allow_self_exchange)
        self._transport = transport  # its waits, for a watch (watch_peers)
        self._peer_watch = None
        self.process_group = group
        self._store_namespace = namespace  # this construction's keys (GossipExchange's roster), the same on all ranks
        _closing.track(self)  # closed when collected or at exit if nobody shut it down (see _closing)
        self._tracked = True

    def __del__(self):
        # Before the native destructor, which could only abandon what is in flight (and warn). Only once the
        # native object exists: if __init__ raised before, calling into it would dereference nothing.
        if self.__dict__.get("_tracked") and not self.closed:
            _closing.close_on_collect(self)
        if self.__dict__.get("_peer_watch") is not None and not sys.is_finalizing():
            self._close_watch()  # shutdown() closed it, unless the drain was skipped

    def shutdown(self):
        """Completes what is in flight and releases the transport (idempotent; after an error it aborts
        instead). The process group is no longer referenced afterwards, so dist.destroy_process_group()
        can really destroy it (and join its backend's threads) while this object lives on."""
        try:
            super().shutdown()
        finally:  # after a failed drain too: the caller cannot shut down again to let go of the group
            self._close_watch()
            self.process_group = None

    def _close_watch(self):
        if self._peer_watch is not None:
            self._peer_watch.close()
            self._peer_watch = None

    def watch_peers(self, watch):
        """Keeps `watch` (exchange.peer_watch.PeerWatch, over this exchanger's transport) for as long as this
        exchanger can wait, the drain at exit or on collection included, and closes it at shutdown."""
        self._peer_watch = watch

    def __enter__(self) -> "Exchanger":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.shutdown()
        else:
            try:  # leaving on an exception: release what we can, and never mask that exception
                self.shutdown()
            except Exception:  # noqa: BLE001
                pass
        return False

    def __repr__(self) -> str:
        return (f"Exchanger(transport={self.transport!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, timeout={self.timeout}s, wire_dtype={self.wire_dtype}, "
                f"in_flight={self.in_flight}, closed={self.closed})")
