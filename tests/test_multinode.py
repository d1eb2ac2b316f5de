"""A real multi-node launch: two torchrun "nodes" (node_rank 0 and 1, 2 ranks each), each in its own network
namespace with its own address, joined through a switch by shaped veth links (decent_train.cluster), train
a few steps of the byte-level GPT with DAdamW on `aer`, whose schedule depends on LOCAL_WORLD_SIZE (set by
torchrun: 2). Every rank's final replica must equal the same rank's replica from a single-node job of 4
ranks that emulates the 2 nodes with --local-world-size 2: same ranks, same data, same gossip schedule, so
only the transport differs.

As root with `ip netns` the traffic between the nodes really crosses the veth links (checked with their byte
counters); otherwise (not root, no `ip`, a container without the capability) the two torchrun jobs run on
the host loopback, which still checks the multi-node rendezvous and LOCAL_WORLD_SIZE handling.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from decent_train.cluster import EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = 6
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--corpus-mb", "0.3", "--eval-tokens", "1024", "--no-progress"]


def flags(out, ck):
    return ["--optimizer", "dadamw", "--topology", "aer", "--steps", str(STEPS), "--eval-every", "3",
            "--log-every", "1", *TINY, "--out", out, "--checkpoint", ck, "--checkpoint-every", str(STEPS)]


def replicas(ck):
    step = os.path.join(ck, f"step_{STEPS:07d}")
    assert sorted(os.listdir(step)) == [f"rank{r}.pt" for r in range(4)]
    return [torch.load(os.path.join(step, f"rank{r}.pt"), map_location="cpu", weights_only=True)["model"]
            for r in range(4)]


def val_losses(out):
    with open(os.path.join(out, "log.json")) as f:
        log = json.load(f)
    assert log["config"]["world_size"] == 4
    return [r["val_loss"] for r in log["rows"] if "val_loss" in r]


def test_two_nodes_match_single_node_aer(tmp_path):
    script = os.path.join(ROOT, "examples", "train_lm.py")
    multi_out, multi_ck = str(tmp_path / "multi"), str(tmp_path / "multi_ck")
    with EmulatedCluster(nodes=2, bandwidth="1Gbit") as cluster:
        before = cluster.link_bytes()
        cluster.torchrun(script, flags(multi_out, multi_ck), nproc_per_node=2, timeout=120,
                         log_dir=str(tmp_path / "logs"))
        after = cluster.link_bytes()
        emulated = cluster.emulated
        print(cluster.describe())

    single_out, single_ck = str(tmp_path / "single"), str(tmp_path / "single_ck")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", script,
           *flags(single_out, single_ck), "--local-world-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"single-node run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    multi, single = replicas(multi_ck), replicas(single_ck)
    for r in range(4):
        assert multi[r].keys() == single[r].keys()
        for name in multi[r]:
            torch.testing.assert_close(multi[r][name], single[r][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} {name}: {m}")
    assert val_losses(multi_out) == pytest.approx(val_losses(single_out), rel=1e-5, abs=1e-6)
    # The replicas are not all equal (the test would also pass with a broken exchange that copied everything).
    assert any(not torch.equal(multi[0][k], multi[2][k]) for k in multi[0])

    if emulated:
        # aer with 2 nodes x 2 ranks: every other step each rank sends its whole replica to its counterpart on
        # the other node, so each node link carries at least 2 ranks x 3 inter-node steps x 4 bytes x params.
        params = sum(v.numel() for v in multi[0].values())
        for node in range(2):
            sent = after[node]["tx"] - before[node]["tx"]
            assert sent >= 2 * (STEPS // 2) * 4 * params, (node, sent, params)
