"""An ATC optimizer dropped without shutdown() (kept only by a reference cycle) is collected wherever an allocation
starts a cyclic garbage collection, also inside torch's loop over a module's state_dict pre-hooks, which iterates
that dict itself. Its finalizer removed its own pre-hooks from those dicts on the spot: "OrderedDict mutated during
iteration" from the user's model.state_dict(). The handles are now removed at the next safe point (a new optimizer's
hooks, a shutdown() outside a collection); until then they do nothing. (The DDP guard's case: test_optim_ddp.py.)"""
import gc

import torch

import decent_comm


def test_an_atc_optimizer_collected_inside_state_dict_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for m in model:  # first in each module's dict: torch runs it before the optimizer's
        m.register_state_dict_pre_hook(lambda module, prefix, keep_vars: gc.collect())
    for _ in range(3):
        opt = decent_comm.DAdamW(model.parameters(), mode="atc", model=model)
        assert [len(m._state_dict_pre_hooks) for m in model] == [2, 2]  # the dropped optimizer's are gone by now
        opt.own_cycle = opt  # only the cyclic GC frees it
        del opt
        state = model.state_dict()
        assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    model[0].weight.grad = torch.ones(2, 2)
    opt = decent_comm.DAdamW(model.parameters(), mode="atc", model=model)
    opt.shutdown()  # outside a collection: its hooks and the orphans are removed at once
    assert [len(m._state_dict_pre_hooks) for m in model] == [1, 1]
