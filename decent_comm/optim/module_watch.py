"""Refuses a step (or collective utility) after the model given as `model=` stopped holding one of the optimizer's
Parameter objects where it held it: `model.fc.weight = nn.Parameter(...)`, a new `model.fc` module,
`model.load_state_dict(sd, assign=True)`, or `model.to(...)` / `.double()` under
torch.__future__.set_overwrite_module_params_on_conversion(True), which makes each parameter a new object. The
optimizer's buckets hold the old objects (decent_comm.optim.buckets): it would go on updating and exchanging those,
which the model no longer reads, and never train the new ones, silently, with replicas drifting apart when one rank
alone did it. torch.optim is as blind to it; without `model=` we cannot see it either (docs/api.md says so).

The check must cost next to nothing per step (a model of 2000 small tensors: comparing every parameter's module entry
by identity took 66 us of a 4.9 ms DSGD step on a loaded 2-core machine, 1.3%):
- torch's global registration hooks see every Parameter or module assigned through nn.Module (setattr,
  register_parameter, add_module, load_state_dict(assign=True)): one assigned on a module of the watched model marks
  the watch, and the next step walks the model (about 1 ms for 2000 tensors) comparing each watched name with what it
  holds now; assignments elsewhere (a module built in a forward, an eval copy) cost a set lookup;
- `_apply` (model.to(...)) writes module._parameters directly, no hook, when it makes new Parameter objects (under the
  overwrite flag, set or since reset), and then replaces every parameter of each module it visits: each step
  compares one entry per module by identity (1000 modules: 35 us, 0.7% of that step), and every entry when one
  differs.
A name that no longer exists is no error (torch.nn.utils.parametrize moves the same Parameter object under
`parametrizations.<name>.original`, a wrapper module moves it under its own name, `bias = None` or `del model[0]` drop
it), nor one that holds another of the optimizer's parameters: only a tensor the optimizer does not hold, at a name
that held one of its parameters, or a name parametrized into new Parameters (weight_norm's `original0`/`original1`)
while the model no longer holds the optimizer's anywhere (it would train a copy nothing reads, the new ones frozen).
Left unseen: a `module._parameters[name] = p` written directly to a module's second or later parameter.
"""

import operator
import weakref
from typing import Dict, List, Optional

import torch
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

_watches: "weakref.WeakSet[ModuleWatch]" = weakref.WeakSet()  # the live watches, for the hooks below


def _mark(module, name, value):
    """torch's global registration hooks: a Parameter or module assigned on `module`. Only a watch whose model holds
    `module` must look again; others (a module built inside a forward, an eval copy, AveragedModel, a GraphModule
    dynamo builds) cost each a set lookup, where a process-wide count made every step walk the whole model twice."""
    for watch in list(_watches):
        if id(module) in watch._module_ids:
            watch._dirty = True


_hooks: List = []  # the two global hooks, registered at the first watch (never removed: they cost a lookup each)


def _walk(module: torch.nn.Module, prefix: str, watched: Optional[Dict[int, torch.nn.Parameter]], out: list,
          seen: set):
    """(module._parameters, name, parameter, dotted name) of every parameter under `module` (those in `watched`
    only, unless None). A module held at several places is visited once, under its first name (as named_modules
    does: visiting it once per path took time exponential in the depth of such sharing); a replacement shows in
    its one _parameters dict whichever name reaches it. `seen` gets the ids of the modules visited."""
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, p in module._parameters.items():
        if p is not None and (watched is None or id(p) in watched):
            out.append((module._parameters, name, p, prefix + name))
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", watched, out, seen)


class ModuleWatch:
    """Watches `model` (None: nothing to watch) for the parameters `params` (the optimizer's)."""

    def __init__(self, model: Optional[torch.nn.Module], params: List[torch.nn.Parameter]):
        self._model = model
        if model is None:
            return
        if not _hooks:
            _hooks.extend([register_module_parameter_registration_hook(_mark),
                           register_module_module_registration_hook(_mark)])
        self._watched = {id(p): p for p in params}
        self._record()
        _watches.add(self)

    def _record(self):
        """Notes where the model holds each watched parameter now."""
        entries, modules = [], set()
        _walk(self._model, "", self._watched, entries, modules)
        self._entries, self._module_ids = entries, modules
        firsts = {}  # per module, its first watched entry: _apply replaces every parameter of a module it visits
        for e in entries:
            firsts.setdefault(id(e[0]), e)
        self._dicts, self._names, self._firsts = ([e[k] for e in firsts.values()] for k in range(3))
        self._dirty = False

    @torch.compiler.disable  # traced into a compiled step(), its state became a guard: a recompile per change
    def check(self, what: str) -> None:
        """RuntimeError naming the first name of the model that holds another tensor than the optimizer's parameter
        it held (`what`: the call, for the message)."""
        if self._model is None:
            return
        if self._dirty:  # something was assigned on one of the model's modules: every name, as it is now
            now = []
            _walk(self._model, "", None, now, set())
            held = {path: q for _, _, q, path in now}
            _compare(self._entries, [held.get(path) for _, _, _, path in self._entries], self._watched, what)
            _check_reparametrized(self._entries, held, self._watched, what)
            self._record()
        elif not all(map(operator.is_, map(dict.get, self._dicts, self._names), self._firsts)):
            _compare(self._entries, [d.get(name) for d, name, _, _ in self._entries], self._watched, what)
            self._record()  # nothing replaced (a parameter deleted, del module.bias): what is left


def _compare(entries, now, watched, what: str) -> None:
    """Raises for the first (dict, name, parameter, path) of `entries` whose path now holds a tensor the optimizer
    does not (`now`: per entry, what the path holds, or None). Another of its parameters is no error: the model still
    trains only what the optimizer updates (del model.layers[0] renames the later layers of a ModuleList)."""
    for (_, _, p, path), q in zip(entries, now):
        if q is not None and q is not p and id(q) not in watched:
            raise _replaced(path, q, what)


def _replaced(path: str, q: torch.Tensor, what: str) -> RuntimeError:
    kind = "Parameter" if isinstance(q, torch.nn.Parameter) else type(q).__name__
    return RuntimeError(
        f"decent_comm: {what}: the model's {path!r} is a {kind} the optimizer does not hold ({q.dtype}, shape "
        f"{tuple(q.shape)}, on {q.device}), where it held one of the optimizer's parameters: a new nn.Parameter or "
        "module was assigned to the model, it was loaded with load_state_dict(assign=True), or converted "
        "(model.to(...), .double(), .cuda()) under torch.__future__.set_overwrite_module_params_on_conversion(True), "
        "which makes every parameter a new object. The optimizer holds the Parameter objects it was built with: it "
        "would never train the new one, and would go on updating and exchanging its own, which the model no longer "
        "reads there. Build the optimizer after replacing parameters or converting the model, or build a new "
        "optimizer for the model as it is now and load this one's state_dict() into it.")


def _check_reparametrized(entries, held, watched, what: str) -> None:
    """Raises for the first entry whose name vanished while its module gained Parameters made from it that the
    optimizer does not hold, and its Parameter is held nowhere in the model (`held`: path -> tensor, the whole model
    now; `watched`: the ids of the optimizer's parameters): a weight_norm registered after the optimizer was built
    (parametrize's `parametrizations.weight.original0/1`, the old torch.nn.utils.weight_norm's `weight_g` /
    `weight_v`), so the optimizer would train a copy nothing reads. orthogonal or spectral_norm keep the same object
    as `...original`, which is reachable; `bias = None` adds nothing; `del model[0]` renumbers modules whose
    Parameters the optimizer holds: no error."""
    vanished = [(name, p, path) for _, name, p, path in entries if path not in held]
    if not vanished:
        return
    unheld = {}  # a module's prefix -> the local names of its Parameters (its parametrizations' too) not held
    for k, q in held.items():
        if id(q) not in watched:
            cut = k.find("parametrizations.")
            cut = cut if cut == 0 or (cut > 0 and k[cut - 1] == ".") else k.rfind(".") + 1
            unheld.setdefault(k[:cut], []).append(k[cut:])
    reachable = {id(q) for q in held.values()}
    for name, p, path in vanished:
        prefix = path[:len(path) - len(name)]
        new = [prefix + k for k in unheld.get(prefix, ())
               if k.startswith(f"parametrizations.{name}.") or ("." not in k and k.startswith(name))]
        if new and id(p) not in reachable:
            raise RuntimeError(
                f"decent_comm: {what}: the model's {path!r} was made into Parameters the optimizer does not hold "
                f"({', '.join(repr(k) for k in new[:4])}; a weight_norm or another parametrization registered after "
                "the optimizer was built), and the model no longer holds the optimizer's parameter anywhere: the "
                "optimizer would go on updating and exchanging that one, which nothing reads, and never train the new "
                "ones. Register parametrizations before building the optimizer, or build a new optimizer for the model "
                "as it is now.")
