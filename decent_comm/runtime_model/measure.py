"""Local measurements for ``plan --measure``: compute time of a model, link proxies.

* ``measure_compute(model, batch, iters, warmup, device)``: per-iteration
  forward + backward (+ ``zero_grad``) times in seconds, synchronising CUDA.
  The loss is the sum of the (first) output, enough to run the backward.
* ``builtin_mlp(params)``: a 4-layer square MLP with about ``params``
  parameters and a batch of 32, when the user gives no model.
* ``load_factory("pkg.mod:fn")``: imports ``fn``; it must return
  ``(model, example_batch)`` (batch: a tensor, a tuple/list of tensors, or a
  dict of keyword tensors).
* ``measure_link()``: a bandwidth/latency probe.  With ``torch.distributed``
  initialised (world size > 1) it times ``all_reduce`` and reports the bus
  bandwidth ``2 (n-1)/n * bytes / time``; otherwise it is a **local proxy**
  only: device memory-copy bandwidth (intra-node stand-in) and TCP loopback
  throughput (inter-node stand-in), neither of which measures your network.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import socket
import threading
import time


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


def load_factory(spec: str):
    """``"module:function"`` -> the function (``ValueError`` with a clear message otherwise)."""
    if ":" not in spec:
        raise ValueError(f"--model must look like module:factory, got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model: cannot import {mod_name!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model: {mod_name!r} has no callable {fn_name!r}")
    return fn


def builtin_mlp(params: float, batch: int = 32):
    """``(model, batch)``: 4 square ``Linear(h, h)`` layers with ReLU, ``4 h^2 + 4 h ~ params``."""
    import torch

    h = max(4, int(math.sqrt(max(params, 64) / 4.0)))
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(h, h), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), torch.randn(batch, h)


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


def measure_compute(model, batch, iters: int = 10, warmup: int = 2, device: str = "auto") -> list:
    """Seconds per forward + backward for ``iters`` timed iterations (after ``warmup``)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    model = model.to(dev)
    batch = _to(batch, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def once():
        if isinstance(batch, dict):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        _loss(out).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        once()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _copy_bandwidth(nbytes: int, iters: int) -> tuple:
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    b = torch.empty_like(a)
    small_a, small_b = a[:16], b[:16]

    def timed(x, y, k):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            y.copy_(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    timed(a, b, 1)
    bw = nbytes / timed(a, b, iters)
    lat = timed(small_a, small_b, 100)
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
        dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / iters
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
