"""A model changed under the optimizer after it was built, by torch's own conversions: under
torch.__future__.set_swap_module_params_on_conversion(True) a model.to(...) keeps each Parameter object and swaps a new
tensor into it. Misuse in general (model.half() with torch's default conversion, reshaped or tied parameters) is in
test_optim_misuse.py."""

import pytest
import torch

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, make_model, train_steps


def _converted_with_swapped_tensors(rank, n, mode, dtype):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="complete", mode=mode, model=model, timeout=10)
    train_steps(rank, model, opt, 2)  # no synchronize(): the last step's exchange is in flight
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(dtype)
        x, y = batch(rank, 2)
        opt.zero_grad()
        ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
        opt.step()
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_a_conversion_swapping_tensors_while_in_flight_is_named_as_a_conversion(mode, dtype):
    """The swapped-in tensors have new version counters, which the check of a write while the exchange is in flight
    compared first: it said the parameters were written in place and to call opt.synchronize() first, which does not
    help; the conversion is named, with what to do, as it is after a synchronize()."""
    for r, m in enumerate(run_ranks(_converted_with_swapped_tensors, 2, mode, dtype, timeout=120)):
        assert m.startswith(f"decent_comm: parameter 0 of bucket 0 is now {dtype} on cpu of shape (3, 4), where the "
                            "optimizer's buffer holds torch.float32"), (r, m)
        assert "Build the optimizer after moving the model" in m and "written in place" not in m, (r, m)
