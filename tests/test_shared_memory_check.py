"""Parameters over one storage are refused only when they share an element (shared_memory.check_no_shared_memory).
Two strided views whose address spans overlap used to be compared by a mask of the whole span, and spans over 2**26
elements were taken to share memory unchecked: the column halves of a (4100, 16384) weight, split as a fused
projection is, were refused with "share memory ... Tie weights by using one Parameter object", where torch.optim
trains them (and eight column slices of a 65M-element tensor took 11 s and 1.4 GB to accept). The check now solves
the offsets' integer equation exactly; here it is compared with an element-by-element mask on random layouts."""
import itertools
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
        if any(map(_refers_twice, views)):  # refused on their own (test_a_parameter_overlapping_itself_...)
            continue
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


def _refers_twice(t):
    """Whether two indices of `t` reach one element, by listing every index's offset (a reference in Python)."""
    offsets = [sum(i * s for i, s in zip(index, t.stride())) for index in itertools.product(*map(range, t.shape))]
    return len(set(offsets)) != len(offsets)


def _refused_alone(p):
    try:
        check_no_shared_memory([{"params": [p]}])
    except ValueError as exc:
        assert "parameter 0 (shape" in str(exc) and "more than once" in str(exc), exc
        return True
    return False


def test_a_parameter_overlapping_itself_is_refused_exactly():
    """Only stride 0 was looked for: as_strided((4, 4), (2, 1)) over 10 elements was taken, each of its 16 indices
    a slot of its own (an element two indices share updated once: 2.0 -> 1.9 with lr 0.1 and gradient 1, where
    torch.optim.SGD steps it through both to 1.8)."""
    rng = random.Random(1)
    storage = torch.empty(400)
    seen = set()
    for _ in range(2000):
        dims = rng.randint(1, 3)
        view = storage.as_strided([rng.randint(1, 4) for _ in range(dims)], [rng.randint(0, 9) for _ in range(dims)])
        want = _refers_twice(view)
        assert _refused_alone(view) == want, (view.shape, view.stride())
        seen.add(want)
    assert seen == {True, False}
    assert _refused_alone(torch.arange(10.).as_strided((4, 4), (2, 1)))
    assert _refused_alone(torch.zeros(7).as_strided((2, 2), (3, 3)))  # (0, 1) and (1, 0) both reach 3
    with pytest.raises(ValueError, match=r"parameter 1 \(shape \(4, 4\), strides \(2, 1\)\).*more than once"):
        decent_comm.DSGD([torch.nn.Parameter(torch.zeros(3)),
                          torch.nn.Parameter(torch.arange(10.).as_strided((4, 4), (2, 1)))], lr=0.1)


def test_layouts_that_do_not_overlap_themselves_train_as_torch_trains_them():
    """Transposed, channels_last, sliced, and an interleaving whose strides fail the quick test (shape (3, 2),
    strides (2, 3): offsets 0, 3, 2, 5, 4, 7) are taken, and step as torch.optim.SGD steps them."""
    def layouts():
        return [torch.arange(12.).view(3, 4).t(),
                torch.arange(2 * 3 * 4 * 5.).view(2, 3, 4, 5).to(memory_format=torch.channels_last),
                torch.arange(40.).view(5, 8)[1:4, ::3],
                torch.arange(8.).as_strided((3, 2), (2, 3)),
                torch.arange(11.).as_strided((2, 3), (4, 3))]  # offsets 0, 3, 6, 4, 7, 10
    for t in layouts():
        assert not _refers_twice(t) and not _refused_alone(t), (t.shape, t.stride())
    ours = [torch.nn.Parameter(t) for t in layouts()]
    theirs = [torch.nn.Parameter(t) for t in layouts()]
    opt, reference = decent_comm.DSGD(ours, lr=0.1, momentum=0.9), torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            p.grad = q.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        reference.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach())
    opt.shutdown()
