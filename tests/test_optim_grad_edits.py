"""User code that points a parameter's .grad elsewhere between steps trains as torch.optim does: each parameter
steps with what its .grad held when step() (or clip_grad_norm_) was called, also when that tensor lies in the
optimizer's own gradient buffers (a swap, one parameter taking another's gradient, a transposed view). And
zero_grad(set_to_none=False) after the model was converted names the conversion, as step() does.
One process (world size 1: the optimizers equal their torch counterparts step for step)."""

import pytest
import torch

import decent_comm

OPTIMIZERS = {  # ours (taking decentralized options), torch's
    "DSGD": (lambda g, **o: decent_comm.DSGD(g, lr=0.1, momentum=0.9, **o),
             lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)),
    "DAdamW": (lambda g, **o: decent_comm.DAdamW(g, lr=0.1, **o), lambda g: torch.optim.AdamW(g, lr=0.1)),
    "Decentralized(SGD)": (lambda g, **o: decent_comm.Decentralized(torch.optim.SGD(g, lr=0.1), **o),
                           lambda g: torch.optim.SGD(g, lr=0.1)),
    "Decentralized(AdamW)": (lambda g, **o: decent_comm.Decentralized(torch.optim.AdamW(g, lr=0.1), **o),
                             lambda g: torch.optim.AdamW(g, lr=0.1)),
}


def _swap(a, b):
    a.grad, b.grad = b.grad, a.grad


def _take_then_scale(a, b):
    b.grad = a.grad            # b takes a's gradient, then a's own is replaced by a scaled copy
    a.grad = a.grad * 0.5


def _transpose_own(a, b):
    a.grad = a.grad.t()        # a view of a's own gradient memory in another layout


def _halves_of_one_tensor(a, b):
    both = torch.cat([b.grad, a.grad])  # swapped, in one foreign tensor: its halves are taken as they are
    a.grad, b.grad = both[:4], both[4:]


EDITS = {"swap": _swap, "take_then_scale": _take_then_scale, "transpose_own": _transpose_own,
         "halves_of_one_tensor": _halves_of_one_tensor}
LAYOUTS = {  # (param groups, our options): one bucket; a bucket per parameter; a group (and bucket) per parameter
    "one_bucket": lambda a, b, w: ([a, b, w], {}),
    "bucket_each": lambda a, b, w: ([a, b, w], dict(bucket_cap_mb=1e-6)),
    "group_each": lambda a, b, w: ([dict(params=[a]), dict(params=[b], lr=0.05), dict(params=[w])], {}),
}


def _params(seed):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]


def _train(name, layout, edit, clip, ours):
    a, b, w = _params(0)
    groups, options = LAYOUTS[layout](a, b, w)
    opt = OPTIMIZERS[name][0](groups, **options) if ours else OPTIMIZERS[name][1](groups)
    torch.manual_seed(1)
    norms = []
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        for p in (a, b, w):  # accumulate, as backward does, into whatever .grad is now (ours: the buffers' views)
            g = torch.randn(4, 4)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        EDITS[edit](a, b)
        if clip:
            norms.append(float(opt.clip_grad_norm_(1.0) if ours else torch.nn.utils.clip_grad_norm_([a, b, w], 1.0)))
        opt.step()
    return [p.detach().clone() for p in (a, b, w)], norms


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip_then_step"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_grad_pointed_into_the_optimizers_buffers_trains_as_torch(name, edit, layout, clip):
    ours, our_norms = _train(name, layout, edit, clip, ours=True)
    theirs, their_norms = _train(name, layout, edit, clip, ours=False)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert our_norms == pytest.approx(their_norms, rel=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_grad_keeping_grads_names_a_model_converted_after_construction(name):
    model = torch.nn.Linear(3, 2)
    opt = OPTIMIZERS[name][0](model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    model.double()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"parameter 0 is now torch.float64 .* model was converted"):
        opt.zero_grad(set_to_none=False)
    for p, g in zip(model.parameters(), grads):  # refused before anything was written
        torch.testing.assert_close(p.grad, g)
    opt.zero_grad()  # set_to_none drops the gradients whatever their dtype, as torch's does
    assert all(p.grad is None for p in model.parameters())



@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clip_grad_norm_below_max_norm_leaves_the_gradients_as_torch(name, norm_type):
    """torch.nn.utils.clip_grad_norm_ scales by min(1, max_norm / (norm + 1e-6)): a norm far below max_norm leaves
    the gradients as they are (the test above clips norms above max_norm only)."""
    ours, theirs = _params(0), _params(0)
    opt = OPTIMIZERS[name][0](ours, bucket_cap_mb=1e-6)  # a bucket per parameter: their norms combined
    torch.manual_seed(1)
    grads = [torch.randn(4, 4) for _ in ours]
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    norm = opt.clip_grad_norm_(100.0, norm_type)
    assert float(norm) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(theirs, 100.0, norm_type)), rel=1e-6)
    for p, q, g in zip(ours, theirs, grads):
        assert torch.equal(q.grad, g) and torch.equal(p.grad, g), (p.grad - g).abs().max()


NORM_TYPES = [2.0, 1, 0.5, 0, float("inf"), float("-inf"), -1, -2, "inf", "-inf", torch.tensor(3.0), True]


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=repr)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clip_grad_norm_measures_the_parameters_not_the_bucket_padding(name, norm_type):
    """Parameters of 5, 3 and 6 elements share a bucket with alignment padding between them, which holds zeros: a
    norm of order <= 0 measured over it was 0 (negative orders, -inf) or counted the runs of parameters (0), and
    nothing was clipped. The norm and the clipped gradients are torch.nn.utils.clip_grad_norm_'s on the same
    gradients, for every norm_type torch takes: a parameter without a gradient is ignored, and a bfloat16 parameter
    (its own bucket) is scaled by the float32 coefficient as torch scales it."""
    torch.manual_seed(2)
    values = [torch.randn(5), torch.randn(3), torch.randn(2, 3), torch.randn(4), torch.randn(7).bfloat16()]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    opt = OPTIMIZERS[name][0]([dict(params=ours[:4]), dict(params=ours[4:])])
    assert opt._buckets[0].numel > sum(p.numel() for p in ours[:4])  # the padding this test is about
    grads = [torch.randn(v.shape, dtype=v.dtype) + 2 for v in values]  # away from 0: orders <= 0 are large
    grads[3] = None  # no gradient: ignored by both
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.01, norm_type)
    norm = opt.clip_grad_norm_(0.01, norm_type)
    assert norm.dtype == expected.dtype
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert float(expected) > 0.01  # torch clipped: so must we
    for p, q in zip(ours, theirs):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6 if q.dtype == torch.float32 else 0, atol=0)
