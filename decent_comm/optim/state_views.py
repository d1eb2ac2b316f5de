"""opt.state as views of the flat buckets: torch.optim tools (state_dict, schedulers, user code) read and write each
parameter's state there, while the fused kernels update the flat float32 buffers behind the views. Publishing the
views, loading a state_dict into the buffers (validated in full before anything is written), and the extra named
buffers (the 8-bit wire's copies, a delayed round's correction) that state_dict() carries for checkpoints.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .buckets import Bucket, find_bucket_of
from .step_counts import count_classes


@dataclass(frozen=True)
class StateLayout:
    """Which per-parameter state of opt.state an optimizer keeps in its flat buffers."""

    names_of: Callable[[Bucket], List[str]]  # the buffers bucket b's update uses (its param group's options)
    # Whether opt.state[p][name] is a flat buffer's view (the class's state names, a delayed round's correction,
    # the 8-bit wire's copies); any other name is another library's note (timm's Lookahead keeps
    # "lookahead_slow_buff" in its base optimizer's state), kept in opt.state as it is, as torch.optim keeps it.
    is_buffer: Callable[[object], bool] = lambda name: True
    # Whether a parameter's count restarts when one of names_of(b) is missing: DSGD's count is the steps since its
    # momentum buffer started (torch.optim.SGD restarts a missing buffer at the gradient, not (1 - dampening) g).
    count_follows_buffers: bool = False


def publish_state(b: Bucket, state, stepped: Optional[List[bool]] = None) -> None:
    """opt.state[p] of every parameter updated at least once (those `stepped` says when given): views of the
    bucket's flat state buffers and of its step count (torch.optim semantics: no state before a parameter's first
    update)."""
    new_names = b.state.keys() - b.published_names
    if all(b.published) and not new_names:
        return
    published, changed = list(b.published), bool(new_names)
    for i, s in enumerate(b.slots):
        if not published[i] and (stepped[i] if stepped is not None else b.step_count[i] > 0):
            views = {name: b.view(buf, s) for name, buf in b.state.items()}
            views["step"] = b.step_count[i]
            state[s.param].update(views)
            published[i], changed = views, True
        elif published[i] and new_names:
            # a state buffer created after this slot was published (DSGD's momentum switched on mid-run): torch
            # keeps it in opt.state, so state_dict() and checkpoints carry it
            added = {name: b.view(b.state[name], s) for name in new_names if name not in published[i]}
            state[s.param].update(added)
            published[i] = {**published[i], **added}
    if changed:  # the same list otherwise (a frozen parameter never published): StateWatch need not look again
        b.published = published
    b.published_names = b.published_names | b.state.keys()


#: what read_state found for each slot it loads: (id(bucket), slot index) -> (count or None, {name: tensor to copy,
#: or None where the saved tensor is that slot's own view already}, {foreign name: value for opt.state})
Loaded = Dict[tuple, tuple]


def load_state(buckets: List[Bucket], saved_state: dict, param_of: dict, state, layout: StateLayout) -> None:
    """Copies a torch.optim state_dict's per-parameter state into the flat buffers: write_state(read_state(...))."""
    write_state(buckets, read_state(buckets, saved_state, param_of, layout), state, layout)


def read_state(buckets: List[Bucket], saved_state: dict, param_of: dict, layout: StateLayout,
               foreign_value: Callable[[torch.Tensor, object], object] = lambda p, value: value) -> Loaded:
    """The first half of loading a state_dict's per-parameter state, which writes nothing and raises ValueError for
    what cannot load (copy_problem's: a tensor of another shape than its parameter's, a meta or sparse one, a value
    that is not a tensor; a step count that is no number), so that a refused state_dict leaves the optimizer as it
    was. `param_of`: saved key (an index, or an FQN from torch.distributed.checkpoint) -> the parameter it names.

    The saved tensors may be this optimizer's own views: opt.load_state_dict(opt.state_dict()), or
    torch.distributed.checkpoint loading into get_state_dict's tensors in place. So everything is read before
    anything is written: the counts as numbers, and a saved tensor sharing memory with the buckets is cloned unless
    it is its own destination (then it stays where it is). Foreign entries (not layout.is_buffer) are not looked at:
    `foreign_value(param, value)` is what opt.state[param] gets."""
    slot_of = find_bucket_of(buckets)
    bucket_memory = {t.untyped_storage().data_ptr() for b in buckets for t in [b.step_count, *b.state.values()]}
    loaded: Loaded = {}
    for key, st in saved_state.items():
        p = saved_param(param_of, key)
        if p is None or not st:
            continue
        b, i = slot_of[id(p)]
        count, tensors, foreign = None, {}, {}
        for name, value in st.items():
            if name == "step":
                count = step_count_of(key, value)
            elif not layout.is_buffer(name):
                try:
                    foreign[name] = foreign_value(p, value)
                except (RuntimeError, NotImplementedError, TypeError) as e:  # torch's cast of a meta tensor, ...
                    raise ValueError(f"state {name!r} of parameter {key!r} cannot be moved to the parameter's dtype "
                                     f"and device ({e}): nothing was loaded") from e
            elif value is not None:
                problem = copy_problem(value, p)
                if problem:
                    raise ValueError(f"state {name!r} of parameter {key!r} {problem}: nothing was loaded")
                tensors[name] = _detached_from_buckets(b, i, name, value, bucket_memory)
        loaded[(id(b), i)] = (count, tensors, foreign)
    return loaded


def copy_problem(value, param: torch.Tensor) -> str:
    """Why `value` cannot be a saved state tensor of `param`, copied into its view of a flat float32 state buffer:
    words for the ValueError, "" when it can. Checked before anything is loaded: copy_ raised these half-way through
    a load (a meta tensor: "Cannot copy out of meta tensor", after opt.state was emptied and the counts zeroed), or
    dropped a complex tensor's imaginary part with a warning."""
    if not torch.is_tensor(value):
        return f"is a {type(value).__name__}, not a tensor"
    if getattr(value, "is_nested", False):
        return "is a nested tensor"
    if value.shape != param.shape:
        return f"has shape {tuple(value.shape)}, the parameter is a tensor of shape {tuple(param.shape)}"
    if value.is_meta:
        return "is a meta tensor: it has no values (a template, or a model built on the meta device, was saved)"
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor, not a dense one (save value.to_dense())"
    if value.is_quantized:
        return "is a quantized tensor (save value.dequantize())"
    if value.is_complex() and not param.is_complex():
        return "is complex, the parameter is real (copied, its imaginary part would be dropped)"
    return ""


def cast_problem(value, param: torch.Tensor) -> str:
    """Why torch.optim's load_state_dict cannot cast a saved state entry (tensors also inside lists, tuples and
    dicts) to `param`'s dtype and device as it does (Decentralized's wrapped optimizer loads it so): words for the
    ValueError, "" when it can. torch raised for a meta tensor only once the load was under way (after the int8
    wire's round was completed), and cast a complex tensor into a real parameter's dtype dropping its imaginary part."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((w for w in (cast_problem(v, param) for v in value) if w), "")
    if not torch.is_tensor(value):
        return ""
    if value.is_meta:
        return "is (or holds) a meta tensor: it has no values (a template, or a model built on the meta device, " \
               "was saved)"
    if value.is_complex() and param.is_floating_point():
        return "is (or holds) a complex tensor, the parameter is real (cast, its imaginary part would be dropped)"
    return ""


def step_count_of(key, value) -> float:
    """A saved per-parameter "step" as a number: a Python number or a one-element tensor with values; ValueError
    (naming parameter `key`) for anything else, before anything is loaded."""
    bad = torch.is_tensor(value) and (value.is_meta or value.is_complex() or value.numel() != 1)
    try:
        if not bad:
            return float(value)
    except (TypeError, ValueError, RuntimeError):
        pass
    what = f"a tensor of shape {tuple(value.shape)} on {value.device}" if torch.is_tensor(value) else repr(value)
    raise ValueError(f"state 'step' of parameter {key!r} is {what}, not a step count (a number, or a tensor of one "
                     "element): nothing was loaded")


def saved_param(param_of: dict, key):
    """The parameter a saved state key names (`param_of`: the saved groups' "params", indices or FQNs, -> the live
    parameters), also an index turned into a string (JSON, ...); None for a key that names none."""
    p = param_of.get(key)
    if p is None and isinstance(key, str) and key.isdigit():
        p = param_of.get(int(key))
    return p


def split_saved_state(saved_state: dict, param_of: dict) -> Tuple[dict, dict]:
    """A state_dict's "state" as (the parameters' entries, the others). The others are what code beside the optimizer
    keeps in opt.state under keys that are no parameter (torch's own tests write opt.state["test"] = 1 from a hook):
    torch.optim's load_state_dict puts them back in opt.state as they are, whatever their type, and so must ours;
    read as a parameter's state, a bool failed to iterate and a string or dict was dropped. ValueError for a
    parameter's entry that is not a dict (its state could not be read)."""
    params, others = {}, {}
    for key, st in saved_state.items():
        if saved_param(param_of, key) is None:
            others[key] = st
        elif st is None or isinstance(st, Mapping):
            params[key] = st
        else:
            raise ValueError(f"the state of parameter {key!r} is a {type(st).__name__}, not a dict of its state "
                             f"names: nothing was loaded")
    return params, others


def param_states(state) -> list:
    """The parameters' entries of a live opt.state (keyed by the parameter tensors, as torch.optim's state_dict()
    tells them from the other keys), not what other code keeps there under other keys (any value: a bool, a
    tensor of several elements)."""
    return [st for k, st in state.items() if isinstance(k, torch.Tensor)]


@torch.no_grad()
def write_state(buckets: List[Bucket], loaded: Loaded, state, layout: StateLayout) -> None:
    """The second half: the flat buffers and counts take what read_state found, and opt.state their views again
    (with the foreign entries read_state found). `layout.names_of(b)`: bucket b's optimizer-state buffers; a
    parameter given none of them starts afresh (zero buffers, count 0), as in a torch optimizer that loads it. A
    parameter given them without a count (torch.optim.SGD saves none) has stepped: count 1; given a count but not
    all of them, with layout.count_follows_buffers, it restarts at count 0, and given a count of 0 beside a nonzero
    buffer, it has stepped (_started)."""
    for b in buckets:
        b.step_count.zero_()
        b.published, b.published_names = [None] * len(b.slots), frozenset()
        names = layout.names_of(b)
        foreign_of = []
        for i, s in enumerate(b.slots):
            count, tensors, foreign = loaded.get((id(b), i), (None, {}, {}))
            if foreign:
                foreign_of.append((s.param, foreign))
            for name, value in tensors.items():
                if value is not None:
                    b.view(b.state_buffer(name), s).copy_(value)
            for name in names:
                if name not in tensors and name in b.state:
                    b.view(b.state[name], s).zero_()
            if count is not None:
                restart = layout.count_follows_buffers and any(name not in tensors for name in names)
                if count == 0 and not restart and layout.count_follows_buffers and b.template and _started(b, i, names):
                    count = 1.0  # a template's 0 left beside a buffer DCP loaded (_started)
                b.step_count[i] = 0.0 if restart else count
            elif any(name in tensors for name in names):
                b.step_count[i] = 1.0
        b.template = False
        if b.classes is not None:  # the loaded counts decide which slots agree
            b.classes = count_classes(b.step_count.tolist())
        publish_state(b, state)
        for param, foreign in foreign_of:
            state[param].update(foreign)


def _started(b: Bucket, i: int, names: List[str]) -> bool:
    """Whether slot i's buffers, as just loaded with a count of 0 into a DCP template (b.template: a new optimizer's
    zero state and counts, published for dcp.load to fill in), hold a started buffer. The template's count 0 stays
    beside the buffer of a checkpoint that has no count (torch.optim.SGD's, loaded with allow_partial_load), and
    restarting that buffer at the gradient dropped the momentum: a nonzero one has stepped, count 1, as a buffer loaded
    without one. Only into a template: elsewhere a count of 0 beside a nonzero buffer is a user's restart (opt.state[p]
    ["step"] set to 0), which a save and load must keep."""
    return any(bool(b.view(b.state[name], b.slots[i]).ne(0).any()) for name in names if name in b.state)


def _detached_from_buckets(b: Bucket, i: int, name: str, value, bucket_memory: set):
    """`value` to copy into slot i's buffer `name`: None when it is that very view already, a clone when it shares
    memory with the buckets otherwise (loading writes them), else itself."""
    if not torch.is_tensor(value) or value.untyped_storage().data_ptr() not in bucket_memory:
        return value
    buf = b.state.get(name)
    if buf is not None:
        dest = b.view(buf, b.slots[i])
        if value.data_ptr() == dest.data_ptr() and value.shape == dest.shape and value.stride() == dest.stride():
            return None
    return value.clone()


def publish_named_state(buckets: List[Bucket], state, name: str, present: bool, stateless_too: bool) -> dict:
    """opt.state[p][name]: views of each bucket's flat buffer `name` when `present` (for every parameter, or with
    `stateless_too` False only those that have state already: a wrapped torch optimizer initializes a parameter's
    state only when it finds none); removed from opt.state otherwise. Returns {param: view} of those left out for
    having no state, which a checkpoint must carry all the same (Decentralized._optimizer_state_dict)."""
    left_out = {}
    for b in buckets:
        buf = b.state.get(name) if present else None
        for s in b.slots:
            st = state.get(s.param)
            if buf is not None and (st or stateless_too):
                state[s.param][name] = b.view(buf, s)
                continue
            if st:
                st.pop(name, None)
            if buf is not None:
                left_out[s.param] = b.view(buf, s)
    return left_out


def drop_named_state(buckets: List[Bucket], state, prefix: str) -> None:
    """Removes every flat buffer whose name starts with `prefix` and its views in opt.state (recreated zero on use)."""
    for b in buckets:
        for name in [n for n in b.state if n.startswith(prefix)]:
            del b.state[name]
    for st in param_states(state):
        for name in [n for n in st if isinstance(n, str) and n.startswith(prefix)]:
            del st[name]


@torch.no_grad()
def gather_named_state(buckets: List[Bucket], state, name: str) -> None:
    """After loading, opt.state[p][name] into each bucket's flat buffer `name` (write_state has put the fused
    optimizers' there already, as views; a wrapped optimizer holds loose tensors)."""
    for b in buckets:
        parts = [(s, state.get(s.param, {}).get(name)) for s in b.slots]
        if any(v is not None for _, v in parts):
            buf = b.state_buffer(name)
            for s, v in parts:
                view = b.view(buf, s)
                if v is not None and v.data_ptr() != view.data_ptr():
                    view.copy_(v)
