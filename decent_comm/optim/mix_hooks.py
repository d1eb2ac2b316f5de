"""ATC's mix-before-use: each bucket's pending mix is applied just before the first module that uses one of
its parameters runs, so the next forward overlaps the exchange and still computes at the mixed point.

The hooks are the forward pre-hooks of ``model``'s modules when it is given, else one global forward pre-hook
(torch.nn.modules.module.register_module_forward_pre_hook). Either way they learn, from the modules that
actually run, which module holds which parameter. A bucket is deferred to the hooks only when every one of
its parameters is held by a module seen running (``deferrable``); any other bucket (a parameter used outside
any module, or not seen in a forward yet) is mixed at the end of step(), without overlap but exactly ATC.
The one assumption, as for Megatron's and FSDP's forward pre-hooks: a parameter is first used inside the
forward of a module that holds it directly (in its own ``_parameters``), not read earlier by another module.

Under torch.compile (model= hooks, traced into the forward) nothing is deferred: the first trace of a compiled forward
turns deferral off for good and applies the pending mix there (_stop_deferring), so the graph holds no mix.
A CUDA graph capture of a forward turns deferral off for good too (MixBeforeUse._captured): a replay runs no
Python hook, so from then on step() applies every mix itself and the replays read mixed parameters. A mix pending
at the capture cannot be applied in it (waiting for the exchange queries and waits on events recorded outside the
capture, which invalidates it, and the mix would be baked into every replay): a RuntimeError says to apply it first.

A pending mix is also applied before such a module's ``state_dict()`` is taken (a state_dict pre-hook on each
module whose forward pre-hook defers a bucket): ``torch.save(model.state_dict())`` before ``opt.state_dict()``
(which applies every pending mix) once saved the unmixed point, and a resume lost that step's mix.

Two ways around the assumption, and what catches them:
* An evaluation (a forward without gradients of a module in eval mode, or in inference_mode) may read parameters
  without running their modules: nn.TransformerEncoder's inference fast path reads its layers' weights, a CLIP-style
  ``encode_image()`` method its projection. So the first hook of such a forward applies every pending mix (eval
  needs no overlap), and learns nothing: ownership comes from training forwards only (an evaluation through
  forward() followed by training through a ``loss()`` method had deferred buckets to a hook that never fired).
* A training forward that reads a deferred bucket's parameters without running the module holding them (a method
  other than forward(), once forward() had run): the gradient is taken at the unmixed point. step() sees the
  bucket's mix still pending while it has gradients (``distrust_used``): from then on that bucket is mixed at the end of
  step(), and a warning names it (that one step's gradient was taken at the unmixed point).
"""

import gc
import weakref
from typing import Dict, List, Optional, Set

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from .._warn import job_rank, warn_user


# Module hook handles let go of during a cyclic garbage collection (a schedule collected, or shut down by its
# optimizer's finalizer): removed at the next safe point (a new MixBeforeUse, a removal outside a collection).
# A collection runs wherever an allocation starts it, also inside torch's loop over a module's state_dict pre-hooks
# (which iterates that dict itself): removing one there raised "OrderedDict mutated during iteration" from the
# user's model.state_dict(). Until then they are no-ops (their schedule is gone or shut down).
_orphaned: List[list] = []
# The phase of the last cyclic garbage collection, as the dict's last key: gc.callbacks calls each with (phase, info),
# so pop then __setitem__ move that phase's key to the end. Only C callables: a Python callback is the first bytecode
# to run after a SIGINT that arrives while C code allocates, so Python's handler raised KeyboardInterrupt inside it,
# and CPython ignores a gc callback's exception ("Exception ignored in ..."): Ctrl-C was lost (a run trained on to the
# end). These run no bytecode: the signal waits for the program's next (or a finalizer's the collection runs).
_gc_phase: dict = {}
gc.callbacks.extend([_gc_phase.pop, _gc_phase.__setitem__])


def _collecting() -> bool:
    """Inside a cyclic garbage collection (a finalizer it runs)."""
    return next(reversed(_gc_phase), None) == "start"


def _remove_orphaned() -> None:
    while _orphaned and not _collecting():
        for handle in _orphaned.pop():
            handle.remove()


def _let_go(global_handles: list, handles: list) -> None:
    """The finalizer's removal. The global forward pre-hook goes at once (torch copies that dict before running
    it, and while it lives every module call anywhere takes the hooks' slow path); the modules' hooks at once only
    outside a collection."""
    for handle in global_handles:
        handle.remove()
    _orphaned.append(handles)
    _remove_orphaned()


class MixBeforeUse:
    def __init__(self, schedule, model: Optional[torch.nn.Module] = None):
        _remove_orphaned()
        self._schedule = weakref.ref(schedule)  # the hooks must not keep an optimizer alive
        self._bucket_of: Dict[int, int] = {id(s.param): b.index for b in schedule.buckets for s in b.slots}
        self._missing = {b.index: {id(s.param) for s in b.slots} for b in schedule.buckets}
        self._owned: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
        self._distrusted: Set[int] = set()  # buckets a training forward used without their module's hook
        self._covers: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        self._handles, self._global_handles = [], []
        # A compiled forward was traced, or a forward captured into a CUDA graph: nothing is deferred any more, step()
        # mixes every bucket (_stop_deferring, _captured)
        self._deferral_off = False
        self._stop_deferring = _deferral_stopper(weakref.ref(self))
        self._global = model is None
        if model is not None:
            _warn_if_compiled_before(model, job_rank(schedule))
            for m in model.modules():
                if m._parameters:
                    # first among the module's pre-hooks: one registered earlier that computes the weight (the old
                    # weight_norm / spectral_norm, torch.nn.utils.prune) must read the mixed parameters
                    self._handles += [m.register_forward_pre_hook(self._hook, prepend=True),
                                      m.register_state_dict_pre_hook(self._state_dict_hook)]
        else:
            # Never traced: Dynamo inlines global hooks into every compiled module's forward, and tracing this
            # one's WeakKeyDictionary lookup of the module failed the compile (Dynamo: the module "is already
            # tracked for mutation"). Disabled, it makes Dynamo run the modules with parameters eagerly (any
            # compiled model's, while this optimizer lives): correct, not compiled. model= hooks do trace.
            self._global_handles.append(register_module_forward_pre_hook(_never_traced(self._hook)))
        # Removed with the schedule even without shutdown() (the global hook lives in a process-wide dict), at the
        # next safe point (_orphaned).
        self._finalizer = weakref.finalize(schedule, _let_go, self._global_handles, self._handles)

    def _learn(self, module: torch.nn.Module) -> tuple:
        """Bucket ids of the parameters `module` holds directly; those parameters now count as covered."""
        ids = set()
        for p in module._parameters.values():
            if p is not None and id(p) in self._bucket_of:
                b = self._bucket_of[id(p)]
                ids.add(b)
                self._missing[b].discard(id(p))
        out = tuple(sorted(ids))
        self._owned[module] = out
        if out and self._global:  # (with `model` every module holding parameters got one at construction)
            self._handles.append(module.register_state_dict_pre_hook(self._state_dict_hook))
        return out

    def _hook(self, module, args):
        if torch.compiler.is_compiling():
            # Dynamo traces a model='s hooks into the compiled forward, where learning and the per-module mix broke
            # the graph at every module holding parameters (10 graphs of one op, slower than eager; fullgraph=True
            # failed). So a compiled forward turns deferral off for good (_stop_deferring, run while Dynamo traces):
            # step() mixes every bucket (no overlap, exactly ATC) and this traces to nothing.
            self._stop_deferring()
            if self._schedule_pending():  # none left; read so that the graph guards on it (a recompile if one is)
                _mix_every_pending(self)
            return
        evaluation = torch.is_inference_mode_enabled() or not (torch.is_grad_enabled() or module.training)
        # is_initialized() first: a Python flag (0.1 us; is_available() took 3 us a hook), and no CUDA call on CPU (a
        # capture needs CUDA initialized). Only a module holding the optimizer's parameters counts: the global hook
        # also sees other models' captures.
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing() and self._holds_ours(module):
            self._captured(module, evaluation)
            return
        if evaluation and self._holds_ours(module):
            # an evaluation: every pending mix now, nothing learned (module docstring); not a no_grad forward of a
            # module in training mode (reentrant activation checkpointing), nor another model's (a frozen teacher)
            schedule = self._schedule()
            if schedule is not None and schedule.pending:
                schedule.mix_pending()
            return
        # Ownership is learned from modules seen running (not declared): a module that never runs covers
        # nothing, so a parameter another module reads directly keeps its bucket mixed at the end of step().
        self._mix_for(module, learn=True)

    def _captured(self, module, evaluation: bool):
        """`module`'s forward is being captured into a CUDA graph, whose replays run no Python hook: deferral is off
        for good, so step() applies every mix before it returns (exactly ATC, without the overlap) and each replay
        reads mixed parameters. A mix the capture would read (the module's own buckets; in an evaluation, which may
        read parameters without running their modules, any) cannot be applied here: waiting for its exchange queries
        an event (forbidden in a global-mode capture: the capture is invalidated) and makes the capturing stream wait
        on one recorded outside it (an error that fails the exchange and aborts its communicator: every neighbour
        times out), and the mix kernel would be captured, re-run by every replay. So the exchange is not touched and
        the capture refused; the mix stays pending, for synchronize() or an eager forward to apply."""
        self._deferral_off = True
        schedule = self._schedule()
        if schedule is None:  # the optimizer is gone
            return
        if evaluation:  # (which teaches the hooks nothing, as outside a capture)
            reads = set(schedule.pending)
        else:
            ids = self._owned.get(module)
            reads = schedule.pending.intersection(self._learn(module) if ids is None else ids)
        if reads:
            raise RuntimeError(
                f"decent_comm: mode='atc': a forward of {type(module).__name__} is being captured into a CUDA graph "
                f"while the last step's mix of its parameters (buckets {sorted(reads)}) is still pending: ATC defers "
                "it to the forward's hooks, which a replay does not run, and it cannot be applied inside the capture. "
                "Apply it before capturing: call opt.synchronize() on every rank (a collective), or run the forward "
                "once eagerly first (a warm-up outside the capture). From this capture on, step() applies every "
                "mix itself, so the replays read mixed parameters.")

    def _schedule_pending(self) -> bool:
        schedule = self._schedule()
        return schedule is not None and bool(schedule.pending)

    def _holds_ours(self, module) -> bool:
        """Whether `module` or a module inside it holds one of the optimizer's parameters (cached per module)."""
        held = self._covers.get(module)
        if held is None:
            held = self._covers[module] = any(id(p) in self._bucket_of for p in module.parameters())
        return held

    def _state_dict_hook(self, module, prefix, keep_vars):
        self._mix_for(module, learn=False)  # buckets deferred to this module's forward: none before it ran

    def _mix_for(self, module, learn: bool):
        schedule = self._schedule()
        if schedule is None:  # the optimizer is gone, or this is a copy's hook (_Detached)
            return
        ids = self._owned.get(module)
        if ids is None and learn:
            ids = self._learn(module)
        if ids and schedule.pending:
            schedule.mix_pending(ids)

    def __reduce__(self):
        # The hooks are bound methods of this object, held in the modules' hook dicts; pickling a module pickles
        # them, and this object's weak references cannot be pickled ("cannot pickle 'weakref.ReferenceType'").
        return _Detached, ()

    def deferrable(self) -> Set[int]:
        """Buckets whose every parameter is held by a module whose pre-hook will mix it before use (none once deferral
        is off: a compiled forward or a CUDA graph capture was seen)."""
        if self._deferral_off:
            return set()
        return {b for b, missing in self._missing.items() if not missing and b not in self._distrusted}

    def distrust_used(self, pending) -> None:
        """At step(), before the pending mix: a `pending` bucket with a non-zero gradient was used in the forward
        without the hooks of the modules holding it firing (a method other than forward(), a parameter read
        directly), so its gradient was taken before its mix: mixed at the end of step() from now on, and said."""
        schedule = self._schedule()
        buckets = schedule.buckets
        used = {i: [s for s in buckets[i].slots if s.param.grad is not None and bool(s.param.grad.any())]
                for i in sorted(pending)}  # (a rare path: the host reads are fine)
        # (a bucket distrusted already is pending only in a step retried after this warning raised, -W error)
        late = [i for i, slots in used.items() if slots and i not in self._distrusted]
        if not late:
            return
        self._distrusted.update(late)
        shapes = [tuple(s.param.shape) for i in late for s in used[i]]
        # A warning (the user can run those modules, or ignore it knowingly), once per bucket (distrusted from now
        # on), at the user's opt.step() line: the forward that read the parameters is over, its line unknown here.
        # Under -W error it raises before this step has changed anything but that distrust (step() checks before the
        # gradients are gathered and GradScaler's unscaled: after, a retry unscaled twice, review DG): a retry steps.
        # Not checked with a closure the wrapped optimizer runs after the mix (the gradients are the last closure's).
        warn_user(f"ATC: parameters of shapes {shapes} were used in a forward without the module holding them running "
                  "(a method other than forward(), or a parameter read directly), so this step's gradient was taken "
                  "before their mix; their buckets are mixed at the end of step() from now on",
                  job_rank(schedule))

    def remove(self):
        self._finalizer()


_NO_MODEL = ("decent_comm: an ATC optimizer built without model= keeps a global forward pre-hook that Dynamo "
             "cannot trace, so every compiled module holding parameters runs eagerly and fullgraph=True fails, for "
             "any model of this process while that optimizer lives: pass model= to the optimizer to compile")


def _never_traced(hook):
    """torch.compiler.disable(hook) with a reason fullgraph=True's error shows (its hint was only "Remove the
    torch.compiler.disable call", which no user can); torch builds without `reason` take the hook as it is."""
    try:
        return torch.compiler.disable(hook, reason=_NO_MODEL)
    except TypeError:
        return torch.compiler.disable(hook)


def _warn_if_compiled_before(model: torch.nn.Module, rank: Optional[int]) -> None:
    """A graph Dynamo compiled from `model` before these hooks existed never runs them (Dynamo does not guard on a
    module's hooks: torch._dynamo.config.skip_nnmodule_hook_guards), so a compiled forward after an eager step read
    the unmixed parameters (0.138 off in a compiled evaluation), silently. Warned when Dynamo has compiled some graph
    and a torch.compile wrapper (or model.compile()) of this model or one of its modules exists: a walk of the
    heap's objects, at construction only."""
    if not torch._dynamo.utils.counters["stats"]["unique_graphs"]:
        return
    import gc

    from torch._dynamo.eval_frame import OptimizedModule

    ours = {id(m) for m in model.modules()}
    if not any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()) and not any(
            issubclass(type(o), OptimizedModule) and id(o._orig_mod) in ours for o in gc.get_objects()):
        return
    # A warning at the user's line that builds the optimizer; under -W error it raises before any hook is registered.
    warn_user("ATC with model=: this model was compiled (torch.compile) before the optimizer was built; a graph "
              "compiled before its mix-before-use hooks existed does not run them, and would read unmixed parameters. "
              "Call torch._dynamo.reset() now (its graphs compile again, with the hooks), or build the optimizer "
              "before the model's first compiled call.", rank)


def _deferral_stopper(hooks_ref: "weakref.ref[MixBeforeUse]"):
    """`hooks._stop_deferring()`: run by Dynamo while it traces a compiled forward's hooks, not by the graph
    (assume_constant_result: called at trace time, its result a constant): no bucket is deferred to a hook from now
    on, and the mix eager forwards deferred is applied now, before the compiled forward reads those parameters.
    Applied by the graph instead, it was a torch.compiler.disable'd call in it after every eager step (a graph break
    per deferring module, and fullgraph=True raised Dynamo's "Skip calling torch.compiler.disable()'d function").
    Only a trace runs this: a cached graph does not, hence off for good (idempotent: a retrace or a second compiled
    model repeats it). A function of no argument, made per hooks object (through a weak reference: no cycle): torch
    2.11's Dynamo turns each argument of an assume_constant_result function into a Python constant first, which a
    MixBeforeUse is not (InternalTorchDynamoError "UserDefinedObjectVariable(MixBeforeUse) is not a constant"; 2.14
    passes the object itself)."""

    @torch.compiler.assume_constant_result
    def stop() -> bool:
        hooks = hooks_ref()
        if hooks is not None:
            hooks._deferral_off = True
            _mix_every_pending(hooks)  # (run here as plain Python: Dynamo calls this function, it does not trace it)
        return True
    return stop


@torch.compiler.disable
def _mix_every_pending(hooks: MixBeforeUse) -> None:
    schedule = hooks._schedule()
    if schedule is not None and schedule.pending:
        schedule.mix_pending()


class _Detached(MixBeforeUse):
    """What the hook object becomes in a pickled or deep-copied module (torch.save(model), copy.deepcopy(model)):
    the copy has no optimizer, so its hooks (MixBeforeUse's methods, bound to this) do nothing."""

    _schedule = staticmethod(lambda: None)

    def __init__(self):  # noqa: D107
        # Holds no parameter. The tables are what the inherited hooks read before they find no schedule (an evaluation
        # of the copy raised AttributeError '_covers'). Not no-op overrides: copy.deepcopy copies a bound method with
        # its function, so a deep copy's hooks stay MixBeforeUse's methods.
        self._bucket_of, self._covers = {}, weakref.WeakKeyDictionary()
        self._stop_deferring = _deferral_stopper(weakref.ref(self))  # (a compiled forward of the copy calls it)
