"""``GossipSchedule``: the gossip half of a decentralized optimizer, held by the fused optimizers and by
``Decentralized`` alike (as torch's PostLocalSGDOptimizer holds a model averager).

It turns the topology into a per-step ``MixPlan`` (consensus factor, averaging-group steps, adaptive
decisions), launches each step's exchange of the buckets, hands out what arrived, applies ATC's pending mixes
(at the next step, or in forward pre-hooks just before the first module using a bucket), measures the
disagreement of each mix, and saves / restores where the schedule stands. It computes no optimizer update.

    t         steps taken (the topology phase)            inflight  the plan whose exchange was launched last
    awc: step t waits for the exchange of x^t launched at the end of step t - 1, mixes it inside the fused
         update, then launches the exchange of x^{t+1}.
    atc: step t updates locally, launches the exchange of x^{t+1/2} and leaves its mix pending: forward
         pre-hooks apply it just before the first module using each bucket runs; a bucket no hook covers is
         mixed at the end of the step.
    awc with cadence.delayed_mix: the step of round r mixes in round r - 1's exchange as a correction, then
         launches round r's exchange of a copy z of x^{t+1}, which stays in flight until round r + 1.

A lossy wire (bf16/fp16 below the buckets' dtype) mixes point-to-point steps in difference form and sums group
steps in the buckets' dtype (wire_buffers.py says why).
"""

import logging
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from ..exchange import BoundedAllReduce, GossipExchange, detached
from ..topology import Adaptive
from . import finite_check, fork_guard
from .adaptation import AdaptiveDriver
from .int8_wire import Int8Wire
from .interrupts import HeldInterrupt
from .meter import DisagreementMeter
from .mix_hooks import MixBeforeUse
from .param_versions import check_before_mix, note_landed, written
from .plan import Cadence, GroupSteps, MixInputs, MixPlan, check_mix_width, consensus_factor, mix_plan
from .schedule_state import CORRECTION, ScheduleCheckpoint
from .tracing import log_setup, traced
from .warmup import WarmupAverage
from .wire_buffers import WireBuffers

log = logging.getLogger(__name__)

MODES = ("awc", "atc")


class GossipSchedule(ScheduleCheckpoint):
    def __init__(self, buckets, topology, *, mode: str, rank: int, world_size: int, process_group, consensus,
                 lr: Callable[[], float], comm_dtype=None, timeout=None, exchange: str = "auto",
                 track_disagreement: bool = False, check_finite: bool = False, cadence: Cadence = Cadence()):
        self.buckets = buckets
        self.topology = topology
        self.mode = mode
        self.rank, self.world_size = rank, world_size
        self.process_group = process_group
        self.consensus = consensus
        self._lr = lr
        self.comm_dtype = comm_dtype
        self.check_finite = bool(check_finite)
        self.cadence = cadence
        self.t = 0                       # optimizer steps taken (the topology phase)
        self.inflight: Optional[MixPlan] = None  # awc: the plan of x^t; atc: of x^{t+1/2}
        self.pending = set()             # atc: buckets received but not yet mixed
        self._fresh = False              # atc: the next pending mix starts a new disagreement measurement
        self._resume_factor = None       # (step, factor): the consensus factor a checkpoint saved for that step's round
        self._restored = False           # delayed_mix: a checkpoint's correction (b.state[CORRECTION]) is due
        self._checkpointed = False       # delayed_mix: the last checkpoint_correction() found a round in flight
        self._wire_round = None          # int8 wire: (step, factor) of the round in flight at the last checkpoint
        self._wire_restored = False      # int8 wire: inflight is a checkpoint's round, nothing to wait for
        self._hooks = None               # atc: MixBeforeUse
        self._shut_down = False          # shutdown() released the exchange: no more steps
        self.mix_error = None            # atc: the error of a mix still pending (mix_pending)
        self.failed = None               # check_finite's first error: every later call raises it (finite_check)
        self.device = buckets[0].device if buckets else torch.device("cpu")
        # comm_dtype=torch.int8: public copies and quantized deltas, point to point (decent_comm.optim.int8_wire)
        self.int8_wire = Int8Wire(topology, rank) if comm_dtype == torch.int8 else None
        self.buffers = WireBuffers(buckets, comm_dtype, self.int8_wire)
        self.group_steps = GroupSteps.scan(topology, rank, world_size, "p2p" if comm_dtype == torch.int8 else exchange)
        if self.group_steps is not None and process_group is not None and \
                dist.get_world_size(process_group) != dist.get_world_size():
            # dist.new_group needs every rank of the default group, which a sub-group's ranks cannot promise.
            log.info("decent_comm: group all-reduce needs the default process group; gossip stays point to point")
            self.group_steps = None
        check_mix_width(topology, rank, world_size, self.group_steps,
                        int(self.int8_wire is not None or cadence.delayed_mix or self.buffers.lossy),
                        ops.MAX_NEIGHBORS)
        self.exchange = None
        if world_size > 1:
            self.exchange = GossipExchange(process_group, self.device, timeout=timeout,
                                           wire_dtype=comm_dtype if self.int8_wire is None else None,
                                           groups=self.group_steps.all_groups if self.group_steps is not None else ())
        # The whole-group all-reduces (warm-up gradients, adaptive statistics, global_average, ...) raise within
        # `timeout` like the gossip does, instead of waiting for the process group's own (gloo: 30 min).
        self.all_reduce = BoundedAllReduce(process_group, timeout=timeout, device=self.device,
                                           owner="optimizer") if world_size > 1 else None
        if self.exchange is not None:  # a rank that stops on one stops on both, for the ranks waiting on the other
            self.exchange.add_companion(self.all_reduce)
            self.all_reduce.add_companion(self.exchange)
        self.warmup = WarmupAverage(buckets, self.all_reduce, world_size, self.device, self.check_finite,
                                    cadence) if world_size > 1 else None
        self.adaptive = None
        if isinstance(topology, Adaptive):
            self.adaptive = AdaptiveDriver(topology, self.all_reduce, world_size, self.device, lr)
            if self.group_steps is not None:  # what each candidate moves per step (group sums: the buckets' dtype)
                width = self.buffers.group_width(buckets)
                topology.costs = [self.group_steps.buffers_per_rank(i, world_size, group_width=width)
                                  for i in range(len(topology.candidates))]
        if self.int8_wire is not None and self.adaptive is None:  # an adaptive topology's copies come as it decides
            self.int8_wire.allocate_copies(buckets)
        self.meter = DisagreementMeter(buckets, track_disagreement or (self.adaptive is not None
                                                                       and self.adaptive.needs_stats))
        log_setup(self)

    # ------------------------------------------------------------------------------------------ planning

    def plan(self, step: int) -> MixPlan:
        resumed = self._take_resume_factor(step)
        r = self.cadence.round_of(step)
        if r is None:  # a warm-up (gradient all-reduce) or local step
            return MixPlan(step, 1.0, [], [], [], 1.0)
        if self.adaptive is not None and self.adaptive.decide(r):
            self._trim_recv_buffers()
        a = resumed if resumed is not None else consensus_factor(self.consensus, step, self._lr())
        return mix_plan(self.topology, self.rank, step, a, self.group_steps, topo_step=r)

    def wants_step_sq(self, decision_step: int) -> bool:
        r = self.cadence.round_of(decision_step)
        return self.adaptive is not None and r is not None and self.adaptive.wants_step_sq(r)

    def record_step_sq(self, value: Optional[torch.Tensor]):
        if self.adaptive is not None and value is not None:
            self.adaptive.record_step_sq(value)

    def average_gradients(self, step: int, found_inf: Optional[torch.Tensor] = None,
                          evaluation: Optional[int] = None, grad_scale=None) -> bool:
        """Warm-up: replaces every bucket's gradient by the mean over the ranks (DDP's update; the replicas stay
        identical; warmup.WarmupAverage.average; `evaluation`: the wrapped optimizer's closure evaluation of the
        step). Returns whether it averaged, which unscaled the gradients by `grad_scale` (GradScaler's) first."""
        if not self.cadence.in_warmup(step) or self.warmup is None:
            return False
        self.warmup.average(step, found_inf, evaluation, grad_scale)
        return True

    # -------------------------------------------------------------------------------------- communication

    def _send_buffer(self, b, plan: MixPlan) -> torch.Tensor:
        """What bucket b sends: its flat buffer, which stays put until the exchange is mixed (the next step);
        with delayed_mix a copy z in the wire dtype, since the parameters move on for a whole interval; over a
        lossy wire's point-to-point steps too, as the difference form mixes z; with the int8 wire the quantized
        change of its public copy (which then plays z's part)."""
        if self.int8_wire is not None:
            return self.int8_wire.encode(b, plan)
        if not self.buffers.sends_copy(plan, self.cadence.delayed_mix):
            return b.flat
        return self.buffers.send_copy(b, plan)

    @traced("exchange_launch")
    @torch.no_grad()
    def launch(self, plan: MixPlan, made_by: Optional[int] = None):
        """Starts the exchange of every bucket's current flat buffer (or its copy, delayed_mix) for `plan` (same
        order on all ranks). `made_by`: the optimizer step whose update produced the buffers (for check_finite's
        message)."""
        bad = finite_check.before_sending(self, plan) if self.check_finite else []
        self._wire_restored = False
        if self.exchange is not None and not plan.silent:
            for b in self.buckets:
                recvs = self.buffers.received(b, plan)
                send = self._send_buffer(b, plan)
                if plan.group is not None:
                    self.exchange.exchange(b.index, send, recvs, group=plan.group)
                else:
                    self.exchange.exchange(b.index, send, recvs, send_to=plan.send, recv_from=plan.recv)
        self.inflight = plan
        wire = []
        if self.check_finite and finite_check.encodes(self, plan):  # the 8-bit wire: its copies, once encoded
            bad, wire = finite_check.after_encoding(self, plan)
        if bad or wire:  # raised after the exchange was posted, so the neighbours name this rank instead of timing out
            finite_check.raise_sent(self, plan, bad, made_by, wire)

    @traced("exchange_wait")
    def mix_inputs(self, b, plan: MixPlan, fuse: bool = True) -> MixInputs:
        """Waits for bucket b's exchange of `plan` and returns what its mix reads (nothing on a silent step). With
        the 8-bit wire and `fuse`, the payloads that arrived travel along, for the mix kernel to add to the copies
        it reads (MixInputs.copies), except under check_finite, which looks at the copies before any mix."""
        if self.exchange is not None and not plan.silent and not self._wire_restored:
            self.exchange.wait(b.index)
        bufs = self.buffers.received(b, plan) if plan.num_buffers else []
        if plan.correction == "checkpoint":
            return MixInputs([b.state[CORRECTION]])
        mix = MixInputs(bufs)
        if plan.correction == "sent":  # a lossy wire's copies z; the int8 wire's public copies after what they sent
            mix = MixInputs(bufs + [self.buffers.copy_of(b, plan)]) if self.int8_wire is None else \
                self.int8_wire.inputs(b, plan, bufs, fuse and not self.check_finite)
        if self.check_finite:
            finite_check.check_received(self, b, plan, mix.neighbors)
        return mix

    def decoded_inputs(self, b, plan: MixPlan) -> List[torch.Tensor]:
        """mix_inputs with the int8 payloads added to their copies here, not in a kernel: the buffers to mix."""
        return self.mix_inputs(b, plan, fuse=False).neighbors

    def awc_plan(self) -> MixPlan:
        """The plan of step t, whose exchange was launched at the end of step t - 1 (launched now if not).
        delayed_mix: on a gossip round, the correction by the previous round's exchange (none before the first
        round, or after a resume or average_parameters()); a local step otherwise."""
        if self.cadence.delayed_mix:
            if self.cadence.round_of(self.t) is not None and self._restored:
                self._restored = False
                return MixPlan(self.t, 1.0, [], [1.0], [], 1.0, correction="checkpoint")
            prev = self.inflight
            if self.cadence.round_of(self.t) is None or prev is None or prev.silent:
                return MixPlan(self.t, 1.0, [], [], [], 1.0)  # a local step
            return prev.as_correction(self.t)
        plan = self.inflight
        if plan is None or plan.step != self.t:
            plan = self.plan(self.t)
            self.launch(plan)
        return self._mix_form(plan)

    def _mix_form(self, plan: MixPlan) -> MixPlan:
        """The int8 wire mixes the public copies in difference form (as a correction), a lossy wire the copies z
        of its point-to-point steps; other wires and group steps the plan."""
        if plan.silent or not (self.int8_wire is not None or self.buffers.mixes_copies(plan)):
            return plan
        return plan.as_correction(plan.step)

    def finish_step(self):
        """awc: step t is done; launch the exchange of x^{t+1} (delayed_mix: round t's, when t is a round)."""
        self.t += 1
        if not self.cadence.delayed_mix:
            self.launch(self.plan(self.t), made_by=self.t - 1)
        elif self.cadence.round_of(self.t - 1) is not None:
            self.launch(self.plan(self.t - 1), made_by=self.t - 1)

    def atc_launch(self):
        """atc: the local update of step t is done; exchange x^{t+1/2} and leave its mix pending."""
        plan = self.plan(self.t)
        self.launch(plan, made_by=self.t)
        self.t += 1
        if plan.mixes:
            self.pending = {b.index for b in self.buckets}
            self._fresh = True
            # A bucket no forward pre-hook will mix before its first use is mixed now, or the next gradient
            # would be taken at the unmixed point (another algorithm).
            deferred = self._hooks.deferrable() if self._hooks is not None else set()
            self.mix_pending(sorted(self.pending - deferred))

    # ------------------------------------------------------------------------------------- mixing (atc)

    def check_deferred_used(self):  # ATC, at step() before the pending mix: mix_hooks.MixBeforeUse.distrust_used
        if self._hooks is not None and self.pending:
            self._hooks.distrust_used(self.pending)

    def end_mix(self, plan: MixPlan):
        """A mix of every bucket is complete: record its disagreement (and the adaptive estimate)."""
        if not self.meter.enabled:
            return
        self.meter.finish(plan.step)
        if self.adaptive is not None:
            self.adaptive.observe_mix(plan, self.meter.total())

    @traced("atc_mix")
    @torch.no_grad()
    def mix_pending(self, bucket_ids=None):
        """ATC: mix the received half-step buffers into the parameters (all pending, or those listed). The error it
        raises (a failed transfer, a non-finite neighbour under check_finite, a parameter written while in flight) is
        kept in `mix_error` while the mix it failed is pending, so that shutdown() - called in a `finally:` after it,
        typically - logs that the mix was not applied instead of raising the same error again. A call mixing other
        buckets (a later module's pre-hook) keeps it. Kept without its traceback (exchange.arrival.detached), whose
        frames hold the optimizer: an optimizer dropped after the failure would never be freed. A Ctrl-C is raised
        once the listed buckets are mixed and marked so (a forward pre-hook's, synchronize()'s: outside step())."""
        with HeldInterrupt():  # raised between a bucket's mix and its mark, the retried forward mixed it twice
            try:
                self._mix_pending(bucket_ids)
            except Exception as e:
                self.mix_error = detached(e)
                raise
            if not self.pending:  # every mix applied: nothing that failed is left
                self.mix_error = None

    def _mix_pending(self, bucket_ids):
        if not self.pending:
            return
        plan = self._mix_form(self.inflight)
        ids = list(self.pending) if bucket_ids is None else [i for i in bucket_ids if i in self.pending]
        if ids:  # (a forward of modules whose buckets are mixed already mixes nothing: not refused)
            finite_check.check_usable(self, "the pending ATC mix")
        check_before_mix([self.buckets[i] for i in ids], self.complete_transfers, self.buckets)
        if ids and self._fresh:  # the first bucket of this exchange: a new disagreement measurement
            self.meter.begin()
            self._fresh = False
        for i in ids:
            b = self.buckets[i]
            nbs, wire = self.mix_inputs(b, plan).at()
            ops.gossip_mix_(b.flat, nbs, plan.self_weight, plan.weights, disagreement=self.meter.slot(b, 0), **wire)
            self.pending.discard(i)
        written([self.buckets[i] for i in ids])
        note_landed([self.buckets[i] for i in ids])  # their transfers completed (mix_inputs waited)
        if ids and not self.pending:
            self.end_mix(plan)

    def attach(self, model=None):
        """ATC: mix each bucket just before the first module using it runs (see mix_hooks.MixBeforeUse)."""
        self._hooks = MixBeforeUse(self, model)

    # ------------------------------------------------------------------------------------------ completion

    def sending_parameters(self) -> set:
        """The buckets whose flat buffer itself (no copy, no conversion) is on the wire: AWC all, ATC the pending."""
        plan = self.inflight
        if self.exchange is None or plan is None or plan.silent or self.int8_wire is not None \
                or self.cadence.delayed_mix or self.buffers.lossy:
            return set()
        ids = self.pending if self.mode == "atc" else {b.index for b in self.buckets}
        return {i for i in ids if self.comm_dtype in (None, self.buckets[i].dtype)}

    def complete_transfers(self):
        """Blocks until every exchange in flight has completed (their data stays valid)."""
        if self.exchange is not None:
            self.exchange.synchronize()
        note_landed(self.buckets)

    def synchronize(self, what: str = "synchronize()"):
        """ATC: applies the pending mix (the parameters are then exactly x^{t+1}); then completes transfers."""
        finite_check.check_usable(self, what)
        if self.mode == "atc" and self.pending:
            self.mix_pending()
        self.complete_transfers()

    def forget_inflight(self):
        """What neighbours sent is stale (the parameters were replaced): the next step exchanges afresh. The int8
        wire adds it to the copies all the same: the senders' copies have it."""
        self.complete_wire_round()
        self.inflight = None
        self._restored = False

    def _trim_recv_buffers(self):
        """After a switch, drop receive buffers the new candidate never needs (a dense graph holds many)."""
        start = self.topology.decided
        topo = self.topology.topology_at(start)
        steps = range(start, start + min(topo.period, 64))
        grouped = {t for t in steps if self.group_steps is not None and self.group_steps.group_of(t) is not None}
        self.buffers.trim(max((len(topo.peers(self.rank, t).recv) for t in steps if t not in grouped), default=0),
                          groups=bool(grouped))

    @property
    def bytes_sent(self) -> int:
        return self.exchange.bytes_sent if self.exchange is not None else 0

    def check_running(self, what: str = "step()"):
        """RuntimeError during CUDA graph capture (as torch.optim: the step keeps its counts and schedule on the host,
        which a replay would not advance), after shutdown() (without its exchange a step would go on mixing the
        buffers received last) or once the process group was destroyed under it (GossipExchange.check_group)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decent_comm: {what} during CUDA graph capture: the step keeps its counts and its "
                               "gossip schedule on the host, which a replay would not advance. Capture the forward and "
                               "backward only (or the fused ops, decent_comm.ops).")
        if self._shut_down:
            raise RuntimeError("decent_comm: step() after shutdown(): the optimizer has released its exchange, so a "
                               "step would mix stale neighbour buffers; build a new optimizer to train on")
        if self.exchange is not None:
            self.exchange.check_group("step()")
        finite_check.check_usable(self, what)

    def shutdown(self):
        # ATC: the last step's pending mix applied, the parameters saved after shutdown() are x^{t+1}. All is released
        # even if it fails. A mix that failed (or its exchange) is not retried: raised again it buried the error.
        fork_guard.check(self, "shutdown()")  # a fork's child: the parent's exchange is not this process's to close
        ex = self.exchange
        first, failed = None, self.failed or self.mix_error or (ex.error if ex is not None else None)
        if self.mode == "atc" and self.pending and not self._shut_down:
            try:
                if failed is None:
                    self.mix_pending()
                else:
                    # logged, not warnings.warn: the failure was raised already, nothing here is the user's to change
                    log.warning("decent_comm: rank %d: shutdown(): the last step's mix was not applied, as it failed "
                                "earlier (%s): this rank's parameters are its half-step x^{t+1/2}", self.rank, failed)
            except Exception as e:  # noqa: BLE001 - raised once the exchange is released
                first = e
        self._shut_down = True
        try:
            self._release()
        finally:
            if first is not None:
                raise first

    def _release(self):
        self.process_group = None  # as the paths below let go of it: nothing here may hold it past shutdown()
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self.all_reduce is not None:  # lets go of the process group, so destroy_process_group() destroys it
            self.all_reduce.close()
        if self.exchange is not None:
            self.exchange.shutdown()
            self.exchange = None
