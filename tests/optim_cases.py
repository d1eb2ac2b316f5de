"""The small model, per-rank data and optimizer cases that the multi-process optimizer tests share
(tests/test_optim_dist.py, tests/test_adaptive.py); each case names the torch.optim math that
tests/optim_reference.py simulates for it."""

import numpy as np
import torch

import decent_comm

def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


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
