"""What the optimizers report about the replicas with collectives (``ReplicaWatch``, mixed into DecentralizedMixin):
the exact consensus distance and per-tensor replica variance, the disagreement averaged over the ranks, and the
mean all-reduce these and the global average use. Each collective is announced first (agreement.announce)."""

from typing import Dict, List, Optional

import torch

from .._args import integer
from .agreement import announce
from . import finite_check
from .buckets import adopt_storage
from .param_versions import checked_first


_CHUNK = 1 << 20  # elements per temporary of the collective utilities (8 MiB in float64)


def all_reduce_mean_(t: torch.Tensor, all_reduce, world_size: int, what: str):
    """t <- the mean of t over the ranks. `all_reduce`: the schedule's BoundedAllReduce (held to the optimizer's
    timeout); `what` names the call in its errors.

    bf16/fp16 values are summed in float32, _CHUNK elements at a time (a float32 copy of at most 4 MiB, not of
    the whole bucket), then rounded once: summed in fp16 the mean was inf wherever the sum passed 65504 (values
    near 3e4 over 4 ranks: a third of them), and summed in bf16 every partial sum was rounded."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        all_reduce(t, what)
        t.div_(world_size)
        return
    flat = t.view(-1)
    for i in range(0, flat.numel(), _CHUNK):
        part = flat[i:i + _CHUNK]
        wide = part.float()
        all_reduce(wide, what)
        part.copy_(wide.div_(world_size))
        all_reduce.let_go(wide)


@torch.no_grad()
def consensus_distance(buckets, all_reduce, world_size: int) -> float:
    """(1/n) sum_i ||x_i - mean||^2 over all parameters (a collective)."""
    if world_size == 1:
        return 0.0
    total = torch.zeros((), dtype=torch.float64, device=buckets[0].device)
    for b in buckets:
        mean = b.flat.to(torch.float64, copy=True)  # a copy for float64 parameters too (.double() is b.flat then)
        all_reduce_mean_(mean, all_reduce, world_size, f"consensus_distance(): the mean of bucket {b.index}")
        # In chunks: the whole bucket's x.double(), x - mean and its square took 8x the bucket's float32 bytes at
        # once (one 16 MiB bucket: 131 MiB), on top of the mean's 2x.
        for i in range(0, b.numel, _CHUNK):
            d = b.flat[i:i + _CHUNK].double().sub_(mean[i:i + _CHUNK])
            total += torch.dot(d, d)
        all_reduce.let_go(mean)
    all_reduce(total, "consensus_distance(): the sum over ranks")
    return float(total) / world_size


def param_names(param_groups, names) -> Dict[int, str]:
    """id(param) -> name, from `names` (an nn.Module, a dict name -> parameter, or (name, parameter) pairs),
    else "group{g}.param{i}"."""
    by_id: Dict[int, str] = {}
    if names is not None:
        if isinstance(names, torch.nn.Module):
            items = names.named_parameters()
        elif isinstance(names, dict):
            items = names.items()
        else:
            items = names
        for name, p in items:
            by_id[id(p)] = name
    out = {}
    for gi, g in enumerate(param_groups):
        for pi, p in enumerate(g["params"]):
            out[id(p)] = by_id.get(id(p), f"group{gi}.param{pi}")
    return out


@torch.no_grad()
def replica_variance(buckets, params: List[torch.Tensor], names_of: Dict[int, str], all_reduce,
                     world_size: int) -> Dict[str, Dict[str, float]]:
    """Per-tensor statistics of the replicas (see ReplicaWatch.replica_variance), in `params` order, with
    one all-reduce of a float64 buffer of the parameters plus one scalar per tensor."""
    order = {id(p): k for k, p in enumerate(params)}
    slots = sorted(((b, s) for b in buckets for s in b.slots), key=lambda bs: order[id(bs[1].param)])
    if not slots:
        return {}
    dev = buckets[0].device
    total = sum(s.numel for _, s in slots)
    buf = torch.empty(total + len(slots), dtype=torch.float64, device=dev)
    offs, off = [], 0
    for i, (b, s) in enumerate(slots):
        seg = buf[off:off + s.numel]
        seg.copy_(b.flat[s.offset:s.offset + s.numel])
        buf[total + i] = torch.dot(seg, seg)
        offs.append(off)
        off += s.numel
    local_sq = buf[total:].clone()
    n = world_size
    if n > 1:
        all_reduce(buf, "replica_variance()")
    # ||mean||^2 = ||sum||^2 / n^2, without a float64 copy of the whole model (mean = buf / n) nor its square
    avg_sq = torch.stack([torch.dot(seg, seg) for seg in (buf[o:o + s.numel] for o, (_, s) in zip(offs, slots))])
    avg_sq /= n * n
    ms = buf[total:] / n
    var = (ms - avg_sq).clamp_min(0.0)
    rows = torch.stack([var, local_sq.sqrt(), ms.sqrt(), avg_sq.sqrt()], 1).tolist()
    if n > 1:
        all_reduce.let_go(buf)
    out = {}
    for (b, s), (v, nrm, rms, avgn) in zip(slots, rows):
        out[names_of[id(s.param)]] = dict(variance=v / s.numel, norm=nrm, norm_rms=rms, avg_norm=avgn, numel=s.numel)
    return out


class ReplicaWatch:
    """The optimizers' methods for watching the replicas (mixed into DecentralizedMixin, whose schedule, buckets
    and process group they read)."""

    def _announce(self, what: str, sizes: List[int]):
        """Before a collective utility's all-reduces (and before ATC's synchronize, which would wait for a round a
        rank at another step never sends): every rank raises if they are not all at this utility and step, or if the
        process group was destroyed under the optimizer (GossipExchange.check_group)."""
        finite_check.check_usable(self._schedule, what)  # raised here: not after a collective the others then wait on
        if self._schedule.exchange is not None:
            self._schedule.exchange.check_group(what)
        self._module_watch.check(what)  # the model's parameters are still the buckets' (module_watch)
        for b in self._buckets:  # the parameters a utility reads and writes are the buckets' (model.half() is not)
            adopt_storage(b, before_copy=checked_first(self._schedule.complete_transfers, self._buckets),
                          siblings=self._buckets)
        announce(self._schedule.all_reduce, what, self._schedule.t, sizes)

    @property
    def last_disagreement(self) -> float:
        """This rank's disagreement with its neighbours at the last mix: sum over all parameters of
        ||mixed - x_old||^2, mixed = sum_j W'_ij x_j (the squared distance to the neighbourhood average, scaled by
        the consensus factor), computed by the fused kernels in the same pass as the mix. Local (no
        communication); reading it waits for the device. 0.0 before the first mix or without mixing; RuntimeError when
        tracking is off (track_disagreement=False, and not an adaptive topology that needs it). In ATC
        mode it is that of the last exchange once every bucket has been mixed (the mix runs at the next step or
        in the forward pre-hooks). ``disagreement(all_reduce=True)`` gives the mean over ranks."""
        return self._schedule.meter.last()

    @torch.no_grad()
    def disagreement(self, all_reduce: bool = False, per_bucket: bool = False):
        """``last_disagreement`` (a float), or per bucket (a list, bucket order) with ``per_bucket=True``.
        ``all_reduce=True`` returns the mean over ranks (a collective: every rank must call it)."""
        out = self._schedule.meter.values(per_bucket, self._schedule.device)
        if all_reduce and self.world_size > 1:
            self._announce("disagreement(all_reduce=True)", [out.numel()])
            all_reduce_mean_(out, self._schedule.all_reduce, self.world_size, "disagreement(all_reduce=True)")
        return out.tolist() if per_bucket else float(out[0])

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for gossip so far (0 without communication)."""
        return self._schedule.bytes_sent

    @torch.no_grad()
    def replica_variance(self, every: int = 1, *, names=None) -> Optional[Dict[str, Dict[str, float]]]:
        """DBench-style per-tensor statistics of the replicas, exact, with one collective.

        Due when the number of optimizer steps taken is a multiple of ``every`` (step 0 included); returns None
        (and communicates nothing) otherwise. When due it is a collective: call it at the same point of the loop
        on every rank (the due steps then agree). ATC: the pending mix is applied first.

        Returns ``{name: {"variance", "norm", "norm_rms", "avg_norm", "numel"}}`` in param-group order:
          variance: mean over the tensor's elements of the variance across replicas,
                    (1 / (n numel)) sum_i ||x_i - xbar||^2 (sum over the tensors times numel gives the consensus
                    distance of ``consensus_distance()``);
          norm:     ||x_i||, this rank's tensor before averaging;
          norm_rms: sqrt((1/n) sum_i ||x_i||^2), the replicas' norms before averaging;
          avg_norm: ||xbar||, the norm of the averaged tensor.
        Names come from ``names`` (an nn.Module, a dict name -> parameter, or (name, parameter) pairs), else
        from the ``model`` given to the optimizer, else "group{g}.param{i}". One all-reduce of a float64 buffer
        of the parameters plus one scalar per tensor (about twice the fp32 model's bytes).
        """
        if self._schedule.t % integer(every, "every", low=1):
            return None
        self._announce("replica_variance()", [sum(len(b.slots) + b.flat.numel() for b in self._buckets)])
        self._schedule.synchronize()
        names_of = param_names(self.param_groups, names if names is not None else self._model)
        return replica_variance(self._buckets, self._param_list(), names_of, self._schedule.all_reduce,
                                self.world_size)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """(1/n) sum_i ||x_i - mean||^2 over all parameters (a collective: every rank must call it)."""
        self._announce("consensus_distance()", [b.flat.numel() for b in self._buckets] + [1])
        self._schedule.synchronize()
        return consensus_distance(self._buckets, self._schedule.all_reduce, self.world_size)
