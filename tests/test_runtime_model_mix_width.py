"""The planner neither prices nor recommends what decent_comm's optimizers refuse at construction: a mix that reads
more buffers than the fused kernels take in one call (decent_comm.optim.plan.check_mix_width). It listed
"complete: awc, comm_dtype=torch.int8" in its time-to-loss list for --exchange p2p --topologies complete on 4096
ranks, and priced complete point to point on 40 ranks. The reference is the optimizers' own check: this file may
import both them and the runtime model (which imports no torch and repeats their constants)."""
import contextlib
import io
import json

import pytest

from decent_comm import ops
from decent_comm.optim import plan as optim_plan
from decent_comm.runtime_model import ClusterConfig, ComputeTime, Workload, plan
from decent_comm.runtime_model.gossip import make_topology
from decent_comm.runtime_model.hardware import MAX_WORLD_SIZE
from decent_comm.runtime_model.messages import MAX_MESSAGES
from decent_comm.runtime_model.quality import RECIPES

GBIT = 1e9 / 8
INT8 = 1 + 4 / 512
BYTES = {"fp32": 4, "bf16": 2, "int8": INT8}


def cluster(nodes, L):
    return ClusterConfig(nodes, L, 25 * GBIT, 600 * GBIT, 10e-6, 3e-6)


def work(wire="fp32", exchange="auto", param_bytes=4):
    return Workload(params=65e6, compute=ComputeTime(0.1), bytes_per_param=BYTES[wire], exchange=exchange,
                    param_bytes=param_bytes)


def optimizers_refuse(topo, exchange, wire, delayed_mix=False, limit=None, param_bytes=4) -> bool:
    """What the optimizers do at construction (schedule.py): the 8-bit wire never groups; its copy, a wire
    narrower than the parameters' copy (its point-to-point mix is in difference form) and delayed_mix's are one
    more buffer."""
    n = topo.world_size
    groups = optim_plan.GroupSteps.scan(topo, 0, n, "p2p" if wire == "int8" else exchange)
    own_copy = wire == "int8" or BYTES[wire] < param_bytes or delayed_mix
    try:
        optim_plan.check_mix_width(topo, 0, n, groups, int(own_copy), ops.MAX_NEIGHBORS if limit is None else limit)
    except ValueError:
        return True
    return False


def test_the_limits_are_the_optimizers():
    from decent_comm.runtime_model import mix_width
    assert mix_width.MAX_MIX_BUFFERS == ops.MAX_NEIGHBORS
    assert mix_width.MAX_GROUP_SCAN == optim_plan.MAX_SCAN
    # what they accept stays within the messages the model handles: the planner prices the recipes unguarded
    assert mix_width.MAX_MIX_BUFFERS * MAX_WORLD_SIZE <= MAX_MESSAGES


CASES = [("complete", 1, 33), ("complete", 1, 34), ("complete", 10, 4), ("aer-pair", 2, 16), ("aer-pair", 2, 17),
         ("aer", 2, 33), ("aer", 2, 34), ("aer-pair", 4, 9), ("exp", 8, 8), ("base-k", 10, 4), ("torus", 8, 8),
         ("ring", 40, 1), ("one-peer-exp", 16, 4),
         # period x ranks > 65,536: the optimizers look for no groups, so every step runs point to point
         ("complete", 16384, 5), ("aer-pair", 256, 17), ("aer-pair", 128, 17)]


@pytest.mark.parametrize("name, nodes, L", CASES)
@pytest.mark.parametrize("wire, exchange, delayed", [("fp32", "auto", False), ("fp32", "p2p", False),
                                                     ("bf16", "auto", True), ("fp32", "p2p", True),
                                                     ("bf16", "p2p", False),
                                                     ("int8", "p2p", False),
                                                     ("int8", "auto", False)])
def test_the_planner_skips_what_the_optimizers_refuse(name, nodes, L, wire, exchange, delayed):
    from decent_comm.runtime_model.mix_width import MixTooWide, check_mix_width
    topo = make_topology(name, nodes * L, L)
    refused = optimizers_refuse(topo, exchange, wire, delayed)
    if refused:
        with pytest.raises(MixTooWide, match="but one mix reads at most 32 buffers: decent_comm's optimizers"):
            check_mix_width(work(wire, exchange), topo, delayed_mix=delayed)
    else:
        check_mix_width(work(wire, exchange), topo, delayed_mix=delayed)


def listed(p):
    """(family, topology, wire, delayed_mix) of every recipe of a plan's time-to-loss list but All-Reduce."""
    return {(q.kind.family, q.topology, q.kind.wire, q.kind.delayed_mix) for q in p.quality
            if q.kind.family != "allreduce"}


def accepted(topo, limit=None, param_bytes=4):
    """The recipes the optimizers build: gossip on `topo`, each wire under exchange auto as the recipes run, and
    periodic averaging, which is complete with atc and gossip_every=k (docs/time_to_target.md)."""
    complete = make_topology("complete", topo.world_size, topo.local_world_size)
    return {(k.family, topo.name if k.family == "gossip" else "complete", k.wire, k.delayed_mix) for k in RECIPES
            if k.family != "allreduce" and not optimizers_refuse(topo if k.family == "gossip" else complete, "auto",
                                                                 k.wire, k.delayed_mix, limit, param_bytes)}


@pytest.mark.parametrize("name, nodes, L", [("complete", 10, 4), ("complete", 1, 33), ("aer-pair", 2, 17),
                                            ("aer-pair", 2, 16), ("complete", 16384, 5), ("one-peer-exp", 16384, 5)])
@pytest.mark.parametrize("exchange", ["auto", "p2p", "group-allreduce"])
def test_time_to_loss_lists_what_the_optimizers_build(name, nodes, L, exchange):
    p = plan(cluster(nodes, L), work(exchange=exchange), [name], run_simulation=False)
    topo = make_topology(name, nodes * L, L)
    if exchange != "group-allreduce":  # the seed library's exchange: the optimizers have none
        assert (name in [c.name for c in p.candidates]) != optimizers_refuse(topo, exchange, "fp32")
    if name in [c.name for c in p.candidates]:
        assert listed(p) == accepted(topo)
    else:
        assert {x for x in listed(p) if x[0] == "gossip"} == set()
        assert "decent_comm's optimizers refuse it" in dict(p.skipped)[name]
    # on more than 65,536 ranks the optimizers run complete point to point: no periodic averaging either
    assert any(x[0] == "periodic" for x in listed(p)) == (nodes * L <= 65536)


def test_complete_point_to_point_is_skipped_with_what_to_do():
    p = plan(cluster(10, 4), work(exchange="p2p"), ["complete", "ring"], run_simulation=False)
    assert [c.name for c in p.candidates] == ["allreduce", "ring"] and p.recommended != "complete"
    assert dict(p.skipped)["complete"] == (
        "complete on 40 ranks: a rank mixes 39 neighbours point to point at step 0, but one mix reads at most 32 "
        "buffers: decent_comm's optimizers refuse it; use exchange auto, which runs this step as one all-reduce per "
        "averaging group")
    p = plan(cluster(10, 4), work("int8", "p2p"), ["complete"], run_simulation=False)
    assert "and its own copy (the 8-bit wire)" in dict(p.skipped)["complete"] and "use a bf16 wire" in \
        dict(p.skipped)["complete"]
    p = plan(cluster(16384, 5), work(), ["complete"], run_simulation=False)
    assert "period x ranks <= 65536" in dict(p.skipped)["complete"]


def test_a_wire_the_optimizers_refuse_is_not_priced_and_said_so():
    p = plan(cluster(10, 4), work(), ["complete"], run_simulation=False)
    assert p.candidate("complete")  # one all-reduce of the 40 ranks a step
    assert {w for family, _, w, _ in listed(p) if family == "gossip"} == {"bf16"}
    assert any(note.startswith("int8 wire recipes not priced on complete: complete on 40 ranks: a rank mixes 39 "
                               "neighbours point to point at step 0 and its own copy (the 8-bit wire)")
               for note in p.notes)


@pytest.mark.parametrize("limit", [2, 3])
def test_delayed_mix_reads_one_buffer_more(monkeypatch, limit):
    """ring reads 2 neighbours: under a limit of 2 the plain bf16 recipes of a bf16 model fit, delayed_mix's and the
    8-bit wire's (the own copy too) do not; the kernels' real 32 needs 32 in-neighbours to show it."""
    from decent_comm.runtime_model import mix_width
    monkeypatch.setattr(mix_width, "MAX_MIX_BUFFERS", limit)
    topo = make_topology("ring", 8, 1)
    p = plan(cluster(8, 1), work(param_bytes=2), ["ring"], run_simulation=False)
    assert listed(p) == accepted(topo, limit, param_bytes=2)
    assert any((k.wire, k.delayed_mix) == ("bf16", True) for k in RECIPES)
    assert (("gossip", "ring", "bf16", True) in listed(p)) == (limit == 3)
    assert any("delayed_mix not priced on ring" in note for note in p.notes) == (limit == 2)


def test_cli_reviewer_case():
    """plan --exchange p2p --topologies complete (4096 ranks in the report; 40 here: the same rule, quicker)."""
    from decent_comm.cli import main
    argv = ["plan", "--nodes", "40", "--params", "65M", "--inter-bw", "25Gbit", "--compute", "100ms", "--no-sim",
            "--exchange", "p2p", "--topologies", "complete", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    d = json.loads(out.getvalue())
    assert d["candidates"] == ["allreduce"] and "refuse it" in d["skipped"]["complete"]
    assert not [q for q in d["time_to_quality"] if q["family"] == "gossip"]


def test_a_wire_narrower_than_the_parameters_reads_the_own_copy_too():
    """A bf16 wire on fp32 parameters mixes point-to-point steps in difference form against the copy sent: on 33
    ranks complete point to point passes with an fp32 wire (32 buffers) and is refused with bf16 (33), as the
    optimizers refuse it; a bf16 model's bf16 wire is not narrower and passes."""
    from decent_comm.runtime_model.mix_width import MixTooWide, check_mix_width
    topo = make_topology("complete", 33, 33)
    check_mix_width(work("fp32", "p2p"), topo)
    check_mix_width(work("bf16", "p2p", param_bytes=2), topo)
    with pytest.raises(MixTooWide, match=r"mixes 32 neighbours point to point at step 0 and its own copy \(a wire "
                                         r"narrower than the parameters"):
        check_mix_width(work("bf16", "p2p"), topo)
    assert optimizers_refuse(topo, "p2p", "bf16") and not optimizers_refuse(topo, "p2p", "fp32")
