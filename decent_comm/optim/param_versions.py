"""The parameters' version counters, which tie the flat buckets to autograd and to the exchange.

The kernels write parameters through their buckets' flat buffers, which autograd does not see (written), and the
exchange sends those buffers without a copy, so a parameter written by user code while its bucket is on the wire
would reach a neighbour half old, half new (note_in_flight / note_landed / check_unwritten).
"""
from typing import List

from torch.autograd.graph import increment_version

from .buckets import Bucket, adopt_storage, converted


def written(buckets) -> None:
    """The kernels wrote these buckets' parameters in place through the flat buffers, which autograd does not see
    (each Parameter keeps its own version counter): bump the parameters' counters as an in-place op of torch
    would, so a backward through a graph that saved them raises "modified by an inplace operation" (opt.step()
    between a forward and its backward) instead of computing a gradient from values that are gone."""
    increment_version([s.param for b in buckets for s in b.slots])


def note_in_flight(buckets, sending) -> None:
    """`sending`: the indices of the buckets whose flat buffers are on the wire now (sent without a copy): remember
    their parameters' version counters, to tell a write by user code before the transfer completed
    (check_unwritten). The others may be written."""
    for b in buckets:
        b.versions = _versions(b) if b.index in sending else None


def _versions(b: Bucket) -> List[int]:
    return [s.param._version for s in b.slots]


def note_landed(buckets) -> None:
    """The buckets' transfers completed: the parameters may be written again."""
    for b in buckets:
        b.versions = None


def check_unwritten(buckets, when: str = "between steps") -> None:
    """RuntimeError when user code wrote a parameter in place (load_state_dict, a pruning mask, clamp_) while its
    bucket was still being sent: a neighbour may have received a buffer part before, part after the write. A
    parameter converted meanwhile (model.to(...) with swapped tensors) is refused as converted instead. One given
    other storage meanwhile (p.set_(t), which bumps its counter; torch.nn.utils.parametrize registering, which calls
    set_) wrote nothing into the buffer on the wire: it is no error, as p.data = t (no bump) is not, and the next step
    or mix takes its values into the bucket (buckets.adopt_storage)."""
    for b in buckets:
        if b.versions is not None and _versions(b) != b.versions:
            _raise_if_converted(buckets)
            sent = b.flat.untyped_storage().data_ptr()
            i = next((i for i, s in enumerate(b.slots)
                      if s.param._version != b.versions[i] and s.param.untyped_storage().data_ptr() == sent), None)
            if i is None:
                continue
            raise RuntimeError(
                f"decent_comm: parameter {b.slots[i].label} (shape {tuple(b.slots[i].param.shape)}) was written "
                f"in place {when} while this rank was still sending it (the exchange sends the parameters "
                "themselves), so a neighbour may have received part old, part new values. Call opt.synchronize() "
                "before writing parameters (between steps, or in a closure before it writes them).")


def check_before_mix(buckets, before_copy, siblings) -> None:
    """ATC, before the pending mix of `buckets`: a write while in flight is refused (check_unwritten; the mix would
    hide it), and a parameter given new storage since the step (p.data = t, set_()) is taken back into its bucket
    (adopt_storage), or the mix went to the buffer it no longer reads and the next step copied its unmixed values
    over it (the mix lost for that parameter). `before_copy`, `siblings`: as adopt_storage's."""
    check_unwritten(buckets)
    before_copy = checked_first(before_copy, siblings)
    for b in buckets:
        if not b.cache.params_in_place():  # (addresses only: else every slot is still its view)
            adopt_storage(b, before_copy, siblings)
            b.cache.note_params()


def checked_first(complete_transfers, buckets):
    """`complete_transfers` (the schedule's: it notes every bucket landed) after check_unwritten(`buckets`): called
    as adopt_storage's before_copy for one parameter's new storage, it forgot the notes of all the others, so a
    write to another bucket still on the wire passed (ATC's pending mix, a collective utility's adoption)."""
    def complete():
        check_unwritten(buckets)
        complete_transfers()
    return complete


def _raise_if_converted(buckets) -> None:
    """Raises the conversion error (buckets.converted) of the first parameter of `buckets` converted after the
    optimizer was built, if any. Under torch.__future__.set_swap_module_params_on_conversion(True),
    model.to(torch.float64) swaps a new tensor into each Parameter object, whose version counter differs from the one
    noted while in flight: the version check must not call that a write to synchronize() before, when what is wrong
    is the conversion, which the step's own check (adopt_storage) refuses with what to do (build the optimizer after
    moving the model)."""
    for b in buckets:
        for i in range(len(b.slots)):
            error = converted(b, i)
            if error is not None:
                raise error
