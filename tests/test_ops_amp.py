"""The optimizer ops under mixed precision: GradScaler's scale and found_inf and the step count are read in the
kernel (no host synchronization), checked against torch.amp.GradScaler + torch.optim and the float64 references."""

import pytest
import torch

from decent_comm import ops

from mix_reference import accum_adam64, assert_close_to_ref, mix64
from op_inputs import flat, gen, random_weights

STATE = {"sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}


class FusedAmpOptimizer(torch.optim.Optimizer):
    """The smallest optimizer that drives an op as GradScaler drives torch's fused optimizers: GradScaler sets
    `grad_scale` and `found_inf` and calls step() even on overflow; the op unscales, skips and counts on its own."""

    _step_supports_amp_scaling = True

    def __init__(self, params, kind, **hp):
        super().__init__(params, hp)
        self.kind = kind

    @torch.no_grad()
    def step(self):
        amp = dict(grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None))
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros(())  # float32, like torch.optim's state["step"]
                    st.update({name: torch.zeros_like(p) for name in STATE[self.kind]})
                if self.kind == "sgd":
                    ops.mix_sgd_(p, [], 1.0, [], p.grad, st["momentum_buffer"], group["lr"], group["momentum"],
                                 group["dampening"], group["weight_decay"], group["nesterov"], state_step=st["step"],
                                 **amp)
                else:
                    beta1, beta2 = group["betas"]
                    ops.mix_adam_(p, [], 1.0, [], p.grad, st["exp_avg"], st["exp_avg_sq"], None, group["lr"], beta1,
                                  beta2, group["eps"], group["weight_decay"], self.kind == "adamw",
                                  state_step=st["step"], **amp)


TORCH_CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.05)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01, nesterov=False)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)),
}
OVERFLOW = {0: float("inf"), 3: float("nan"), 4: float("-inf"), 8: float("inf")}  # the first step overflows too


@pytest.mark.parametrize("init_scale", [2.0 ** 12, 3.0])  # 3: the reciprocal is rounded, as GradScaler rounds it
@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_under_grad_scaler_the_op_follows_torch_optim(case, init_scale):
    torch_cls, hp = TORCH_CASES[case]
    n = 1031
    p_ref = torch.nn.Parameter(flat(n, torch.float32, "cpu", gen=gen(1)))
    p = torch.nn.Parameter(p_ref.detach().clone())
    opt_ref = torch_cls([p_ref], foreach=False, **hp)
    opt = FusedAmpOptimizer([p], case.split("-")[0], **hp)
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3) for _ in range(2)]
    g = gen(2)
    for t in range(12):
        target = flat(n, torch.float32, "cpu", gen=g)
        if t in OVERFLOW:
            target[t * 7] = OVERFLOW[t]
        for param, o, scaler in [(p_ref, opt_ref, scalers[0]), (p, opt, scalers[1])]:
            o.zero_grad()
            scaler.scale((param * target).sum()).backward()
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        torch.testing.assert_close(p.detach(), p_ref.detach(), rtol=2e-6, atol=2e-6, msg=f"params at step {t}")
        ref_state = opt_ref.state[p_ref]
        applied = sum(1 for s in range(t + 1) if s not in OVERFLOW)
        assert float(opt.state[p]["step"]) == applied == float(ref_state.get("step", applied))
        for name in STATE[opt.kind]:
            if name in ref_state:
                torch.testing.assert_close(opt.state[p][name], ref_state[name], rtol=2e-6, atol=2e-6)
            else:  # torch has not created it yet: every step so far overflowed, so ours is still untouched
                assert torch.all(opt.state[p][name] == 0)


def _optimizer_call(op, n, g, device="cpu"):
    """(call, tensors, mix) for one optimizer op with two bf16 neighbours: call(**kw) runs it with the step and AMP
    keywords given; tensors holds x, grad, state and disagreement; mix = (neighbors, self_weight, weights)."""
    ys = [flat(n, torch.bfloat16, device, gen=g) for _ in range(2)]
    sw, ws = random_weights(2, g)
    t = dict(x=flat(n, torch.float32, device, gen=g), grad=flat(n, torch.float32, device, gen=g),
             state=[flat(n, torch.float32, device, gen=g, scale=0.1).abs() for _ in range(3)],
             disagreement=torch.zeros(1, device=device))
    x, grad, st, d = t["x"], t["grad"], t["state"], t["disagreement"]
    calls = {
        "sgd": lambda **kw: ops.mix_sgd_(x, ys, sw, ws, grad, st[0], 0.1, 0.9, 0.1, 0.01, disagreement=d, **kw),
        "adam": lambda **kw: ops.mix_adam_(x, ys, sw, ws, grad, st[0], st[1], lr=0.01, disagreement=d, **kw),
        "accum": lambda **kw: ops.mix_accum_adam_(x, ys, sw, ws, grad, st[0], st[1], st[2], accum_steps=3, lr=0.01,
                                                  weight_decay=0.1, decoupled=True, disagreement=d, **kw),
    }
    return calls[op], t, (ys, sw, ws)


def host_step(op, t):
    """The keywords of update number t counted on the host: SGD's first-step flag, Adam's 1-based step."""
    return {"first_step": t == 1} if op == "sgd" else {"step": t}


def device_step(op, count):
    """The keywords of an update counted on the device by `count` (updates applied before it)."""
    return {"state_step": count} if op == "sgd" else {"step": None, "state_step": count}


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("found_inf", [1.0, 2.0, float("nan")])  # GradScaler sums the flags of its devices
@pytest.mark.parametrize("op", ["sgd", "adam", "accum"])
def test_an_overflow_step_only_mixes(op, found_inf):
    """found_inf != 0: x <- mixed exactly as gossip_mix_ computes it; state and count untouched."""
    call, t, (ys, sw, ws) = _optimizer_call(op, 3001, gen(3))
    mixed, d = t["x"].clone(), torch.zeros(1)
    ops.gossip_mix_(mixed, ys, sw, ws, disagreement=d)
    state_before = [_bits(s) for s in t["state"]]
    count = torch.tensor(5.0)
    call(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(found_inf), **device_step(op, count))
    assert torch.equal(_bits(t["x"]), _bits(mixed))
    assert all(torch.equal(_bits(s), b) for s, b in zip(t["state"], state_before))
    assert float(count) == 5.0 and torch.equal(t["disagreement"], d)


@pytest.mark.parametrize("count_dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("op", ["sgd", "adam", "accum"])
def test_neutral_amp_scalars_give_the_plain_result_bit_for_bit(op, count_dtype):
    """grad_scale = 1, found_inf = 0 and a device count of t - 1 change no bit of the step-t result (NaN and
    infinite gradients included), and advance the count to t."""
    for t_step in [1, 2, 3, 7]:
        plain, tp, _ = _optimizer_call(op, 517, gen(4))
        amp, ta, _ = _optimizer_call(op, 517, gen(4))
        for tensors in (tp, ta):
            tensors["grad"][5], tensors["grad"][6] = float("nan"), float("-inf")
        count = torch.tensor(t_step - 1, dtype=count_dtype)
        plain(**host_step(op, t_step))
        amp(grad_scale=torch.tensor(1.0), found_inf=torch.tensor(0.0), **device_step(op, count))
        pairs = [(tp["x"], ta["x"]), (tp["disagreement"], ta["disagreement"])] + list(zip(tp["state"], ta["state"]))
        for a, b in pairs:
            assert torch.equal(_bits(a), _bits(b)), f"step {t_step}"
        assert int(count) == t_step


def test_an_int64_count_counts_past_float32_exactly():
    for applied in [2 ** 24, 2 ** 40 + 1]:
        plain, tp, _ = _optimizer_call("accum", 301, gen(6))
        amp, ta, _ = _optimizer_call("accum", 301, gen(6))
        count = torch.tensor(applied, dtype=torch.int64)
        plain(step=applied + 1)
        amp(**device_step("accum", count))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tp["state"] + [tp["x"]], ta["state"] + [ta["x"]]))
        assert int(count) == applied + 1


@pytest.mark.parametrize("op", ["sgd", "adam", "accum"])
def test_a_float32_count_stops_at_2_pow_24_as_torch_optims_does(op):
    """torch.optim's float32 state["step"] stops at 2^24 (2^24 + 1 rounds back to it) and torch goes on stepping with
    t = 2^24: so does a float32 count here, from 2^24 - 1 (the last exact increment) and from 2^24 itself."""
    for applied in [2 ** 24 - 1, 2 ** 24]:
        plain, tp, _ = _optimizer_call(op, 301, gen(7))
        amp, ta, _ = _optimizer_call(op, 301, gen(7))
        count = torch.tensor(float(applied), dtype=torch.float32)
        plain(**host_step(op, 2 ** 24))
        amp(**device_step(op, count))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tp["state"] + [tp["x"]], ta["state"] + [ta["x"]]))
        assert float(count) == 2 ** 24


def test_accum_adam_under_amp_matches_the_reference_that_skips_overflow_steps():
    """Ten steps with a scale of 2^10 and three overflows: skipped steps neither accumulate nor move the window."""
    n, K, scale = 2053, 3, 2.0 ** 10
    g = gen(9)
    x = flat(n, torch.float32, "cpu", gen=g)
    state = [torch.zeros(n) for _ in range(3)]
    count = torch.zeros((), dtype=torch.int64)
    hp = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, decoupled=False)
    applied = 0
    for t in range(10):
        ys = [flat(n, torch.bfloat16, "cpu", gen=g)]
        sw, ws = random_weights(1, g)
        grad = flat(n, torch.float32, "cpu", gen=g, scale=scale)
        overflow = t in (2, 5, 6)
        if overflow:
            grad[11] = float("inf")
        ref_x, old_state = x.double(), [s.double() for s in state]
        mixed, mix_scale = mix64(ref_x, ys, sw, ws)
        if overflow:
            ref_x_new, ref_state = mixed, old_state
        else:
            applied += 1
            ref_x_new, *ref_state = accum_adam64(ref_x, mixed, grad.double() / scale, *old_state, applied, K, **hp)
        ops.mix_accum_adam_(x, ys, sw, ws, grad, *state, None, K, grad_scale=torch.tensor(scale),
                            found_inf=torch.tensor(float(overflow)), state_step=count, **hp)
        update = (ref_x_new - mixed).abs()
        assert_close_to_ref(x, ref_x_new, mix_scale + 10 * update + ref_x.abs(), torch.float32, 13, what=f"x at {t}")
        magnitude = sum(s.abs() for s in old_state) + (grad.double() / scale).nan_to_num(0).abs() + ref_x.abs()
        for name, s, r in zip(["M", "V", "A"], state, ref_state):
            assert_close_to_ref(s, r, r.abs() + magnitude, torch.float32, 10, what=f"{name} at {t}")
        assert int(count) == applied
