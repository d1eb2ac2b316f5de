"""``python -m decent_comm plan``: predict step times per topology and recommend one.

Builds a ``ClusterConfig`` and a ``Workload`` from the flags (human units),
optionally measures the compute time and a link proxy (``--measure``), runs
``decent_comm.runtime_model.plan`` and prints a table (``plan_report``) or
JSON (``--json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from .. import topology as _topology
from ..runtime_model import units
from ..runtime_model.hardware import BACKENDS, INTRA_SHARING, MAX_WORLD_SIZE, ClusterConfig
from ..runtime_model.planner import GAP_THRESHOLD, default_topologies, plan
from ..runtime_model.workload import DDP_BUCKET_BYTES, EXCHANGES, MODES, WIRE_DTYPES, ComputeTime, Workload

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}
from . import plan_report
from .args import BANDWIDTH, COUNT, DURATION, SIZE, integer, number, read_sample
from .registry import Subcommand, register

#: Most simulated steps ``--steps`` accepts (the default is 500; the simulation budget may lower it further).
MAX_STEPS = 100_000
#: Most timed iterations ``--measure-iters`` accepts.
MAX_MEASURE_ITERS = 1000

DESCRIPTION = f"""\
Predict the mean step time of ring All-Reduce and of gossip topologies on a
cluster, closed form and simulated side by side, with the paper's ratios
gamma (all-reduce comm / compute), omega (gossip comm / all-reduce comm) and
sigma^2 (compute variance / mean^2), and recommend one.

Units: bandwidth 25Gbit, 100Gbps, 600Gbit/s (bits) or 12.5GB/s, 12.5GBps
(bytes); counts 65M, 1.3B; durations 120ms, 0.12s, 5us.  Inter-node
bandwidth is per node (the node's ranks share its NIC); intra-node bandwidth
is per rank (--intra-sharing pair: per rank pair).  --backend says how
all-reduces cross nodes: nccl (default, GPU clusters) or gloo (CPU clusters:
one flat ring over all ranks, 1.5x NCCL's bytes per NIC on 2 nodes x 2 ranks).

Recommendation: the fastest (simulated, else closed-form) step time among
the topologies whose spectral gap per step is >= --gap-threshold (sparser
graphs average slower per step, so they may need more steps to reach the
same loss; if none reaches it, all topologies compete), when it is more than
5% faster than allreduce's; else allreduce (at equal speed its exact average
is better; the time-to-loss list uses the same margin).  When a candidate
would exceed the simulation budget (large clusters), nothing is simulated and
the comparison is closed form.  A candidate decent_comm's optimizers would
refuse (a mix of more than 32 buffers: complete point to point on 34+ ranks,
over the int8 or a narrower bf16 wire on 33+) is skipped with the reason, and so are such
time-to-loss recipes.  At most {MAX_WORLD_SIZE} ranks (--nodes x
--gpus-per-node).

--json prints one object: one entry per candidate name ("allreduce" and each
topology) with step_seconds, speedup, simulated_step_seconds,
simulated_speedup, comm_seconds, gamma, omega, sigma2, spectral_gap_per_step,
...; plus "candidates" (the names in order), "recommended", "rule",
"skipped", "notes" and "inputs".

example:
  python -m decent_comm plan --nodes 4 --gpus-per-node 4 --params 65M \\
      --inter-bw 25Gbit --intra-bw 600Gbit --compute 120ms --compute-std 10ms
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=integer(1, MAX_WORLD_SIZE), default=1, help="number of nodes (default 1)")
    g.add_argument("--gpus-per-node", "--ranks-per-node", dest="gpus_per_node", type=integer(1, MAX_WORLD_SIZE),
                   default=1, help="ranks per node (default 1)")
    g.add_argument("--inter-bw", type=BANDWIDTH, help="inter-node bandwidth per node, e.g. 25Gbit")
    g.add_argument("--intra-bw", type=BANDWIDTH, help="intra-node bandwidth per rank, e.g. 600Gbit")
    g.add_argument("--latency", type=DURATION, help="latency of both link classes, e.g. 5us")
    g.add_argument("--inter-latency", type=DURATION, help="inter-node latency (default 10us)")
    g.add_argument("--intra-latency", type=DURATION, help="intra-node latency (default 3us)")
    g.add_argument("--intra-sharing", choices=INTRA_SHARING, default="rank",
                   help="intra-node bandwidth belongs to each rank (default) or to each rank pair")
    g.add_argument("--backend", choices=BACKENDS, default="nccl",
                   help="the torch.distributed backend the all-reduces (DDP, periodic averaging, group steps) run"
                        " on: nccl (default; GPU clusters) prices them hierarchical, a NIC carrying 2(N-1)/N"
                        " buffers on N nodes; pick gloo for CPU clusters: one flat ring over all ranks, 2(n-1)/n"
                        " buffers per NIC on n ranks")
    g = p.add_argument_group("workload")
    g.add_argument("--params", type=COUNT, help="parameters per replica, e.g. 65M, 1.3B")
    g.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="fp32", metavar="DTYPE",
                   help="dtype on the wire, as the optimizers' comm_dtype: fp32 (default, 4 bytes/param), bf16, "
                        "fp16 (2), int8 (1, plus a 4-byte scale per 512), fp64 (8)")
    g.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16", "fp64"), default=None,
                   help="the parameters' dtype (default: the measured model's, else fp32): group all-reduce steps "
                        "(fp16: summed in float32) and the default wire move it")
    g.add_argument("--compute", type=DURATION,
                   help="mean forward+backward+update time per step, e.g. 120ms")
    g.add_argument("--compute-std", type=DURATION, default=0.0,
                   help="its standard deviation (default 0)")
    g.add_argument("--compute-sample", metavar="FILE|LIST",
                   help="measured step times: a file with one duration per line (bare numbers: seconds) or a comma "
                        "list with units, e.g. 118ms,121ms (resampled)")
    g.add_argument("--forward-fraction", type=number(0, 1), default=1 / 3, help="forward share of compute (1/3)")
    g.add_argument("--backward-fraction", type=number(0, 1), default=2 / 3, help="backward share of compute (2/3)")
    g.add_argument("--mode", choices=MODES, default="awc",
                   help="awc: exchange overlaps forward+backward (default); atc: forward only")
    g.add_argument("--exchange", choices=EXCHANGES, default="auto",
                   help="auto (default, what decent_comm's optimizers do): steps that average uniformly over groups"
                        " of >= 3 ranks run one all-reduce per group, the others point to point; p2p: each rank"
                        " sends its buffer to each peer; group-allreduce: every uniform-group step as all-reduces"
                        " (Decent-DP)")
    g.add_argument("--bucket-size", type=SIZE, default=float(DDP_BUCKET_BYTES),
                   help="all-reduce bucket size (default 25MiB, as PyTorch DDP)")
    g = p.add_argument_group("planning")
    g.add_argument("--topologies", help="comma list (default: one-peer-exp,one-peer-hypercube,exp,ring,aer,"
                   "aer-pair,base-k,torus,complete; aer and aer-pair only when nodes is a power of two >= 2,"
                   " one-peer-hypercube only when nodes x gpus-per-node is)")
    g.add_argument("--gap-threshold", type=number(hi=1), default=GAP_THRESHOLD,
                   help=f"minimum spectral gap per step to be recommended (default {GAP_THRESHOLD})")
    g.add_argument("--steps", type=integer(1, MAX_STEPS), default=500,
                   help=f"simulated steps (default 500, at most {MAX_STEPS})")
    g.add_argument("--warmup", type=integer(0, MAX_STEPS), default=50, help="simulated warm-up steps (default 50)")
    g.add_argument("--seed", type=integer(0, 2 ** 63 - 1), default=0, help="simulation seed")
    g.add_argument("--no-sim", action="store_true", help="closed form only")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = p.add_argument_group("measurement")
    g.add_argument("--measure", action="store_true",
                   help="time the model's forward+backward locally and probe the links (local proxy unless"
                        " torch.distributed is initialised); explicit flags still win")
    g.add_argument("--model", metavar="MODULE:FACTORY",
                   help="with --measure: factory returning (model, example_batch); default a built-in MLP"
                        " of --params parameters")
    g.add_argument("--measure-iters", type=integer(1, MAX_MEASURE_ITERS), default=10,
                   help="timed iterations (default 10)")
    g.add_argument("--device", default="auto", help="with --measure: auto, cpu, cuda, cuda:1 ...")


def _measure(args, notes: list):
    """Fill compute / params / links from local measurements (explicit flags win)."""
    from . import measure

    dev = measure.resolve_device(args.device)
    if args.model:
        model, batch = measure.load_model(args.model)
    else:
        if args.params is None:
            raise ValueError("--measure without --model needs --params (size of the built-in MLP)")
        model, batch = measure.builtin_mlp(args.params)
    n_params = sum(p.numel() for p in model.parameters())
    times = measure.measure_compute(model, batch, iters=args.measure_iters, device=str(dev))
    what = f"model {args.model}" if args.model else "built-in MLP"
    notes.append(f"measured compute over {len(times)} iterations ({what},"
                 f" {n_params / 1e6:.3g}M params): mean {units.format_seconds(sum(times) / len(times))}")
    if args.params is None:
        args.params = float(n_params)
    if args.param_dtype is None:
        widest = max(model.parameters(), key=lambda p: p.element_size(), default=None)
        dtype = str(widest.dtype) if widest is not None else "torch.float32"
        names = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64"}  # fp16: float32 sums
        args.param_dtype = names.get(dtype, "fp32")
    if args.compute is None and args.compute_sample is None:
        args.compute_sample = times
    probe = measure.measure_link()
    notes.append("links: " + probe.source)
    if args.inter_bw is None:
        args.inter_bw = probe.inter_bandwidth
    if args.intra_bw is None:
        args.intra_bw = probe.intra_bandwidth
    if args.inter_latency is None and args.latency is None:
        args.inter_latency = probe.inter_latency
    if args.intra_latency is None and args.latency is None:
        args.intra_latency = probe.intra_latency


def _check(args, parser) -> None:
    """What no single flag's type can check; ``parser.error`` (exit code 2) naming the flags."""
    n = args.nodes * args.gpus_per_node
    if n > MAX_WORLD_SIZE:
        parser.error(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {n} ranks; the planner models"
                     f" at most {MAX_WORLD_SIZE} ranks")
    if args.warmup >= args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.forward_fraction + args.backward_fraction > 1 + 1e-9:
        parser.error(f"--forward-fraction + --backward-fraction must be <= 1 (shares of one compute time), got"
                     f" {args.forward_fraction:g} + {args.backward_fraction:g}")
    if args.model and not args.measure:
        parser.error("--model is used with --measure only")
    if args.device != "auto" and not args.measure:
        parser.error("--device is used with --measure only")


def build_inputs(args, parser):
    """``(ClusterConfig, Workload, notes)`` from parsed flags; ``parser.error`` on missing ones."""
    _check(args, parser)
    notes = []
    if args.measure:
        _measure(args, notes)
    if args.params is None:
        parser.error("--params is required (e.g. --params 65M), or --measure with --model")
    if args.compute is None and args.compute_sample is None:
        parser.error("--compute is required (e.g. --compute 120ms), or --compute-sample / --measure")
    if args.nodes > 1 and args.inter_bw is None:
        parser.error("--inter-bw is required with --nodes > 1 (e.g. --inter-bw 25Gbit), or --measure")
    if args.gpus_per_node > 1 and args.intra_bw is None:
        parser.error("--intra-bw is required with --gpus-per-node > 1 (e.g. --intra-bw 600Gbit), or --measure")
    lat = args.latency
    cluster = ClusterConfig(
        nodes=args.nodes, ranks_per_node=args.gpus_per_node,
        inter_bandwidth=args.inter_bw if args.inter_bw is not None else math.inf,
        intra_bandwidth=args.intra_bw if args.intra_bw is not None else math.inf,
        inter_latency=args.inter_latency if args.inter_latency is not None else (lat if lat is not None else
                                                                                 _DEFAULTS["inter_latency"]),
        intra_latency=args.intra_latency if args.intra_latency is not None else (lat if lat is not None else
                                                                                 _DEFAULTS["intra_latency"]),
        intra_sharing=args.intra_sharing, backend=args.backend)
    fractions = dict(forward_fraction=args.forward_fraction, backward_fraction=args.backward_fraction)
    if args.compute is not None:
        compute = ComputeTime(mean=args.compute, std=args.compute_std, **fractions)
        if args.compute_sample is not None:
            notes.append("--compute given: --compute-sample / measured times not used")
    else:
        sample = args.compute_sample
        if args.compute_std:
            notes.append("--compute-std not used: the sample's own spread is")
        compute = ComputeTime.from_sample(sample if isinstance(sample, list) else read_sample(sample), **fractions)
    exchange = args.exchange
    if args.wire_dtype == "int8":
        # The 8-bit wire's error feedback keeps each pair's public copies: every step runs point to point.
        if exchange == "group-allreduce":
            parser.error("--wire-dtype int8 moves every gossip step point to point (its error feedback keeps each "
                         "pair's public copies), so --exchange group-allreduce does not apply")
        if exchange == "auto":
            exchange = "p2p"
            notes.append("--wire-dtype int8: gossip priced point to point, as the 8-bit wire runs every step; "
                         "allreduce (DDP, which has no 8-bit wire) priced with gradients in the parameters' dtype")
    workload = Workload(params=args.params, compute=compute, bytes_per_param=WIRE_DTYPES[args.wire_dtype],
                        mode=args.mode, bucket_bytes=args.bucket_size, exchange=exchange,
                        param_bytes=WIRE_DTYPES[args.param_dtype or "fp32"],
                        group_sum_bytes=4 if args.param_dtype == "fp16" else 0)  # fp16 sums run in float32
    return cluster, workload, notes


def allreduce_workload(args, workload):
    """What DDP is priced with: the same workload, but gradients in the parameters' dtype under --wire-dtype int8
    (DDP has no 8-bit wire; its bf16/fp16 compression hooks make the other wires real for it)."""
    if args.wire_dtype != "int8":
        return workload
    return dataclasses.replace(workload, bytes_per_param=workload.param_bytes, exchange="auto")


def topology_names(text, cluster, notes: list) -> list:
    """Canonical names from ``--topologies`` (``ValueError`` naming the flag for an unknown one), or the
    defaults for ``cluster``; ``allreduce`` is always a candidate, so naming it changes nothing."""
    if text is None:
        names = default_topologies(cluster)
        if "aer" not in names:
            notes.append("aer skipped: it needs the number of nodes to be a power of two >= 2"
                         f" (got {cluster.nodes})")
        if "one-peer-hypercube" not in names:
            notes.append("one-peer-hypercube skipped: it needs the number of ranks to be a power of two"
                         f" (got {cluster.world_size})")
        return names
    names = []
    for raw in (t.strip() for t in text.split(",")):
        if raw and raw.lower().replace("_", "-") not in ("allreduce", "all-reduce"):
            try:
                names.append(_topology.canonical_name(raw))
            except ValueError:
                raise ValueError(f"--topologies: unknown topology {raw!r}; valid names: allreduce,"
                                 f" {', '.join(_topology.NAMES)}") from None
    if not names and not text.strip(", "):
        raise ValueError("--topologies is empty")
    return names


def run(args, parser) -> int:
    cluster, workload, notes = build_inputs(args, parser)
    names = topology_names(args.topologies, cluster, notes)
    ar_workload = allreduce_workload(args, workload)
    result = plan(cluster, workload, names, simulate_steps=args.steps, warmup=args.warmup, seed=args.seed,
                  run_simulation=not args.no_sim, gap_threshold=args.gap_threshold, allreduce_workload=ar_workload)
    if args.json:
        print(plan_report.to_json(result, cluster, workload, args.wire_dtype, notes))
    else:
        print(plan_report.to_text(result, cluster, workload, args.wire_dtype, notes, ar_workload))
    return 0


register(Subcommand(name="plan", help="predict step time per topology vs All-Reduce and recommend one",
                    add_arguments=add_arguments, run=run, description=DESCRIPTION))
