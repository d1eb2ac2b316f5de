"""Parameters over one storage are refused only when they share an element (shared_memory.check_no_shared_memory).
Two strided views whose address spans overlap used to be compared by a mask of the whole span, and spans over 2**26
elements were taken to share memory unchecked: the column halves of a (4100, 16384) weight, split as a fused
projection is, were refused with "share memory ... Tie weights by using one Parameter object", where torch.optim
trains them (and eight column slices of a 65M-element tensor took 11 s and 1.4 GB to accept). The check now solves
the offsets' integer equation exactly; here it is compared with an element-by-element mask on random layouts."""
import random

import pytest
import torch

import decent_comm
from decent_comm.optim.shared_memory import check_no_shared_memory


def _mask_reference(a, b):
    """Whether the views share an element, by marking every element of `a` in a mask of the storage."""
    size = max(t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) for t in (a, b))
    index = torch.arange(size)
    mask = torch.zeros(size, dtype=torch.bool)
    mask[index.as_strided(a.shape, a.stride(), a.storage_offset())] = True
    return bool(mask[index.as_strided(b.shape, b.stride(), b.storage_offset())].any())


def _refused(*params):
    try:
        check_no_shared_memory([{"params": list(params)}])
    except ValueError as exc:
        assert "share memory" in str(exc), exc
        return True
    return False


def test_random_layouts_match_an_element_by_element_mask():
    rng = random.Random(0)
    storage = torch.empty(4000)
    compared = shared = 0
    while compared < 3000:
        views = []
        for _ in range(2):
            dims = rng.randint(1, 3)
            shape = [rng.randint(1, 6) for _ in range(dims)]
            stride = [rng.randint(1, 40) for _ in range(dims)]
            views.append(storage.as_strided(shape, stride, rng.randint(0, 200)))
        a, b = views
        want = _mask_reference(a, b)
        assert _refused(a, b) == want, (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(),
                                        b.storage_offset())
        compared, shared = compared + 1, shared + want
    assert 300 < shared < 2700, shared  # both answers were exercised


def test_column_slices_of_a_weight_over_2_26_elements_are_taken():
    big = torch.empty(4100, 16384, dtype=torch.uint8)  # 67.2M elements: past the old check's mask
    assert not _refused(big[:, :8192], big[:, 8192:])
    assert not _refused(*[big[:, i * 2048:(i + 1) * 2048] for i in range(8)])
    assert not _refused(big[:, 0::2], big[:, 1::2])
    assert _refused(big[:, :8193], big[:, 8192:])  # one shared column
    assert _refused(big[:, 0::2], big[:, 4096::4])


def test_column_halves_train_as_torch_trains_them():
    weight = torch.randn(64, 128, dtype=torch.float64)
    torch_halves = [torch.nn.Parameter(weight.clone()[:, :64]), torch.nn.Parameter(weight.clone()[:, 64:])]
    shared = weight.clone().float()
    ours = [torch.nn.Parameter(shared[:, :64]), torch.nn.Parameter(shared[:, 64:])]
    reference = torch.optim.AdamW([p.detach().double().requires_grad_() for p in torch_halves], lr=1e-2,
                                  foreach=False)
    opt = decent_comm.DAdamW(ours, lr=1e-2)
    for step in range(3):
        grads = [torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 2 + i))
                 for i in range(2)]
        for p, q, g in zip(ours, reference.param_groups[0]["params"], grads):
            p.grad, q.grad = g.float(), g
        opt.step()
        reference.step()
    for p, q in zip(ours, reference.param_groups[0]["params"]):
        assert torch.allclose(p.double(), q, atol=1e-6), (p.double() - q).abs().max()
    opt.shutdown()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_a_refused_dtype_names_the_parameters_place(dtype):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]},
              {"params": [torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, 3, dtype=dtype)]}]
    with pytest.raises(ValueError, match=rf"got {dtype} of shape \(2, 3\): parameter 1 of param group 1"):
        decent_comm.DSGD(groups, lr=0.1)
