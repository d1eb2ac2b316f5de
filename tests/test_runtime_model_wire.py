"""The runtime model prices a narrow wire as the optimizers move it under exchange="auto": a bf16/fp16 wire's
group steps sum the float32 parameters (decent_comm/optim/wire_buffers.py), the 8-bit wire never groups (its
per-edge deltas cannot be summed); "group-allreduce" (the seed library) sums in the wire dtype."""

import pytest

from decent_comm.runtime_model import ClusterConfig, ComputeTime, Workload, predict, simulate
from decent_comm.runtime_model.gossip import make_topology
from decent_comm.runtime_model.gossip import schedule_comm

GBIT = 1e9 / 8
INT8 = 1 + 4 / 512


def _cluster():
    return ClusterConfig(2, 4, 25 * GBIT, 600 * GBIT, 10e-6, 3e-6)


def _work(bytes_per_param, exchange="auto"):
    return Workload(params=65e6, compute=ComputeTime(0.01), bytes_per_param=bytes_per_param, exchange=exchange)


def _seconds(work, topo):
    return [s.seconds for s in schedule_comm(_cluster(), work, topo)]


def test_group_steps_of_a_bf16_wire_move_float32():
    complete = make_topology("complete", 8, 4)  # one group all-reduce of 8 every step
    assert _seconds(_work(2), complete) == _seconds(_work(4), complete)
    # the seed library's all-reduce sums bf16: about half the time
    assert _seconds(_work(2, "group-allreduce"), complete)[0] < 0.6 * _seconds(_work(4), complete)[0]
    # the simulator draws the same group costs
    c, w = _cluster(), _work(2)
    assert simulate(c, w, complete, steps=40, warmup=4).step_seconds == pytest.approx(
        predict(c, w, complete).step_seconds, rel=1e-6)


def test_the_8bit_wire_is_point_to_point_under_auto():
    complete = make_topology("complete", 8, 4)
    assert _seconds(_work(INT8), complete) == _seconds(_work(INT8, "p2p"), complete)
    assert _seconds(_work(INT8), complete) != _seconds(_work(INT8, "group-allreduce"), complete)


def test_a_bf16_models_group_steps_move_its_two_bytes():
    """param_bytes: the optimizers sum a group step in the parameters' dtype, so a bf16 model over a bf16 wire
    moves 2 bytes per element there (priced 4 before: float32 assumed)."""
    complete = make_topology("complete", 8, 4)
    bf16_model = Workload(params=65e6, compute=ComputeTime(0.01), bytes_per_param=2, param_bytes=2)
    assert bf16_model.group_bytes_per_rank == 65e6 * 2 and _work(2).group_bytes_per_rank == 65e6 * 4
    assert _seconds(bf16_model, complete) == _seconds(_work(2, "group-allreduce"), complete)
    with pytest.raises(ValueError, match="param_bytes must be 2"):
        Workload(params=1, compute=ComputeTime(0.01), param_bytes=3)
    for bad in (2, 8, True, -4.0, float("nan")):  # (taken before: priced as max(bytes, bad))
        with pytest.raises(ValueError, match="group_sum_bytes must be 0"):
            Workload(params=1, compute=ComputeTime(0.01), group_sum_bytes=bad)


def test_recipe_wires_follow_the_parameters_dtype():
    from decent_comm.runtime_model.quality import wire_bytes
    assert [wire_bytes(w) for w in ("fp32", "bf16", "int8")] == [4.0, 2.0, INT8]
    assert [wire_bytes(w, 2) for w in ("fp32", "bf16", "int8")] == [2.0, 2.0, INT8]  # comm_dtype=None: bf16
    assert [wire_bytes(w, 8) for w in ("fp32", "bf16", "int8")] == [8.0, 2.0, INT8]


def test_plan_param_dtype_prices_bf16_and_fp16_models():
    import json
    import subprocess
    import sys

    def plan(*extra):
        cmd = [sys.executable, "-m", "decent_comm", "plan", "--nodes", "2", "--gpus-per-node", "4", "--params", "65M",
               "--inter-bw", "25Gbit", "--intra-bw", "600Gbit", "--compute", "100ms", "--wire-dtype", "bf16",
               "--topologies", "complete,one-peer-exp", "--no-sim", "--json", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    fp32, bf16, fp16 = plan(), plan("--param-dtype", "bf16"), plan("--param-dtype", "fp16")
    # complete: one group all-reduce a step, float32 sums for an fp32 model, bf16 for a bf16 one, float32 for an
    # fp16 one (an fp16 sum overflows at 65504: decent_comm/optim/wire_buffers.py; priced as bf16's before)
    assert bf16["complete"]["comm_seconds"] < 0.6 * fp32["complete"]["comm_seconds"]
    assert fp16["complete"]["comm_seconds"] == fp32["complete"]["comm_seconds"]
    # one-peer-exp is point to point over the bf16 wire either way, and DDP all-reduces the bf16 wire either way
    for name in ("one-peer-exp", "allreduce"):
        assert bf16[name]["comm_seconds"] == fp32[name]["comm_seconds"] == fp16[name]["comm_seconds"]


def test_schedule_comm_takes_a_topology_name_as_its_siblings_do():
    """predict/simulate/plan take names; schedule_comm raised AttributeError ("'str' object has no attribute
    '__dict__'") on one."""
    c, w = _cluster(), _work(4)
    assert _seconds(w, "aer") == _seconds(w, make_topology("aer", 8, 4))
    with pytest.raises(TypeError, match="topology must be"):
        schedule_comm(c, w, None)
    with pytest.raises(ValueError, match="local_world_size=2"):
        schedule_comm(c, w, make_topology("ring", 8, 2))
