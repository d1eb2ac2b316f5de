"""What the optimizers report about the replicas: the disagreement the fused kernels measure in the same pass
as the mix, and the exact collective statistics (consensus distance, per-tensor replica variance)."""

import logging
from typing import Dict, List, Optional

import torch

from ..exchange import CollectiveMismatch, ranks_text
from .buckets import adopt_storage
from .device_scalars import sum_scalars

log = logging.getLogger("decent_comm")


class DisagreementMeter:
    """Per device, one float32 scratch with a slot per (bucket, segment): the fused kernels write each call's
    sum((mixed - x_old)^2) there in the same pass as the mix, and nothing is read back unless asked."""

    def __init__(self, buckets, enabled: bool):
        self.enabled = bool(enabled)
        self._buckets = buckets
        self._buf: Dict[torch.device, torch.Tensor] = {}
        self._off: Dict[int, int] = {}
        self.valid = False  # a mix has been measured
        if self.enabled:
            sizes: Dict[torch.device, int] = {}
            for b in buckets:
                self._off[b.index] = sizes.get(b.device, 0)
                sizes[b.device] = sizes.get(b.device, 0) + max(1, len(b.slots))
            self._buf = {d: torch.zeros(n, dtype=torch.float32, device=d) for d, n in sizes.items()}

    def slot(self, b, k: int) -> Optional[torch.Tensor]:
        """The 1-element output of segment k of bucket b, or None when not tracking."""
        if not self.enabled:
            return None
        off = self._off[b.index] + k
        return self._buf[b.device][off:off + 1]

    def begin(self):
        for buf in self._buf.values():
            buf.zero_()

    def total(self) -> torch.Tensor:
        """Sum over every slot, as a device scalar (no host sync)."""
        total = sum_scalars([buf.sum() for buf in self._buf.values()])
        return torch.zeros(()) if total is None else total

    def finish(self, step: int):
        """A mix is complete: its value is the one reported from now on."""
        if not self.enabled:
            return
        self.valid = True
        if log.isEnabledFor(logging.DEBUG):  # reading the value synchronizes with the device: only when asked
            log.debug("decent_comm: step %d: local disagreement %.6g", step, float(self.total()))

    def last(self) -> float:
        return float(self.total()) if self.enabled and self.valid else 0.0

    def values(self, per_bucket: bool, device) -> torch.Tensor:
        """float64 on `device`: the total (shape [1]) or one entry per bucket; zeros before the first mix."""
        if not self.enabled:
            raise RuntimeError("disagreement tracking is off (track_disagreement=False)")
        if per_bucket:
            vals = [self._buf[b.device][self._off[b.index]:self._off[b.index] + max(1, len(b.slots))].sum().to(device)
                    for b in self._buckets]
            out = torch.stack(vals).double() if vals else torch.zeros(0, dtype=torch.float64, device=device)
        else:
            out = self.total().double().to(device).reshape(1)
        if not self.valid:
            out.zero_()
        return out


def all_reduce_mean_(t: torch.Tensor, all_reduce, world_size: int, what: str):
    """`all_reduce`: the schedule's BoundedAllReduce (held to the optimizer's timeout); `what` names the call in
    its errors."""
    all_reduce(t, what)
    t.div_(world_size)


def announce(all_reduce, what: str, step: int, sizes: List[int], evaluation: Optional[int] = None) -> None:
    """Before the optimizer's whole-group all-reduces of `sizes` elements (a step's or a utility's): every rank
    checks that every rank is about to run the same ones, after the same number of optimizer steps
    (BoundedAllReduce.agree), and raises RuntimeError naming the ranks otherwise, before any of them is posted.

    Gossip cannot see it: a rank that calls step() once more than the others (an uneven last batch) pairs each later
    round with its neighbours' previous one, same sizes and tags, so nothing fails and the replicas mix rounds of
    different steps; and whole-group all-reduces out of step would pair tensors of different calls (gloo aborts the
    process on unequal sizes).

    `evaluation`: the wrapped optimizer's closure evaluation of this step (1 for the first) whose gradients the
    warm-up averages (Decentralized): ranks that evaluate it a different number of times are named as such."""
    if all_reduce is None:
        return
    try:
        all_reduce.agree(what, step, sizes, sub=evaluation)
    except CollectiveMismatch as e:
        sides = e.sides
        uneven = _uneven_evaluations(sides)
        if uneven:
            raise RuntimeError(f"decent_comm: {what}: {uneven}") from e
        known = [v for v in sides.values() if v is not None]
        if len(known) == len(sides) and len({(v[0], v[2], v[3]) for v in known}) == 1:
            by_count: Dict[int, List[int]] = {}
            for r, v in sides.items():
                by_count.setdefault(v[1], []).append(r)
            seen = "; ".join(f"{ranks_text(rs)}: {c} steps" for c, rs in sorted(by_count.items(), reverse=True))
            problem = f"the ranks have taken different numbers of optimizer steps ({seen})"
        else:
            same_call = len(known) == len(sides) and len({(v[0], v[1]) for v in known}) == 1
            seen = "; ".join(f"rank {r}: " + (f"{v[0]} after {v[1]} steps" if v is not None else "(unknown)")
                             + (f" ({v[2]} tensors, {v[3]} elements)" if same_call else "") for r, v in sides.items())
            problem = f"the ranks are not running the same whole-group all-reduce ({seen})"
        raise RuntimeError(f"decent_comm: {what}: {problem}. Every rank must call step() equally often (e.g. drop an "
                           "uneven last batch on every rank), use a GradScaler on every rank or on none, and call the "
                           "collective utilities together; gossip between ranks at different steps mixes neighbours' "
                           "parameters of other steps") from e


def _uneven_evaluations(sides) -> str:
    """The error's words when the sides of a mismatch (CollectiveMismatch.sides) are ranks whose wrapped optimizer
    evaluated a warm-up step's closure a different number of times, else "". Every earlier announcement agreed, so
    the ranks at a k-th evaluation (k > 1) of step t are all at that one, and every other rank stopped after k - 1
    (it went on to the next step, or to another call)."""
    if any(v is None for v in sides.values()):
        return ""
    further = [(v[1], v[4]) for v in sides.values() if len(v) > 4 and v[4] > 1]
    if not further:
        return ""
    step, k = further[0]
    at = [r for r, v in sides.items() if len(v) > 4 and (v[1], v[4]) == (step, k)]
    stopped = [r for r in sides if r not in at]
    if not stopped:  # all at the same evaluation: they differ in something else (sizes)
        return ""
    return (f"the wrapped optimizer evaluated the closure a different number of times on the ranks in warm-up step "
            f"{step} ({ranks_text(at)}: {k} times or more; {ranks_text(stopped)}: {k - 1} "
            f"time{'s' if k > 2 else ''}). In a warm-up step every evaluation's gradients are averaged over the ranks, "
            "as DDP's backward does, so every rank must evaluate the closure equally often; an optimizer that decides "
            "from this rank's own loss when to stop (LBFGS's tolerance_change, its strong_wolfe line search) may stop "
            "earlier on one rank. Make the number of evaluations the same on every rank (LBFGS: line_search_fn=None "
            "and tolerance_change=0, so that max_iter, max_eval and the averaged gradient decide it), or use "
            "warmup_steps=0 with such an optimizer (warming up first, if wanted, with another optimizer wrapped)")


_CHUNK = 1 << 20  # elements per temporary of the collective utilities (8 MiB in float64)


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
        if self._schedule.exchange is not None:
            self._schedule.exchange.check_group(what)
        for b in self._buckets:  # the parameters a utility reads and writes are the buckets' (model.half() is not)
            adopt_storage(b, before_copy=self._schedule.complete_transfers, siblings=self._buckets)
        announce(self._schedule.all_reduce, what, self._schedule.t, sizes)

    @property
    def last_disagreement(self) -> float:
        """This rank's disagreement with its neighbours at the last mix: sum over all parameters of
        ||mixed - x_old||^2, mixed = sum_j W'_ij x_j (the squared distance to the neighbourhood average, scaled by
        the consensus factor), computed by the fused kernels in the same pass as the mix. Local (no
        communication); reading it waits for the device. 0.0 before the first mix or without mixing. In ATC
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
        if isinstance(every, bool) or int(every) != every or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if self._schedule.t % int(every):
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


def log_setup(schedule) -> None:
    """One DEBUG line per rank saying how this optimizer will gossip, so that `logging.DEBUG` shows which path a
    run took (point to point or group all-reduce, which wire) without reading the code."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    topo, buckets = schedule.topology, schedule.buckets
    if schedule.world_size == 1:
        path = "a single rank: no gossip"
    elif schedule.group_steps is not None:
        groups = len(schedule.group_steps.all_groups)
        path = f"group all-reduce on the steps that average in groups of >= 3 ranks ({groups} group(s)), point " \
               f"to point otherwise"
    else:
        path = "point to point"
    wire = "int8 with error feedback" if schedule.int8_wire is not None else \
        str(schedule.comm_dtype or "the parameters' dtype").replace("torch.", "")
    log.debug("decent_comm: rank %d of %d: topology %s (period %d), mode %s, wire %s, %s; %d parameter element(s) in "
              "%d bucket(s) of %d elements", schedule.rank, schedule.world_size,
              getattr(topo, "current_name", topo.name), topo.period, schedule.mode, wire, path,
              sum(s.numel for b in buckets for s in b.slots), len(buckets), sum(b.numel for b in buckets))
