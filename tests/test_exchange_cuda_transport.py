"""CUDA buffers without our NCCL transport (an extension built without NCCL) went to the process group's own
send/recv, and under a gloo group that handed CUDA pointers to gloo's host-side transport (read and written as host
memory: a crash or garbage). The Exchanger now refuses that at construction, on every rank, unless the group's
backend for CUDA tensors is NCCL.

No GPU and no NCCL group here: the decision (exchanger._transport_problem) is tested on its inputs, the lookup of a
group's backend for a device (exchanger._group_backend_for) on real gloo groups and on fakes standing for a NCCL
one, and the refusal reaching every rank on 2 gloo ranks, with rank 1's device resolved to cuda:0 by a patch (the
CPU build has no NCCL transport, as a DECENT_COMM_NCCL=0 build). An optimizer holding CUDA parameters cannot be
built on this machine; it builds its exchange through this constructor (GossipExchange), so it raises the same."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from decent_comm.exchange import Exchanger, exchanger

from dist_utils import run_ranks
from exchange_support import errors, payload


@pytest.mark.parametrize("device, nccl_transport, backend, refused", [
    ("cpu", False, "gloo", False),
    ("cpu", False, None, False),
    ("cuda", True, "gloo", False),   # our NCCL transport: the group only carries its unique id
    ("cuda", True, None, False),
    ("cuda", False, "nccl", False),  # a NCCL group's send/recv take CUDA tensors
    ("cuda", False, "gloo", True),   # gloo's send/recv take host memory only
    ("cuda", False, None, True),     # a group with no backend for CUDA tensors (e.g. "cpu:gloo")
    ("cuda", False, "mpi", True),    # CUDA-aware in some builds only: not taken on trust
])
def test_the_transport_decision(device, nccl_transport, backend, refused):
    problem = exchanger._transport_problem(device, nccl_transport, backend)
    assert (problem is not None) == refused, problem
    if refused:
        found = "has no backend for CUDA tensors" if backend is None else f"moves CUDA tensors with {backend!r}"
        for words in ("NCCL transport", "DECENT_COMM_NCCL=0", "backend for CUDA tensors is NCCL", found,
                      "'cpu:gloo,cuda:nccl'", "on the CPU"):
            assert words in problem, (words, problem)


class _FakeBackend:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


class _FakeGroup:
    """Stands for a c10d ProcessGroup: the device types it has backends for, and those backends."""

    def __init__(self, **backends):
        self._backends = backends
        self._device_types = [torch.device(d) for d in backends]

    def _get_backend(self, device):
        return _FakeBackend(self._backends[device.type])


def test_a_groups_backend_for_cuda_tensors():
    assert exchanger._group_backend_for(_FakeGroup(cpu="gloo", cuda="nccl"), "cuda") == "nccl"  # "cpu:gloo,cuda:nccl"
    assert exchanger._group_backend_for(_FakeGroup(cuda="nccl"), "cuda") == "nccl"  # "nccl"
    assert exchanger._group_backend_for(_FakeGroup(cpu="gloo"), "cuda") is None


def _real_groups(rank, world_size):
    """What torch registers for a plain gloo group (gloo also for CUDA tensors) and a "cpu:gloo" one (none)."""
    cpu_only = dist.new_group(list(range(world_size)), backend="cpu:gloo")
    return (exchanger._group_backend_for(dist.group.WORLD, "cuda"), exchanger._group_backend_for(cpu_only, "cuda"),
            exchanger._group_backend_for(dist.group.WORLD, "cpu"))


def test_real_gloo_groups_backends_for_cuda_tensors():
    assert run_ranks(_real_groups, 2, timeout=120) == [("gloo", None, "gloo")] * 2


def _cuda_on_rank_1(rank, world_size):
    """Rank 1 asks for a CUDA exchanger over the gloo group (its device resolved to cuda:0 by a patch: there is no
    GPU), rank 0 for a CPU one. Then both build a CPU exchanger, which must deliver: nothing was claimed."""
    resolve = exchanger._resolve_device
    as_cuda = (lambda device, group: torch.device("cuda", 0)) if rank == 1 else resolve
    # A build without the NCCL transport (DECENT_COMM_NCCL=0; CI's build has it, compiled against no GPU)
    with mock.patch.object(exchanger, "_resolve_device", as_cuda), \
            mock.patch.object(exchanger, "nccl_available", lambda: False):
        refused = errors(lambda: Exchanger(timeout=20).shutdown())
    peer = 1 - rank
    with Exchanger(timeout=20) as ex:
        x, r = payload(rank, 0, 2, 100), torch.empty(100)
        ex.exchange(2, x, [r], [peer], [peer])
        ex.wait(2)
        delivers = torch.equal(r, payload(peer, 0, 2, 100))
    return refused, delivers


def test_a_cuda_exchanger_over_a_gloo_group_is_refused_on_every_rank():
    for rank, ((kind, message), delivers) in enumerate(run_ranks(_cuda_on_rank_1, 2, timeout=120)):
        assert kind == "ValueError", (rank, kind, message)
        assert "CUDA buffers need the NCCL transport" in message and "moves CUDA tensors with 'gloo'" in message, \
            (rank, message)
        if rank == 0:
            assert "rank 1 of the group refused its arguments" in message, message
        assert delivers
