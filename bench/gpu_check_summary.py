"""The compact table that bench/gpu_check.sh prints last, from what its steps wrote:

    python bench/gpu_check_summary.py --junit A.xml [B.xml ...] [--mix mix.json] [--exchange nccl_self.json]

Prints each op's GB/s and % of the device's copy bandwidth at 16M and 64M elements (fp32 and bf16 neighbours),
mix_adam_ against torch.optim.AdamW(fused=True) + the same mix, the NCCL transport's self-exchange GB/s, and the
test counts. The verdict is the tests': exits 1 when a test failed or errored, or when a one-GPU NCCL transport
test was skipped (on the GPU machine it must run: a skipped one means NCCL never moved a byte). A missing benchmark
(cut by the check's deadline after a slow build, or failed: gpu_check.sh prints its log's tail) is named on the
verdict line but does not turn passing tests into a FAIL. A pytest run its time limit stopped (SIGINT: its XML
holds the tests it finished; --cut lists such XML files) counts as a failure: the tests after the cut did not run.
"""
import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

# The skip reason of the tests that must run wherever there is a GPU (tests/test_exchange_nccl.py).
MUST_RUN = "one-GPU NCCL transport test"


def parse_sizes(text):
    """'16M,64M' -> element counts (M = 2^20), as bench/mix_kernels.py --sizes reads them."""
    return [int(float(v[:-1]) * 2**20) if v.endswith("M") else int(v) for v in text.split(",")]


def elements(n):
    return f"{n >> 20}M" if n >= 1 << 20 else str(n)


def test_counts(paths, cut=()):
    """Counts per outcome, and a line per failed, errored, skipped or missing test (the failures' first line of
    message: the logs that hold their tracebacks travel packed, so the verdict names them itself). `cut`: the XML
    files of pytest runs their time limit stopped, each one failure."""
    counts = dict(passed=0, failed=0, skipped=0, must_run_skipped=0)
    reasons = []
    for path in paths:
        if not os.path.exists(path):
            counts["failed"] += 1
            reasons.append(f"missing {path} (pytest did not run or was killed by its time limit)")
            continue
        if path in cut:
            counts["failed"] += 1
            reasons.append(f"stopped by its time limit: {path} (the tests it finished are counted; the rest did "
                           "not run)")
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.get("name") is None:  # the test running when SIGINT came: pytest records it without a name
                continue
            name = f"{case.get('classname')}.{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                counts["failed"] += 1
                first = (bad.get("message") or bad.text or "").strip().splitlines()
                reasons.append(f"FAILED {name}: {first[0][:300] if first else '(no message)'}")
            elif case.find("skipped") is not None:
                message = case.find("skipped").get("message", "")
                counts["skipped"] += 1
                counts["must_run_skipped"] += MUST_RUN in message
                reasons.append(f"skipped {name}: {message}")
            else:
                counts["passed"] += 1
    return counts, reasons


def load(path):
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", nargs="+", default=[])
    ap.add_argument("--mix", default=None)
    ap.add_argument("--exchange", default=None)
    ap.add_argument("--sizes", default="16M,64M", help="the kernel benchmark's sizes to show")
    ap.add_argument("--cut", default=None, help="a file listing, a line each, the --junit files whose pytest run "
                                                "its time limit stopped (absent: none was)")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    mix, exchange = load(args.mix), load(args.exchange)
    copy = exchange["copy_gbps"] if exchange else None
    device = exchange["device"] if exchange else "?"
    print(f"== gpu_check summary ({device}; device copy bandwidth "
          f"{f'{copy:.0f} GB/s' if copy else 'not measured'}: x.copy_(y), bytes read + written)")

    def pct(gbps):
        return f"{100 * gbps / copy:.0f}%" if copy else "-"

    def table(title, columns, rows):
        if rows is None:
            print(f"{title}: MISSING")
            return False
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return True

    def mix_row(r):
        vs = "  ".join(f"{name} {x:.2f}x" for name, x in r["speedup"].items()
                       if name in ("op_chain", "foreach", "cupy", "lerp", "adamw+mix", "adamw_only"))
        return [r["op"], elements(r["n"]), str(r["k"]), r["nb_dtype"], f"{r['gbps']:.0f}", pct(r["gbps"]), vs]

    missing = []
    if not table("kernel benchmark", ["op", "elements", "k", "neighbours", "GB/s", "% copy", "speedup vs"],
                 None if mix is None else [mix_row(r) for r in mix["rows"] if r["n"] in sizes]):
        missing.append("kernel")
    def host(r, key):  # absent from a JSON written before bench/exchange.py timed the host
        return f"{r[key]:.0f}" if key in r else "?"

    # A loopback reads and writes each byte it sends, as the copy it is measured against: % copy counts both.
    if not table("NCCL self-exchange benchmark", ["NCCL self-exchange", "elements", "wire", "GB/s sent",
                                                  "% copy (2x sent)", "host us: exchange()", "wait()"],
                 None if exchange is None else [["exchange+wait", elements(r["numel"]), r["wire"], f"{r['gbps']:.0f}",
                                                 pct(2 * r["gbps"]), host(r, "host_exchange_us"),
                                                 host(r, "host_wait_us")]
                                                for r in exchange["rows"]]):
        missing.append("NCCL self-exchange")
    cut = ()
    if args.cut and os.path.exists(args.cut):
        with open(args.cut) as f:
            cut = {line.strip() for line in f if line.strip()}
    counts, reasons = test_counts(args.junit, cut)
    for reason in reasons:
        print(f"  {reason}")
    print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"({counts['must_run_skipped']} of them one-GPU NCCL transport tests, counted as failures)")
    two_rank = sum("two GPUs" in r for r in reasons)
    if two_rank:  # a PASS must not read as more than it is
        print(f"not verified here: {two_rank} two-rank NCCL test(s) skipped (one GPU and NCCL < 2.30), so the "
              "optimizers over NCCL between ranks did not run; only the one-rank loopback transport did")
    ok = counts["failed"] == 0 and counts["must_run_skipped"] == 0
    unmeasured = f" (benchmark missing: {', '.join(missing)})" if missing else ""
    print(("gpu_check: PASS" if ok else "gpu_check: FAIL") + unmeasured)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
