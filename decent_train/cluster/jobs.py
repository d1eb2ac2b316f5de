"""Running one torchrun job across the nodes of an emulated cluster: one `python -m torch.distributed.run
--nnodes K --node_rank i ...` per node, inside that node, all at once; the job fails as a whole on the first
node that fails or at its timeout."""

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from .. import REPO_ROOT


@dataclasses.dataclass
class NodeResult:
    node: int
    returncode: int
    log_path: str
    seconds: float

    def tail(self, chars: int = 6000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


class ClusterJobError(RuntimeError):
    pass


class TorchrunJobs:
    """EmulatedCluster's torchrun launcher (uses its nodes, addresses, `popen` and `_kill`)."""

    def torchrun_cmd(self, i: int, script: str, args: Sequence[str], nproc_per_node: int,
                     rdzv: str = "static") -> List[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
               "--nproc_per_node", str(nproc_per_node)]
        if rdzv == "static":
            cmd += ["--node_rank", str(i), "--master_addr", self.master_addr, "--master_port", str(self.master_port)]
        elif rdzv == "c10d":
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{self.master_addr}:{self.master_port}",
                    "--rdzv_id", self.base, "--rdzv_conf", f"is_host={int(i == 0)}"]
        else:
            raise ValueError(f"rdzv must be 'static' or 'c10d', got {rdzv!r}")
        # The address this node advertises (c10d: node 0's becomes the workers' MASTER_ADDR; the hostname
        # would resolve to 127.0.0.1 inside every namespace).
        cmd += ["--local_addr", self.node_addr(i)]
        return [*cmd, script, *args]

    def torchrun(self, script: str, args: Sequence[str] = (), nproc_per_node: int = 1, *,
                 env: Optional[Dict[str, str]] = None, timeout: float = 600, log_dir: Optional[str] = None,
                 rdzv: str = "static", check: bool = True, echo: bool = False,
                 poll: Optional[Callable[[], None]] = None) -> List[NodeResult]:
        """Runs one torchrun per node (all at once) and waits; the job fails as a whole on the first node
        that fails or at `timeout` (every node's process group is killed). Output goes to
        `log_dir/node<i>.log` (a temporary directory by default); `echo` also copies it to stderr.
        `poll()` is called every 50 ms while the job runs (e.g. to reshape the links when the job asks)."""
        log_dir = log_dir or tempfile.mkdtemp(prefix="netns_cluster_")
        os.makedirs(log_dir, exist_ok=True)
        procs, files, t0 = [], [], time.monotonic()
        try:
            for i in range(self.nodes):
                path = os.path.join(log_dir, f"node{i}.log")
                f = open(path, "w")
                files.append((path, f))
                procs.append(self.popen(i, self.torchrun_cmd(i, script, args, nproc_per_node, rdzv), env=env,
                                        stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT))
            done: Dict[int, NodeResult] = {}
            failed = None
            while len(done) < self.nodes:
                for i, p in enumerate(procs):
                    if i not in done and p.poll() is not None:
                        done[i] = NodeResult(i, p.returncode, files[i][0], time.monotonic() - t0)
                        if p.returncode != 0 and failed is None:
                            failed = i
                if failed is not None or time.monotonic() - t0 > timeout:
                    break
                if poll is not None:
                    poll()
                time.sleep(0.05)
            if failed is not None or len(done) < self.nodes:
                for i, p in enumerate(procs):
                    self._kill(p)
                    if i not in done:
                        done[i] = NodeResult(i, p.returncode if p.returncode is not None else -9, files[i][0],
                                             time.monotonic() - t0)
            results = [done[i] for i in range(self.nodes)]
        finally:
            for p in procs:
                self._kill(p)
                with contextlib.suppress(ValueError):
                    self._procs.remove(p)
            for _, f in files:
                f.close()
        if echo:
            for r in results:
                sys.stderr.write(f"----- node {r.node} ({r.log_path}) -----\n{r.tail(20000)}\n")
        if check and any(r.returncode != 0 for r in results):
            why = (f"node {failed} exited with code {results[failed].returncode}" if failed is not None
                   else f"timed out after {timeout:.0f} s")
            details = "".join(f"\n----- node {r.node} (exit {r.returncode}) -----\n{r.tail()}" for r in results)
            raise ClusterJobError(f"torchrun job failed on {self.describe()}: {why}{details}")
        return results
