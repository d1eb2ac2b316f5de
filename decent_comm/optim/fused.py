"""The fused decentralized optimizers: torch.optim signatures plus the decentralized keyword options.

Each is a torch.optim.Optimizer whose step runs one fused mix+update kernel per bucket (decent_comm.ops).
Without an initialized process group, or with world size 1, each matches its torch counterpart to float32 rounding
(not bit for bit: the fused kernel orders the arithmetic its own way; docs/api.md).
"""

import collections
import functools
import re

import torch

from .. import ops
from .._args import integer, is_bool, is_real
from .base import DecentralizedMixin
from .group_fingerprint import options_fingerprint
from .startup import refusal_told
from .step_counts import grads_present
from .tracing import traced

_DECENTRALIZED_DEFAULTS = dict(topology="one-peer-exp", mode="awc", process_group=None, bucket_cap_mb=25,
                               comm_dtype=None, consensus=1.0, model=None, broadcast_init=True, timeout=None,
                               track_disagreement=False, exchange="auto", check_finite=False,
                               gossip_every=1, warmup_steps=0, delayed_mix=False)
_DOC_OPTIONS = """
    Decentralized options (keyword-only):
        topology: a built-in name (decent_comm.topology.NAMES), a decent_comm.topology.Topology, or a mixing
            matrix / list of matrices (time-varying, cycled).
        mode: "awc" (communicate while adapting; the exchange overlaps the next forward+backward) or "atc"
            (adapt then combine; the exchange overlaps the next forward, with or without `model`). ATC averages each
            step before the next gradient, so replicas stay closer and, at equal steps, the loss is better
            (train_lm: within 2% of all-reduce where AWC trails by up to 11%, docs/quality_results.md); AWC hides
            more communication.
        process_group: the group to gossip in (default: the default group).
        bucket_cap_mb: size of the flat buckets parameters are laid out in.
        comm_dtype: wire dtype (e.g. torch.bfloat16 halves the bytes); received buffers keep it. torch.int8: the
            8-bit wire, about a quarter of fp32's bytes: each round sends the int8 change (one scale per 512
            elements) of a public copy that sender and receivers keep, CHOCO-style, so quantization errors are fed
            back, not accumulated (decent_comm.optim.int8_wire; costs float32 copies of the parameters: 3 on a
            ring, 2 log2(n) on one-peer-exp; point to point only).
        consensus: DSGD-AC factor a (W -> (1-a) I + a W): a number, a callable of the step, or a schedule
            object such as decent_comm.AdaptiveConsensus.
        model: the module the parameters belong to; in ATC mode its forward pre-hooks apply each bucket's mix
            just before the first module using it runs. Without it a global forward pre-hook finds the modules
            that run; a bucket no running module holds is mixed at the end of step(). ATC is exact either way.
        broadcast_init: start all replicas from rank 0's parameters.
        timeout: seconds a peer may take before step() raises (default: the process group's timeout).
        track_disagreement: have the fused kernels also compute, in the same pass, each rank's squared distance
            to its neighbourhood average (``last_disagreement``, ``disagreement()``); always on when an
            ``Adaptive`` topology's policy needs it. Off by default: on CPU the extra reduction costs about a
            third of the kernel's time (mix_adam_, 4M floats, 1 neighbour, 2 threads: 4.6 ms -> 6.2 ms).
        exchange: "auto" runs every step whose mixing is uniform averaging within groups of >= 3 ranks
            (complete, intra-node averaging, aer with inter="pair", ...) as one all-reduce per group, which moves
            fewer bytes than point-to-point gossip; "p2p" never does (see decent_comm.optim.plan.GroupSteps).
        gossip_every: gossip every k-th step only, with local steps between (a communication interval, as
            torch's PeriodicModelAverager's period or Bagua's communication_interval); the r-th gossiping step uses
            the topology's step r (and an Adaptive topology decides per gossip round).
        warmup_steps: all-reduce the gradients for the first steps instead of gossiping (torch's
            PostLocalSGDOptimizer warm-up: the replicas start identical and stay so, DDP's update), then gossip.
            Steps count from 0; gossip_every applies from warmup_steps on.
        delayed_mix: (awc) launch each gossip round's exchange at the end of its step, from a copy of the
            parameters, and mix it in at the next round as a correction x <- x + sum_j w_j (x_j' - x') (x' the
            copies sent): the transfer overlaps the whole interval of gossip_every steps instead of one forward and
            backward, so on slow links a round costs no waiting once gossip_every steps of compute cover it. Costs
            one copy of the parameters in the wire dtype. A checkpoint carries the round in flight (per-parameter
            state "delayed_mix_correction"), so a resume continues exactly.
        check_finite: raise, naming the rank, the step and the bucket, when a rank's parameters become non-finite
            (checked before they are sent) or a neighbour's arrive non-finite, instead of letting a NaN spread
            through the gossip silently. Costs a device sync per bucket and step: for debugging.
"""


def _split_options(kwargs):
    unknown = set(kwargs) - set(_DECENTRALIZED_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return {**_DECENTRALIZED_DEFAULTS, **kwargs}


def _next(step):
    """The 1-based count after this update from the host count before it; None when the kernel counts
    (`state_step` among the device scalars, decent_comm.optim.amp)."""
    return None if step is None else step + 1


_TORCH_NAME = {"DSGD": "SGD", "DAdam": "Adam", "DAdamW": "AdamW"}


def _reject_unsupported(cls_name, where="", **flags):
    for flag, value in flags.items():
        if value:
            inner = _TORCH_NAME.get(cls_name, "Adam")
            raise ValueError(f"{cls_name}{where}: {flag}=True is not supported by the fused kernels; wrap the torch "
                             f"optimizer instead: decent_comm.Decentralized(torch.optim.{inner}(..., {flag}=True))")


class _FusedGroupOptions:
    """torch options that change the update and the fused kernels do not implement: refused in every param group
    too (constructor arguments, groups given as dicts, loaded checkpoints), as torch reads them per group."""
    _UNSUPPORTED = ("maximize", "differentiable")  # checked at construction, load and every step, as torch reads them
    _accepted_options = None  # group_fingerprint.options_fingerprint of each live group when last accepted

    def _check_group_options(self, groups, changed_only=False):
        """changed_only (step()): only the live groups whose options differ from when they were last accepted
        (group_fingerprint). Construction checks every group; load_state_dict every group it loads, after which the
        next step checks every live group again (the fingerprints are dropped)."""
        name, live = type(self).__name__, groups is self.param_groups
        if not changed_only or self._accepted_options is None:
            self._accepted_options = []
        accepted = self._accepted_options
        del accepted[len(groups):]
        for index, group in enumerate(groups):
            math_dtype = self._math_dtype(index)
            seen = options_fingerprint(group, index, math_dtype) if live else None
            if changed_only and index < len(accepted) and accepted[index] == seen:
                continue
            where = f" (param group {index})"
            _reject_unsupported(name, where, **{flag: group.get(flag) for flag in self._UNSUPPORTED})
            self._check_group(group, name + where)
            _check_group_tensors(group, name + where)
            self._check_values(group, name + where, math_dtype)
            if live:  # (index <= len(accepted): every group before this one has its entry)
                accepted[index:index + 1] = [seen]

    def _check_group(self, group, where):
        """Class-specific checks of one group; `where` names the optimizer and the group for the message."""

    # Its own profiler range: the stand-in's kernel call is a decent_comm::mix_adam_ / mix_sgd_ event too, and
    # outside any range it read as a second kernel per step in a trace (kernel counts doubled); inside this range the
    # real ones are those inside mix_update / local_update. (traced: one flag read per group when no profiler runs.)
    @traced("check_values")
    def _check_values(self, group, where, math_dtype):
        """ValueError for a hyper-parameter value the kernels refuse (lr, eps, weight_decay, momentum < 0, betas
        outside [0, 1), a value float32 math cannot hold, ...; torch.optim takes some of them), found by the kernel
        call of a step on a one-element stand-in on the meta device: the kernels' own checks, which the Meta kernel
        shares, with nothing computed. Every group is checked before any bucket moves: the kernel of the group
        holding such a value raised after the groups before it had stepped, their step counts advanced."""
        try:
            self._local_update(_meta_bucket(math_dtype), slice(0, 1), group, 0, [], 1.0, [])
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{where}: {re.sub(r'^decent_comm[.][a-z_]+: ', '', str(e))}") from None

    def _math_dtype(self, index):
        """The math dtype of live param group `index`'s kernels: float64 when its parameters are all float64 (any
        finite value is taken), else float32 (bf16, fp16, fp32 storage), where a value must also fit in float32."""
        params = self.param_groups[index]["params"] if index < len(self.param_groups) else []
        return torch.float64 if params and all(p.dtype == torch.float64 for p in params) else torch.float32

    def _complete_loaded_groups(self, groups):
        """A loaded checkpoint's groups (torch's load_state_dict takes them whole): a key the saved optimizer did not
        have (AccumAdamW's accum_steps in torch.optim.AdamW's) takes this one's default, as torch's optimizers
        setdefault theirs; `capturable` (a GPU AdamW's, which does not change the update) is kept as False."""
        for group in groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if "capturable" in group:
                group["capturable"] = False


class _MetaBucket:
    """What _local_update reads of a bucket, one element long on the meta device (state float32, as the kernels
    keep it): a kernel call on it only checks its arguments."""

    def __init__(self, dtype):
        self.flat = torch.empty(1, device="meta", dtype=dtype)
        self.grad = torch.empty_like(self.flat)
        self.state = collections.defaultdict(lambda: torch.empty(1, device="meta"))

    def state_buffer(self, name):
        return self.state[name]


@functools.lru_cache(maxsize=None)
def _meta_bucket(dtype):
    return _MetaBucket(dtype)


def _check_scalars(**values):
    """Each option a number torch.optim's arithmetic takes, named when it is not: a non-number (a string, which the
    kernels' float() parsed: a typo'd "0.1" trained) is torch's TypeError; a bool, which torch refuses as weight decay
    ("Boolean alpha") and the kernels took as 1.0, a ValueError (_args.is_bool: a bool is no number anywhere here).
    A tensor option of several elements is torch.optim's ValueError("Tensor lr must be 1-element"), raised before the
    option is compared: `0.0 <= lr` raised RuntimeError("Boolean value of Tensor with more than one value is
    ambiguous"), which names no option. torch checks lr (and betas, too late) so; eps, weight_decay, momentum and
    dampening fail the same way in torch, and are named here too. A meta tensor holds no value to read."""
    for name, value in values.items():
        if is_bool(value):
            raise ValueError(f"{name} must be a number, got {value!r} (a bool is not a number here)")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Tensor {name} must be 1-element")
            if value.is_meta or value.is_complex():
                raise ValueError(f"Tensor {name} must hold a real value, got one of dtype {value.dtype} on "
                                 f"{value.device}")
        elif not is_real(value):  # a 0-d numpy array (np.array(0.1)) is a number, as torch.optim trains with it
            raise TypeError(f"{name} must be a float or a 1-element tensor, got {value!r} ({type(value).__name__})")


def _check_group_tensors(group, where):
    """_check_scalars for a param group's options (groups given as dicts, edited, or loaded), naming it."""
    names = ("lr", "eps", "weight_decay", "momentum", "dampening")
    values = {name: group[name] for name in names if name in group}
    values.update({f"betas[{i}]": b for i, b in enumerate(group.get("betas", ()))})
    try:
        _check_scalars(**values)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def _check_common(lr, weight_decay, eps=None, betas=None):
    _check_scalars(lr=lr, weight_decay=weight_decay, **({} if eps is None else dict(eps=eps)))
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        if len(betas) != 2:  # else a step failed to unpack them
            raise ValueError(f"betas must be a pair (beta1, beta2), got {tuple(betas)!r}")
        _check_scalars(**{f"betas[{i}]": b for i, b in enumerate(betas)})
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")


class DSGD(_FusedGroupOptions, DecentralizedMixin, torch.optim.Optimizer):
    __doc__ = "Decentralized torch.optim.SGD (momentum, dampening, nesterov, weight_decay as torch)." + _DOC_OPTIONS
    _sparse_grads_ok = True
    _amp_in_kernel = True

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None, **decentralized):
        with refusal_told(decentralized):
            _check_common(lr, weight_decay)
            _check_scalars(momentum=momentum, dampening=dampening)
            if momentum < 0:
                raise ValueError(f"Invalid momentum value: {momentum}")
            if nesterov and (momentum <= 0 or dampening != 0):
                raise ValueError("Nesterov momentum requires a momentum and zero dampening")
            _reject_unsupported("DSGD", maximize=maximize, differentiable=differentiable)
            opts = _split_options(decentralized)
            torch.optim.Optimizer.__init__(self, params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                                              weight_decay=weight_decay, nesterov=nesterov))
        self._init_decentralized(**opts)

    _STATE_NAMES = ("momentum_buffer",)
    # The count is the steps since the buffer started: a parameter whose buffer is dropped (opt.state[p]
    # ["momentum_buffer"] = None, del, a checkpoint without it) restarts at 0, and its buffer at g, as torch's.
    _COUNT_FOLLOWS_BUFFERS = True

    def _state_names(self, group):
        return list(self._STATE_NAMES) if group["momentum"] != 0 else []

    def _prepare_bucket(self, b, group):
        # The kernels start a parameter's momentum buffer at g (not (1 - dampening) g) on its step 0, as torch does the
        # first time it finds no buffer. Momentum switched on after the first steps (or a checkpoint without buffers
        # loaded): the step counts restart, so each parameter's first step with momentum is its step 0 again, on the
        # host and in the kernels that keep the counts on the device alike. torch.optim.SGD keeps no step count; ours
        # counts the steps since the buffer started.
        if group["momentum"] != 0 and "momentum_buffer" not in b.state and \
                any(grads_present(b)):  # (none for a frozen bucket, as torch)
            b.state_buffer("momentum_buffer")
            b.step_count.zero_()
            if b.classes is not None:
                b.classes = [0] * len(b.slots)

    def _local_update(self, b, sl, group, step, nbs, self_weight, weights, disagreement=None, **op_kwargs):
        momentum = group["momentum"]
        buf = b.state["momentum_buffer"][sl] if momentum != 0 else None
        ops.mix_sgd_(b.flat[sl], nbs, self_weight, weights, b.grad[sl], buf, group["lr"], momentum,
                     group["dampening"], group["weight_decay"], group["nesterov"] and momentum != 0,
                     first_step=step == 0,
                     disagreement=disagreement, **op_kwargs)


class _AdamBase(_FusedGroupOptions, DecentralizedMixin, torch.optim.Optimizer):
    _decoupled = False
    _UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
    _amp_in_kernel = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None, _extra_defaults=None,
                 **decentralized):
        with refusal_told(decentralized):
            _check_common(lr, weight_decay, eps, betas)
            _reject_unsupported(type(self).__name__, amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                                differentiable=differentiable)
            opts = _split_options(decentralized)
            # as torch's Adam (_to_scalar): a one-element tensor beta is kept as a 0-dim tensor
            betas = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() else b for b in betas)
            defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **(_extra_defaults or {}))
            torch.optim.Optimizer.__init__(self, params, defaults)
        self._init_decentralized(**opts)

    def _check_group(self, group, where):
        if len(tuple(group["betas"])) != 2:  # else the step failed to unpack them
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {tuple(group['betas'])!r}")
        # torch's Adam groups say which decay they apply: a checkpoint's must match where there is any decay
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is not None and bool(decoupled) != self._decoupled and group.get("weight_decay", 0) != 0:
            # the kernels take one decay kind per optimizer: torch's per-group flag has no fused equivalent
            choose = ("AccumAdamW for decoupled decay, AccumAdam for L2" if isinstance(self, AccumAdam) else
                      "DAdam(..., decoupled_weight_decay=True) (as torch.optim.Adam's) or DAdamW for decoupled decay, "
                      "DAdam for L2")
            raise ValueError(f"{where}: decoupled_weight_decay={decoupled} with weight_decay={group['weight_decay']}, "
                             f"but {type(self).__name__} applies {'decoupled' if self._decoupled else 'L2'} weight "
                             f"decay to every group: the flag is per optimizer here, not per param group. Use "
                             f"{choose}, for every group alike; for decay that differs between groups, "
                             "decent_comm.Decentralized(torch.optim.Adam(...)) (torch honours the flag per group)")

    _STATE_NAMES = _STATE_NEEDED = ("exp_avg", "exp_avg_sq")

    def _state_names(self, group):
        return list(self._STATE_NAMES)

    def _local_update(self, b, sl, group, step, nbs, self_weight, weights, disagreement=None, **op_kwargs):
        beta1, beta2 = group["betas"]
        ops.mix_adam_(b.flat[sl], nbs, self_weight, weights, b.grad[sl], b.state_buffer("exp_avg")[sl],
                      b.state_buffer("exp_avg_sq")[sl], _next(step), group["lr"], beta1, beta2, group["eps"],
                      group["weight_decay"], self._decoupled, disagreement=disagreement, **op_kwargs)


class DAdam(_AdamBase):
    __doc__ = "Decentralized torch.optim.Adam (L2 weight decay folded into the gradient)." + _DOC_OPTIONS

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, **decentralized):
        # torch.optim.Adam's flag: True is AdamW's update (and its groups say so, which checkpoints and the start-up
        # comparison of the ranks see)
        self._decoupled = bool(decoupled_weight_decay)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         _extra_defaults=dict(decoupled_weight_decay=True) if self._decoupled else None,
                         **decentralized)


class DAdamW(_AdamBase):
    __doc__ = "Decentralized torch.optim.AdamW (decoupled weight decay)." + _DOC_OPTIONS
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None, **decentralized):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused, **decentralized)


class AccumAdam(_AdamBase):
    __doc__ = ("AccumAdam (Wang et al., ICLR 2025): Adam whose moments absorb the mean gradient of every "
               "`accum_steps` steps, damping the momentum drift decentralization adds." + _DOC_OPTIONS)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 accum_steps=4, foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 **decentralized):
        with refusal_told(decentralized):
            accum_steps = integer(accum_steps, "accum_steps", low=1)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         _extra_defaults=dict(accum_steps=accum_steps), **decentralized)

    _STATE_NAMES = ("exp_avg", "exp_avg_sq", "accum")

    def _check_group(self, group, where):
        # as the constructor checks it: an edited or loaded True trained as accum_steps=1 (the op's int64 took it)
        super()._check_group(group, where)
        integer(group.get("accum_steps"), "accum_steps", low=1, where=where)

    def _local_update(self, b, sl, group, step, nbs, self_weight, weights, disagreement=None, **op_kwargs):
        beta1, beta2 = group["betas"]
        k = integer(group["accum_steps"], "accum_steps")  # an edited 2.0 as the int 2 the op's int64 takes
        ops.mix_accum_adam_(b.flat[sl], nbs, self_weight, weights, b.grad[sl], b.state_buffer("exp_avg")[sl],
                            b.state_buffer("exp_avg_sq")[sl], b.state_buffer("accum")[sl], _next(step), k,
                            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], self._decoupled,
                            disagreement=disagreement, **op_kwargs)


class AccumAdamW(AccumAdam):
    __doc__ = "AccumAdamW: AccumAdam with decoupled weight decay." + _DOC_OPTIONS
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 accum_steps=4, foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 **decentralized):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, accum_steps=accum_steps, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused,
                         **decentralized)
