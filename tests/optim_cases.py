"""The small model, per-rank data and optimizer cases that the multi-process optimizer tests share
(tests/test_optim_dist.py, tests/test_adaptive.py); each case names the torch.optim math that
tests/optim_reference.py simulates for it."""

import io
import numpy as np
import torch

import decent_comm

from optim_reference import Reference


def make_model(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).to(dtype)


def state_test_model(seed=0):
    """The single-process state tests' model (test_optim_dcp_migration, test_optim_torch_conventions)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def step_on_seeded_grads(m, opt, t):
    """One opt.step() on gradients drawn from a generator seeded by the step t, the same for every optimizer."""
    g = torch.Generator().manual_seed(100 + t)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)



def train_steps(rank, model, opt, steps, start=0, after_step=None):
    """`steps` steps of the tests' regression problem on rank's batches from step `start` on; after_step(t), if
    given, runs after each step (an lr scheduler, a measurement)."""
    dtype = next(model.parameters()).dtype  # a half-precision model's batches in its dtype
    for t in range(start, start + steps):
        x, y = (v.to(dtype) for v in batch(rank, t))
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if after_step is not None:
            after_step(t)

def assert_every_rank_close(results, tol=1e-5):
    """`results`: per rank, {case: deviation from the dense simulation}; every one must be below `tol`."""
    for r, errs in enumerate(results):
        bad = {k: e for k, e in errs.items() if not e < tol}
        assert not bad, (r, bad)


def resumed_vs_straight(rank, build, total, stop, serialize=False, on_load=None, model_first=False, schedule=None,
                        before_load=None, dtype=torch.float32):
    """Trains `total` steps straight, then again with a checkpoint (optimizer and model state_dict) at `stop` loaded
    into a new optimizer on other initial parameters; returns (largest deviation of the resumed run's final
    parameters from the straight run's, the checkpoint, on_load(new optimizer) right after loading, or None).
    `build(model)` makes the optimizer; `serialize`: the checkpoint goes through torch.save / torch.load
    (weights_only=True), as a file would; `model_first`: the model's state_dict is taken before the optimizer's;
    `schedule(opt)`, if given, makes an lr scheduler, stepped after each step and resumed from its state_dict;
    `before_load(opt_sd)` edits the optimizer's checkpoint before it loads (as an earlier version saved it); `dtype`:
    the model's."""
    def run(model, opt, steps, start=0, sched_state=None):
        sched = schedule(opt) if schedule is not None else None
        if sched_state is not None:
            sched.load_state_dict(sched_state)
        train_steps(rank, model, opt, steps, start, after_step=None if sched is None else lambda t: sched.step())
        return None if sched is None else sched.state_dict()

    model = make_model(rank, dtype)
    opt = build(model)
    run(model, opt, total)
    opt.synchronize()
    straight = flat_params(model)
    opt.shutdown()
    model = make_model(rank, dtype)
    opt = build(model)
    sched_state = run(model, opt, stop)
    if model_first:
        model_sd = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt = (opt.state_dict(), model_sd)
    else:
        opt_sd = opt.state_dict()
        ckpt = (opt_sd, {k: v.clone() for k, v in model.state_dict().items()})
    opt.shutdown()
    if serialize:
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
    if before_load is not None:
        before_load(ckpt[0])
    model = make_model(10 + rank, dtype)
    opt = build(model)
    model.load_state_dict(ckpt[1])
    opt.load_state_dict(ckpt[0])
    seen = on_load(opt) if on_load is not None else None
    run(model, opt, total - stop, stop, sched_state)
    opt.synchronize()
    err = (flat_params(model) - straight).abs().max().item()
    opt.shutdown()
    return err, ckpt, seen


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather_flat(model, n):
    """Every rank's flat parameters (a collective)."""
    out = [torch.empty_like(flat_params(model)) for _ in range(n)]
    torch.distributed.all_gather(out, flat_params(model))
    return out


ADAM_HP = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8)
OPTIMIZERS = {
    # name: (constructor(params, **decentralized), reference kind, reference hyper-parameters)
    "dsgd-nesterov": (lambda ps, **kw: decent_comm.DSGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                         **kw), "sgd",
                      dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "dsgd": (lambda ps, **kw: decent_comm.DSGD(ps, lr=0.1, **kw), "sgd", dict(lr=0.1)),
    "dadam": (lambda ps, **kw: decent_comm.DAdam(ps, weight_decay=0.01, **ADAM_HP, **kw), "adam",
              dict(weight_decay=0.01, **ADAM_HP)),
    "dadamw": (lambda ps, **kw: decent_comm.DAdamW(ps, weight_decay=0.1, **ADAM_HP, **kw), "adamw",
               dict(weight_decay=0.1, **ADAM_HP)),
    "accumadamw": (lambda ps, **kw: decent_comm.AccumAdamW(ps, weight_decay=0.05, accum_steps=3, **ADAM_HP, **kw),
                   "accumadamw", dict(weight_decay=0.05, accum_steps=3, **ADAM_HP)),
    "wrapped-adam": (lambda ps, **kw: decent_comm.Decentralized(torch.optim.Adam(ps, weight_decay=0.01, **ADAM_HP),
                                                                **kw), "adam", dict(weight_decay=0.01, **ADAM_HP)),
}


def doubly_stochastic(n, seed):
    rng = np.random.default_rng(seed)
    W = np.zeros((n, n))
    for w in rng.dirichlet(np.ones(3)):
        W += w * np.eye(n)[rng.permutation(n)]
    return W


def run_against_reference(rank, n, opt_name, topo, mode, steps=20, consensus=1.0, comm_dtype=None,
                          scheduler=None, probe=None, give_model=True, model_fn=None, overflow=None, closure=False,
                          each_step=None, **cadence):
    """Trains rank `rank`'s replica and the float64 dense simulation of all ranks side by side; returns the
    largest deviation of this rank's parameters from the simulation. ``give_model``: pass ``model=`` in ATC mode
    (else the optimizer finds the modules itself). ``overflow``: train under torch.amp.GradScaler, with the loss of
    these (rank, step) pairs made infinite. ``closure``: step(closure), the closure zeroing the gradients and running
    the forward and backward. ``each_step``: called with the optimizer after every step (a state_dict() between steps,
    which must change nothing)."""
    ctor, kind, hp = OPTIMIZERS[opt_name]
    make_model_ = model_fn or make_model
    models = [make_model_(seed) for seed in range(n)]  # distinct replicas, known to every rank
    model = models[rank]
    ref = Reference(make_model_(0), [flat_params(m) for m in models], topo, mode, kind, hp, consensus=consensus,
                    wire_dtype=comm_dtype, overflow=overflow or (), **cadence)
    # powers of two: unscaling is exact, so the simulation's unscaled gradients are the kernels'
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if overflow is not None else None
    opt = ctor(model.parameters(), topology=topo, mode=mode, model=model if mode == "atc" and give_model else None,
               broadcast_init=False, consensus=consensus, comm_dtype=comm_dtype, timeout=30, **cadence)
    # the int8 wire's simulation quantizes what the ranks really quantize: their parameters around each step
    observe = (lambda: gather_flat(model, n)) if comm_dtype == torch.int8 else (lambda: None)
    before = observe()
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        loss_of = lambda: ((model(x) - y) ** 2).mean()  # noqa: E731
        if closure:  # which zeroes the gradients itself, as torch's examples write it
            opt.step(lambda: (opt.zero_grad(), loss_of().backward()))
        elif scaler is None:
            loss_of().backward()
            opt.step()
        else:
            (scaler.scale(loss_of()) * (float("inf") if (rank, t) in overflow else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
        after = observe()  # before each_step: ATC's quantizer took the half step, which a state_dict() mixes
        if each_step is not None:
            each_step(opt)
        ref.step([batch(r, t) for r in range(n)], observed_before=before, observed_after=after)
        before = after
    opt.synchronize()
    err = (flat_params(model).double() - ref.X[rank]).abs().max().item()
    if probe is not None:
        probe(opt)
    opt.shutdown()
    return err


UTILITIES = {  # average_parameters and disagreement(all_reduce=True) share global_average's all_reduce_mean_
    "global_average": lambda opt: opt.global_average().__enter__(),
    "consensus_distance": lambda opt: opt.consensus_distance(),
    "replica_variance": lambda opt: opt.replica_variance(),
}
EVERY_UTILITY = {**UTILITIES, "average_parameters": lambda opt: opt.average_parameters(),
                 "disagreement": lambda opt: opt.disagreement(all_reduce=True),
                 "synchronize": lambda opt: opt.synchronize()}
