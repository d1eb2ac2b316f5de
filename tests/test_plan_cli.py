"""``python -m decent_comm plan``: output, measurement, and bad input (one line on stderr, exit code 2)."""
import contextlib
import io
import json

import pytest

from decent_comm.cli import main
from decent_comm.cli.args import MAX_SAMPLE
from decent_comm.runtime_model.hardware import MAX_WORLD_SIZE
from decent_comm.runtime_model.planner import DEFAULT_TOPOLOGIES

EXAMPLE = ["plan", "--nodes", "4", "--gpus-per-node", "4", "--params", "65M", "--inter-bw", "25Gbit",
           "--intra-bw", "600Gbit", "--compute", "120ms", "--compute-std", "10ms"]
MEASURE = ["plan", "--nodes", "2", "--gpus-per-node", "2", "--measure", "--measure-iters", "2", "--no-sim",
           "--topologies", "ring"]


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:   # main returns the code; a SystemExit escaping it is caught here too
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_example_json():
    code, out, _ = run_cli(EXAMPLE + ["--json", "--steps", "80", "--warmup", "10"])
    assert code == 0
    d = json.loads(out)
    names = d["candidates"]
    assert names[0] == "allreduce" and set(names[1:]) == set(DEFAULT_TOPOLOGIES)
    for name in names:
        for key in ("step_seconds", "speedup", "simulated_step_seconds", "comm_seconds", "gamma", "omega"):
            assert key in d[name], (name, key)
        assert d[name]["step_seconds"] > 0
    assert d["allreduce"]["speedup"] == 1.0
    assert d["recommended"] in names
    assert d["inputs"]["bytes_per_rank"] == 260e6


def test_cli_table():
    code, out, _ = run_cli(EXAMPLE + ["--no-sim", "--nodes", "3", "--topologies", "ring,aer,allreduce"])
    assert code == 0
    assert "recommended:" in out and "skipped aer" in out and "ring" in out   # aer cannot be built on 3 nodes


def test_cli_hypercube_where_the_world_size_is_a_power_of_two():
    code, out, _ = run_cli(EXAMPLE + ["--no-sim", "--nodes", "2", "--gpus-per-node", "2", "--inter-bw", "50Mbit",
                                      "--json"])
    d = json.loads(out)
    assert code == 0 and "one-peer-hypercube" in d["candidates"]
    # comm-bound on 2 nodes x 2 ranks: 1 buffer per step on the node link on average against one-peer-exp's 1.5
    ratio = d["one-peer-exp"]["step_seconds"] / d["one-peer-hypercube"]["step_seconds"]
    assert ratio == pytest.approx(1.5, rel=0.01)
    code, out, _ = run_cli(EXAMPLE + ["--no-sim", "--nodes", "3", "--gpus-per-node", "2", "--json"])
    d = json.loads(out)
    assert code == 0 and "one-peer-hypercube" not in d["candidates"] and not d["skipped"]
    assert any("one-peer-hypercube skipped" in n and "power of two" in n and "6" in n for n in d["notes"])


def test_cli_missing_required_inputs():
    code, _, err = run_cli(["plan", "--nodes", "2", "--params", "1M", "--compute", "10ms"])
    assert code == 2 and "--inter-bw is required" in err
    code, _, err = run_cli(["plan", "--params", "1M"])
    assert code == 2 and "--compute is required" in err


def tiny_model():
    """``--model test_plan_cli:tiny_model`` factory: (model, example batch)."""
    import torch
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), torch.randn(8, 16)


def tiny_bf16_model():
    import torch
    model, batch = tiny_model()
    return model.to(torch.bfloat16), batch.to(torch.bfloat16)


def tiny_fp16_model():
    import torch
    model, batch = tiny_model()
    return model.to(torch.float16), batch.to(torch.float16)


def raising_model():
    raise RuntimeError("no weights here")


def test_cli_measure_is_honest_about_the_proxy():
    code, out, _ = run_cli(MEASURE + ["--model", "test_plan_cli:tiny_model", "--device", "cpu", "--json"])
    assert code == 0
    d = json.loads(out)
    assert d["inputs"]["params"] == 16 * 32 + 32 + 32 * 4 + 4
    assert d["inputs"]["compute_sample_size"] == 2
    assert any("LOCAL PROXY" in n for n in d["notes"]) and any("measured compute" in n for n in d["notes"])


def test_cli_measure_takes_the_models_parameter_dtype():
    """A bf16 model's group steps sum in bf16 (docs/planner.md --param-dtype); an explicit flag wins."""
    base = MEASURE + ["--device", "cpu", "--json"]
    sizes = [json.loads(run_cli(base + extra)[1])["inputs"]["param_bytes"] for extra in
             (["--model", "test_plan_cli:tiny_model"], ["--model", "test_plan_cli:tiny_bf16_model"],
              ["--model", "test_plan_cli:tiny_bf16_model", "--param-dtype", "fp32"])]
    assert sizes == [4, 2, 4]
    # an fp16 model: 2-byte parameters whose group steps sum in float32 (decent_comm/optim/wire_buffers.py)
    inputs = json.loads(run_cli(base + ["--model", "test_plan_cli:tiny_fp16_model"])[1])["inputs"]
    assert (inputs["param_bytes"], inputs["group_sum_bytes"]) == (2, 4)
    assert json.loads(run_cli(EXAMPLE + ["--json", "--no-sim"])[1])["inputs"]["param_bytes"] == 4  # fp32 default


def test_cli_compute_sample_file(tmp_path):
    f = tmp_path / "steps.txt"
    f.write_text("# measured\n100ms\n0.11\n\n120ms\n")
    code, out, _ = run_cli(EXAMPLE[:-4] + ["--compute-sample", str(f), "--no-sim", "--json"])
    assert code == 0 and json.loads(out)["inputs"]["compute_sample_size"] == 3


def _binary_file(tmp_path):
    f = tmp_path / "binary.dat"
    f.write_bytes(b"\xff\xfe\x00\x81" * 64)
    return str(f)


def _huge_sample(tmp_path):
    f = tmp_path / "many.txt"
    f.write_text("1ms\n" * (MAX_SAMPLE + 1))
    return str(f)


def _no_compute(argv):
    i = argv.index("--compute")
    return argv[:i] + argv[i + 4:]


# (extra flags, or a function of tmp_path giving them; the flag the one-line message must name)
BAD = [
    (["--nodes", "1000000000"], "--nodes"),
    (["--nodes", str(MAX_WORLD_SIZE), "--gpus-per-node", "8"], "--gpus-per-node"),
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "nan"], "--nodes"),
    (["--nodes", "2.5"], "--nodes"),
    (["--gpus-per-node", "-1"], "--gpus-per-node"),
    (lambda p: ["--compute-sample", "/"], "--compute-sample"),
    (lambda p: ["--compute-sample", str(p / "missing.txt")], "--compute-sample"),
    (lambda p: ["--compute-sample", "/dev/zero"], "--compute-sample"),
    (lambda p: ["--compute-sample", _binary_file(p)], "--compute-sample"),
    (lambda p: ["--compute-sample", _huge_sample(p)], "--compute-sample"),
    (lambda p: ["--compute-sample", "10ms,fast"], "--compute-sample"),
    (lambda p: ["--compute-sample", ","], "--compute-sample"),
    (lambda p: ["--compute-sample", "10ms,1e300s"], "--compute-sample"),
    (lambda p: ["--compute-sample", "100,120"], "--compute-sample"),  # units needed, as for --compute
    (["--measure", "--device", "tpu:9"], "--device"),
    (["--measure", "--device", "cuda:7"], "--device"),
    (["--measure", "--device", "meta"], "--device"),
    (["--measure", "--model", "no_such_module:f"], "--model"),
    (["--measure", "--model", "model_raising_at_import:f"], "--model"),  # a traceback before
    (["--measure", "--model", "os:getcwd"], "--model"),
    (["--measure", "--model", "test_plan_cli:raising_model"], "--model"),
    (["--measure", "--model", "nocolon"], "--model"),
    (["--measure", "--params", "1e12"], "--params"),
    (["--measure-iters", "1000000000"], "--measure-iters"),
    (["--model", "test_plan_cli:tiny_model"], "--model"),
    (["--steps", "1000000000"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--steps", "nan"], "--steps"),
    (["--warmup", "500"], "--warmup"),
    (["--warmup", "-1"], "--warmup"),
    (["--seed", "-1"], "--seed"),
    (["--compute", "nan"], "--compute"),
    (["--compute=-5ms"], "--compute"),
    (["--compute", "-5ms"], "--compute"),  # argparse took "-5ms" for a flag: "expected one argument"
    (["--compute", "300"], "--compute"),   # 300 s, silently: a unit is required
    (["--bucket-size", "25"], "--bucket-size"),  # 25 bytes, silently
    (["--inter-bw", "25e9"], "--inter-bw"),  # bytes/s, silently: 200 Gbit/s
    (["--device", "cpu"], "--device"),     # only with --measure, as --model
    (["--compute", "inf"], "--compute"),
    (["--compute", "1e300s"], "--compute"),
    (["--compute-std", "1e-300s"], "--compute-std"),
    (["--inter-bw", "0"], "--inter-bw"),
    (["--inter-bw", "-25Gbit"], "--inter-bw"),
    (["--inter-bw", "25Gbiz"], "--inter-bw"),
    (["--intra-bw", "1e-300bit"], "--intra-bw"),
    (["--latency", "nan"], "--latency"),
    (["--params", "0"], "--params"),
    (["--params", "lots"], "--params"),
    (["--params", "1e300"], "--params"),
    (["--bucket-size", "0"], "--bucket-size"),
    (["--gap-threshold", "nan"], "--gap-threshold"),
    (["--gap-threshold", "2"], "--gap-threshold"),
    (["--forward-fraction", "1.5"], "--forward-fraction"),
    (["--forward-fraction", "0.5", "--backward-fraction", "0.9"], "--forward-fraction"),
    (["--wire-dtype", "fp7"], "--wire-dtype"),
    (["--wire-dtype", "fp8"], "--wire-dtype"),  # no optimizer or DDP runs an fp8 wire: never priced
    (["--wire-dtype", "tf32"], "--wire-dtype"),
    (["--intra-sharing", "socket"], "--intra-sharing"),
    (["--mode", "sync"], "--mode"),
    (["--topologies", "moebius"], "--topologies"),
    (["--topologies", "ring,,moebius"], "--topologies"),
    (["--topologies", ",,"], "--topologies"),
    (["--frobnicate"], "--frobnicate"),
]


@pytest.mark.parametrize("extra,flag", BAD, ids=[f"{i}-{flag}" for i, (_, flag) in enumerate(BAD)])
def test_cli_bad_input_is_one_line_and_exit_2(extra, flag, tmp_path):
    extra = extra(tmp_path) if callable(extra) else extra
    base = _no_compute(EXAMPLE) if any(str(x).startswith("--compute-sample") for x in extra) else EXAMPLE
    code, out, err = run_cli(base + extra + ["--no-sim"])
    assert code == 2, (code, out[-300:], err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m decent_comm") and ": error: " in lines[0], err
    assert flag in lines[0], err
    assert out == ""


@pytest.mark.parametrize("extra, says", [(["--compute", "-5ms"], "must be >= 0"),
                                         (["--inter-bw", "-25Gbit"], "must be > 0"),
                                         (["--compute", "300"], "needs a unit, e.g. 120ms"),
                                         # "expected one argument" before: only a digit or "." after the minus
                                         # glued a value to its flag
                                         (["--gap-threshold", "-inf"], "expected a finite number <= 1, got '-inf'"),
                                         (["--gap-threshold", "-nan"], "expected a finite number <= 1, got '-nan'"),
                                         (["--gap-threshold", "-Infinity"], "got '-Infinity'"),
                                         (["--compute", "-INFms"], "'-INFms' is not a number followed by a unit")])
def test_cli_negative_and_unitless_values_get_their_own_message(extra, says):
    code, _, err = run_cli(EXAMPLE + extra + ["--no-sim"])
    assert code == 2 and says in err, err


def test_cli_and_api_share_the_default_latencies():
    """ClusterConfig defaulted to 5/2 us where the command line used 10/3 us: 196.1 vs 196.4 ms for one cluster."""
    from decent_comm.cli import build_parser
    from decent_comm.cli.plan import build_inputs
    from decent_comm.runtime_model import ClusterConfig
    parser = build_parser()
    args = parser.parse_args(EXAMPLE + ["--no-sim"])
    cluster, _, _ = build_inputs(args, args._subparser)
    api = ClusterConfig(cluster.nodes, cluster.ranks_per_node, cluster.inter_bandwidth, cluster.intra_bandwidth)
    assert (api.inter_latency, api.intra_latency) == (cluster.inter_latency, cluster.intra_latency) == (10e-6, 3e-6)


SLOW_LINKS = ["plan", "--nodes", "4", "--gpus-per-node", "1", "--params", "0.43M", "--inter-bw", "50Mbit",
              "--compute", "100ms", "--no-sim", "--json"]


def test_quality_term_prices_time_to_allreduce_loss():
    """The cluster of bench/time_to_target.py (train_lm: 0.43M params, 100 ms of compute, 50 Mbit links): a round
    of one-peer gossip over a bf16 wire moves 0.43M x 2 B in 138 ms, which two steps of compute hide with
    delayed_mix and one step does not; over the int8 wire (0.43M x (1 + 4/512) B, 69 ms) one step hides it;
    periodic averaging and All-Reduce move the fp32 model."""
    code, out, _ = run_cli(SLOW_LINKS)
    assert code == 0
    q = json.loads(out)["time_to_quality"]
    by = {(x["family"], x["mode"], x["gossip_every"], x["delayed_mix"], x["wire"]): x for x in q}
    round_s = 0.43e6 * 2 * 8 / 50e6
    assert by[("gossip", "awc", 2, True, "bf16")]["step_seconds"] == pytest.approx(0.1)     # hidden by 2 steps
    # (the closed form adds the link latency, microseconds)
    # 0.1 + (round - 0.1)
    assert by[("gossip", "awc", 1, False, "bf16")]["step_seconds"] == pytest.approx(round_s, rel=1e-3)
    assert by[("gossip", "atc", 2, False, "bf16")]["step_seconds"] == pytest.approx(0.1 + (round_s - 0.1 / 3) / 2,
                                                                                   rel=1e-3)
    assert by[("gossip", "awc", 1, False, "int8")]["step_seconds"] == pytest.approx(0.1)    # hidden by 1 step
    ddp = by[("allreduce", "-", 1, False, "fp32")]
    for x in q:
        assert x["time_vs_allreduce"] == pytest.approx(x["steps_multiplier"] * x["step_seconds"] / ddp["step_seconds"])
    # cheapest first, except that a recipe needs to beat All-Reduce by more than 5% (the multipliers' noise) to
    # rank ahead of it
    key = [x["time_vs_allreduce"] * (1.0 if x["family"] == "allreduce" else 1.05) for x in q]
    assert key == sorted(key)
    # What bench/time_to_target.py measured on that cluster: gossip every step over the int8 wire first, then
    # delayed gossip every 2 steps over bf16, both ahead of periodic averaging (docs/time_to_target.md).
    first = [(x["family"], x["topology"], x["gossip_every"], x["delayed_mix"], x["wire"]) for x in q[:2]]
    assert first == [("gossip", "one-peer-exp", 1, False, "int8"), ("gossip", "one-peer-exp", 2, True, "bf16")]
    assert "comm_dtype=torch.int8" in q[0]["label"]
    best_periodic = min(x["time_vs_allreduce"] for x in q if x["family"] == "periodic")
    assert q[0]["time_vs_allreduce"] < best_periodic < 1.0
    code, out, _ = run_cli(["plan", "--nodes", "4", "--gpus-per-node", "1", "--params", "0.43M", "--inter-bw", "10Gbit",
                            "--compute", "100ms", "--no-sim"])
    assert code == 0 and "1.00x  allreduce (DDP)" in out.split("time to all-reduce's loss")[1].splitlines()[1]


def test_the_8bit_wire_is_priced_as_it_runs():
    """The 8-bit wire moves every gossip step point to point, and DDP has none: with --wire-dtype int8 the gossip
    candidates cost what --exchange p2p gives them and allreduce what fp32 gradients cost (before, aer-pair was
    priced as one int8 group all-reduce and recommended at 2x, where it runs 35x slower)."""
    base = ["plan", "--nodes", "4", "--gpus-per-node", "8", "--params", "1.3B", "--inter-bw", "25Gbit",
            "--intra-bw", "600Gbit", "--compute", "300ms", "--no-sim", "--json"]
    runs = {}
    for key, extra in {"int8": ["--wire-dtype", "int8"], "int8-p2p": ["--wire-dtype", "int8", "--exchange", "p2p"],
                       "fp32": []}.items():
        code, out, _ = run_cli(base + extra)
        assert code == 0
        runs[key] = json.loads(out)
    for name in runs["int8"]["candidates"][1:]:
        assert runs["int8"][name]["step_seconds"] == runs["int8-p2p"][name]["step_seconds"], name
    assert runs["int8"]["allreduce"]["step_seconds"] == runs["fp32"]["allreduce"]["step_seconds"]
    assert runs["int8"]["recommended"] != "aer-pair"
    # every row's speedup, gamma and omega are against the All-Reduce row shown (they were against int8 gradients)
    ar = runs["int8"]["allreduce"]
    for name in runs["int8"]["candidates"][1:]:
        row = runs["int8"][name]
        assert row["speedup"] == pytest.approx(ar["step_seconds"] / row["step_seconds"], rel=1e-9), name
        assert row["gamma"] == pytest.approx(runs["fp32"][name]["gamma"], rel=1e-9), name
    code, _, err = run_cli(base + ["--wire-dtype", "int8", "--exchange", "group-allreduce"])
    assert code == 2 and "point to point" in err


def test_a_recipe_is_priced_on_its_own_wire_whatever_the_plan_wire():
    """The time-to-loss recipes name their wire (bf16 gossip, fp32 periodic averaging): --wire-dtype changes the
    table's rows, not what a recipe moves (under int8 the bf16 recipes were priced with int8 bytes, periodic
    averaging with bf16 all-reduces under bf16)."""
    for topology in ("one-peer-exp", "complete"):  # complete: group all-reduces (fp32 sums) but the 8-bit wire's
        steps = {}
        for wire in ("fp32", "bf16", "int8"):
            code, out, _ = run_cli(SLOW_LINKS + ["--topologies", topology, "--wire-dtype", wire])
            assert code == 0
            steps[wire] = {(x["family"], x["mode"], x["gossip_every"], x["delayed_mix"], x["wire"]): x["step_seconds"]
                           for x in json.loads(out)["time_to_quality"] if x["family"] != "allreduce"}
        for key, seconds in steps["fp32"].items():
            # periodic averaging is rescaled from All-Reduce by bytes (its microseconds of latency with them)
            assert steps["bf16"][key] == pytest.approx(seconds, rel=1e-3), (topology, key)
            assert steps["int8"][key] == pytest.approx(seconds, rel=1e-3), (topology, key)
    # on complete the 8-bit recipe is point to point (3 copies per rank), the bf16 one a float32 all-reduce
    by = {k[4]: v for k, v in steps["fp32"].items() if k[:4] == ("gossip", "awc", 1, False)}
    assert by["int8"] > 0.1 + 0.9 * (3 * 0.43e6 * (1 + 4 / 512) * 8 / 50e6 - 0.1)


def test_a_schedule_that_never_averages_is_not_recommended():
    """local (spectral gap 0) won as "none reaches the threshold: all topologies compete", and its recipes were
    priced with the one-peer multipliers (0.70x DDP's time to its loss, a loss local never reaches)."""
    code, out, _ = run_cli(SLOW_LINKS + ["--topologies", "local,ring"])
    assert code == 0
    d = json.loads(out)
    assert d["recommended"] != "local"
    assert all(x["topology"] != "local" for x in d["time_to_quality"])
    code, out, _ = run_cli(SLOW_LINKS + ["--topologies", "local"])
    d = json.loads(out)
    assert code == 0 and d["recommended"] == "allreduce"
    assert {x["family"] for x in d["time_to_quality"]} == {"allreduce", "periodic"}


def test_every_priced_wire_is_one_the_optimizers_run():
    """--wire-dtype offers the optimizers' comm_dtype choices only, each at its element size on the wire (int8: one
    float32 scale per INT8_BLOCK elements); it priced an fp8 wire that every optimizer refuses."""
    import torch

    from decent_comm.ops import INT8_BLOCK
    from decent_comm.optim.startup import COMM_DTYPES
    from decent_comm.runtime_model import WIRE_DTYPES

    torch_name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
    for name, nbytes in WIRE_DTYPES.items():
        dtype = getattr(torch, torch_name.get(name, name))
        assert dtype in COMM_DTYPES, name
        element = torch.empty((), dtype=dtype).element_size()
        assert nbytes == (element + 4 / INT8_BLOCK if dtype == torch.int8 else element), name
    assert {getattr(torch, torch_name.get(n, n)) for n in WIRE_DTYPES} == set(COMM_DTYPES)
