"""A parameter written in place by the closure step(closure) evaluates, while its bucket is still on the wire, is
refused on every rank, as the same write between steps is. step() checked the versions before it ran the closure,
and AWC's update reads none again: the write passed, and a neighbour could mix part old, part new values."""

import pytest
import torch

import decent_comm

from dist_utils import run_ranks


def _write_in_closure(rank, n, mode, repoint):
    """Two warm steps; then a step whose closure halves layer 1's weight in place before its forward (and, with
    `repoint`, gives layer 0 new storage, whose adoption completes the transfers first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    opt = decent_comm.DSGD(model.parameters(), lr=0.01, topology="ring", mode=mode, model=model, bucket_cap_mb=0.01,
                           timeout=20)
    x = torch.randn(8, 64)

    def closure(write=False):
        if write:
            with torch.no_grad():
                model[1].weight.mul_(0.5)
                if repoint:
                    model[0].weight.data = model[0].weight.data.clone()
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    try:
        opt.step(lambda: closure(write=True))
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        try:
            opt.shutdown()
        except RuntimeError:
            pass


@pytest.mark.parametrize("mode, repoint", [("awc", False), ("awc", True), ("atc", False), ("atc", True)])
def test_a_write_in_flight_inside_the_closure_is_refused_on_every_rank(mode, repoint):
    for m in run_ranks(_write_in_closure, 2, mode, repoint, timeout=120):
        assert "parameter 1 (shape (64, 64)) was written in place" in m and "still sending it" in m, m
