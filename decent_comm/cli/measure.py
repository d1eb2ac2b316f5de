"""Local measurements for ``plan --measure``: compute time of a model, link proxies.

The runtime model only predicts from numbers; this is where the command line gets them by running
things (torch is imported lazily, only here).

* ``measure_compute(model, batch, iters, warmup, device)``: per-iteration
  forward + backward (+ ``zero_grad``) times in seconds, synchronising CUDA.
  The loss is the sum of the (first) output, enough to run the backward.
* ``builtin_mlp(params)``: a 4-layer square MLP with about ``params``
  parameters and a batch of 32, when the user gives no model (at most ``MAX_MLP_PARAMS``).
* ``load_model(spec)``: calls ``fn`` of ``"pkg.mod:fn"``; it must return
  ``(model, example_batch)`` (batch: a tensor, a tuple/list of tensors, or a
  dict of keyword tensors).
* ``resolve_device(text)``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` that exists here.
* ``measure_link()``: a bandwidth/latency probe.  With ``torch.distributed``
  initialised (world size > 1) it times ``all_reduce`` and reports the bus
  bandwidth ``2 (n-1)/n * bytes / time``; otherwise it is a **local proxy**
  only: device memory-copy bandwidth (intra-node stand-in) and TCP loopback
  throughput (inter-node stand-in), neither of which measures your network.

Errors in what the user gave (``--model``, ``--device``, a model that fails to run) raise ``ValueError``
naming the flag, which the command line prints as one line.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import socket
import threading
import time

#: Largest built-in MLP ``--measure`` builds from ``--params`` (400 MB of float32 weights, as much again in
#: gradients); pass ``--model`` to time a bigger model.
MAX_MLP_PARAMS = 100e6


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    """``intra_bandwidth`` / ``inter_bandwidth`` (bytes/s), ``intra_latency`` /
    ``inter_latency`` (s), ``source`` (what was measured, in words), ``is_proxy``."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    source: str
    is_proxy: bool


def load_model(spec: str):
    """``(model, batch)`` from the factory ``"module:function"`` (``ValueError`` naming ``--model`` otherwise)."""
    if ":" not in spec:
        raise ValueError(f"--model must look like module:factory, got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - importing runs the user's module, which may raise anything
        raise ValueError(f"--model: cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model: {mod_name!r} has no callable {fn_name!r}")
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything; report it as bad input
        raise ValueError(f"--model {spec}: the factory raised {type(e).__name__}: {e}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and hasattr(out[0], "parameters")):
        raise ValueError(f"--model {spec}: the factory must return (model, example_batch), got {type(out).__name__}")
    return out


def builtin_mlp(params: float, batch: int = 32):
    """``(model, batch)``: 4 square ``Linear(h, h)`` layers with ReLU, ``4 h^2 + 4 h ~ params``."""
    import torch

    if params > MAX_MLP_PARAMS:
        raise ValueError(f"--params {params:g} is too large for the built-in MLP of --measure (at most"
                         f" {MAX_MLP_PARAMS:g}); pass --model for a bigger model")
    h = max(4, int(math.sqrt(max(params, 64) / 4.0)))
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(h, h), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), torch.randn(batch, h)


def resolve_device(text: str):
    """The ``torch.device`` of ``--device`` (``auto``: CUDA when available); ``ValueError`` if unusable here."""
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {text!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {text!r}: CUDA is not available here; use cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {text!r}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}")
    elif dev.type != "cpu":
        raise ValueError(f"--device {text!r}: only cpu and cuda are supported; use auto, cpu, cuda or cuda:N")
    return dev


def _to(batch, device):
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _loss(out):
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum()


def _seconds_per_call(fn, calls: int, device) -> float:
    """Mean wall time of ``calls`` calls of ``fn``, the device synchronised before and after."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def measure_compute(model, batch, iters: int = 10, warmup: int = 2, device: str = "auto") -> list:
    """Seconds per forward + backward for ``iters`` timed iterations (after ``warmup``)."""
    dev = resolve_device(device)
    model = model.to(dev)
    batch = _to(batch, dev)

    def once():
        if isinstance(batch, dict):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        _loss(out).backward()
        model.zero_grad(set_to_none=True)

    try:
        for _ in range(warmup):
            once()
        return [_seconds_per_call(once, 1, dev) for _ in range(iters)]
    except Exception as e:  # noqa: BLE001 - the user's model may raise anything; report it as bad input
        raise ValueError(f"--model: forward + backward on {dev} failed: {type(e).__name__}: {e}") from None


def _copy_bandwidth(nbytes: int, iters: int) -> tuple:
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    b = torch.empty_like(a)
    small_a, small_b = a[:16], b[:16]
    _seconds_per_call(lambda: b.copy_(a), 1, dev)
    bw = nbytes / _seconds_per_call(lambda: b.copy_(a), iters, dev)
    lat = _seconds_per_call(lambda: small_b.copy_(small_a), 100, dev)
    return bw, lat, dev.type


def _loopback_bandwidth(nbytes: int) -> tuple:
    """TCP throughput and round-trip/2 over 127.0.0.1 (bytes/s, seconds)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def sink():
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < nbytes:                  # bulk phase
                data = conn.recv(1 << 20)
                if not data:
                    return
                got += len(data)
            conn.sendall(b"k")
            while conn.recv(1):                  # ping-pong phase: echo one byte
                conn.sendall(b"p")

    th = threading.Thread(target=sink, daemon=True)
    th.start()
    cli = socket.create_connection(("127.0.0.1", port))
    try:
        payload = b"\0" * (1 << 20)
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            cli.sendall(payload)
            sent += len(payload)
        cli.recv(1)
        bw = nbytes / (time.perf_counter() - t0)
        rtts = []
        for _ in range(20):
            t1 = time.perf_counter()
            cli.sendall(b"p")
            cli.recv(1)
            rtts.append(time.perf_counter() - t1)
        lat = sorted(rtts)[len(rtts) // 2] / 2
    finally:
        cli.close()
        srv.close()
    return bw, lat


def measure_link(nbytes: int = 32 << 20, iters: int = 5) -> LinkProbe:
    """A ``LinkProbe``: torch.distributed all_reduce if initialised, else local proxies."""
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001 - no torch.distributed: fall back to the proxy
        distributed = False
    if distributed:
        import torch
        n = dist.get_world_size()
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        x = torch.ones(nbytes // 4, device=dev)
        _seconds_per_call(lambda: dist.all_reduce(x), 1, dev)
        t = _seconds_per_call(lambda: dist.all_reduce(x), iters, dev)
        bus = 2.0 * (n - 1) / n * nbytes / t
        return LinkProbe(bus, bus, 5e-6, 5e-6,
                         f"torch.distributed all_reduce bus bandwidth over {n} ranks (one number for both links)",
                         is_proxy=False)
    copy_bw, copy_lat, kind = _copy_bandwidth(nbytes, iters)
    loop_bw, loop_lat = _loopback_bandwidth(nbytes)
    return LinkProbe(copy_bw, loop_bw, copy_lat, loop_lat,
                     f"LOCAL PROXY ONLY: intra = {kind} memory-copy bandwidth, inter = TCP loopback"
                     " (127.0.0.1); neither measures your cluster's links, pass --intra-bw/--inter-bw",
                     is_proxy=True)
