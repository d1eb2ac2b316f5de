"""Memory for the buckets' flat buffers: on CPU, each buffer of a bucket starts in its own 256-byte lane of the 4 KiB
page, so the streams one fused op reads and writes side by side (parameters, gradients, state, neighbours' copies)
never start at the same offset in a page.

Why: equal-sized tensors allocated one after another (as torch.zeros for each buffer did) start at the same page
offset, a whole number of pages apart, and then element i of every stream lives in the same L1 cache set with the
same low 12 address bits. On the 2-core AVX-512 AMD EPYC of docs/benchmarks.md ("Where the buffers lie"), 16M
elements, one thread: mix_adam_ over separately allocated operands ran at 66-91% of the memory roofline with the AVX2
loops, at 91-118% with its operands in distinct lanes; a standalone Adam loop with streams 1-3 pages (mod 4) apart ran
at 23-36 GB/s against 45-49 GB/s at distances that avoid it. Which page distances hurt depends on the CPU; distinct
page offsets avoided it in every case measured.

Other devices get plain allocations: this is about a CPU core's L1 cache and store buffer, which GPU kernels'
coalesced accesses do not go through.

A lane buffer is a tensor of its own storage, which starts at the lane (storage_offset 0), not a view into the
allocation: torch.compile (auto_functionalize, torch 2.14's try_use_slice) regenerates a slice that a fused op writes
from the slice's storage offset as if its base started the storage, so under a compiled DSGD step the part of a bucket
with gradients, bucket.flat[0:n] of a buffer 64 elements into its allocation, was regenerated as [64:64 + n], empty
("decent_comm.mix_sgd_: grad has s23 elements but x has 0") or, in a larger bucket, the wrong elements.
"""

import torch

PAGE_BYTES = 4096
# Lanes of 256 and 512 bytes measured alike (mix_adam_ with six streams, both instruction sets; 64 bytes was as slow
# as one offset). 16 lanes cover a bucket's buffers in the usual configurations (parameters, gradients, AccumAdam's
# three states, the int8 wire's copies of a period's neighbours and its own: 10 on one-peer-exp over 8 ranks); more
# buffers share lanes again.
LANE_BYTES = 256
LANES = PAGE_BYTES // LANE_BYTES


def flat_buffer(numel: int, dtype: torch.dtype, device, lane: int, zero: bool = True) -> torch.Tensor:
    """A contiguous 1-D buffer of `numel` elements; on CPU one that starts `lane % LANES` lanes into a page (a view of
    an allocation one page longer). Zero-filled when `zero`."""
    device = torch.device(device)
    if device.type != "cpu":
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
    element = dtype.itemsize
    raw = torch.empty(numel * element + PAGE_BYTES, dtype=torch.uint8)
    # torch's CPU allocator aligns to 64 bytes, so the distance to the lane is a whole number of elements; if some
    # allocator did not, the buffer simply starts where the allocation does.
    start = ((lane % LANES) * LANE_BYTES - raw.data_ptr()) % PAGE_BYTES
    start = start if start % element == 0 else 0
    # Its own storage from the lane on (module doc: torch.compile): a slice of the allocation's storage, which keeps
    # it alive by a C++ reference (torch.frombuffer over a NumPy view kept it by a Python object, which only the
    # holder of the GIL can release).
    lane_storage = raw.untyped_storage()[start: start + numel * element]
    buf = torch.empty(0, dtype=dtype).set_(lane_storage, 0, (numel,))
    if zero:
        buf.zero_()
    return buf
