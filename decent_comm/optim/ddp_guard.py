"""Refuses a model left wrapped in DistributedDataParallel while a decentralized optimizer trains it: DDP would
all-reduce every gradient while the optimizer gossips the parameters, both communicating, neither as intended."""

import weakref

from torch.nn.modules.module import register_module_forward_pre_hook, register_module_module_registration_hook
from torch.nn.parallel import DistributedDataParallel


_DDP_MESSAGE = ("decent_comm: the model is wrapped in DistributedDataParallel, which all-reduces every gradient while "
                "the decentralized optimizer gossips the parameters: both would run. Drop the DDP wrap (and "
                "`.module`) and give the optimizer the plain model's parameters.")


_guards: "weakref.WeakSet[DDPGuard]" = weakref.WeakSet()  # the live guards, for the one registration hook below
_registration_hook = []  # its handle, registered with the first guard and never removed


def _on_module_registration(parent, name, module):
    """The one global submodule-registration hook of all guards. Never removed: torch's add_module iterates its
    registration hooks' dict itself, and a guard closed from a finalizer (its optimizer collected by a cyclic GC
    that an allocation in any such hook can start) removed its own hook mid-iteration: "OrderedDict mutated during
    iteration" raised from a user's nn.Sequential(...)."""
    for guard in list(_guards):
        guard._wrap_hook(parent, name, module)


class DDPGuard:
    """Refuses a model left wrapped in DDP. A wrap made while the optimizer lives: in DDP's constructor, before its
    broadcast of rank 0's parameters (a global hook on submodule registration, kept: it runs when any module assigns
    a submodule, never in a forward or step; without it a wrap after the first step went unseen, the broadcast's
    write tripped the write-during-send check, whose advice, synchronize(), led to training with both DDP's
    all-reduce and the gossip). A wrap made before: with `model=`, at construction when it is the DDP wrap, else at
    a forward that DDP runs (a pre-hook on the model, kept: removing it would change what torch.compile guards on,
    and a compiled model would compile twice); without, at the first forward of a DDP holding our parameters (a
    global forward pre-hook, removed at the optimizer's first step(), as such a wrap would have shown by then).
    A DDP that ignores all our parameters (its ignore list) is a hybrid, allowed: only the rest is all-reduced."""

    def __init__(self, owner, buckets, model=None):
        self._ours = {id(s.param) for b in buckets for s in b.slots}
        if isinstance(model, DistributedDataParallel) and self._reduces_ours(model.module):
            raise RuntimeError(_DDP_MESSAGE)
        if model is not None:
            self._handle, self._global = model.register_forward_pre_hook(self._model_hook), False
        else:
            self._handle, self._global = register_module_forward_pre_hook(self._hook), True
        # Whether step() still has the global hook to remove: a plain bool that a compiled step() reads (the handle
        # itself is a RemovableHandle, which Dynamo cannot represent: a graph break at every step), and kept here, not
        # on the optimizer, as torch 2.11's Dynamo cannot trace a setattr on a torch.optim.Optimizer (step_vars.py).
        self.watching_forwards = self._global
        if not _registration_hook:
            _registration_hook.append(register_module_module_registration_hook(_on_module_registration))
        _guards.add(self)
        weakref.finalize(owner, self.close)

    def _reduces_ours(self, module):
        """Whether DDP wrapping `module` all-reduces any of our parameters: DDP skips the names listed by
        DDP._set_params_and_buffers_to_ignore_for_model (its own rule, `_module_parameters`), so a hybrid where DDP
        all-reduces one part of the model and we gossip the ignored rest is no double communication."""
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        return any(id(p) in self._ours for name, p in module.named_parameters() if name not in ignored)

    def _wrap_hook(self, parent, name, module):
        # DDP.__init__ assigns `self.module = module` before any collective of its own
        if isinstance(parent, DistributedDataParallel) and module is not None and self._reduces_ours(module):
            raise RuntimeError(_DDP_MESSAGE)

    def _hook(self, module, args):
        if isinstance(module, DistributedDataParallel) and self._reduces_ours(module.module):
            raise RuntimeError(_DDP_MESSAGE)

    def _model_hook(self, module, args):
        ddp = DistributedDataParallel._active_ddp_module  # set by DDP around its call of the wrapped module
        if ddp is not None and self._reduces_ours(ddp.module):
            raise RuntimeError(_DDP_MESSAGE)

    def remove(self):
        """At the first step: lets go of the global hook (the model's stays)."""
        self.watching_forwards = False
        if self._global and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def close(self):
        """At shutdown() (or when the optimizer is collected): a DDP wrap is the user's to make from now on (a run
        that ends with DDP fine-tuning), as the optimizer no longer gossips."""
        _guards.discard(self)
        self.watching_forwards = False
        if self._handle is not None:  # (torch's module call copies its forward pre-hooks before running them)
            self._handle.remove()
        self._handle = None
