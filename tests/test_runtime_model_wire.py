"""The runtime model prices a narrow wire as the optimizers move it under exchange="auto": a bf16/fp16 wire's
group steps sum the float32 parameters (decent_comm/optim/wire_buffers.py), the 8-bit wire never groups (its
per-edge deltas cannot be summed); "group-allreduce" (the seed library) sums in the wire dtype."""

import pytest

from decent_comm.runtime_model import ClusterConfig, ComputeTime, Workload, predict, simulate
from decent_comm.runtime_model.closed_form import make_topology
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
