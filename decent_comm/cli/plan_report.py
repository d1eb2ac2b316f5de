"""Rendering a ``runtime_model.Plan`` as a text table or as JSON."""
from __future__ import annotations

import json
import math

from ..runtime_model.allreduce import allreduce_cost
from ..runtime_model.units import format_bandwidth, format_bytes, format_seconds

SPARSE_NOTE = ("gap/step: spectral gap per gossip step (1 = exact average); sparser graphs average slower,"
               " so they may need more steps to reach the same loss even when each step is faster.")


def _ms(x):
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.1f}"


def _num(x, fmt="{:.2f}"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def _header(cluster, workload, wire_dtype, allreduce_workload=None) -> list:
    c = workload.compute
    ar = allreduce_cost(cluster, allreduce_workload or workload)
    comp = (f"{format_seconds(c.mean)} +- {format_seconds(c.std)}" +
            (f" (resampled from {len(c.sample)} measured steps)" if c.sample is not None else ""))
    lines = [
        f"cluster: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks = {cluster.world_size} ranks;"
        f" inter {format_bandwidth(cluster.inter_bandwidth)} per node, {format_seconds(cluster.inter_latency)};"
        f" intra {format_bandwidth(cluster.intra_bandwidth)} per {cluster.intra_sharing},"
        f" {format_seconds(cluster.intra_latency)}",
        f"workload: {workload.params / 1e6:.4g}M params x {workload.bytes_per_param:.4g} B ({wire_dtype})"
        f" = {format_bytes(workload.bytes_per_rank)} per rank per step; compute {comp}"
        f" (sigma^2 = {c.cv2:.4f}); mode {workload.mode}, exchange {workload.exchange}"
        + ("" if workload.param_bytes == 4 else f"; parameters of {workload.param_bytes:g} B"),
        f"all-reduce: {format_seconds(ar.comm_seconds)} communication"
        f" ({'hierarchical' if ar.hierarchical else 'flat'} ring{', gloo' if ar.backend == 'gloo' else ''},"
        f" {ar.buckets} buckets),"
        f" {format_seconds(ar.exposed_seconds)} not hidden by the backward;"
        f" gamma = {_num(ar.comm_seconds / c.mean if c.mean > 0 else None, '{:.3f}')}",
    ]
    return lines


def to_text(plan, cluster, workload, wire_dtype: str, notes=(), allreduce_workload=None) -> str:
    """A header, one table row per candidate, the recommendation and notes."""
    lines = _header(cluster, workload, wire_dtype, allreduce_workload) + [""]
    cols = ["candidate", "gap/step", "comm ms", "omega", "step ms", "bound ms", "sim ms", "speedup",
            "sim speedup", "sync set"]
    rows = []
    for c in plan.candidates:
        p = c.prediction
        rows.append([c.name + (" *" if c.name == plan.recommended else ""),
                     _num(c.gap_per_step, "{:.3f}"), _ms(p.comm_seconds), _num(p.omega, "{:.3f}"),
                     _ms(p.step_seconds), _ms(p.lower_bound_seconds),
                     _ms(c.simulated.step_seconds if c.simulated else None),
                     _num(p.speedup, "{:.2f}x"), _num(c.simulated_speedup, "{:.2f}x"),
                     _num(p.sync_set, "{:.2f}")])
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]

    def fmt(r):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))

    lines.append(fmt(cols))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    lines.append("")
    lines.append(f"recommended: {plan.recommended} ({plan.rule})")
    lines.append(SPARSE_NOTE)
    lines.append("step ms: closed form (ranks in phase); bound ms: no faster than this (busiest link's load);"
                 " sim ms: discrete-event simulation; speedup: all-reduce step / step; sync set: the straggler"
                 " term equals the expected max of that many compute times.")
    if plan.quality:
        lines.append("")
        lines.append("time to all-reduce's loss (step time x the steps multiplier measured by "
                     "bench/time_to_target.py, docs/time_to_target.md):")
        for i, q in enumerate(plan.quality):
            lines.append(f"  {q.time_vs_allreduce:5.2f}x  {q.label}  (step {_ms(q.step_seconds)} ms, "
                         f"{q.kind.steps_multiplier:.2f}x the steps)" + ("  <- for a target loss soonest" if i == 0 else ""))
    for name, why in plan.skipped:
        lines.append(f"skipped {name}: {why}")
    for n in list(notes) + list(plan.notes):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def to_dict(plan, cluster, workload, wire_dtype: str, notes=()) -> dict:
    """One entry per candidate name, plus candidates/recommended/rule/skipped/notes/inputs."""
    out = {}
    for c in plan.candidates:
        out[c.name] = c.to_dict()
    c = workload.compute
    out["candidates"] = [c.name for c in plan.candidates]
    out["recommended"] = plan.recommended
    out["rule"] = plan.rule
    out["time_to_quality"] = [q.to_dict() for q in plan.quality]
    out["skipped"] = {name: why for name, why in plan.skipped}
    out["notes"] = list(notes) + list(plan.notes)
    out["inputs"] = {
        "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node, "world_size": cluster.world_size,
        "inter_bandwidth_bytes_per_s": cluster.inter_bandwidth, "intra_bandwidth_bytes_per_s": cluster.intra_bandwidth,
        "inter_latency_s": cluster.inter_latency, "intra_latency_s": cluster.intra_latency,
        "intra_sharing": cluster.intra_sharing, "backend": cluster.backend, "params": workload.params,
        "param_bytes": workload.param_bytes, "group_sum_bytes": workload.group_sum_bytes,
        "wire_dtype": wire_dtype,
        "bytes_per_rank": workload.bytes_per_rank, "compute_mean_s": c.mean, "compute_std_s": c.std,
        "compute_sample_size": len(c.sample) if c.sample is not None else None, "sigma2": c.cv2,
        "mode": workload.mode, "exchange": workload.exchange, "bucket_bytes": workload.bucket_bytes,
        "gap_threshold": plan.gap_threshold,
    }
    return _clean(out)


def to_json(plan, cluster, workload, wire_dtype: str, notes=()) -> str:
    return json.dumps(to_dict(plan, cluster, workload, wire_dtype, notes), indent=2)
