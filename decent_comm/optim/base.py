"""The machinery every decentralized optimizer shares: flat buckets, the gossip schedule and its exchange,
AWC/ATC step orchestration, forward pre-hooks, state_dict, and the collective utilities.

Semantics (t counts optimizer steps from 0; W'(t) = (1 - a_t) I + a_t W(t)):
  awc  x_i^{t+1} = sum_j W'_ij(t) x_j^t - lr * d_i^t          (one fused kernel per bucket; the exchange
       of x^{t+1} is launched at the end of step t and overlaps the whole next forward and backward)
  atc  x_i^{t+1} = sum_j W'_ij(t) (x_j^t - lr * d_j^t)         (local update, exchange, then the mix: in a
       forward pre-hook of the first module using each bucket when `model` is given, else at the next step)

Watching and adapting the communication (see also decent_comm.topology.adaptive):
  last_disagreement / disagreement()   ||mixed - x_old||^2 of this rank, from the fused kernels' extra output
  replica_variance(every=K)            exact per-tensor variance across replicas every K steps (one collective)
  bytes_sent                           gossip bytes this rank has sent
  an Adaptive topology is decided before the plan of each step is built (AWC: at the end of the previous step,
  before its exchange is launched), from an all-reduced statistic, so every rank switches at the same step.
"""

import contextlib
import logging
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from .buckets import Bucket, build_buckets, gather_grads, segments, zero_grads
from ..topology.adaptive import Adaptive, AdaptStats
from .gossip import consensus_factor, distributed_context, make_exchanger, mix_plan, resolve_topology
from .groups import GroupAllReduce, scan_groups

log = logging.getLogger("decent_comm")

MODES = ("awc", "atc")


class DecentralizedMixin:
    """Mixed into a torch.optim.Optimizer subclass. The subclass implements `_local_update(bucket, seg_slice,
    group, step, neighbors, self_weight, weights)`, one fused kernel call over a slice of a bucket."""

    # GradScaler then calls step() even on overflow (passing grad_scale / found_inf), so a rank that skips
    # its update still keeps the exchange schedule in lockstep with its neighbours.
    _step_supports_amp_scaling = True

    def _init_decentralized(self, *, topology, mode, process_group, bucket_cap_mb, comm_dtype, consensus, model,
                            broadcast_init, timeout, track_disagreement=False, exchange="auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.process_group = process_group
        self.rank, self.world_size = distributed_context(process_group)
        self.topology = resolve_topology(topology, self.world_size)
        self.consensus = consensus
        consensus_factor(consensus, 0, self.param_groups[0]["lr"])  # validate early
        self.comm_dtype = comm_dtype
        self._buckets: List[Bucket] = build_buckets(self.param_groups, bucket_cap_mb)
        self._t = 0                      # optimizer steps taken (the topology phase)
        self._inflight = None            # MixPlan of the exchange in flight (awc: of x^t; atc: of x^{t+1/2})
        self._pending_mix: set = set()   # atc: buckets received but not yet mixed
        self._resume_factor = None       # consensus factor of step _t restored from a checkpoint
        self._recv: Dict[int, List[torch.Tensor]] = {b.index: [] for b in self._buckets}
        self._hooks = []
        self._exchanger = None
        self._groups = None              # GroupAllReduce: the steps run as one all-reduce per averaging group
        self._model = model
        self._init_disagreement(bool(track_disagreement))
        if self.world_size > 1:
            self._verify_replicas()
            if broadcast_init:
                self._broadcast_from_rank0()
            device = self._buckets[0].device if self._buckets else torch.device("cpu")
            self._exchanger = make_exchanger(process_group, device, timeout, comm_dtype)
        self._groups = GroupAllReduce.build(self.topology, process_group, self.rank, self.world_size, timeout, exchange)
        if self._groups is not None and isinstance(self.topology, Adaptive):
            self.topology.costs = self._effective_costs()
        if model is not None:
            self._register_forward_hooks(model)

    # ------------------------------------------------------------------------------------------ start-up

    def _verify_replicas(self):
        """Every rank must hold the same parameter shapes/dtypes and topology; report who differs."""
        mine = dict(
            params=[(tuple(s.param.shape), str(s.param.dtype)) for b in self._buckets for s in b.slots],
            fingerprint=self.topology.fingerprint(), mode=self.mode, optimizer=type(self).__name__,
        )
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for r, other in enumerate(everyone):
            if other == ref:
                continue
            if len(other["params"]) != len(ref["params"]):
                what = f"{len(other['params'])} parameters but rank 0 has {len(ref['params'])}"
            elif other["params"] != ref["params"]:
                i = next(i for i, (a, b) in enumerate(zip(other["params"], ref["params"])) if a != b)
                what = f"parameter {i} is {other['params'][i]} but on rank 0 it is {ref['params'][i]}"
            elif other["fingerprint"] != ref["fingerprint"]:
                what = f"topology fingerprint {other['fingerprint']} differs from rank 0's {ref['fingerprint']}"
            else:
                what = f"optimizer/mode {other['optimizer']}/{other['mode']} differs from rank 0's " \
                       f"{ref['optimizer']}/{ref['mode']}"
            raise RuntimeError(f"decent_comm: replicas disagree: rank {r}: {what}")

    def _broadcast_from_rank0(self):
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for b in self._buckets:
                dist.broadcast(b.flat, src=src, group=self.process_group)

    def _register_forward_hooks(self, model: torch.nn.Module):
        where = {id(s.param): b.index for b in self._buckets for s in b.slots}
        for module in model.modules():
            ids = sorted({where[id(p)] for p in module.parameters(recurse=False) if id(p) in where})
            if ids:
                self._hooks.append(module.register_forward_pre_hook(self._make_hook(ids)))

    def _make_hook(self, bucket_ids):
        def hook(module, args):
            if self._pending_mix:
                self._apply_pending_mix(bucket_ids)
        return hook

    # ---------------------------------------------------------------------------------------- scheduling

    def _lr0(self) -> float:
        lr = self.param_groups[0]["lr"]
        return float(lr)

    def _plan(self, step: int):
        self._adapt(step)
        # After a resume, the factor the interrupted run had already chosen for this step (from the lr in
        # effect when it launched the exchange) keeps the trajectory identical.
        if self._resume_factor is not None and step == self._t:
            a, self._resume_factor = self._resume_factor, None
        else:
            a = consensus_factor(self.consensus, step, self._lr0())
        return mix_plan(self.topology, self.rank, step, a, self._groups)

    def _recv_buffers(self, b: Bucket, k: int) -> List[torch.Tensor]:
        bufs = self._recv[b.index]
        while len(bufs) < k:
            bufs.append(torch.empty(b.numel, dtype=self.comm_dtype or b.dtype, device=b.device))
        return bufs[:k]

    def _launch(self, plan):
        """Starts the exchange of every bucket's current flat buffer for `plan` (same order on all ranks)."""
        if plan.group is not None:
            with torch.no_grad():
                for b in self._buckets:
                    total = self._recv_buffers(b, 1)[0]
                    total.copy_(b.flat)  # the all-reduce sums in place (in comm_dtype when one is set)
                    self._groups.start(b.index, total, plan.group)
        elif self._exchanger is not None and not plan.silent:
            with torch.no_grad():
                for b in self._buckets:
                    self._exchanger.exchange(b.index, b.flat, self._recv_buffers(b, len(plan.recv)), plan.send,
                                             plan.recv)
        self._inflight = plan

    def _wait(self, b: Bucket, plan) -> List[torch.Tensor]:
        if plan.group is not None:
            self._groups.wait(b.index)
        elif self._exchanger is not None and not plan.silent:
            self._exchanger.wait(b.index)
        return self._recv_buffers(b, plan.num_buffers) if plan.num_buffers else []

    def _apply_pending_mix(self, bucket_ids=None):
        """ATC: mix the received half-step buffers into the parameters (all pending, or those listed)."""
        plan = self._inflight
        ids = list(self._pending_mix) if bucket_ids is None else [i for i in bucket_ids if i in self._pending_mix]
        if ids and self._atc_fresh:  # the first bucket of this exchange: a new disagreement measurement
            self._begin_disagreement()
            self._atc_fresh = False
        with torch.no_grad():
            for i in ids:
                b = self._buckets[i]
                nbs = self._wait(b, plan)
                ops.gossip_mix_(b.flat, nbs, plan.self_weight, plan.weights, disagreement=self._dis_slot(b, 0))
                self._pending_mix.discard(i)
        if ids and not self._pending_mix:
            self._end_disagreement(plan)

    # ---------------------------------------------------------------------------------------------- step

    def _amp_unscale_and_check(self) -> bool:
        """GradScaler protocol: unscale when asked, and tell whether this step's update must be skipped."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return True
        if grad_scale is not None:
            inv = 1.0 / grad_scale.double() if torch.is_tensor(grad_scale) else 1.0 / grad_scale
            for b in self._buckets:
                b.grad.mul_(inv.to(b.grad.device) if torch.is_tensor(inv) else inv)
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for b in self._buckets:
            gather_grads(b)
        skip_update = self._amp_unscale_and_check()
        if self.mode == "awc":
            self._step_awc(skip_update)
        else:
            self._step_atc(skip_update)
        return loss

    def _update_bucket(self, b: Bucket, neighbors, self_weight, weights, skip_update: bool):
        """One fused call per segment of the bucket: update where gradients exist, plain mix elsewhere. When
        mixing and tracking, segment k's disagreement goes to the bucket's slot k."""
        group = self.param_groups[b.group_index]
        mixing = bool(neighbors) or self_weight != 1.0
        for k, seg in enumerate(segments(b, b.steps)):
            sl = slice(seg.start, seg.stop)
            nbs = [y[sl] for y in neighbors]
            dis = self._dis_slot(b, k) if mixing else None
            if seg.has_grad and not skip_update:
                self._local_update(b, sl, group, seg.step, nbs, self_weight, weights, disagreement=dis)
            elif mixing:
                ops.gossip_mix_(b.flat[sl], nbs, self_weight, weights, disagreement=dis)
        if not skip_update:
            for i, s in enumerate(b.slots):
                if s.param.grad is not None:
                    b.steps[i] += 1

    def _step_awc(self, skip_update: bool):
        plan = self._inflight
        if plan is None or plan.step != self._t:
            plan = self._plan(self._t)
            self._launch(plan)
        measure = self._wants_step_sq(self._t + 1)  # the decision for step t+1 is taken at the end of this one
        self._begin_disagreement()
        step_sq = []
        for b in self._buckets:
            nbs = self._wait(b, plan)
            ref = None
            if measure:  # the mixed point, so that x^{t+1} - ref is the local update alone
                ref = b.flat.clone()
                if nbs or plan.self_weight != 1.0:
                    ops.gossip_mix_(ref, nbs, plan.self_weight, plan.weights)
            self._update_bucket(b, nbs, plan.self_weight, plan.weights, skip_update)
            if measure:
                step_sq.append(self._sq_dist(b.flat, ref))
        self._end_disagreement(plan)
        if measure:
            self._step_sq = self._sum_scalars(step_sq)
        self._t += 1
        self._launch(self._plan(self._t))

    def _step_atc(self, skip_update: bool):
        if self._pending_mix:
            self._apply_pending_mix()
        measure = self._wants_step_sq(self._t)  # decided below, before this step's exchange
        step_sq = []
        for b in self._buckets:
            ref = b.flat.clone() if measure else None
            self._update_bucket(b, [], 1.0, [], skip_update)
            if measure:
                step_sq.append(self._sq_dist(b.flat, ref))
        if measure:
            self._step_sq = self._sum_scalars(step_sq)
        plan = self._plan(self._t)
        self._launch(plan)
        if plan.recv or plan.self_weight != 1.0:
            self._pending_mix = {b.index for b in self._buckets}
            self._atc_fresh = True
        self._t += 1

    # ---------------------------------------------------------------------------------------- disagreement

    def _init_disagreement(self, track: bool):
        """Per device, one float32 scratch with a slot per (bucket, segment): the fused kernels write each
        call's sum((mixed - x_old)^2) there in the same pass as the mix, and nothing is read back unless asked."""
        self._adaptive_stats = isinstance(self.topology, Adaptive) and self.topology.policy.needs_stats
        self.track_disagreement = bool(track) or self._adaptive_stats
        self._dis_buf: Dict[torch.device, torch.Tensor] = {}
        self._dis_off: Dict[int, int] = {}
        self._dis_valid = False      # a mix has been measured
        self._atc_fresh = False      # atc: the next pending mix starts a new measurement
        self._step_sq = None         # ||local update||^2 of the last step, when a decision needs it
        self._adapt_sum = None       # sum over mixes since the last decision of the consensus estimate (device)
        self._adapt_count = 0.0      # number of those mixes
        if self.track_disagreement:
            sizes: Dict[torch.device, int] = {}
            for b in self._buckets:
                self._dis_off[b.index] = sizes.get(b.device, 0)
                sizes[b.device] = sizes.get(b.device, 0) + max(1, len(b.slots))
            self._dis_buf = {d: torch.zeros(n, dtype=torch.float32, device=d) for d, n in sizes.items()}

    def _dis_slot(self, b: Bucket, k: int):
        if not self.track_disagreement:
            return None
        off = self._dis_off[b.index] + k
        return self._dis_buf[b.device][off:off + 1]

    def _begin_disagreement(self):
        if self.track_disagreement:
            for buf in self._dis_buf.values():
                buf.zero_()

    def _dis_total(self) -> torch.Tensor:
        parts = [buf.sum() for buf in self._dis_buf.values()]
        if not parts:
            return torch.zeros(())
        total = parts[0]
        for p in parts[1:]:
            total = total + p.to(total.device)
        return total

    def _end_disagreement(self, plan):
        """A mix is complete: accumulate the adaptive topology's consensus estimate (on the device, no sync)."""
        if not self.track_disagreement:
            return
        self._dis_valid = True
        if self._adaptive_stats:
            group = getattr(plan, "group", None)
            if group is not None:  # row of (1 - a) I + a W with uniform weight 1/|G| on the group's members
                c = plan.factor ** 2 * (len(group) - 1) / len(group)
            else:
                c = (1.0 - plan.self_weight) ** 2 + sum(w * w for w in plan.weights)
            if c > 0:
                est = self._dis_total().double() * ((self.world_size - 1) / self.world_size / c)
                self._adapt_sum = est if self._adapt_sum is None else self._adapt_sum + est
                self._adapt_count += 1.0
        if log.isEnabledFor(logging.DEBUG):  # reading the value synchronizes with the device: only when asked
            log.debug("decent_comm: step %d: local disagreement %.6g", plan.step, float(self._dis_total()))

    @property
    def last_disagreement(self) -> float:
        """This rank's disagreement with its neighbours at the last mix: sum over all parameters of
        ||mixed - x_old||^2, mixed = sum_j W'_ij x_j (the squared distance to the neighbourhood average, scaled by
        the consensus factor), computed by the fused kernels in the same pass as the mix. Local (no
        communication); reading it waits for the device. 0.0 before the first mix or without mixing. In ATC
        mode it is that of the last exchange once every bucket has been mixed (the mix runs at the next step or
        in the forward pre-hooks). ``disagreement(all_reduce=True)`` gives the mean over ranks."""
        if not self.track_disagreement or not self._dis_valid:
            return 0.0
        return float(self._dis_total())

    @torch.no_grad()
    def disagreement(self, all_reduce: bool = False, per_bucket: bool = False):
        """``last_disagreement`` (a float), or per bucket (a list, bucket order) with ``per_bucket=True``.
        ``all_reduce=True`` returns the mean over ranks (a collective: every rank must call it)."""
        if not self.track_disagreement:
            raise RuntimeError("disagreement tracking is off (track_disagreement=False)")
        dev = self._buckets[0].device if self._buckets else torch.device("cpu")
        if per_bucket:
            vals = [self._dis_buf[b.device][self._dis_off[b.index]:self._dis_off[b.index] + max(1, len(b.slots))]
                    .sum().to(dev) for b in self._buckets]
            out = torch.stack(vals).double() if vals else torch.zeros(0, dtype=torch.float64, device=dev)
        else:
            out = self._dis_total().double().to(dev).reshape(1)
        if not self._dis_valid:
            out.zero_()
        if all_reduce and self.world_size > 1:
            self._all_reduce_mean_(out)
        return out.tolist() if per_bucket else float(out[0])

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for gossip so far (0 without communication)."""
        sent = int(self._exchanger.bytes_sent) if self._exchanger is not None else 0
        return sent + (self._groups.bytes_sent if self._groups is not None else 0)

    # ---------------------------------------------------------------------------------- adaptive topology

    @staticmethod
    def _sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """||a - b||^2 as a float64 device scalar (accumulated in float32 for lower-precision storage)."""
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        return torch.linalg.vector_norm(a - b, dtype=acc).double() ** 2

    @staticmethod
    def _sum_scalars(vals):
        if not vals:
            return None
        total = vals[0]
        for v in vals[1:]:
            total = total + v.to(total.device)
        return total

    def _wants_step_sq(self, decision_step: int) -> bool:
        """Whether the step about to run must measure ||local update||^2 for a decision at decision_step."""
        return (self._adaptive_stats and decision_step > self.topology.decided
                and self.topology.policy.due(decision_step))

    def _adapt(self, step: int):
        """Adaptive topology: decides the candidate of `step` (same inputs, hence same result, on every rank)."""
        if not isinstance(self.topology, Adaptive):
            return
        before = self.topology.current_name
        if self.topology.advance(step, lambda: self._collect_adapt_stats(step)):
            log.info("decent_comm: step %d: topology %s -> %s%s", step, before, self.topology.current_name,
                     "" if getattr(self.topology.policy, "last", None) is None
                     else " (q = %.3g)" % self.topology.policy.last[0])
            self._trim_recv_buffers()

    def _adapt_local_stats(self) -> torch.Tensor:
        """[sum of consensus estimates since the last decision, their count, ||update||^2, lr] of this rank."""
        dev = self._buckets[0].device if self._buckets else torch.device("cpu")
        out = torch.zeros(4, dtype=torch.float64, device=dev)
        if self._adapt_sum is not None:
            out[0] = self._adapt_sum.to(dev)
        out[1] = self._adapt_count
        if self._step_sq is not None:
            out[2] = self._step_sq.to(dev)
        out[3] = self._lr0()
        return out

    def _collect_adapt_stats(self, step: int) -> AdaptStats:
        """One all-reduce of the four scalars: every rank gets the same statistics, hence the same decision."""
        local = self._adapt_local_stats()
        if self.world_size > 1:
            dist.all_reduce(local, group=self.process_group)
        total, count, step_sq, lr = local.tolist()
        n = self.world_size
        self._adapt_sum, self._adapt_count, self._step_sq = None, 0.0, None
        return AdaptStats(step=step, lr=lr / n, consensus_sq=total / count if count > 0 else 0.0,
                          step_sq=step_sq / n, window=count)

    def _effective_costs(self) -> List[float]:
        """Per candidate, buffers moved per rank and step (mean over ranks and the period, the same on every
        rank): 2 (|G| - 1) / |G| for a group all-reduce step, one per send peer otherwise."""
        n, out = self.world_size, []
        for cand in self.topology.candidates:
            table = scan_groups(cand, n)
            steps = range(min(cand.period, 64))
            total = 0.0
            for t in steps:
                size = {r: len(g) for g in table.get(t, []) for r in g}
                total += sum(2 * (size[r] - 1) / size[r] if r in size else len(cand.peers(r, t).send)
                             for r in range(n))
            out.append(total / (n * len(steps)))
        return out

    def _trim_recv_buffers(self):
        """After a switch, drop receive buffers the new candidate never needs (a dense graph holds many)."""
        start = self.topology.decided
        topo = self.topology.topology_at(start)
        need = max(1 if self._groups is not None and self._groups.group_of(t) is not None
                   else len(topo.peers(self.rank, t).recv) for t in range(start, start + min(topo.period, 64)))
        for bufs in self._recv.values():
            del bufs[need:]

    def _adaptive_state(self):
        if not isinstance(self.topology, Adaptive):
            return None
        return dict(topology=self.topology.state_dict(),
                    sum=float(self._adapt_sum) if self._adapt_sum is not None else None, count=self._adapt_count)

    def _load_adaptive_state(self, state):
        if state is None or not isinstance(self.topology, Adaptive):
            return
        self.topology.load_state_dict(state["topology"])
        dev = self._buckets[0].device if self._buckets else torch.device("cpu")
        self._adapt_sum = None if state["sum"] is None else torch.tensor(state["sum"], dtype=torch.float64, device=dev)
        self._adapt_count = float(state["count"])
        self._step_sq = None

    # ------------------------------------------------------------------------------------ replica variance

    def _param_names(self, names) -> Dict[int, str]:
        src = names if names is not None else self._model
        by_id: Dict[int, str] = {}
        if src is not None:
            if isinstance(src, torch.nn.Module):
                items = src.named_parameters()
            elif isinstance(src, dict):
                items = src.items()
            else:
                items = src
            for name, p in items:
                by_id[id(p)] = name
        out = {}
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                out[id(p)] = by_id.get(id(p), f"group{gi}.param{pi}")
        return out

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
        if self._t % int(every):
            return None
        self.synchronize()
        order = {id(p): k for k, p in enumerate(self._param_list())}
        slots = sorted(((b, s) for b in self._buckets for s in b.slots), key=lambda bs: order[id(bs[1].param)])
        if not slots:
            return {}
        dev = self._buckets[0].device
        total = sum(s.numel for _, s in slots)
        buf = torch.empty(total + len(slots), dtype=torch.float64, device=dev)
        offs, off = [], 0
        for i, (b, s) in enumerate(slots):
            seg = buf[off:off + s.numel]
            seg.copy_(b.flat[s.offset:s.offset + s.numel])
            buf[total + i] = seg.square().sum()
            offs.append(off)
            off += s.numel
        local_sq = buf[total:].clone()
        n = self.world_size
        if n > 1:
            dist.all_reduce(buf, group=self.process_group)
        mean = buf[:total] / n
        avg_sq = torch.stack([mean[o:o + s.numel].square().sum() for o, (_, s) in zip(offs, slots)])
        ms = buf[total:] / n
        var = (ms - avg_sq).clamp_min(0.0)
        rows = torch.stack([var, local_sq.sqrt(), ms.sqrt(), avg_sq.sqrt()], 1).tolist()
        names_of = self._param_names(names)
        out = {}
        for (b, s), (v, nrm, rms, avgn) in zip(slots, rows):
            out[names_of[id(s.param)]] = dict(variance=v / s.numel, norm=nrm, norm_rms=rms, avg_norm=avgn,
                                              numel=s.numel)
        return out

    # ------------------------------------------------------------------------------------------ grad utils

    def zero_grad(self, set_to_none: bool = True):
        for b in self._buckets:
            zero_grads(b, set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Local gradient-norm clipping over the flat gradient buffers (torch.nn.utils.clip_grad_norm_
        semantics; parameters without a gradient are ignored)."""
        norms = []
        for b in self._buckets:
            gather_grads(b)
            for seg in segments(b, b.steps):
                if seg.has_grad:
                    norms.append(torch.linalg.vector_norm(b.grad[seg.start:seg.stop], norm_type))
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b in self._buckets:
            b.grad.mul_(coef.to(b.grad.device, b.grad.dtype))
        return total

    # ---------------------------------------------------------------------------------------- collectives

    def synchronize(self):
        """Completes all pending communication. In ATC mode it applies the pending mix, so the parameters
        are exactly x^{t+1}. In AWC mode the received x^t of the neighbours stays valid for the next step."""
        if self.mode == "atc" and self._pending_mix:
            self._apply_pending_mix()
        self._complete_transfers()

    def _complete_transfers(self):
        """Blocks until every exchange and group all-reduce in flight has completed (their data stays valid)."""
        if self._exchanger is not None:
            self._exchanger.synchronize()
        if self._groups is not None:
            self._groups.wait_all()

    def _all_reduce_mean_(self, t: torch.Tensor):
        dist.all_reduce(t, group=self.process_group)
        t.div_(self.world_size)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """(1/n) sum_i ||x_i - mean||^2 over all parameters (a collective: every rank must call it)."""
        self.synchronize()
        if self.world_size == 1:
            return 0.0
        total = torch.zeros((), dtype=torch.float64, device=self._buckets[0].device)
        for b in self._buckets:
            x = b.flat.double()
            mean = x.clone()
            self._all_reduce_mean_(mean)
            total += ((x - mean) ** 2).sum()
        dist.all_reduce(total, group=self.process_group)
        return float(total) / self.world_size

    @contextlib.contextmanager
    def global_average(self):
        """Swaps in the exact global average of the replicas (for evaluation or saving) and restores each
        rank's own parameters on exit. A collective: every rank must enter it."""
        self.synchronize()
        saved = [b.flat.clone() for b in self._buckets]
        try:
            self._average_()
            yield self
        finally:
            with torch.no_grad():
                for b, s in zip(self._buckets, saved):
                    b.flat.copy_(s)

    def average_parameters(self):
        """Permanently replaces every replica by the global average (e.g. before final evaluation)."""
        self.synchronize()
        self._average_()
        self._inflight = None  # what neighbours sent before the average is stale now

    @torch.no_grad()
    def _average_(self):
        if self.world_size > 1:
            for b in self._buckets:
                self._all_reduce_mean_(b.flat)

    # ---------------------------------------------------------------------------------------- state_dict

    def _param_list(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _slot_of(self):
        return {id(s.param): (b, i) for b in self._buckets for i, s in enumerate(b.slots)}

    def state_dict(self):
        self.synchronize()
        slot_of = self._slot_of()
        for p in self._param_list():
            b, i = slot_of[id(p)]
            if b.steps[i] > 0:  # torch.optim semantics: state only for parameters that were updated
                st = self.state[p]
                for name in b.state:
                    st[name] = b.view(b.state[name], b.slots[i])
                st["step"] = torch.tensor(float(b.steps[i]))
        sd = super().state_dict()
        # atc: the in-flight plan is of step _t - 1 and already applied; awc: of step _t, still to be used
        next_plan = self._inflight if self._inflight is not None and self._inflight.step == self._t else None
        sd["decentralized"] = dict(
            step=self._t, next_factor=next_plan.factor if next_plan is not None else None, topology=self.topology.fingerprint(), mode=self.mode, world_size=self.world_size,
            rank=self.rank,
            consensus=self.consensus.state_dict() if hasattr(self.consensus, "state_dict") else None,
            adaptive=self._adaptive_state(),
        )
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        saved_state = state_dict.get("state", {})
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        slot_of = self._slot_of()
        with torch.no_grad():
            for idx, p in enumerate(self._param_list()):
                st = saved_state.get(idx, saved_state.get(str(idx)))
                if not st:
                    continue
                b, i = slot_of[id(p)]
                for name, value in st.items():
                    if name == "step":
                        b.steps[i] = int(value)
                        continue
                    view = b.view(b.state_buffer(name), b.slots[i])
                    view.copy_(value)
                    self.state[p][name] = view
        self._restore_schedule(extra)

    def _restore_schedule(self, extra):
        """Restores the step counter, consensus state and the pending exchange from a checkpoint's extras."""
        if extra is not None:
            if extra["topology"] != self.topology.fingerprint():
                raise ValueError("the checkpoint was written with another topology (fingerprint "
                                 f"{extra['topology']}, this optimizer has {self.topology.fingerprint()})")
            self._t = int(extra["step"])
            self._resume_factor = extra.get("next_factor")
            if extra.get("consensus") is not None and hasattr(self.consensus, "load_state_dict"):
                self.consensus.load_state_dict(extra["consensus"])
            self._load_adaptive_state(extra.get("adaptive"))
        # Whatever was in flight carried the old parameters: start the next exchange afresh.
        self._complete_transfers()
        self._inflight = None
        self._pending_mix = set()
        self._atc_fresh = False

    # ----------------------------------------------------------------------------------------- teardown

    def shutdown(self):
        """Completes pending communication and releases the exchanger (call before destroying the group)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._complete_transfers()
        if self._exchanger is not None:
            self._exchanger.shutdown()
            self._exchanger = None
