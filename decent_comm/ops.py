"""The fused gossip-mix operators (torch.ops.decent_comm.*), with Python signatures and docs.

All ops mutate their first argument (and the optimizer state) in place and return None. Math runs in
float32 (float64 for float64 storage) whatever the storage dtype; neighbour buffers may have another
dtype than x (e.g. fp32 params mixed with bf16 received buffers). Inputs are contiguous 1-D flat buffers
of equal length on one device; optimizer state is float32.

``disagreement``, when given, is a 1-element float32 tensor that receives sum((mixed - x_old)^2), the
squared distance to the neighbourhood average, computed in the same pass over memory.

Refused before anything is written, with a message that starts ``decent_comm.<op>: `` and names the argument:
- by the dispatcher, caught here and refused with a RuntimeError: a tensor of another layout than strided (sparse,
  sparse CSR, mkldnn), none of whose backends has a kernel;
- by the kernels' checks (C++), with a RuntimeError: wrong lengths, dtypes, devices, layouts or shifted/shared
  memory; a non-finite weight or hyper-parameter, or one that overflows the math dtype (float32 unless x is
  float64); lr, eps, momentum, weight_decay < 0; betas outside [0, 1) (also once rounded to float32); step < 1,
  accum_steps < 1; a payload_block/block that is not a multiple of 4 in [4, 8192], a payload_offset < 0 (both
  also without copies, where Python raises the kernels' RuntimeError for them); and, while autograd is recording,
  any operand that requires grad (the ops have no derivative);
- here, in Python, before the call, with a ValueError: step, accum_steps, payload_offset, payload_block or block
  that is not an integer (a bool neither) or does not fit in int64 (step=1.5; step=0 is the kernels'); step=None
  without state_step, or a step given with it; copies without payloads or payloads without copies; and any bad
  argument of the pure-Python int8_payload_nbytes and int8_payload_views (a block the kernels refuse too).
Float hyper-parameters and weights go through float() unchecked (a string float() parses is taken; None raises
float's own TypeError): the optimizers check their options' types before they call the ops.
Under ``torch.no_grad()`` requires-grad tensors are accepted, as torch's in-place ops accept Parameters there;
every written tensor's version counter is bumped, as torch's in-place ops do.

The 8-bit wire dequantized inside the mix (every op, keyword-only): ``copies`` (float32 flat buffers, the public
copies of decent_comm.optim.int8_wire) and ``payloads`` (one int8_encode_ payload per copy, whole, uint8) with
``payload_offset`` (the payload element that x[0] corresponds to: a slice of a bucket passes its start; the end,
payload_offset + len(x), at most ``MAX_PAYLOAD_ELEMENTS`` = 2^31 - 1) and ``payload_block``. In the same pass over
memory, each copy is first advanced by its payload, exactly as ``int8_dequantize_add_`` would (copy[i] +=
level[offset + i] * scale, each rounded to float32: the sender's copy and this one keep the same bits), then mixed:
the copies take weights[0:len(copies)], the neighbours the rest, in that order. All neighbours are then float32.
The copies are written, so they may not share memory with x, the state or each other.

Mixed precision without host synchronization (the optimizer ops, keyword-only, all optional, each a 1-element
tensor on x's device):

- ``grad_scale`` (float32, GradScaler's scale): the kernel unscales the gradient itself, g = grad * (1 / scale)
  with the reciprocal rounded to float32 as ``GradScaler.unscale_`` does; ``grad`` is not modified.
- ``found_inf`` (float32, GradScaler's flag): when != 0 (or NaN) the update is skipped: x <- mixed (the gossip
  still happens, so ranks stay in lockstep), the optimizer state and the step count are left untouched.
- ``state_step`` (float32 like torch.optim's ``state["step"]``, float64, or int64): the number of updates
  applied *before* this call (0 initially), in place of the host ``step`` (pass ``step=None``). The kernel
  computes the bias corrections (AccumAdam: the window count and flush; SGD: the first-step momentum
  initialization) from count + 1, and the op then advances it by one unless the update was skipped. Pass the
  same tensor again next step. Counts up to 2^24 (float32), 2^53 (float64) or 2^62 (int64) are valid; there
  the count stops and the updates go on with t = the limit, as torch.optim's float32 ``step`` stops at 2^24. On
  CPU an invalid count (negative, fractional, NaN, past the limit) raises; on a GPU it cannot be checked without
  a synchronization, and it turns x into NaN instead of a plausible wrong update.
Every element of one call shares one count, so an optimizer needs one count per group of parameters with the
same update history. On CPU grad_scale must be finite and > 0 (checked; on a GPU it is GradScaler's). Nothing
here reads a device value on the host, so the calls capture into CUDA graphs. On a GPU a call with any of these
is three launches: a one-thread kernel that resolves them (and advances the count), then the update kernel and
a mix-only kernel, of which only the one found_inf selects does any work.
"""

import operator
from typing import Optional, Sequence

import torch

from . import _native  # noqa: F401  (registers the ops)
from ._args import is_bool

_ops = torch.ops.decent_comm

#: Most neighbours one call accepts.
MAX_NEIGHBORS = 32
#: Most payload elements one call's ``payloads=`` address: payload_offset + len(x) must not exceed it. The CUDA
#: kernels index a payload in 32 bits, and csrc/op_call.cpp (OpCall::set_payloads) refuses more on every device, so
#: the 8-bit wire's buckets (decent_comm.optim.int8_wire.check_bucket_sizes) hold at most this many elements.
MAX_PAYLOAD_ELEMENTS = 2 ** 31 - 1

#: Elements per float32 scale of the 8-bit wire's payloads (0.8% of a payload is scales): the default
#: ``block``/``payload_block`` of these ops and the block decent_comm.optim.int8_wire encodes with, defined here
#: alone. The kernels take any multiple of 4 in [4, 8192] (csrc/op_call.cpp); both ends of an edge must use one.
INT8_BLOCK = 512
#: The largest block the kernels take (csrc/kernels/int8_codec_math.h, kInt8MaxBlock).
_INT8_MAX_BLOCK = 8192

_INT64_MAX = 2 ** 63 - 1


def _refused(op: str, problem: str) -> ValueError:
    """A Python-side refusal of op `op`'s arguments, prefixed as the kernels' own (RuntimeError) refusals are."""
    return ValueError(f"decent_comm.{op}: {problem}")


def _int64(op: str, name: str, value) -> int:
    """`value` as an int64 for the op schema, refused by name when it is not an integer or does not fit. A bool is
    no integer (decent_comm._args' rule): operator.index takes True as 1, so step=True or accum_steps=True ran.
    Unlike the optimizers' options, a whole float (2.0) stays refused: the ops' arguments are the schema's int64s."""
    try:
        if is_bool(value):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise _refused(op, f"{name} must be an integer, got {value!r}") from None
    if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
        raise _refused(op, f"{name} must fit in int64 (at most 2**63 - 1), got {v}")
    return v


def _block_problem(name: str, block: int):
    """The kernels' refusal of block `block` (csrc: int8_ops.cpp, OpCall::set_payloads), or None: what Python checks
    where no kernel sees the value, with the kernels' words."""
    if not (4 <= block <= _INT8_MAX_BLOCK and block % 4 == 0):
        return f"{name} must be a multiple of 4 in [4, {_INT8_MAX_BLOCK}] (int8_encode_'s block), got {block}"
    return None


def _call(op: str, *args) -> None:
    """torch.ops.decent_comm.<op>(*args), a tensor of another layout than strided (sparse, sparse CSR, mkldnn)
    refused by name: the dispatcher finds no kernel for its backend before the kernels' checks run, and raised its
    own NotImplementedError ("Could not run 'decent_comm::mix_sgd_' with arguments from the 'SparseCPU' backend"),
    which named neither the op as decent_comm.<op> nor the argument. Looked for only once the dispatcher has refused,
    so the usual call pays nothing for it."""
    fn = getattr(_ops, op)
    try:
        fn(*args)
    except NotImplementedError:
        for arg, value in zip(fn.default._schema.arguments, args):
            named = [(f"{arg.name}[{j}]", t) for j, t in enumerate(value)] if isinstance(value, list) else \
                [(arg.name, value)]
            for name, t in named:
                if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                    raise RuntimeError(f"decent_comm.{op}: {name} has layout {t.layout}; the ops take dense (strided) "
                                       "tensors only (pass .to_dense())") from None
        raise


def _step_args(op: str, step, state_step) -> int:
    """The schema's host step: the given one, or 0 when the count comes from the device (state_step)."""
    if state_step is None:
        if step is None:
            raise _refused(op, "step is None but no state_step was given: pass the 1-based step or a state_step "
                               "tensor")
        return _int64(op, "step", step)
    if step is not None:
        raise _refused(op, f"pass step=None with state_step (the device count replaces it), got step={step!r}")
    return 0


def _weights(weights: Sequence[float]):
    return [float(w) for w in weights]


def _wire(op: str, copies, payloads, payload_offset, payload_block):
    """The schema's copies, payloads, payload_offset, payload_block."""
    if (copies is None) != (payloads is None):
        raise _refused(op, "pass copies and payloads together (one payload per copy), or neither")
    offset, block = _int64(op, "payload_offset", payload_offset), _int64(op, "payload_block", payload_block)
    if copies is None:
        # Checked all the same, a bad value being a bug in the caller whether or not a wire is used: with the
        # kernels' RuntimeError and words (payload_block=3 or payload_offset=-1 passed silently without copies), so
        # that copies= changes neither the outcome nor its type.
        problem = _block_problem("payload_block", block) or (
            f"payload_offset must be >= 0, got {offset}" if offset < 0 else None)
        if problem:
            raise RuntimeError(f"decent_comm.{op}: {problem}")
        return None, None, 0, INT8_BLOCK
    return list(copies), list(payloads), offset, block


def gossip_mix_(x: torch.Tensor, neighbors: Sequence[torch.Tensor], self_weight: float,
                weights: Sequence[float], disagreement: Optional[torch.Tensor] = None, *, copies=None, payloads=None,
                payload_offset: int = 0, payload_block: int = INT8_BLOCK) -> None:
    """x <- self_weight * x + sum_j weights[j] * neighbors[j] (with copies: see the module doc)."""
    _call("gossip_mix_", x, list(neighbors), float(self_weight), _weights(weights), disagreement,
                         *_wire("gossip_mix_", copies, payloads, payload_offset, payload_block))


def mix_sgd_(x, neighbors, self_weight, weights, grad, momentum_buffer, lr, momentum=0.0, dampening=0.0,
             weight_decay=0.0, nesterov=False, first_step=False, disagreement=None, *, grad_scale=None,
             found_inf=None, state_step=None, copies=None,
             payloads=None, payload_offset=0, payload_block=INT8_BLOCK) -> None:
    """Gossip mix fused with a torch.optim.SGD step whose direction is computed at x_old (AWC):

    g' = g + weight_decay * x_old; b = momentum * b + (1 - dampening) * g' (b = g' on the first step);
    d = g' + momentum * b if nesterov else b (d = g' when momentum = 0);
    x <- self_weight * x_old + sum_j w_j y_j - lr * d.

    ``first_step`` says the momentum buffer is uninitialized. With ``state_step`` (a device count, see the module
    doc) the kernel decides that instead (count == 0), so an overflow-skipped first step leaves the next one
    first; ``first_step`` must then be False.
    """
    _call("mix_sgd_", x, list(neighbors), float(self_weight), _weights(weights), grad, momentum_buffer,
                      float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov),
                      bool(first_step), disagreement, grad_scale, found_inf, state_step,
                      *_wire("mix_sgd_", copies, payloads, payload_offset, payload_block))


def mix_adam_(x, neighbors, self_weight, weights, grad, exp_avg, exp_avg_sq, step, lr, beta1=0.9,
              beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, disagreement=None, *, grad_scale=None,
              found_inf=None, state_step=None, copies=None,
              payloads=None, payload_offset=0, payload_block=INT8_BLOCK) -> None:
    """Gossip mix fused with a torch.optim.Adam (decoupled=False) / AdamW (decoupled=True) step.

    ``step`` is the 1-based count after this update, or None with ``state_step``, the device count of the
    updates applied before it (advanced by the op; see the module doc).
    x <- mix(x_old) - lr * (m_hat / (sqrt(v_hat) + eps) [+ weight_decay * x_old if decoupled]); with no
    neighbours and self_weight = 1 it is one torch step (to float32 rounding).
    """
    _call("mix_adam_", x, list(neighbors), float(self_weight), _weights(weights), grad, exp_avg, exp_avg_sq,
                       _step_args("mix_adam_", step, state_step), float(lr), float(beta1), float(beta2), float(eps),
                       float(weight_decay), bool(decoupled), disagreement, grad_scale, found_inf, state_step,
                       *_wire("mix_adam_", copies, payloads, payload_offset, payload_block))


def mix_accum_adam_(x, neighbors, self_weight, weights, grad, exp_avg, exp_avg_sq, accum, step, accum_steps,
                    lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                    disagreement=None, *, grad_scale=None, found_inf=None, state_step=None, copies=None,
                    payloads=None, payload_offset=0, payload_block=INT8_BLOCK) -> None:
    """Gossip mix fused with an AccumAdam(W) step (Wang et al., ICLR 2025).

    With K = accum_steps, t the 1-based update number (``step`` as in mix_adam_) and k = ceil(t / K):
    m = b1*M + (1-b1)*g; v = b2*V + (1-b2)*g^2;
    x <- mix(x_old) - lr * ((m / (1-b1^k)) / (sqrt(v / (1-b2^k)) + eps) [+ decoupled decay]);
    A += g / K; every K updates M, V absorb A (M = b1*M + (1-b1)*A, V = b2*V + (1-b2)*A^2) and A = 0.
    A skipped (found_inf) step does not count: it neither accumulates nor moves the window.
    """
    _call("mix_accum_adam_", x, list(neighbors), float(self_weight), _weights(weights), grad, exp_avg, exp_avg_sq,
                             accum, _step_args("mix_accum_adam_", step, state_step),
                             _int64("mix_accum_adam_", "accum_steps", accum_steps), float(lr), float(beta1),
                             float(beta2), float(eps), float(weight_decay), bool(decoupled), disagreement,
                             grad_scale, found_inf, state_step,
                             *_wire("mix_accum_adam_", copies, payloads, payload_offset, payload_block))


def int8_encode_(x: torch.Tensor, copy: torch.Tensor, payload: torch.Tensor, block: int = INT8_BLOCK) -> None:
    """The 8-bit wire's encoder, one pass over memory: payload <- Q(x - copy), then copy += deq(payload).

    Q cuts d = x - copy, rounded once to float32 (as torch.sub into a float32 output: a float64 x is subtracted in
    float64, a 16-bit x converted exactly), into blocks of ``block`` elements and writes, per block, int8 levels and
    one float32 scale. With fl() the rounding to float32 (to nearest, ties to even), absmax = max |d| over the block,
    inv = fl(127 / absmax) (0 when absmax is 0 or not finite; +inf when absmax < 127 / FLT_MAX), p = fl(d * inv)
    (0 where that is NaN: 0 * inf, inf * 0, a NaN d) clamped to -127..127:
        level = p rounded to an integer, ties to even;  scale = fl(absmax / 127);
        new copy = fl(copy + fl(level * scale)).
    That is not round(d * 127 / absmax): the rounding of 127 / absmax moves products across a half (-30 in the
    block [-10, -30, -60, -43]: -30 * fl(127 / 60) = -63.499996 gives -63, where the exact -63.5 would give -64).
    The payload (uint8) is ceil(n / block) * block levels (the tail of the last block 0), then the ceil(n / block)
    scales, so it has ``int8_payload_nbytes(n, block)`` bytes and must start 4-byte aligned. ``copy`` is float32,
    ``x`` float32, bfloat16, float16 (or float64 on CPU). Every float operation is one IEEE operation with its own
    rounding (no FMA), with subnormals kept whatever the caller's flush-to-zero mode (torch.set_flush_denormal: the
    CPU loops run with it off), so a receiver's int8_dequantize_add_ leaves its copy bit-identical to the sender's,
    on any CPU or GPU. A NaN makes its block's scale NaN, a +-inf makes it +inf; either way the block's levels are 0
    and its new copies NaN (0 * scale), on the sender and its receivers alike.

    The new copy differs from x by at most absmax / 254 per element (half a level, to the float32 roundings: within
    absmax / 254 x (1 + 1e-4), tested), plus the rounding of the copy itself to float32 (half an ulp of it), for a
    block whose absmax is at least 127 / FLT_MAX = 3.7321948e-37 and whose new copies are finite. Below that absmax
    (every |d| in the block below 3.73e-37: subnormal values, and normal ones up to about 31 x FLT_MIN) 127 / absmax
    overflows: every nonzero element gets level +-127 and its copy moves by +-absmax (to the scale's rounding), an
    error up to absmax (< 3.74e-37) instead. Float32's range bounds the rest. Where d itself overflows (|x - copy|
    >= 2^128 - 2^103, about 3.4028236e38: a float64 x of 1e39, whatever the copy, or a float32 x of 3e38 against a
    copy of -3e38) the block's absmax and scale are +inf and the whole block's new copies NaN, as for an inf in x.
    With every d finite, a copy overflows to +-inf where copy + level * scale passes FLT_MAX: from a zero copy only
    in a block whose absmax is FLT_MAX itself, from another for an element within absmax / 254 of +-FLT_MAX (or
    beyond it: a float64 x). The optimizers' check_finite=True names either as the wire's float32 range.
    """
    _call("int8_encode_", x, copy, payload, _int64("int8_encode_", "block", block))


def int8_dequantize_add_(copy: torch.Tensor, payload: torch.Tensor, block: int = INT8_BLOCK) -> None:
    """copy += deq(payload) (level * scale, then the add, each rounded to float32): a receiver's side of
    int8_encode_."""
    _call("int8_dequantize_add_", copy, payload, _int64("int8_dequantize_add_", "block", block))


def int8_payload_nbytes(numel: int, block: int = INT8_BLOCK) -> int:
    """Bytes of an int8_encode_ payload for `numel` elements: the levels padded to whole blocks, and a float32
    scale per block. `block` is refused (ValueError) as the kernels refuse it: block=0 divided by zero, 3 (which
    the kernels refuse) and -1 gave a size."""
    numel, block = _codec_block("int8_payload_nbytes", block, numel)
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def _codec_block(op: str, block, numel=0):
    """(numel, block) as ints for the pure-Python codec helpers: numel >= 0, block one the kernels take."""
    numel, block = _int64(op, "numel", numel), _int64(op, "block", block)
    problem = f"numel must be >= 0, got {numel}" if numel < 0 else _block_problem("block", block)
    if problem:
        raise _refused(op, problem)
    return numel, block


def int8_payload_views(payload: torch.Tensor, block: int = INT8_BLOCK):
    """The (blocks, block) int8 levels and the (blocks,) float32 scales of an int8_encode_ payload, as views of it
    (the one place in Python that knows the layout)."""
    _, block = _codec_block("int8_payload_views", block)
    if not isinstance(payload, torch.Tensor):
        raise _refused("int8_payload_views", f"payload must be a tensor (int8_encode_'s uint8 payload), got "
                       f"{type(payload).__name__}")
    if payload.dim() != 1 or payload.dtype != torch.uint8 or payload.numel() % (block + 4):
        raise _refused("int8_payload_views", f"not an int8_encode_ payload of blocks of {block}: {payload.dtype} of "
                       f"shape {tuple(payload.shape)} (int8_payload_nbytes gives its size)")
    blocks = payload.numel() // (block + 4)
    return (payload[:blocks * block].view(torch.int8).view(blocks, block),
            payload[blocks * block:].view(torch.float32))


def has_cuda_kernels() -> bool:
    """True when this build registered CUDA kernels for every op."""
    return _native.built_with_cuda()
