"""A schedule whose mix would read more buffers than the fused kernels take in one call (ops.MAX_NEIGHBORS) is
refused at construction on every rank, naming the topology and what to do; it failed at the first step with the
kernels' "split the mix into two calls", which a user cannot do. Group steps read one sum; the 8-bit wire and
delayed_mix read the rank's own copy too."""

import numpy as np
import pytest
import torch

import decent_comm
from decent_comm import ops
from decent_comm import topology as T
from decent_comm.optim.plan import GroupSteps, check_mix_width

from dist_utils import run_ranks


def test_the_limit_is_the_kernels():
    x = torch.zeros(8)
    ops.gossip_mix_(x, [torch.ones(8)] * ops.MAX_NEIGHBORS, 0.0, [1.0 / ops.MAX_NEIGHBORS] * ops.MAX_NEIGHBORS)
    torch.testing.assert_close(x, torch.ones(8))
    with pytest.raises(RuntimeError, match=f"at most {ops.MAX_NEIGHBORS}"):
        ops.gossip_mix_(x, [x.clone()] * (ops.MAX_NEIGHBORS + 1), 0.0, [0.0] * (ops.MAX_NEIGHBORS + 1))


def _dense(n):
    return T.from_matrix(np.full((n, n), 1.0 / n))


@pytest.mark.parametrize("rank", [0, 5])
def test_complete_point_to_point_beyond_the_limit_is_refused_on_every_rank(rank):
    topo = T.make("complete", 40)
    with pytest.raises(ValueError, match=r"topology 'complete': rank 0 mixes 39 neighbours at step 0, but one mix "
                                         r"reads at most 32 buffers: .*exchange='auto'"):
        check_mix_width(topo, rank, 40, None, 0, ops.MAX_NEIGHBORS)


def test_group_steps_read_one_sum():
    topo = T.make("complete", 40)
    check_mix_width(topo, 3, 40, GroupSteps.scan(topo, 3, 40, "auto"), 0, ops.MAX_NEIGHBORS)
    check_mix_width(topo, 3, 40, GroupSteps.scan(topo, 3, 40, "auto"), 1, ops.MAX_NEIGHBORS)


def test_the_own_copy_counts():
    check_mix_width(_dense(33), 0, 33, None, 0, ops.MAX_NEIGHBORS)  # 32 neighbours: exactly the limit
    with pytest.raises(ValueError, match="mixes 32 neighbours at step 0 and its own copy"):
        check_mix_width(_dense(33), 0, 33, None, 1, ops.MAX_NEIGHBORS)
    check_mix_width(T.make("ring", 100), 0, 100, None, 1, ops.MAX_NEIGHBORS)
    check_mix_width(T.make("one-peer-exp", 256), 0, 256, None, 1, ops.MAX_NEIGHBORS)


def test_adaptive_candidates_are_checked_each():
    topo = T.make("adaptive:phase:ring@0,complete@5", 40)
    with pytest.raises(ValueError, match="topology 'complete': rank 0 mixes 39"):
        check_mix_width(topo, 0, 40, None, 0, ops.MAX_NEIGHBORS)


def _build(rank, n, topology, options, limit):
    ops.MAX_NEIGHBORS = limit  # the kernels' 32, which 3 ranks cannot reach
    if "comm_dtype" in options:
        options = {**options, "comm_dtype": {"int8": torch.int8, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}[options["comm_dtype"]]}
    try:
        decent_comm.DAdamW(torch.nn.Linear(3, 2).parameters(), topology=topology, timeout=30, **options)
        return "built"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("topology, options, limit, refused", [
    ("complete", dict(exchange="p2p"), 1, "rank 0 mixes 2 neighbours at step 0, but one mix reads at most 1"),
    ("complete", dict(), 1, None),  # one all-reduce of the three
    ("ring", dict(exchange="p2p"), 2, None),
    ("ring", dict(comm_dtype="int8"), 2, "rank 0 mixes 2 neighbours at step 0 and its own copy"),
    ("ring", dict(exchange="p2p", delayed_mix=True), 2, "rank 0 mixes 2 neighbours at step 0 and its own"),
    ("ring", dict(exchange="p2p", comm_dtype="bf16"), 2, "rank 0 mixes 2 neighbours at step 0 and its own copy"),
    ("ring", dict(exchange="p2p", comm_dtype="fp16"), 2, "rank 0 mixes 2 neighbours at step 0 and its own copy"),
])
def test_every_rank_refuses_at_construction(topology, options, limit, refused):
    for r, msg in enumerate(run_ranks(_build, 3, topology, options, limit, timeout=120)):
        if refused is None:
            assert msg == "built", (r, msg)
        else:
            assert refused in msg, (r, msg)
