"""The optimizers under torch.amp.GradScaler: the fused ones hand GradScaler's scale and overflow flag to their
kernels (unscale, skip and count on the device, decent_comm.optim.amp), so a step reads nothing back from the
device; the wrapped one takes the host path. Checked against torch.optim + GradScaler without a process group,
against the float64 dense simulation of all ranks with overflows on some ranks, and for host reads (on a GPU:
torch.cuda.set_sync_debug_mode("error"); on CPU: the Tensor methods that read a value, patched to raise)."""

import contextlib
import copy
import itertools

import pytest
import torch

import decent_comm
from decent_comm import topology as T

from dist_utils import run_ranks
from optim_cases import OPTIMIZERS, assert_every_rank_close, run_against_reference
from test_optim_local import DEVICES, PAIRS, assert_params_close, groups, make_model, make_pair

OVERFLOW_STEPS = {0, 3, 4}  # the first step overflows too: SGD's momentum starts at the next one
STEPS = 9


def run_scaled(model, opt, device, steps=STEPS, on_step=None, start=0, scaler=None):
    scaler = scaler or torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    last = list(model.parameters())[-1]
    for t in range(start, steps):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(9, 5, generator=g).to(device), torch.randn(9, 2, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if t in OVERFLOW_STEPS else 1.0)
        scaler.scale(loss).backward()
        if t % 3 == 1:
            last.grad = None  # no gradient this step: its step count falls behind the others'
        with (on_step(t) if on_step is not None else contextlib.nullcontext()):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=(t % 2 == 0))
    return [p.detach().clone() for p in model.parameters()], scaler


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PAIRS))
def test_under_grad_scaler_equals_torch_optimizer(name, device):
    m_ours, ours, m_torch, ref = make_pair(name, device)
    assert_params_close(name, run_scaled(m_ours, ours, device)[0], run_scaled(m_torch, ref, device)[0])
    # the state torch.optim tools read: every parameter's step count (overflowed steps and steps without a
    # gradient do not count) and buffers
    for i, (p, q) in enumerate(zip(m_ours.parameters(), m_torch.parameters())):
        mine, theirs = ours.state[p], ref.state[q]
        for key in theirs:  # torch's SGD keeps no step count
            if key == "step":
                assert float(mine["step"]) == float(theirs["step"]), (name, i, float(mine["step"]),
                                                                      float(theirs["step"]))
            else:
                torch.testing.assert_close(mine[key], theirs[key], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["DAdam", "DAdamW", "DSGD"])
def test_step_counts_past_2_pow_24_go_on_as_torch_optimizers_do(name):
    """A float32 state["step"] stops at 2^24 in torch.optim, which keeps stepping with t = 2^24; ours keep their
    counts in float32 tensors too, read by the kernels under GradScaler (a long run, or a count written in place)."""
    m_ours, ours, m_torch, ref = make_pair(name, "cpu")
    scalers = [run_scaled(m, opt, "cpu", steps=2)[1] for m, opt in [(m_ours, ours), (m_torch, ref)]]
    for p, q in zip(m_ours.parameters(), m_torch.parameters()):
        if q in ref.state:  # a parameter stepped so far (torch's SGD keeps no count: only ours is moved)
            ours.state[p]["step"].fill_(2 ** 24 - 2)
            if "step" in ref.state[q]:
                ref.state[q]["step"].fill_(2 ** 24 - 2)
    got = run_scaled(m_ours, ours, "cpu", start=5, scaler=scalers[0])[0]
    want = run_scaled(m_torch, ref, "cpu", start=5, scaler=scalers[1])[0]
    assert_params_close(name, got, want)
    stepped = [float(ours.state[p]["step"]) for p in m_ours.parameters()]
    assert stepped.count(2 ** 24) >= 1, stepped
    for p, q in zip(m_ours.parameters(), m_torch.parameters()):
        if "step" in ref.state[q]:
            assert float(ours.state[p]["step"]) == float(ref.state[q]["step"])


@contextlib.contextmanager
def no_host_reads(device):
    """Raises on anything that reads a tensor's value on the host (a device synchronization on a GPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return

    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor's value was read on the host during the step")
    names = ["item", "tolist", "__float__", "__int__", "__bool__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["DSGD", "DAdamW", "AccumAdamW"])
def test_fused_step_under_grad_scaler_reads_nothing_on_the_host(name, device):
    ctor = {"DSGD": lambda ps: decent_comm.DSGD(ps, lr=0.05, momentum=0.9),
            "DAdamW": lambda ps: decent_comm.DAdamW(ps, lr=0.01),
            "AccumAdamW": lambda ps: decent_comm.AccumAdamW(ps, lr=0.01, accum_steps=3)}[name]
    model = make_model(device)
    opt = ctor(groups(model))
    # from the second step on (the first moves the step counts to the device, once), overflowed or not
    run_scaled(model, opt, device, on_step=lambda t: no_host_reads(device) if t >= 1 else contextlib.nullcontext())
    # .type: a tensor on the GPU is on cuda:0, which torch.device("cuda") does not equal
    assert all(st["step"].device.type == device for st in opt.state.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["DSGD", "AccumAdamW"])
def test_state_dict_with_device_counts_resumes_exactly(name, device):
    """A checkpoint taken while the kernels count (state["step"] on the device) resumes the same trajectory."""
    ctor = {"DSGD": lambda ps: decent_comm.DSGD(ps, lr=0.05, momentum=0.9),
            "AccumAdamW": lambda ps: decent_comm.AccumAdamW(ps, lr=0.01, accum_steps=3)}[name]
    m_full = make_model(device)
    full = run_scaled(m_full, ctor(groups(m_full)), device)[0]
    m_a = make_model(device)
    opt_a = ctor(groups(m_a))
    scaler = run_scaled(m_a, opt_a, device, steps=5)[1]
    saved = copy.deepcopy((opt_a.state_dict(), m_a.state_dict(), scaler.state_dict()))
    m_b = make_model(device)
    opt_b = ctor(groups(m_b))
    m_b.load_state_dict(saved[1])
    opt_b.load_state_dict(saved[0])
    scaler_b = torch.amp.GradScaler(device)
    scaler_b.load_state_dict(saved[2])
    resumed = run_scaled(m_b, opt_b, device, start=5, scaler=scaler_b)[0]
    for i, (a, b) in enumerate(zip(resumed, full)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name} parameter {i}: {m}")


def test_the_host_read_guard_catches_a_host_read():
    with pytest.raises(AssertionError, match="read on the host"):
        with no_host_reads("cpu"):
            float(torch.ones(()))


def _overflows_match_simulation(rank, n, cadence):
    topo = T.make("one-peer-exp", n)
    overflow = {(0, 0), (1, 2), (2, 5), (1, 6)} if not cadence else {(1, 1), (2, 5)}  # (1, 1): in the warm-up
    modes = ["awc", "atc"]
    return {(o, mode): run_against_reference(rank, n, o, topo, mode, steps=9, overflow=overflow, **cadence)
            for o, mode in itertools.product(OPTIMIZERS, modes)}


@pytest.mark.parametrize("cadence", [{}, dict(warmup_steps=2, gossip_every=2)], ids=["every-step", "warmup2-every2"])
def test_overflow_on_some_ranks_matches_dense_simulation(cadence):
    """A rank whose gradient overflows skips its update but not its exchange; its neighbours are unaffected (in
    the all-reduce warm-up every rank skips)."""
    assert_every_rank_close(run_ranks(_overflows_match_simulation, 3, cadence, timeout=600))


def _gossip_steps_read_nothing(rank, n, mode):
    model = make_model("cpu")
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology="one-peer-exp", mode=mode, model=model, timeout=30)
    try:
        run_scaled(model, opt, "cpu", on_step=lambda t: no_host_reads("cpu") if t >= 1 else contextlib.nullcontext())
        return "ok"
    except AssertionError as exc:
        return str(exc)
    finally:
        opt.shutdown()


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_gossip_step_under_grad_scaler_reads_nothing_on_the_host(mode):
    """With neighbours too: the exchange schedule decides from host counters, never from a tensor's value."""
    assert run_ranks(_gossip_steps_read_nothing, 2, mode, timeout=120) == ["ok", "ok"]


def _expert_without_tokens_on_one_rank(rank, n):
    torch.manual_seed(0)
    trunk, expert = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opts = [decent_comm.DAdamW(m.parameters(), lr=1e-2, warmup_steps=3, timeout=30) for m in (trunk, expert)]
    scaler = torch.amp.GradScaler("cpu")
    for t in range(3):
        h = trunk(torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * t + rank)))
        if rank != 2 or t == 1:  # rank 2 routes no token to the expert at steps 0 and 2
            h = h + expert(h)
        scaler.scale(h.pow(2).mean()).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
    return [p.detach().clone() for m in (trunk, expert) for p in m.parameters()]


def test_a_rank_whose_optimizer_has_no_gradient_under_grad_scaler_takes_the_warmup_average():
    """GradScaler hands an optimizer without any gradient found_inf = 0, an int: that rank announced its warm-up
    average without the overflow flag, the others with it, and every rank raised a mismatch. The warm-up is DDP's
    update (a rank without a gradient adds zeros): torch's AdamW on the ranks' mean gradients, the reference."""
    torch.manual_seed(0)
    trunk, expert = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    params = [*trunk.parameters(), *expert.parameters()]
    ref = torch.optim.AdamW(params, lr=1e-2)
    for t in range(3):
        grads = [torch.zeros_like(p) for p in params]
        for r in range(3):
            h = trunk(torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * t + r)))
            if r != 2 or t == 1:
                h = h + expert(h)
            for g, d in zip(grads, torch.autograd.grad(h.pow(2).mean(), params, allow_unused=True)):
                if d is not None:
                    g += d / 3
        for p, g in zip(params, grads):
            p.grad = g
        ref.step()
    for got in run_ranks(_expert_without_tokens_on_one_rank, 3, timeout=120):
        for a, b in zip(got, params):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("flag", [float("nan"), 1.0, 0.0], ids=["nan", "inf-found", "finite"])
def test_the_host_path_skips_the_update_as_grad_scaler_skips_a_torch_optimizer(flag):
    """The wrapped optimizer reads GradScaler's found_inf on the host. The reference: GradScaler's own decision for a
    torch optimizer it hands no flag to (_maybe_opt_step: step only when the flags sum to zero; NaN is not zero)."""
    m_ours, ours, m_torch, ref = make_pair("Decentralized(AdamW)", "cpu")
    for m in (m_ours, m_torch):
        m(torch.randn(9, 5, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    ours.grad_scale, ours.found_inf = torch.tensor(1.0), torch.tensor(flag)
    ours.step()
    flags = {"found_inf_per_device": {torch.device("cpu"): torch.tensor(flag)}}
    torch.amp.GradScaler("cpu")._maybe_opt_step(ref, flags)
    assert_params_close("Decentralized(AdamW)", [p.detach() for p in m_ours.parameters()],
                        [p.detach() for p in m_torch.parameters()])
    assert [float(ours.state[p].get("step", 0)) for p in m_ours.parameters()] == \
        [float(ref.state[p].get("step", 0)) for p in m_torch.parameters()]


# Scaled gradients in the all-reduce warm-up, without scaler.unscale_(opt): each rank's GradScaler backs off from
# its own overflow flag, so after an overflow on rank 1 (every rank skips that step) the ranks' scales differ.
WARMUP_OVERFLOW, WARMUP_STEPS = {(1, 1), (2, 2)}, 5  # both in the warm-up, followed by more warm-up steps
WARMUP_CASES = {  # name: (our optimizer, torch's for the DDP reference), same hyper-parameters
    "DSGD-awc": (lambda ps, **kw: decent_comm.DSGD(ps, lr=0.05, momentum=0.9, mode="awc", **kw),
                 lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "DAdamW-awc": (lambda ps, **kw: decent_comm.DAdamW(ps, lr=0.01, mode="awc", **kw),
                   lambda ps: torch.optim.AdamW(ps, lr=0.01)),
    "DAdamW-atc": (lambda ps, **kw: decent_comm.DAdamW(ps, lr=0.01, mode="atc", **kw),
                   lambda ps: torch.optim.AdamW(ps, lr=0.01)),
    "Decentralized(AdamW)": (lambda ps, **kw: decent_comm.Decentralized(torch.optim.AdamW(ps, lr=0.01), **kw),
                             lambda ps: torch.optim.AdamW(ps, lr=0.01)),
    "Decentralized(AdamW-fused)": (
        lambda ps, **kw: decent_comm.Decentralized(torch.optim.AdamW(ps, lr=0.01, fused=True), mode="atc", **kw),
        lambda ps: torch.optim.AdamW(ps, lr=0.01)),
    "Decentralized(SGD)": (lambda ps, **kw: decent_comm.Decentralized(torch.optim.SGD(ps, lr=0.05), **kw),
                           lambda ps: torch.optim.SGD(ps, lr=0.05)),
}


def _warmup_batch(rank, t, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(6, 5, generator=g).to(dtype), torch.randn(6, 2, generator=g).to(dtype)


def _warmup_under_scaler_without_unscale(rank, n):
    out = {}
    for name, (ctor, _) in WARMUP_CASES.items():
        model = make_model("cpu")
        opt = ctor(list(model.parameters()), warmup_steps=WARMUP_STEPS, timeout=30)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        for t in range(WARMUP_STEPS):
            x, y = _warmup_batch(rank, t)
            loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if (rank, t) in WARMUP_OVERFLOW else 1.0)
            scaler.scale(loss).backward()  # and no scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out[name] = ([p.detach().clone() for p in model.parameters()], opt.consensus_distance(), scaler.get_scale())
        opt.shutdown()
    return out


def _ddp_reference(torch_ctor, n):
    """DDP's update in float64: torch's optimizer on the mean over the ranks of their unscaled gradients; a step
    with an overflow on any rank is skipped by all (DDP's all-reduced gradient overflows on every rank)."""
    model = make_model("cpu").double()
    params = list(model.parameters())
    opt = torch_ctor(params)
    for t in range(WARMUP_STEPS):
        if any((r, t) in WARMUP_OVERFLOW for r in range(n)):
            continue
        per_rank = [torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), params)
                    for x, y in (_warmup_batch(r, t, torch.float64) for r in range(n))]
        for p, *gs in zip(params, *per_rank):
            p.grad = sum(gs) / n
        opt.step()
    return [p.detach() for p in params]


def test_warmup_average_unscales_each_ranks_gradient_by_its_own_scale():
    """The scaled gradients were averaged, (s*g0 + s/2*g1 + s*g2)/3, and each rank unscaled the mean by its own
    scale: rank 1 stepped twice as far and the replicas parted (consensus distance 5e-4). Now each rank's gradient
    is unscaled before the average: the replicas stay identical, on DDP's trajectory."""
    results = run_ranks(_warmup_under_scaler_without_unscale, 3, timeout=300)
    for name, (_, torch_ctor) in WARMUP_CASES.items():
        scales = [r[name][2] for r in results]
        assert len(set(scales)) > 1, (name, scales)  # the case this is about: the ranks' scales differ
        want = _ddp_reference(torch_ctor, 3)
        for rank, r in enumerate(results):
            params, cd, _ = r[name]
            assert cd < 1e-14, (name, rank, cd)
            for i, (a, b, w) in enumerate(zip(params, results[0][name][0], want)):
                assert torch.equal(a, b), (name, rank, i, (a - b).abs().max())
                torch.testing.assert_close(a.double(), w, rtol=0, atol=2e-6,
                                           msg=lambda m: f"{name} rank {rank} parameter {i}: {m}")
