"""The buckets' flat CPU buffers start in distinct 256-byte lanes of the page (decent_comm/optim/flat_memory.py), so
the streams of one fused op never share a page offset; and a buffer placed so is an ordinary contiguous tensor the
optimizers, state_dict and the exchange use as before (the optimizer suites check that end to end)."""

import pytest
import torch

import decent_comm
from decent_comm.optim.flat_memory import LANE_BYTES, LANES, PAGE_BYTES, flat_buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("numel", [1, 1000, 3 << 20])
def test_flat_buffer_starts_in_its_lane(dtype, numel):
    for lane in range(LANES + 2):
        buf = flat_buffer(numel, dtype, "cpu", lane)
        assert buf.shape == (numel,) and buf.dtype == dtype and buf.is_contiguous()
        assert buf.data_ptr() % PAGE_BYTES == (lane % LANES) * LANE_BYTES
        assert torch.count_nonzero(buf) == 0
        # the allocation behind it holds all of it
        storage = buf.untyped_storage()
        assert buf.data_ptr() + numel * buf.element_size() <= storage.data_ptr() + storage.nbytes()
        # its own storage, from the lane on: torch.compile regenerates a slice a fused op writes from the slice's
        # storage offset as if its base started the storage (tests/test_compiled_step.py)
        assert buf.storage_offset() == 0 and storage.data_ptr() == buf.data_ptr()


def test_an_empty_flat_buffer_is_an_empty_tensor():
    buf = flat_buffer(0, torch.bfloat16, "cpu", 5)
    assert buf.shape == (0,) and buf.dtype == torch.bfloat16


def test_flat_buffer_off_cpu_is_a_plain_allocation():
    buf = flat_buffer(10, torch.float32, "meta", 3, zero=False)
    assert buf.device.type == "meta" and buf.shape == (10,) and buf.storage_offset() == 0


def test_an_optimizers_streams_start_in_distinct_lanes():
    """A DAdamW step over a model: the parameters, gradients and both Adam moments of each bucket are in four different
    lanes; the parameters are still views of the flat buffer, and the step is torch's AdamW step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    twin.load_state_dict(model.state_dict())
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1)
    for m, o in ((model, opt), (twin, ref)):
        m(torch.ones(3, 64)).square().sum().backward()
        o.step()
    for b in opt._buckets:
        streams = [b.flat, b.grad, b.state["exp_avg"], b.state["exp_avg_sq"]]
        assert len({t.data_ptr() % PAGE_BYTES for t in streams}) == len(streams)
        for s in b.slots:
            assert s.param.data_ptr() == b.view(b.flat, s).data_ptr()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
