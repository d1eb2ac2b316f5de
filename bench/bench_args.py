"""What the bench/ scripts share to refuse bad input before a benchmark runs and to keep what it measured.

The argparse types raise argparse.ArgumentTypeError, so a bad value is one line naming the flag and exit code 2
at parsing: checked later, it cost the minutes of the jobs run before (bench/cluster.py --target abc failed in the
analysis of the first finished job) or a traceback. output_file makes an output's directory the way a bare file
name needs, and collect waits for spawned ranks without outliving one that died.
"""

import argparse
import os
import queue as queue_module
import time

from decent_train.cluster import parse_bandwidth_bits
from decent_train.flags import count, number, optimizer_name, topology_name  # count, number: the scripts' too


def names(allowed):
    """argparse type: a comma list of names from `allowed` (a typo ran a job that judged nothing)."""
    def parse(text):
        got = [n for n in text.split(",") if n]
        unknown = [n for n in got if n not in allowed]
        if unknown or not got:
            raise argparse.ArgumentTypeError(f"unknown {unknown or 'empty list'}; choose from {','.join(allowed)}")
        return got
    return parse


def listed(item):
    """argparse type: a non-empty comma list, each item read by the argparse type `item`; the error names it."""
    def parse(text):
        values = []
        for part in (p for p in text.split(",") if p.strip()):
            try:
                values.append(item(part.strip()))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{part.strip()!r}: {e}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
        return values
    return parse


def elements(text):
    """argparse type: an element count >= 1, `16M` meaning 16 x 2^20 (an empty tensor divided by zero later)."""
    try:
        n = int(float(text[:-1]) * 2**20) if text.endswith("M") else int(text)
    except (ValueError, OverflowError):  # OverflowError: infM
        n = None
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"expected an element count >= 1 (e.g. 4096 or 16M), got {text!r}")
    return n


def layout(text):
    """argparse type: NODESxRANKS_PER_NODE, both >= 1, as a tuple (`4` was a ValueError of tuple unpacking)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected NODESxRANKS_PER_NODE with both >= 1 (e.g. 4x1), got {text!r}")
    return int(parts[0]), int(parts[1])


def link_bandwidth(text):
    """argparse type: a link bandwidth as decent_train.cluster reads it ('50Mbit', 'unshaped'); the text is kept,
    as the plan and the report print it."""
    try:
        bits = parse_bandwidth_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if bits is not None and not bits > 0:
        raise argparse.ArgumentTypeError(f"expected a bandwidth > 0 (or 'unshaped'), got {text!r}")
    return text


def loss_target(text):
    """argparse type of bench/cluster.py --target: 'worst', 'ddp' or a validation loss > 0."""
    if text in ("worst", "ddp"):
        return text
    try:
        return number(0.0, strictly=True)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'worst', 'ddp' or a loss > 0, got {text!r}") from None


def decentralized_optimizer(text):
    """argparse type: an examples' --optimizer name other than the all-reduce ones (the baseline runs anyway)."""
    name = optimizer_name(text)
    if name.startswith("allreduce"):
        raise argparse.ArgumentTypeError(f"{text!r} is the all-reduce baseline, which runs anyway; name a "
                                         "decentralized optimizer (dadamw, dsgd, decentralized-<torch optimizer>, ...)")
    return name


def topology_on_wire(wires):
    """argparse type: NAME or NAME:WIRE, NAME a built-in topology and WIRE a key of `wires` (not '')."""
    def parse(text):
        name, _, wire = text.partition(":")
        if wire not in wires:
            raise argparse.ArgumentTypeError(f"the wire after ':' must be one of {', '.join(w for w in wires if w)}")
        return topology_name(name) + (f":{wire}" if wire else "")
    return parse


def device_name(text):
    """argparse type: cpu or cuda, cuda only where torch sees a GPU (else the first kernel raised)."""
    import torch
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: torch sees no CUDA device here")
    return text


def even_ranks(text):
    """argparse type: a world size >= 2 and even (aer pairs the ranks into emulated nodes of 2)."""
    n = count(2)(text)
    if n % 2:
        raise argparse.ArgumentTypeError(f"must be even (aer pairs ranks into nodes), got {n}")
    return n


def output_file(path):
    """`path` after making its directory; a bare file name lies in the working directory (os.path.dirname of it
    is '', and os.makedirs('') raised after the benchmark had run, so its results were lost)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def collect(results, procs, script, limit_s=3600.0, poll_s=0.5):
    """What rank 0 puts on the queue `results`, waiting at most `limit_s`; as soon as one of the spawned `procs`
    has exited non-zero (or all exited without a result) the others are terminated and SystemExit names it: a rank
    that died left the rest in a collective, and a plain results.get(timeout=3600) waited the hour."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return results.get(timeout=poll_s)
        except queue_module.Empty:
            pass
        failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
        ended = all(p.exitcode is not None for p in procs)
        if ended and not failed:
            try:  # rank 0 put its result before it exited: it is in the pipe now
                return results.get(timeout=5)
            except queue_module.Empty:
                pass
        if failed or ended or time.monotonic() > deadline:
            break
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join()
    if failed:
        why = ", ".join(f"rank {rank} exited with code {code}" for rank, code in failed)
        raise SystemExit(f"{script}: {why}; stopped the other ranks (what it printed is above)")
    raise SystemExit(f"{script}: " + ("every rank exited without a result" if ended else
                                      f"no result after {limit_s:g} s; stopped the ranks"))
