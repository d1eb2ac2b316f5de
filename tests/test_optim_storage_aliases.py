"""A parameter that is a view into larger memory another tensor holds (nn.Parameter(base[:4]) with base kept): the
optimizer moves it into its flat buffer, so that tensor no longer sees the updates torch.optim's in-place steps
give it. Construction warns, naming the parameters (review BV: base kept its old values, silently); ordinary models,
whose parameters own their memory or share it only with each other (cuDNN's RNN weights), build without a warning."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations

import decent_comm

OPTIMIZERS = {
    "DSGD": lambda ps: decent_comm.DSGD(ps, lr=0.1, momentum=0.9),
    "DAdamW": lambda ps: decent_comm.DAdamW(ps, lr=0.1),
    "AccumAdamW": lambda ps: decent_comm.AccumAdamW(ps, lr=0.1),
    "Decentralized(AdamW)": lambda ps: decent_comm.Decentralized(torch.optim.AdamW(ps, lr=0.1)),
}
WARNING = "into larger memory that another tensor holds"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_slices_of_a_kept_tensor_are_warned_naming_them(name):
    """The warning's claim, checked against torch: base follows torch's parameters, ours keeps its values."""
    torch.manual_seed(0)
    ours_base = torch.randn(8, 4)
    torch_base = ours_base.clone()
    ours = [nn.Parameter(ours_base[:4]), nn.Parameter(ours_base[4:])]
    theirs = [nn.Parameter(torch_base[:4]), nn.Parameter(torch_base[4:])]
    with pytest.warns(UserWarning, match=WARNING) as record:
        opt = OPTIMIZERS[name](ours)
    assert len([w for w in record if WARNING in str(w.message)]) == 1  # once per construction, both named
    msg = str(record[0].message)
    assert "parameter 0 (shape (4, 4): 64 bytes of a storage of 128)" in msg, msg
    assert "parameter 1 (shape (4, 4): 64 bytes of a storage of 128)" in msg, msg
    assert ".clone()" in msg and "no longer see the updates" in msg, msg
    assert record[0].filename == __file__  # the user's line, not decent_comm's
    ref = torch.optim.AdamW(theirs, lr=0.1)
    before = ours_base.clone()
    for ps, o in ((ours, opt), (theirs, ref)):
        for p in ps:
            p.grad = torch.ones(4, 4)
        o.step()
    assert torch.equal(torch_base, torch.cat([p.detach() for p in theirs]))  # torch: base is updated
    assert torch.equal(ours_base, before)  # ours: as warned, base keeps its values
    assert not torch.equal(torch.cat([p.detach() for p in ours]), before)


def test_one_slice_in_a_second_param_group_is_named_by_its_group():
    base = torch.zeros(10)
    with pytest.warns(UserWarning, match=r"parameter 1 of param group 1 \(shape \(3,\): 12 bytes of a storage of 40\)"):
        decent_comm.DSGD([{"params": [nn.Parameter(torch.zeros(2))]},
                          {"params": [nn.Parameter(torch.zeros(1)), nn.Parameter(base[2:5])]}], lr=0.1)


def _cudnn_layout(rnn: nn.RNNBase) -> torch.Tensor:
    """What torch._cudnn_rnn_flatten_weight does to an RNN's weights on CUDA (on the CPU they stay apart): copies them
    into one buffer, with gaps, and points each at its place (set_). Returns the buffer, which torch drops."""
    weights = list(rnn._flat_weights)
    flat = torch.zeros(sum(w.numel() + 4 for w in weights))
    offset = 0
    with torch.no_grad():
        for w in weights:
            flat[offset:offset + w.numel()].copy_(w.reshape(-1))
            w.set_(flat.untyped_storage(), offset, w.shape, w.stride())
            offset += w.numel() + 4
    assert weights[1].untyped_storage().data_ptr() == flat.data_ptr()
    return flat


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10)
        self.out.weight = self.emb.weight


def _ordinary_models():
    """(name, model, parameters) of models whose parameters no other tensor reads."""
    loaded = nn.Linear(4, 3)
    state = nn.Linear(4, 3).state_dict()  # kept: load_state_dict copies it in
    loaded.load_state_dict(state)
    cudnn = nn.LSTM(4, 3, num_layers=2)
    _cudnn_layout(cudnn)  # the buffer dropped, as torch does: the weights alone share it
    lora = nn.Linear(4, 4)
    lora.weight.requires_grad_(False)
    rebuilt = nn.Linear(4, 3)
    first = decent_comm.DAdamW(rebuilt.parameters())  # kept: its bucket holds the parameters the next one moves
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    models = {
        "Linear": nn.Linear(4, 3), "Embedding": nn.Embedding(10, 4),
        "sparse Embedding": nn.Embedding(10, 4, sparse=True),
        "Conv2d channels_last": conv.to(memory_format=torch.channels_last), "rebuilt optimizer": rebuilt,
        "LSTM": nn.LSTM(4, 3, num_layers=2, bidirectional=True), "GRU": nn.GRU(4, 3), "LSTM, cuDNN's layout": cudnn,
        "weight_norm": parametrizations.weight_norm(nn.Linear(4, 3)),
        "spectral_norm": parametrizations.spectral_norm(nn.Linear(4, 3)),
        "orthogonal": parametrizations.orthogonal(nn.Linear(4, 4)),
        "old weight_norm": torch.nn.utils.weight_norm(nn.Linear(4, 3)),
        "float64": nn.Linear(4, 3).to(torch.float64), "loaded": loaded, "tied": _Tied(),
        "transformer": nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    }
    cases = [(n, m, list(m.parameters())) for n, m in models.items()]
    cases.append(("frozen left out", lora, [p for p in lora.parameters() if p.requires_grad]))
    cases.append(("slice of a temporary", None, [nn.Parameter(torch.randn(8, 4)[:4])]))
    return cases, (state, first)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ordinary_models_build_without_the_warning(name):
    cases, kept_alive = _ordinary_models()
    kept = nn.Linear(4, 3)
    sd = kept.state_dict()  # views of the whole parameters: nothing tells them from the parameters (docs/api.md)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for case, model, params in cases + [("a state_dict kept", kept, list(kept.parameters()))]:
            OPTIMIZERS[name](params)
    assert kept_alive and sd


def test_cudnns_layout_is_warned_only_while_its_buffer_is_kept():
    """The counterpart of the cuDNN case above: the same layout with the buffer still held is warned."""
    lstm = nn.LSTM(4, 3, num_layers=2)
    flat = _cudnn_layout(lstm)
    assert flat.numel() == 4 * 12 + 3 * 12 * 3 + 12 * 4 + 8 * 4  # the weights, biases, and a gap after each
    with pytest.warns(UserWarning, match=r"parameter 0 \(shape \(12, 4\): 192 bytes of a storage of 944\), "
                                         r"parameter 1 .* and 4 more are views into larger memory"):
        decent_comm.DAdamW(lstm.parameters())


def test_a_vector_given_to_the_parameters_and_kept_is_warned():
    """vector_to_parameters points each parameter into the vector: torch's steps reach it, ours would not."""
    model = nn.Linear(4, 3)
    vec = torch.zeros(15)
    torch.nn.utils.vector_to_parameters(vec, model.parameters())
    with pytest.warns(UserWarning, match=WARNING):
        decent_comm.DSGD(model.parameters(), lr=0.1)
    clone = nn.Linear(4, 3)
    torch.nn.utils.vector_to_parameters(vec, clone.parameters())
    for p in clone.parameters():  # as the warning says: cloned, they are the parameters' own
        p.data = p.data.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decent_comm.DSGD(clone.parameters(), lr=0.1)
