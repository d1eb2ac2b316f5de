"""A pure-Python exchanger on torch.distributed isend/irecv, with the interface of
decent_comm.exchange.Exchanger (the C++ scheduler).

It is the fallback when the native scheduler is not available (e.g. an extension built without it) and
the reference the scheduler is benchmarked against. Per-bucket tags keep several buckets in flight
between the same pair of ranks apart.
"""

import datetime
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


class PythonExchanger:
    transport = "python-p2p"

    def __init__(self, process_group=None, device=None, *, timeout: Optional[float] = None, wire_dtype=None):
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout = datetime.timedelta(seconds=timeout) if timeout else None
        self.wire_dtype = wire_dtype
        self.bytes_sent = 0
        self._works: Dict[int, tuple] = {}
        self._send_bufs: Dict[int, torch.Tensor] = {}
        self._error: Optional[str] = None

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def exchange(self, bucket: int, send: torch.Tensor, recvs: Sequence[torch.Tensor], send_to: Sequence[int],
                 recv_from: Sequence[int]) -> None:
        self._check_usable()
        if bucket in self._works:
            raise RuntimeError(f"bucket {bucket} is still in flight; wait for it before exchanging it again")
        if len(recvs) != len(recv_from):
            raise ValueError(f"bucket {bucket}: {len(recvs)} receive buffers for {len(recv_from)} peers")
        if self.wire_dtype is not None and send.dtype != self.wire_dtype and send_to:
            buf = self._send_bufs.get(bucket)
            if buf is None or buf.numel() != send.numel():
                buf = torch.empty(send.numel(), dtype=self.wire_dtype, device=send.device)
                self._send_bufs[bucket] = buf
            buf.copy_(send)
            send = buf
        works = []
        tag = int(bucket)
        for r in recv_from:
            self._check_peer(bucket, r)
        for r in send_to:
            self._check_peer(bucket, r)
        # Post receives first so a pair that sends to each other never waits on the other's send.
        for buf, r in zip(recvs, recv_from):
            works.append((dist.irecv(buf, self._global(r), group=self.group, tag=tag), r))
        for r in send_to:
            works.append((dist.isend(send, self._global(r), group=self.group, tag=tag), r))
            self.bytes_sent += send.numel() * send.element_size()
        self._works[bucket] = (works, send)

    def _check_peer(self, bucket, r):
        if not (0 <= r < self.world_size) or r == self.rank:
            raise ValueError(f"bucket {bucket}: peer rank {r} is invalid for rank {self.rank} of {self.world_size}")

    def _check_usable(self):
        if self._error is not None:
            raise RuntimeError(f"the exchanger is unusable after an earlier error: {self._error}")

    def wait(self, bucket: int) -> None:
        self._check_usable()
        entry = self._works.pop(bucket, None)
        if entry is None:
            return
        for work, peer in entry[0]:
            try:
                if self.timeout is not None:
                    work.wait(self.timeout)
                else:
                    work.wait()
            except RuntimeError as exc:
                self._error = f"bucket {bucket}, peer {peer}: {exc}"
                raise RuntimeError(f"exchange of bucket {bucket} with peer {peer} failed or timed out: {exc}") from exc

    def wait_all(self) -> None:
        for b in list(self._works):
            self.wait(b)

    def synchronize(self) -> None:
        self.wait_all()

    def shutdown(self) -> None:
        self._works.clear()

    def pending(self) -> List[int]:
        return list(self._works)
