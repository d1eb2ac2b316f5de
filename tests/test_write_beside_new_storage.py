"""A parameter written in place while its bucket is on the wire is refused on every rank (the exchange sends the
parameters themselves) even where another parameter's new storage is taken into its bucket first, which completes
the transfers."""

import pytest
import torch

import decent_comm

from dist_utils import run_ranks


def _write_beside_new_storage(rank, n, then):
    """Layer 1 written in place while its bucket is on the wire, layer 0 given new storage (p.data = clone); then
    the ATC forward (layer 0's hook mixes its bucket first) or a collective utility."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    opt = decent_comm.DSGD(model.parameters(), lr=0.01, topology="ring", mode="atc", model=model,
                           bucket_cap_mb=0.01, timeout=20)
    x = torch.randn(8, 64)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        model[1].weight.mul_(0.5)
        model[0].weight.data = model[0].weight.data.clone()
    try:
        model(x) if then == "forward" else opt.consensus_distance()
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        try:
            opt.shutdown()  # (its pending mix is refused the same way: logged)
        except RuntimeError:
            pass


@pytest.mark.parametrize("then", ["forward", "consensus_distance"])
def test_a_write_in_flight_is_named_beside_another_parameters_new_storage(then):
    """Taking layer 0's new storage into its bucket first completes the transfers, which noted every bucket landed:
    layer 1's write on the wire then passed, on every rank."""
    for m in run_ranks(_write_beside_new_storage, 2, then, timeout=120):
        assert "parameter 1 (shape (64, 64)) was written in place between steps while this rank was still " \
               "sending it" in m, m
