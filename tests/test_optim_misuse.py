"""Misuse of the optimizers is a clear error naming what is wrong - on every rank - never a crash, a hang or a
silently wrong result: options that differ between ranks, another rank's state_dict, non-finite values spreading,
a silent peer on the group all-reduce path, a rank dying during the construction's check, sparse gradients, a model
converted after construction, a model left in DDP, add_param_group, and options checked whatever the world size."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm.exchange import ExchangeTimeout

from dist_utils import exit_now, run_ranks
from optim_cases import batch, make_model, train_steps

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


@pytest.mark.parametrize("bad, match", [
    (dict(timeout=-5), "timeout"), (dict(timeout=float("nan")), "timeout"), (dict(timeout="1"), "timeout"),
    (dict(comm_dtype=torch.int32), "comm_dtype"), (dict(comm_dtype="bf16"), "comm_dtype"),
    (dict(comm_dtype=torch.float8_e4m3fn), "comm_dtype"),
    (dict(betas=(0.9,)), "betas must be a pair"),  # the first step failed to unpack them  # refused by the kernels at the first multi-rank step
    (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb"), (dict(bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(mode="adapt"), "mode"), (dict(exchange="allreduce"), "exchange"),
])
def test_options_are_checked_at_world_size_one(bad, match):
    with pytest.raises(ValueError, match=match):
        decent_comm.DAdamW(torch.nn.Linear(2, 2).parameters(), **bad)


def test_model_converted_after_construction_is_named():
    lin = torch.nn.Linear(2, 2)
    opt = decent_comm.DAdamW(lin.parameters())
    lin.to(torch.float64)
    lin(torch.zeros(1, 2, dtype=torch.float64)).sum().backward()
    before = lin.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"model\.to\(\.\.\.\).*after the optimizer was built"):
        opt.step()
    assert torch.equal(lin.weight, before)


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


# ------------------------------------------------------------------------------------------ multi-rank


def _build_with(rank, n, option):
    model = torch.nn.Linear(64, 32)
    ctor, kw, *groups_of = OPTION_MISMATCHES[option](rank)
    params = groups_of[0](model) if groups_of else model.parameters()
    try:
        opt = ctor(params, topology="ring", timeout=20, **kw)
    except RuntimeError as exc:
        return str(exc)
    opt.shutdown()
    return "no error"


OPTION_MISMATCHES = {
    "comm_dtype": lambda r: (decent_comm.DAdamW, dict(comm_dtype=None if r == 0 else torch.bfloat16)),
    "comm_dtype fp16/bf16": lambda r: (decent_comm.DAdamW, dict(comm_dtype=torch.float16 if r == 0 else torch.bfloat16)),
    "bucket_cap_mb": lambda r: (decent_comm.DAdamW, dict(bucket_cap_mb=25 if r == 0 else 0.001)),
    "mode": lambda r: (decent_comm.DAdamW, dict(mode="awc" if r == 0 else "atc")),
    "exchange": lambda r: (decent_comm.DAdamW, dict(exchange="auto" if r == 0 else "p2p")),
    "consensus": lambda r: (decent_comm.DAdamW, dict(consensus=1.0 if r == 0 else 0.5)),
    "optimizer": lambda r: (decent_comm.DAdamW if r == 0 else decent_comm.DAdam, {}),
    "param group": lambda r: (decent_comm.AccumAdamW, dict(accum_steps=4 if r == 0 else 2)),
    # named as param groups, not as the buckets they split into
    "param group count": lambda r: (decent_comm.DAdamW, {}, lambda m: [{"params": [m.weight]}, {"params": [m.bias]}]
                                    if r == 1 else m.parameters()),
    # a callable is compared by its values (its name alone agreed here, and the replicas' mean drifted)
    "consensus callable": lambda r: (decent_comm.DAdamW, dict(consensus=lambda t: 1.0 if r == 0 or t < 5 else 0.3)),
}
_TABLE = [1.0, 0.9, 0.8, 0.7]  # a schedule for a 3-step run (AWC plans the step after): raises beyond, on every rank


def _schedules_for_the_run_only(rank, n):
    model = make_model(rank)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", timeout=20, consensus=lambda t: _TABLE[t])
    train_steps(rank, model, opt, 3)
    opt.shutdown()
    return "trained"


def test_a_consensus_schedule_defined_for_the_run_only_builds():
    """Its values are compared up to step 1e6 at construction: one failing beyond the run's length (a table, (1 -
    t / T) ** 0.5) made the construction fail on several ranks, and not on one."""
    assert run_ranks(_schedules_for_the_run_only, 3, timeout=120) == ["trained"] * 3


@pytest.mark.parametrize("option", sorted(OPTION_MISMATCHES))
def test_options_that_differ_between_ranks_are_named_on_every_rank(option):
    msgs = run_ranks(_build_with, 3, option, timeout=120)
    for m in msgs:
        assert "rank 1" in m and option.split()[0] in m, (option, m)
    if option == "param group count":
        assert all("rank 1: 2 param groups but rank 0 has 1" in m for m in msgs), msgs
    if option == "consensus callable":
        assert all("consensus factor at step 5 is 0.3" in m for m in msgs), msgs


def _parameters_in_another_order(rank, n, give_model):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    params = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    if rank == 1:  # list(set_of_names): its order follows each process's hash seed
        params = params[2:] + params[:2]
    try:
        decent_comm.DAdamW(params, topology="ring", timeout=20, model=model if give_model else None).shutdown()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def _layouts_differ(rank, n):
    model = torch.nn.Conv2d(3, 4, 3)
    if rank == 1:
        model = model.to(memory_format=torch.channels_last)  # same shapes, another order of the elements in memory
    try:
        decent_comm.DAdamW(model.parameters(), topology="ring", timeout=20).shutdown()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_a_parameter_in_another_memory_format_on_one_rank_is_named():
    """The buckets keep each parameter's layout (channels_last), so the flat buffers of two ranks whose layouts
    differ would pair other elements: the strides are part of the start-up comparison."""
    for m in run_ranks(_layouts_differ, 3, timeout=120):
        assert "replicas disagree: rank 1: parameter 0 is ((4, 3, 3, 3), 'torch.float32', 'strides (27, 1, 9, 3)')" \
            in m, m


def test_parameters_of_equal_shapes_in_another_order_are_named_when_the_model_is_given():
    """Without their names the shapes agree and each layer gossips with the other layer's replicas, silently; with
    model= the names go into the start-up comparison."""
    for m in run_ranks(_parameters_in_another_order, 3, True, timeout=120):
        assert "replicas disagree: rank 1: parameter 0 is ('2.weight'" in m and "it is ('0.weight'" in m, m
    assert run_ranks(_parameters_in_another_order, 3, False, timeout=120) == ["no error"] * 3  # nothing tells


class _RowsSumTo1_2(decent_comm.topology.Topology):
    """A user-built schedule validate() refuses: trained, it moved the replicas' mean (29 in 20 steps at lr 0)."""

    def peers(self, rank, step):
        return decent_comm.topology.Peers(0.5, [((rank + 1) % self.world_size, 0.7)], [(rank - 1) % self.world_size])


ONE_RANK_REFUSES = {  # rank 1's options fail its own checks; the others' are valid
    "mode": (dict(mode="AWC"), "mode must be one of"),
    "delayed_mix": (dict(mode="atc", delayed_mix=True), "delayed_mix=True needs mode='awc'"),
    "topology": (dict(topology="one-peer-hypercube"), "one-peer-hypercube"),  # needs a power of 2 ranks
    "timeout": (dict(timeout=-1), "timeout must be a positive number"),
    "Topology object": (dict(topology=_RowsSumTo1_2(3)), "sum to 1.2, not 1"),
}


def _one_rank_refuses(rank, n, case):
    kw, _ = ONE_RANK_REFUSES[case]
    start = time.monotonic()
    try:  # no timeout: the group's own (30 min) would be the wait for a rank that never comes
        opt = decent_comm.DAdamW(make_model(rank).parameters(), **dict(dict(topology="ring"), **(kw if rank == 1 else {})))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    opt.shutdown()
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("case", sorted(ONE_RANK_REFUSES))
def test_options_one_rank_refuses_are_named_on_every_rank_at_once(case):
    reason = ONE_RANK_REFUSES[case][1]
    for r, (kind, msg, seconds) in enumerate(run_ranks(_one_rank_refuses, 3, case, timeout=120)):
        assert kind == "ValueError" and reason in msg, (r, kind, msg)
        if r != 1:
            assert "rank 1 refused to build the optimizer" in msg, msg
        assert seconds < 20, (r, seconds)


UTILITIES = {  # average_parameters and disagreement(all_reduce=True) share global_average's all_reduce_mean_
    "global_average": lambda opt: opt.global_average().__enter__(),
    "consensus_distance": lambda opt: opt.consensus_distance(),
    "replica_variance": lambda opt: opt.replica_variance(),
}


def _utility_with_a_late_rank(rank, n, utility):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=2)
    if rank == 1:
        time.sleep(12)  # late for the collective: the others must not wait for it (nor for the group's own 30 min)
    start = time.monotonic()
    try:
        UTILITIES[utility](opt)
        return "no error", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start


@pytest.mark.parametrize("utility", sorted(UTILITIES))
def test_collective_utilities_time_out_naming_the_late_rank(utility):
    results = run_ranks(_utility_with_a_late_rank, 3, utility, timeout=120)
    for r in (0, 2):
        kind, msg, seconds = results[r]
        assert kind == "ExchangeTimeout" and "rank 1" in msg, (r, kind, msg)
        assert seconds < 9, (r, seconds)  # the timeout (2 s) and the grace for naming the culprit (2 s), not 12 s


def _extra_step_on_one_rank(rank, n, utility, mode):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="one-peer-exp", mode=mode, model=model, timeout=2,
                             track_disagreement=True)
    train_steps(rank, model, opt, 4 if rank == 2 else 3)  # rank 2 steps once more (an uneven last batch)
    try:
        EVERY_UTILITY[utility](opt)
        return "no error", ""
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


EVERY_UTILITY = {**UTILITIES, "average_parameters": lambda opt: opt.average_parameters(),
                 "disagreement": lambda opt: opt.disagreement(all_reduce=True)}


@pytest.mark.parametrize("utility,mode", [(u, "awc") for u in sorted(EVERY_UTILITY)] +
                         [("consensus_distance", "atc"), ("global_average", "atc")])
def test_a_rank_that_stepped_more_often_is_named_by_the_collective_utilities_on_every_rank(utility, mode):
    """The gossip itself cannot tell (each later round pairs with the neighbours' previous one: same sizes, same
    tags); a utility, which meets every rank anyway, compares the step counts before its all-reduces."""
    for rank, (kind, msg) in enumerate(run_ranks(_extra_step_on_one_rank, 4, utility, mode, timeout=120)):
        assert kind == "RuntimeError", (rank, kind, msg)
        assert "different numbers of optimizer steps (rank 2: 4 steps; ranks [0, 1, 3]: 3 steps)" in msg, (rank, msg)


def _out_of_step_whole_group_all_reduces(rank, n, case):
    """Ranks that disagree on the optimizer's whole-group all-reduces (inside step() during the warm-up, or a
    utility's): before, gloo paired tensors of different calls and aborted a process (SIGABRT) on unequal sizes."""
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=4, warmup_steps=10)
    try:
        if case == "extra-step":  # the last rank steps once more, then every rank asks for the consensus distance
            train_steps(rank, model, opt, 4 if rank == n - 1 else 3)
            opt.consensus_distance()
        elif case == "utility-on-one-rank":
            train_steps(rank, model, opt, 3)
            if rank == 0:
                opt.consensus_distance()
            train_steps(rank, model, opt, 1, start=3)
        elif case == "grad-scaler-on-one-rank":
            scaler = torch.amp.GradScaler("cpu", enabled=rank == 0)
            x, y = batch(rank, 0)
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            scaler.step(opt)
        elif case == "two-optimizers-in-other-orders":
            head = torch.nn.Linear(2, 2)
            other = decent_comm.DAdamW(head.parameters(), topology="ring", timeout=4, warmup_steps=10)
            x, y = batch(rank, 0)
            ((head(model(x)) - y) ** 2).mean().backward()
            for o in ((opt, other) if rank == 0 else (other, opt)):
                o.step()
        return "no error", ""
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("case,sides", [
    ("extra-step", ["consensus_distance() after 3 steps", "rank 2: the warm-up gradient average after 3 steps"]),
    ("utility-on-one-rank", ["rank 0: consensus_distance() after 3 steps",
                             "rank 1: the warm-up gradient average after 3 steps"]),
    ("grad-scaler-on-one-rank", ["rank 0: the warm-up gradient average with GradScaler's overflow flag after 0 steps",
                                 "rank 1: the warm-up gradient average after 0 steps"]),
    ("two-optimizers-in-other-orders", ["(of another optimizer)"]),
])
def test_ranks_out_of_step_on_whole_group_all_reduces_are_named_on_every_rank(case, sides):
    for rank, (kind, msg) in enumerate(run_ranks(_out_of_step_whole_group_all_reduces, 3, case, timeout=120)):
        assert kind == "RuntimeError" and "not running the same whole-group all-reduce" in msg, (rank, kind, msg)
        for side in sides:
            assert side in msg, (rank, side, msg)


def _nodes_of_different_sizes(rank, n, topology):
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "1"  # torchrun on nodes of 2, 1 and 1 processes
    model = make_model(rank)
    try:
        opt = decent_comm.DAdamW(model.parameters(), topology=topology, timeout=20)
    except RuntimeError as exc:
        return str(exc)
    train_steps(rank, model, opt, 2)
    opt.shutdown()
    return "trained"


def test_nodes_of_different_sizes_agree_on_a_topology_that_ignores_the_layout():
    assert run_ranks(_nodes_of_different_sizes, 4, "ring", timeout=120) == ["trained"] * 4
    for m in run_ranks(_nodes_of_different_sizes, 4, "aer", timeout=120):  # aer's schedule follows the nodes
        assert "topology fingerprint" in m and "rank 2" in m, m


def _subgroup_layout(rank, n, members, topology):
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # torchrun on 2 nodes of 2: nodes {0, 1} and {2, 3}
    group = dist.new_group(members)
    if rank not in members:
        return None
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology=topology, process_group=group, timeout=20)
    train_steps(rank, model, opt, 2)
    opt.shutdown()
    return opt.topology.local_world_size


@pytest.mark.parametrize("members, topology, ranks_per_node", [
    ([0, 1, 3], "ring", 1),   # 2 + 1 members: no regular layout (3 was refused: LOCAL_WORLD_SIZE=2 does not divide 3)
    ([0, 2], "aer", 1),       # one member on each node (was taken for one node of 2)
    ([1, 3], "ring", 1),
    ([2, 3], "aer", 2),       # both on node 1
])
def test_a_subgroup_takes_its_members_node_layout(members, topology, ranks_per_node):
    out = run_ranks(_subgroup_layout, 4, members, topology, timeout=120)
    assert [out[r] for r in members] == [ranks_per_node] * len(members), out


def _subgroup_misbehaves(rank, n, case):
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    model = make_model(rank)
    try:
        opt = decent_comm.DSGD(model.parameters(), lr=0.2 if case == "lr" and rank == 3 else 0.1, topology="ring",
                               process_group=group, timeout=5)
        if case == "dies" and rank == 3:
            exit_now("exited")
        train_steps(rank, model, opt, 3)
        opt.synchronize()
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case", ["lr", "dies"])
def test_errors_on_a_subgroup_say_which_global_ranks_they_name(case):
    """On the group of global ranks [1, 2, 3], global rank 3 is group rank 2, which the messages name: they also say
    so (a reader took "rank 2" for global rank 2)."""
    out = run_ranks(_subgroup_misbehaves, 4, case, timeout=120)
    for msg in out[1:3] + (out[3:] if case == "lr" else []):
        assert "rank 2" in msg and msg.endswith("[ranks of the process group: its ranks 0..2 are global ranks "
                                                "[1, 2, 3]]"), msg


def _load_other_ranks_state(rank, n):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=20)
    model(torch.zeros(1, 4)).sum().backward()
    opt.step()
    states = [None] * n
    dist.all_gather_object(states, opt.state_dict())
    try:
        opt.load_state_dict(states[(rank + 1) % n])
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    opt.load_state_dict(states[rank])  # its own loads
    opt.shutdown()
    return msg


def test_another_ranks_state_dict_is_refused():
    for r, m in enumerate(run_ranks(_load_other_ranks_state, 3, timeout=120)):
        assert f"saved by rank {(r + 1) % 3}" in m and f"rank {r}" in m, m


def _nan_on_one_rank(rank, n, mode, topology, culprit_exits=False, warmup_steps=0):
    model = make_model(rank)
    # exchange="p2p": a ring on 3 ranks would otherwise run as the group all-reduce too, as "complete" does.
    # ring-int8: the 8-bit wire, whose received bytes are checked once added to the neighbour's public copy
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology=topology.split("-")[0], mode=mode, check_finite=True,
                           timeout=20, exchange="p2p" if topology.startswith("ring") else "auto",
                           comm_dtype=torch.int8 if topology.endswith("int8") else None, warmup_steps=warmup_steps)
    start = time.monotonic()
    try:
        for t in range(6):
            x, y = batch(rank, t)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            if rank == 1 and t == 3:
                loss = loss * float("nan")
            if culprit_exits and rank != 1 and t == 3:
                time.sleep(1.0)  # the culprit posts step 3's exchange, raises and exits before its peers post theirs
            loss.backward()
            opt.step()
        opt.synchronize()
    except RuntimeError as exc:
        if culprit_exits and rank == 1:  # as a script dies of the error: no teardown, nothing drained at exit
            exit_now(dict(msg=str(exc), elapsed=time.monotonic() - start))
        return dict(msg=str(exc), elapsed=time.monotonic() - start)
    return dict(msg="no error", elapsed=time.monotonic() - start)


@pytest.mark.parametrize("mode", ["awc", "atc"])
@pytest.mark.parametrize("topology", ["ring", "complete", "ring-int8"])  # complete: the group all-reduce path
def test_check_finite_names_the_rank_and_step_on_every_rank(mode, topology):
    res = run_ranks(_nan_on_one_rank, 3, mode, topology, timeout=120)
    assert "rank 1:" in res[1]["msg"] and "after optimizer step 3" in res[1]["msg"], res[1]
    for r in (0, 2):
        m = res[r]["msg"]
        # The p2p path names the sender; a group's sum cannot tell, so rank 1 flags its own values (Roster.flag).
        culprit = "from rank 1" if topology.startswith("ring") else \
            "all-reduce among ranks [0, 1, 2] (rank 1 sent non-finite"
        assert "non-finite" in m and culprit in m, (r, m)
        assert res[r]["elapsed"] < 15, res[r]


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_check_finite_names_the_rank_whose_gradient_the_warmup_average_carried(mode):
    """During the warm-up the all-reduced gradient makes every rank's parameters non-finite at once: each rank
    used to name itself; the culprit marks its own gradients beside the average, and every rank names it."""
    for r, res in enumerate(run_ranks(_nan_on_one_rank, 3, mode, "ring", False, 5, timeout=120)):
        assert f"rank {r}: the parameters of bucket(s) [0] are not finite after optimizer step 3, a warm-up step whose " \
               "gradient average carried the non-finite gradients of rank 1" in res["msg"], (r, res)


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_check_finite_culprit_that_exits_at_once_is_still_named(topology):
    """The culprit's process ends right after its error (os._exit): its peers still get its values, and in a group
    its flag, because it completed the exchange it had posted before raising (an exit with the all-reduce in
    flight made them report "the all-reduce ... failed" instead)."""
    res = run_ranks(_nan_on_one_rank, 3, "awc", topology, True, timeout=120)
    assert "rank 1:" in res[1]["msg"], res[1]
    culprit = "from rank 1" if topology == "ring" else "(rank 1 sent non-finite"
    for r in (0, 2):
        assert "non-finite" in res[r]["msg"] and culprit in res[r]["msg"], (r, res[r])


def _silent_group_peer(rank, n):
    model = make_model(0)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="complete", timeout=3)
    if rank == 2:
        time.sleep(12)  # alive but silent: never takes another step
        return "slept"
    start = time.monotonic()
    try:
        for t in range(4):
            opt.zero_grad()
            model(torch.zeros(1, 4)).sum().backward()
            opt.step()
    except ExchangeTimeout as exc:
        return dict(elapsed=time.monotonic() - start, msg=str(exc), kind="ExchangeTimeout")
    return dict(elapsed=time.monotonic() - start, msg="no error", kind=None)


def test_silent_peer_on_group_allreduce_is_an_exchange_timeout():
    res = run_ranks(_silent_group_peer, 3, timeout=120)
    for r in (0, 1):
        assert res[r]["kind"] == "ExchangeTimeout" and "ranks [0, 1, 2]" in res[r]["msg"], res[r]
        assert res[r]["elapsed"] < 3 + 5, res[r]


def _dies_before_its_config(rank, n):
    """Rank 1 arrives at the construction's meeting, then dies before it puts its configuration in the store."""
    if rank == 1:
        import decent_comm.optim.startup as startup
        startup.swap = lambda *args, **kwargs: exit_now("died")
    model = make_model(0)
    start = time.monotonic()
    try:
        decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", timeout=3)
    except ExchangeTimeout as exc:
        return dict(elapsed=time.monotonic() - start, msg=str(exc))
    return dict(elapsed=time.monotonic() - start, msg="no error")


def test_rank_dying_between_arrival_and_its_config_is_named_by_the_others():
    res = run_ranks(_dies_before_its_config, 3, timeout=120)
    assert res[1] == "died"
    for r in (0, 2):
        assert "rank 1 arrived but did not send its configuration within 3 s" in res[r]["msg"], res[r]
        assert res[r]["elapsed"] < 3 + 5, res[r]


def _ddp_wrapped(rank, n):
    model = make_model(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    out = []
    for give_model in (True, False):
        try:
            opt = decent_comm.DSGD(ddp.parameters(), lr=0.1, model=ddp if give_model else None, timeout=20)
            ddp(torch.zeros(1, 4)).sum().backward()
            opt.step()
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_model_left_in_ddp_is_refused():
    for msgs in run_ranks(_ddp_wrapped, 2, timeout=120):
        assert all("DistributedDataParallel" in m for m in msgs), msgs
