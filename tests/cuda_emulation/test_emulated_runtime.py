"""The emulated CUDA runtime of tests/cuda_emulation, tested on kernels of its own (selftest_kernels.cpp): its warp
shuffles and indices agree with CUDA's definitions, barriers order shared memory, unwritten shared memory reads a
fill, and what a GPU would hang or leave undefined on (a deadlocked barrier, a shuffle over exited lanes), or the
emulation cannot do (a partial-mask shuffle), is reported. Runs only in run.py's emulated build."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("DECENT_COMM_TEST_CUDA_EMULATION") != "1",
                                reason="only in the emulated build (tests/cuda_emulation/run.py)")

SHUFFLES, DEADLOCK, EXITED_LANES, SHARED, UNWRITTEN_SHARED, PARTIAL_MASK = range(6)


def selftest(which, grid, block):
    import decent_comm  # noqa: F401  (loads the emulated _C, which registers torch.ops.dc_emulation)

    return torch.ops.dc_emulation.selftest(which, grid, block)


@pytest.mark.parametrize("grid,block", [(1, 32), (3, 64), (2, 256)])
def test_shuffles_follow_cuda(grid, block):
    total = grid * block
    index, down, xor = selftest(SHUFFLES, grid, block).view(3, total)
    t = torch.arange(total, dtype=torch.int32)
    lane = t % 32
    assert torch.equal(index, t)
    assert torch.equal(down, torch.where(lane + 1 < 32, t + 1, t))  # past the warp's end: the lane's own value
    assert torch.equal(xor, t ^ 16)


def test_shared_memory_is_ordered_by_the_barrier():
    out = selftest(SHARED, 4, 256)[:4 * 256].view(4, 256)
    b, t = torch.meshgrid(torch.arange(4), torch.arange(256), indexing="ij")
    assert torch.equal(out, (b * 1000 + 255 - t).int())  # each block sees its own writes: odd blocks run downwards


def test_a_deadlocked_barrier_is_reported():
    with pytest.raises(RuntimeError, match=r"deadlock in block 0: 256 live threads wait at a barrier"):
        selftest(DEADLOCK, 1, 256)


def test_a_shuffle_over_exited_lanes_is_reported():
    with pytest.raises(RuntimeError, match=r"warp shuffle in block 0, warp 0 with 16 of 32 lanes live"):
        selftest(EXITED_LANES, 1, 64)


def test_unwritten_shared_memory_reads_the_fill_in_every_block():
    out = selftest(UNWRITTEN_SHARED, 3, 64)[:3 * 64]
    assert torch.all(out == 0x7F7F7F7F)  # a later block does not see an earlier one's values either


def test_a_partial_mask_shuffle_is_refused():
    with pytest.raises(RuntimeError, match=r"only full-warp shuffles are emulated"):
        selftest(PARTIAL_MASK, 1, 32)
