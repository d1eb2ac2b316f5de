"""CUDA buffers without our NCCL transport (an extension built without NCCL) went to the process group's own
send/recv. Under a gloo group that handed CUDA pointers to gloo's host-side transport (read and written as host
memory: a crash or garbage); under a NCCL group each send and recv ran alone on the pair's one stream, so the two
receives of a two-way edge waited for sends queued behind them (a deadlock until the timeout). The Exchanger
refuses CUDA buffers without the NCCL transport at construction, on every rank, whatever the group's backend.

No GPU here: the decision (exchanger._transport_problem) is tested on its inputs, and the refusal reaching every
rank on 2 gloo ranks, with rank 1's device resolved to cuda:0 by a patch (the build without the NCCL transport
patched in, as a DECENT_COMM_NCCL=0 build). An optimizer holding CUDA parameters builds its exchange through this
constructor (GossipExchange), so it raises the same."""

from unittest import mock

import pytest
import torch

from decent_comm.exchange import Exchanger, exchanger

from dist_utils import run_ranks
from exchange_support import errors, payload


@pytest.mark.parametrize("device, nccl_transport, refused", [
    ("cpu", False, False),
    ("cpu", True, False),
    ("cuda", True, False),   # our NCCL transport: the group only carries its unique id
    ("cuda", False, True),   # whatever the group's backend: gloo takes host memory, NCCL's lone p2p deadlocks
])
def test_the_transport_decision(device, nccl_transport, refused):
    problem = exchanger._transport_problem(device, nccl_transport)
    assert (problem is not None) == refused, problem
    if refused:
        for words in ("CUDA buffers need the NCCL transport", "DECENT_COMM_NCCL=0", "gloo's take host memory",
                      "deadlock on a two-way edge", "Rebuild the extension with NCCL", "on the CPU"):
            assert words in problem, (words, problem)


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
        assert "CUDA buffers need the NCCL transport" in message and "deadlock on a two-way edge" in message, \
            (rank, message)
        if rank == 0:
            assert "rank 1 of the group refused its arguments" in message, message
        assert delivers
