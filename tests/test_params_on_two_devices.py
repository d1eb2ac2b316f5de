"""Parameters of one rank on two devices (a CPU-offloaded embedding beside a body on cuda:k, a model split over two
GPUs) are refused when the optimizer is built, on every rank, naming the devices and a parameter on each. The
exchange, its all-reduces and the warm-up run on one device: the other device's bucket was refused at the first
step ("send is on meta but this exchanger moves cpu buffers"), after the first bucket had gone out, naming no
parameter. No second device here: meta stands in for it, its own refusal (startup._refuse_meta) patched out."""
from unittest import mock

import torch

import decent_comm
from decent_comm.optim import startup

from dist_utils import run_ranks


def _two_devices(rank, world_size):
    on_cpu = torch.nn.Parameter(torch.randn(4))
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with mock.patch.object(startup, "_refuse_meta", lambda *args: None, create=True):
        try:
            opt = decent_comm.DSGD([{"params": [on_cpu]}, {"params": [on_meta]}], lr=0.1, topology="ring")
        except ValueError as exc:
            return str(exc)
    opt.shutdown()
    return "built"


def test_parameters_on_two_devices_are_refused_at_construction_on_every_rank():
    for said in run_ranks(_two_devices, 2, timeout=120):
        assert "the parameters are on 2 devices: cpu (parameter 0 of param group 0 first), meta (parameter 0 of " \
               "param group 1 first)" in said and "build one optimizer per device" in said, said
