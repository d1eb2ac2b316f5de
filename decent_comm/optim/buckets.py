"""Flat parameter/gradient buckets: what the fused kernels and the exchange scheduler operate on.

Parameters of one param group, device and dtype are laid out back to back in flat buffers of about
`bucket_cap_mb`; each Parameter keeps its identity but its .data becomes a view into its bucket, and its
.grad a view into the bucket's flat gradient buffer. Optimizer state lives in flat float32 buffers of the
same layout, exposed per parameter as views (so torch.optim's state_dict machinery sees per-param state).

The buckets' step counts and the runs a fused kernel call spans: step_counts.py; the parameters' version
counters (kernel writes autograd must see, user writes while a buffer is on the wire): param_versions.py.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._args import real
from .flat_memory import flat_buffer
from .shared_memory import check_no_shared_memory, labelled_params
from .step_cache import StepCache

# Start every parameter on a 16-byte boundary of its bucket, so the per-parameter views used when only
# some parameters have gradients keep the CUDA kernels on their vectorized path.
_ALIGN_BYTES = 16


@dataclass
class Slot:
    """Where one parameter lives inside its bucket."""

    param: torch.nn.Parameter
    offset: int
    numel: int
    # The parameter's strides when it is dense but not contiguous (channels_last): its views keep that layout, as
    # torch's optimizers never change a parameter's memory format. None: contiguous views.
    stride: Optional[Tuple[int, ...]] = None
    shape: Tuple[int, ...] = ()  # the parameter's shape at construction (its view's, whatever .data becomes)
    # Its name in errors: its place in the user's param groups (shared_memory.labelled_params), not in the bucket's
    # slots, which differ where a group mixes dtypes or devices
    label: str = ""


@dataclass
class Bucket:
    index: int
    group_index: int
    device: torch.device
    dtype: torch.dtype
    slots: List[Slot]
    numel: int
    flat: torch.Tensor = None                    # the parameters
    grad: torch.Tensor = None                    # the gradients
    state: Dict[str, torch.Tensor] = field(default_factory=dict)  # float32 optimizer state
    # Per slot: optimizer steps taken. A float32 CPU tensor, like torch's state["step"]: opt.state[p]["step"]
    # is a view of its entry, so what torch.optim tools read and write is what the kernels use.
    step_count: torch.Tensor = None
    # Per slot: the views opt.state[p] got, if any. Replaced, never changed in place, so that a new list object
    # tells user_edits.StateWatch to look again.
    published: List[Optional[dict]] = field(default_factory=list)
    published_names: frozenset = frozenset()  # the state buffers the published views cover
    # The parameters' version counters while the flat buffer is on the wire (param_versions.note_in_flight), else None.
    versions: Optional[List[int]] = None
    # Once the kernels count the steps on the device (GradScaler, decent_comm.optim.amp): per slot, an id of its
    # history of updates; slots with equal ids have equal counts, which the host no longer reads. None before.
    classes: Optional[List[int]] = None
    lanes_used: int = 0  # flat buffers allocated so far: the next one starts in the next page lane (flat_memory)
    # opt.state published for DCP's state initialization, nothing stepped or loaded since (state_views._started)
    template: bool = False
    cache: StepCache = None  # what the last step found, to tell cheaply that the next finds the same (step_cache)

    @property
    def steps(self) -> List[int]:
        return [int(v) for v in self.step_count.tolist()]

    @property
    def count_keys(self) -> List[int]:
        """Per slot, a key that is equal for slots whose step counts are equal (read without a device sync)."""
        return self.steps if self.classes is None else self.classes

    def view(self, flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        seg = flat[slot.offset: slot.offset + slot.numel]
        return seg.view(slot.shape) if slot.stride is None else seg.as_strided(slot.shape, slot.stride)

    def new_flat(self, dtype: Optional[torch.dtype] = None, zero: bool = True) -> torch.Tensor:
        """A new flat buffer of this bucket's length (`dtype`, default the bucket's), in the next page lane."""
        self.lanes_used += 1
        return flat_buffer(self.numel, dtype or self.dtype, self.device, self.lanes_used - 1, zero)

    def state_buffer(self, name: str) -> torch.Tensor:
        """The flat float32 state buffer `name`, created zero-filled on first use."""
        buf = self.state.get(name)
        if buf is None:
            buf = self.new_flat(torch.float32)
            self.state[name] = buf
        return buf


def _aligned(n: int, element_size: int) -> int:
    per = max(1, _ALIGN_BYTES // element_size)
    return (n + per - 1) // per * per


def build_buckets(param_groups: List[dict], bucket_cap_mb: float,
                  check: Optional[Callable[[List[Bucket]], None]] = None) -> List[Bucket]:
    """Assigns every parameter to a bucket (one param group, device and dtype per bucket, in parameter
    order) and moves it into the bucket's flat buffers. Parameter order is kept, so buckets follow the
    order in which a model's modules use them (model.parameters() order). `check` sees the layout (slots and
    sizes) before any buffer is allocated, so that what it refuses costs no memory."""
    bucket_cap_mb = real(bucket_cap_mb, "bucket_cap_mb", low=0, low_open=True)  # np.float32 and np.int64 too
    cap_bytes = int(bucket_cap_mb * 2**20)
    buckets: List[Bucket] = []
    seen = set()
    for gi, group in enumerate(param_groups):
        open_buckets: Dict[tuple, Bucket] = {}
        for j, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError(f"a parameter appears more than once in the optimizer's param groups (parameter {j} "
                                 f"of param group {gi}, shape {tuple(p.shape)})")
            if isinstance(p, torch.nn.parameter.UninitializedParameter):
                raise ValueError(f"param group {gi} holds an uninitialized parameter (nn.LazyLinear and the other lazy "
                                 "modules): run one forward pass before building the optimizer, as its buffers are "
                                 "laid out from the parameters' sizes")
            seen.add(id(p))
            if p.is_sparse or not p.is_floating_point():
                raise ValueError(f"decentralized optimizers need dense real floating-point parameters, got {p.dtype}"
                                 f"{' sparse' if p.is_sparse else ''} of shape {tuple(p.shape)}: parameter {j} of param "
                                 f"group {gi}"
                                 f"{'' if p.requires_grad else ' (it needs no gradient: leave such tensors, e.g. quantized weights, out of the params, as [p for p in model.parameters() if p.requires_grad] does)'}")
            key = (p.device, p.dtype)
            b = open_buckets.get(key)
            size = _aligned(p.numel(), p.element_size())
            if b is not None and b.numel > 0 and (b.numel + size) * p.element_size() > cap_bytes:
                b = None
            if b is None:
                b = Bucket(len(buckets), gi, p.device, p.dtype, [], 0)
                buckets.append(b)
                open_buckets[key] = b
            b.slots.append(Slot(p, b.numel, p.numel(), None if p.is_contiguous() or not _dense(p) else p.stride(),
                                tuple(p.shape)))
            b.numel += size
    check_no_shared_memory(param_groups)
    labels = {id(p): label for label, p in labelled_params(param_groups)}
    for b in buckets:
        for s in b.slots:
            s.label = labels[id(s.param)]
    if check is not None:
        check(buckets)
    for b in buckets:
        b.cache = StepCache([s.param for s in b.slots])
        _materialize(b)
        b.step_count = torch.zeros(len(b.slots), dtype=torch.float32)
        b.published = [None] * len(b.slots)
    return buckets


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill numel() consecutive places, each once, in some order of the dimensions (channels_last)."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _materialize(b: Bucket) -> None:
    b.flat = b.new_flat()
    b.grad = b.new_flat()
    with torch.no_grad():
        for s, grad_view in zip(b.slots, b.cache.grad_views(b)):
            view = b.view(b.flat, s)
            view.copy_(s.param.detach())
            had_grad = s.param.grad is not None
            if had_grad:
                grad_view.copy_(s.param.grad)
            s.param.data = view
            s.param.grad = grad_view if had_grad else None


@torch.no_grad()
def adopt_storage(b: Bucket, before_copy: Optional[Callable[[], None]] = None,
                  siblings: Sequence[Bucket] = ()) -> None:
    """Parameters whose .data is no longer their view of the bucket. Same dtype, device and shape: user code gave
    them new storage (p.data = t, vector_to_parameters, p.set_(t), model.to_empty()), and torch would train that:
    the values are copied into the view and .data points back at it. Another dtype, device or shape (model.to(...),
    .half(), .cuda(), a reshape) is refused with what to do: the updates would go to a buffer the model no longer
    reads (a view of another shape laid over the slot's strides wrote into the next parameter). Storage inside this
    optimizer's buffers (`siblings`: its buckets), another parameter's (b.data = a.data), is refused too: copied
    back, the tie was silently undone.
    `before_copy`: called once before the first copy (to complete the bucket's transfers: the copy writes it)."""
    for i, s in enumerate(b.slots):
        p = s.param
        error = converted(b, i)
        if error is not None:
            raise error
        view = b.view(b.flat, s)
        if p.data_ptr() != view.data_ptr() or p.stride() != view.stride():
            mine = {o.flat.untyped_storage().data_ptr() for o in (b, *siblings)}
            if p.untyped_storage().data_ptr() in mine:
                raise RuntimeError(
                    f"decent_comm: parameter {s.label} (shape {tuple(p.shape)}) now shares memory "
                    "with another parameter of this optimizer (tied after it was built, b.data = a.data; swapped, "
                    "a.data, b.data = b.data, a.data) or is a view of its own memory in another layout (p.data = "
                    "p.data.t()): tie parameters before building the optimizer (it takes a shared parameter once); "
                    "swap or re-lay-out clones (a.data, b.data = b.data.clone(), a.data.clone())")
            if before_copy is not None:
                before_copy()
                before_copy = None
            view.copy_(p.detach())
            p.data = view


def converted(b: Bucket, i: int) -> Optional[RuntimeError]:
    """The error for slot i's parameter when it is no longer of its bucket's dtype, device and shape (None when it
    is)."""
    p, s = b.slots[i].param, b.slots[i]
    if p.dtype == b.dtype and p.device == b.device and tuple(p.shape) == s.shape:
        return None
    return RuntimeError(
        f"decent_comm: parameter {s.label} is now {p.dtype} on {p.device} of shape "
        f"{tuple(p.shape)}, where the optimizer's buffer holds {b.dtype} of shape {s.shape} on {b.device}: the "
        "model was converted, moved, resized or reshaped (model.to(...), .cuda(), .half()) after the optimizer was "
        "built. Build the optimizer after moving the model (as with DDP), or build a new one and load the old one's "
        "state_dict().")


def find_bucket_of(buckets: List[Bucket]) -> Dict[int, tuple]:
    """id(param) -> (bucket, slot index)."""
    return {id(s.param): (b, i) for b in buckets for i, s in enumerate(b.slots)}
