"""Misuse of the optimizers is a clear error naming what is wrong, never a crash or a silently wrong result:
sparse gradients, parameters sharing memory, a model converted after construction, a parameter written while its
exchange is in flight, add_param_group, and options checked whatever the world size. A model left in DDP is in
test_optim_ddp.py; ranks that disagree in test_optim_mismatch.py; late, silent, dead or non-finite ranks in
test_optim_faults.py."""

import datetime
import fractions
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm.optim.plan import consensus_factor

from dist_utils import run_ranks
from optim_cases import EVERY_UTILITY, make_model, train_steps

# ----------------------------------------------------------------------------------------- one process


SPARSE_TAKERS = {  # ours, torch's: the update from a sparse gradient densified is torch's from the sparse one
    "DSGD": (lambda ps: decent_comm.DSGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "Decentralized(SGD)": (lambda ps: decent_comm.Decentralized(torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                           lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "Decentralized(Adagrad)": (lambda ps: decent_comm.Decentralized(torch.optim.Adagrad(ps, lr=0.1)),
                               lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
}
SPARSE_REFUSERS = {  # torch's AdamW refuses sparse gradients, and its SGD and Adagrad with weight decay; the
    "DAdamW": lambda ps: decent_comm.DAdamW(ps),   # wrapper densified them and stepped, DSGD decayed every row
    "Decentralized(AdamW)": lambda ps: decent_comm.Decentralized(torch.optim.AdamW(ps)),
    "DSGD(weight_decay)": lambda ps: decent_comm.DSGD(ps, lr=0.1, weight_decay=0.1),
    "Decentralized(Adagrad(weight_decay))": lambda ps: decent_comm.Decentralized(torch.optim.Adagrad(ps, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(SPARSE_TAKERS))
def test_sparse_gradients_train_as_torch_where_torch_takes_them(name):
    ours, theirs = SPARSE_TAKERS[name]
    torch.manual_seed(0)
    emb, ref = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Embedding(10, 3, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt, ropt = ours(emb.parameters()), theirs(ref.parameters())  # torch's SGD takes no weight decay on sparse
    for idx in ([1, 2, 2, 5], [0, 5], [9]):
        for mod, o in ((emb, opt), (ref, ropt)):
            o.zero_grad()
            mod(torch.tensor(idx)).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(emb.weight, ref.weight)


@pytest.mark.parametrize("name", sorted(SPARSE_REFUSERS))
def test_sparse_gradients_are_refused_where_torch_refuses_them(name):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = SPARSE_REFUSERS[name](emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    with pytest.raises(ValueError, match="SparseAdam"):  # it raised torch's "does not support dense gradients"
        decent_comm.Decentralized(torch.optim.SparseAdam(emb.parameters()))


@pytest.mark.parametrize("name", sorted(SPARSE_REFUSERS))
def test_a_refused_sparse_gradient_names_the_users_parameter(name):
    """Named by the user's group and index, not by the slot in its bucket: with float64, float32, float64 the
    third parameter is the float64 bucket's second, and the message said "parameter 1 of bucket 0"."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]},
              {"params": [torch.nn.Parameter(torch.zeros(n, dtype=dtype))
                          for n, dtype in ((4, torch.float64), (5, torch.float32), (6, torch.float64))]}]
    opt = SPARSE_REFUSERS[name](groups)
    for g in groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    groups[1]["params"][2].grad = torch.ones(6, dtype=torch.float64).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(parameter 2 of param group 1, shape \(6,\)\)"):
        opt.step()


@pytest.mark.parametrize("ctor", [decent_comm.DSGD, decent_comm.DAdamW,
                                  lambda ps: decent_comm.Decentralized(torch.optim.SGD(ps, lr=0.1))])
def test_parameters_that_share_memory_are_refused(ctor):
    """torch.optim updates memory two Parameters share through both; each would get its own flat slot here, and the
    shared tensor was silently left behind (p1 -0.3, p2 -0.6 where torch gives -0.9 to both)."""
    base = torch.arange(6.0)
    with pytest.raises(ValueError, match=r"parameters 0 and 1 \(shapes \(6,\) and \(2, 3\)\) share memory"):
        ctor([torch.nn.Parameter(base), torch.nn.Parameter(base.view(2, 3))])
    with pytest.raises(ValueError, match=r"parameters 0 and 2 .*share memory"):
        ctor([torch.nn.Parameter(base[2:]), torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(base[:3])])
    with pytest.raises(ValueError, match="parameter 0 .*more than once"):  # torch refuses the in-place write
        ctor([torch.nn.Parameter(torch.zeros(1, 3).expand(4, 3))])
    lin = torch.nn.Linear(3, 3)
    halves = [torch.nn.Parameter(base[:3]), torch.nn.Parameter(base[3:])]  # views that do not overlap are fine
    matrix = torch.zeros(4, 6)  # column halves and even/odd columns: their spans overlap, their elements do not
    columns = [torch.nn.Parameter(matrix[:, :3]), torch.nn.Parameter(matrix[:, 3:])]
    ctor(list(lin.parameters()) + halves + columns)
    interleaved = torch.zeros(4, 6)
    ctor([torch.nn.Parameter(interleaved[:, ::2]), torch.nn.Parameter(interleaved[:, 1::2])])
    with pytest.raises(ValueError, match="share memory"):  # one shared column
        overlapping = torch.zeros(4, 6)
        ctor([torch.nn.Parameter(overlapping[:, :4]), torch.nn.Parameter(overlapping[:, 3:])])
    # Named by their place in the user's list and groups, not in the buckets' (one per dtype: float32 parameters 0
    # and 2 are the float32 bucket's 0 and 1, the message said "parameters 0 and 1", the float64 one's)
    with pytest.raises(ValueError, match=r"parameters 0 and 2 \(shapes \(3,\) and \(3,\)\) share memory"):
        ctor([torch.nn.Parameter(base[:3]), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
              torch.nn.Parameter(base[:3])])
    with pytest.raises(ValueError, match=r"parameters 1 of param group 0 and 0 of param group 1 \(shapes"):
        ctor([{"params": [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(base[1:4])]},
              {"params": [torch.nn.Parameter(base[3:])]}])
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 \(shape \(4, 3\).*more than once"):
        ctor([{"params": [torch.nn.Parameter(torch.zeros(2))]},
              {"params": [torch.nn.Parameter(torch.zeros(1, 3).expand(4, 3))]}])


PG_TYPE = r"process_group must be a torch.distributed ProcessGroup \(or None for the default group\), got "


@pytest.mark.parametrize("bad, match", [
    (dict(timeout=-5), "timeout"), (dict(timeout=float("nan")), "timeout"), (dict(timeout="1"), "timeout"),
    (dict(comm_dtype=torch.int32), "comm_dtype"), (dict(comm_dtype="bf16"), "comm_dtype"),
    (dict(comm_dtype=torch.float8_e4m3fn), "comm_dtype"),
    (dict(betas=(0.9,)), "betas must be a pair"),  # the first step failed to unpack them  # refused by the kernels at the first multi-rank step
    (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb"), (dict(bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(mode="adapt"), "mode"), (dict(exchange="allreduce"), "exchange"),
    # strings and bools went through bool() / float(): check_finite="no" checked, consensus="0.5" trained
    (dict(check_finite="no"), "check_finite must be True or False"),
    (dict(broadcast_init="False"), "broadcast_init must be True or False"),
    (dict(track_disagreement=1), "track_disagreement must be True or False"),
    (dict(consensus="0.5"), r"consensus factor must be a number in \[0, 1\], got '0.5' \(str\)"),
    (dict(consensus=True), "consensus factor must be a number"), (dict(consensus=1.5), "must be in"),
    (dict(consensus=torch.tensor(True)), "consensus factor must be a number"),
    (dict(consensus=torch.tensor([0.5, 0.5])), "consensus factor must be a number"),
    (dict(timeout=1e10), "timeout must be at most"),  # the transports' deadline overflowed: every wait timed out
    (dict(timeout=datetime.timedelta.max), "timeout must be at most"),
    # torch's "Group x is not registered" or an AttributeError, naming neither the argument nor what it must be
    (dict(process_group="x"), PG_TYPE + "str"), (dict(process_group=0), PG_TYPE + "int"),
    (dict(process_group=object()), PG_TYPE + "object"),
])
def test_options_are_checked_at_world_size_one(bad, match):
    with pytest.raises(ValueError, match=match):
        decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), **bad)


@pytest.mark.parametrize("timeout", [0, datetime.timedelta(0)], ids=["0", "timedelta(0)"])
@pytest.mark.parametrize("ctor", [decent_comm.DSGD, decent_comm.DAdam, decent_comm.DAdamW, decent_comm.AccumAdamW,
                                  lambda ps, **kw: decent_comm.Decentralized(torch.optim.SGD(ps, lr=0.1), **kw)],
                         ids=["DSGD", "DAdam", "DAdamW", "AccumAdamW", "Decentralized"])
def test_a_zero_timeout_is_refused_by_every_optimizer(ctor, timeout):
    """Zero is no bound: every wait would time out at once (the transports take at least 1 ms)."""
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        ctor(torch.nn.Linear(2, 2).parameters(), timeout=timeout)


def _unusable_process_group(rank, world_size):
    """Rank 0 passes what is no process group of its own; ranks 1 and 2 build on a group of theirs (None: the default
    group; timeout 3 s)."""
    from decent_comm.exchange import Exchanger
    everyone, pair = dist.new_group([0, 1, 2]), dist.new_group([1, 2])  # pair: NON_GROUP_MEMBER on rank 0
    out = {}
    for case, build in [("optimizer", lambda g: decent_comm.DSGD([torch.nn.Parameter(torch.ones(4))], lr=0.1,
                                                                 process_group=g, timeout=3)),
                        ("exchanger", lambda g: Exchanger(process_group=g, timeout=3))]:
        for kind, bad, group in [("str", "x", None), ("object", object(), everyone), ("non-member", pair, pair)]:
            try:
                built = build(bad if rank == 0 else group)
                built.shutdown()
                out[case, kind] = ("built", "")
            except Exception as exc:  # noqa: BLE001
                out[case, kind] = (type(exc).__name__, str(exc))
    dist.barrier()  # rank 0 is done at once: it leaves the default group only when the others are done too
    return out


def test_an_unusable_process_group_is_named_and_its_peers_time_out_naming_the_rank():
    """A process_group that is no ProcessGroup on one rank: that rank raises a ValueError naming the argument and the
    type given, before torch sees it (it raised torch's "Group x is not registered", or an AttributeError that also
    escaped the Exchanger's refusal handling); it has no group to tell its peers on, so they time out naming it. A
    group the rank is not a member of (dist.new_group's NON_GROUP_MEMBER) says so, and its members build."""
    out = run_ranks(_unusable_process_group, 3, timeout=120)
    for case, prefix in [("optimizer", ""), ("exchanger", "Exchanger: ")]:
        for kind in ("str", "object"):
            assert out[0][case, kind] == ("ValueError", prefix + PG_TYPE.replace("\\", "") + kind), out[0]
            for r in (1, 2):
                err, msg = out[r][case, kind]
                assert err == "ExchangeTimeout" and "rank 0 did not arrive within 3 s" in msg, (r, case, kind, msg)
        err, msg = out[0][case, "non-member"]
        assert err == "ValueError" and msg.startswith(prefix + "this process (global rank 0) is not a member of the "
                                                      "process_group given"), msg
        assert out[1][case, "non-member"] == out[2][case, "non-member"] == ("built", "")


@pytest.mark.parametrize("value", [0.25, 1, np.float32(0.25), torch.tensor(0.25, dtype=torch.float64),
                                   fractions.Fraction(1, 4), lambda step: torch.tensor(0.25)])
def test_consensus_takes_any_real_number(value):
    expected = 1.0 if value == 1 else 0.25
    decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), consensus=value).shutdown()
    assert consensus_factor(value, 3, 0.1) == expected


def test_a_consensus_callable_returning_a_string_is_named_at_that_step():
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\], got '0.5' \(str\) at step 7"):
        consensus_factor(lambda step: "0.5" if step > 5 else 0.5, 7, 0.1)


def test_a_launchers_job_without_a_process_group_is_refused(monkeypatch):
    """Built before init_process_group under torchrun: on one node of 2 it failed with "local_world_size=2 must
    divide world_size=1" (a flag the user never gave); on 2 nodes of 1 every rank trained alone, silently."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for world in ("2", " 4"):
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(RuntimeError, match=f"not initialized, but WORLD_SIZE={world.strip()} .*init_process_group"):
            decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), topology="aer")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process that inherited a launcher's LOCAL_WORLD_SIZE: as torch's
    for local in ("2", "x"):  # whatever its value: not this process's (a malformed one was refused)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        lin = torch.nn.Linear(2, 2)
        opt = decent_comm.DAdamW(lin.parameters(), topology="aer")
        lin(torch.ones(1, 2)).sum().backward()
        opt.step()


def test_model_converted_after_construction_is_named():
    lin = torch.nn.Linear(2, 2)
    opt = decent_comm.DAdamW(lin.parameters())
    lin.to(torch.float64)
    lin(torch.zeros(1, 2, dtype=torch.float64)).sum().backward()
    before = lin.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"model\.to\(\.\.\.\).*after the optimizer was built"):
        opt.step()
    assert torch.equal(lin.weight, before)


RESHAPED = {  # a parameter, and the same elements in another shape
    "contiguous": (lambda: torch.randn(3, 5), (5, 3)),
    "transposed": (lambda: torch.randn(5, 3).t(), (1, 15)),
    "channels_last": (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), (5, 4, 3, 2)),
}


@pytest.mark.parametrize("layout", RESHAPED)
def test_a_parameter_reshaped_after_construction_is_refused(layout):
    """p.data = a tensor of another shape (same elements): laid over the slot's strides, the new shape wrote into
    the next parameter (a transposed (3, 5) given (1, 15): 9 elements of its zero neighbour changed); contiguous,
    the state kept the old shape and the optimizer's own state_dict no longer loaded."""
    make, shape = RESHAPED[layout]
    p, neighbour = torch.nn.Parameter(make()), torch.nn.Parameter(torch.zeros(64))
    opt = decent_comm.DAdamW([p, neighbour], lr=0.1)
    p.data = torch.ones(shape)
    p.grad, neighbour.grad = torch.ones(shape), torch.zeros(64)
    with pytest.raises(RuntimeError, match=rf"parameter 0 is now .* of shape {re.escape(str(shape))}, "
                                           r"where .* reshaped"):
        opt.step()
    assert torch.equal(neighbour, torch.zeros(64))


@pytest.mark.parametrize("groups", [1, 2])
def test_parameters_tied_after_construction_are_refused(groups):
    """b.data = a.data after the optimizer was built (in one bucket, or in two: two param groups): copied back
    into b's own slot, the tie was silently undone (torch updates the shared memory through both)."""
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = decent_comm.DSGD([a, b] if groups == 1 else [{"params": [a]}, {"params": [b]}], lr=0.1)
    b.data = a.data
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    where = "parameter 1" if groups == 1 else "parameter 0 of param group 1"
    with pytest.raises(RuntimeError, match=f"{where} .*shares memory with another parameter"):
        opt.step()


def test_lazy_parameters_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="uninitialized parameter .*run one forward pass before"):
        decent_comm.DAdamW(torch.nn.LazyLinear(3).parameters())


def _too_many_buckets(rank, n):
    import decent_comm.optim.base as base
    base.MAX_BUCKETS = 3  # the exchange's 65536, which a step reached only after minutes of exchanges
    try:
        decent_comm.DSGD([torch.nn.Parameter(torch.zeros(4)) for _ in range(5)], lr=0.1, bucket_cap_mb=1e-6,
                         timeout=30)
        return "built"
    except ValueError as e:
        return str(e)


def test_more_buckets_than_the_exchange_takes_are_refused_at_construction():
    for r, msg in enumerate(run_ranks(_too_many_buckets, 2, timeout=120)):
        assert "5 buckets (bucket_cap_mb=1e-06): the exchange takes at most 3" in msg, (r, msg)


def _write_between_steps(rank, n, mode, synchronize_first):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", mode=mode, model=model, timeout=10)
    train_steps(rank, model, opt, 2)
    if synchronize_first:
        opt.synchronize()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # a pruning mask, a clamp, a rollback with model.load_state_dict
    try:
        train_steps(rank, model, opt, 2, start=2)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_a_parameter_written_while_its_exchange_is_in_flight_is_named(mode):
    """The exchange sends the parameters themselves; a write before it completed gave a neighbour a buffer part
    before, part after it (2.95M of 4M elements, silently). Written after synchronize() it is fine."""
    for m in run_ranks(_write_between_steps, 3, mode, False, timeout=120):
        assert "was written in place between steps while this rank was still sending it" in m, m
    assert run_ranks(_write_between_steps, 3, mode, True, timeout=120) == ["no error"] * 3


def _utility_after_conversion(rank, n, utility):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=10)
    train_steps(rank, model, opt, 2)
    model.double()  # e.g. for a final evaluation; the parameters no longer live in the optimizer's buckets
    try:
        EVERY_UTILITY[utility](opt)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("utility", ["global_average", "consensus_distance"])
def test_collective_utilities_refuse_a_model_converted_after_construction(utility):
    """Only step() used to check: global_average() averaged the buckets, which the converted model no longer
    reads, and each rank kept its own weights inside the block."""
    for m in run_ranks(_utility_after_conversion, 2, utility, timeout=120):
        assert "is now torch.float64" in m and "model.to(...)" in m, m


def test_add_param_group_is_refused_and_groups_added_to_the_inner_optimizer_too():
    opt = decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    wrapped = decent_comm.Decentralized(inner)
    inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(RuntimeError, match="param group"):
        wrapped.step()


def test_decentralized_hooks_and_lbfgs_closure():
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1)
    opt = decent_comm.Decentralized(torch.optim.LBFGS(lin.parameters(), lr=0.5))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    x = torch.randn(16, 2)
    y = x @ torch.tensor([[1.0], [-2.0]]) + 0.5

    def closure():
        opt.zero_grad()
        loss = ((lin(x) - y) ** 2).mean()
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(4)]
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post"] * 4 + ["sd", "load"]
    assert losses[-1] < 1e-6 < losses[0]  # LBFGS solves the least-squares problem


@pytest.mark.parametrize("inner", ["DSGD", "Decentralized(SGD)"])
def test_wrapping_an_optimizer_that_is_decentralized_already_is_refused(inner):
    """It was accepted, trained at world size 1, and at 2 ranks failed at the first step saying parameters were
    written while being sent, advising synchronize()."""
    params = list(torch.nn.Linear(2, 2).parameters())
    opt = decent_comm.DSGD(params, lr=0.1) if inner == "DSGD" else \
        decent_comm.Decentralized(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match=f"{type(opt).__name__}, which is decentralized already"):
        decent_comm.Decentralized(opt)
