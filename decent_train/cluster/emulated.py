"""An emulated multi-node cluster on one machine: K network namespaces ("nodes") behind one switch, each
node's link shaped with `tc tbf`, and torchrun launched once per node inside its namespace.

    with EmulatedCluster(nodes=2, bandwidth="1Gbit") as cluster:
        results = cluster.torchrun("examples/train_lm.py", ["--optimizer", "dadamw"], nproc_per_node=2)
        cluster.set_bandwidth("200Mbit")          # reshape between jobs
        cluster.link_bytes()                      # bytes each node's link carried so far

Layout (why a switch, not point-to-point links): every node gets ONE veth link into a bridge that lives in
its own "switch" namespace, and that link is shaped in both directions (tbf on the node end = upload, tbf
on the switch end = download). That is a full-duplex NIC of the given bandwidth per node, shared by all of
the node's ranks and by all its peers -- the model decent_comm.runtime_model assumes (hardware.py: "the
bandwidth is per node ... egress and ingress are separate resources"). Point-to-point veth pairs between
every two nodes would give each node PAIR its own unshared link: K(K-1)/2 links, and an aer or all-reduce
step whose node talks to one peer could never contend with another flow, which is not what a real NIC
does. With K = 2 the two layouts carry the same traffic. Keeping the bridge in its own namespace leaves
the host's network untouched (no bridge, route or iptables rule in the root namespace).

Inside a node: `lo` up and one address 198.18.0.<i+1>/24 (RFC 2544's benchmarking range; the namespaces
are isolated, so concurrent clusters can reuse it) on the device `veth0`. Ranks bind the node address
(GLOO_SOCKET_IFNAME=veth0: gloo would otherwise pick 127.0.0.1 from the hostname), so traffic between two
ranks of the same node goes over `lo` (unshaped, fast) and traffic between nodes over the shaped link.
netem is not available on the kernels this was written for, so no latency is added: tbf's `latency` is a
queue limit, not a delay.

torchrun per node: `ip netns exec <node> python -m torch.distributed.run --nnodes K --nproc_per_node M
--node_rank i --master_addr <node 0> --master_port P` (static rendezvous: rank = i * M + local rank, so
rank r lives on node r // M, as decent_comm.topology assumes), or `--rdzv c10d` (node 0 hosts the c10d
store: `--rdzv_conf is_host=1`, since node 0's address is not recognized as local from the hostname).
Node 0's namespace is fresh, so the store port never collides with anything else on the machine.

Clean-up: every namespace name is `dcn-<pid>-<tag>-...` (pid of the owning process). The context manager,
an atexit hook and a SIGTERM/SIGHUP handler delete everything a cluster made (killing the process groups it
started first); deleting a namespace deletes its veth ends and their qdiscs. `cleanup_stale()` (run at
every set-up, or `python bench/netns_cluster.py --cleanup`) removes the namespaces of owners that died
without cleaning up (SIGKILL).

Faults (`wires=True`, decent_train/cluster/faults.py): each node's link gets a "wire" namespace between the node
and the switch (node veth0 -- a | bridge | b -- p<i> switch), where `drop(i, fraction)` (1.0: a partition),
`throttle(i, rate)` and `heal(i)` act. Dropping there, not on the node's own veth, makes every loss remote to
both ends: a packet dropped by the sender's own qdisc is reported to its TCP as local congestion and resent at
once, without the retransmission timeout a real lost packet costs.

Fallback: without root, without `ip`/`tc`, or when any set-up command fails (an unprivileged container),
the cluster runs every "node" on the host's loopback with no shaping and says so (`emulated` is False,
`reason` says why, a warning is logged). `DECENT_COMM_NETNS=0` forces the fallback.
"""

import atexit
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence, Union

from .faults import LinkFaults
from .jobs import TorchrunJobs
from .net import (DEFAULT_PORT, NODE_IF, PREFIX, SUBNET, cleanup_stale, delete_namespace, format_bits, free_port,
                  netns_unavailable_reason, parse_bandwidth_bits, run_cmd)

log = logging.getLogger(__name__)

# Every live cluster, for the atexit / signal clean-up.
_LIVE: "set[EmulatedCluster]" = set()
_LIVE_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _cleanup_all():
    with _LIVE_LOCK:
        clusters = list(_LIVE)
    for c in clusters:
        with contextlib.suppress(Exception):
            c.close()


def _on_signal(signum, frame):
    _cleanup_all()
    # Re-raise as the default action would (exit status 128 + signum), after cleaning up.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers():
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)
    _HANDLERS_INSTALLED = True


# --------------------------------------------------------------------------------------------- cluster

class EmulatedCluster(TorchrunJobs, LinkFaults):
    """K nodes joined by a switch, each node's link shaped to `bandwidth` (bits/s or '1Gbit'; None: unshaped).

    `emulated` says whether namespaces are in use (False: loopback fallback, `reason` says why).
    `fallback=False` raises instead of falling back. `wires=True` adds the wire namespaces the link faults
    (drop, throttle, heal) need.
    """

    def __init__(self, nodes: int, bandwidth: Union[None, str, float] = None, *, fallback: bool = True,
                 burst_bytes: Optional[int] = None, tag: Optional[str] = None, prefix: str = PREFIX,
                 wires: bool = False):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes = nodes
        self.bandwidth_bits = parse_bandwidth_bits(bandwidth)
        self.burst_bytes = burst_bytes
        self.fallback = fallback
        self.wires = wires
        self.base = f"{prefix}-{os.getpid()}-{tag or '%04x' % random.getrandbits(16)}"
        self.prefix = prefix
        self.emulated = False
        self.reason: Optional[str] = None
        self._made: List[str] = []      # namespaces created, in order
        self._procs: List[subprocess.Popen] = []
        self._fallback_port: Optional[int] = None
        self._open = False

    # ------------------------------------------------------------------ names and addresses
    @property
    def switch_ns(self) -> str:
        return f"{self.base}-sw"

    def node_ns(self, i: int) -> str:
        return f"{self.base}-n{i}"

    def node_addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}" if self.emulated else "127.0.0.1"

    @property
    def master_addr(self) -> str:
        return self.node_addr(0)

    @property
    def master_port(self) -> int:
        if self.emulated:
            return DEFAULT_PORT
        if self._fallback_port is None:
            self._fallback_port = free_port()
        return self._fallback_port

    def node_env(self, i: int) -> Dict[str, str]:
        """What every process of node i needs in its environment."""
        return {"GLOO_SOCKET_IFNAME": NODE_IF if self.emulated else "lo", "OMP_NUM_THREADS": "1"}

    def wrap(self, i: int, cmd: Sequence[str]) -> List[str]:
        """`cmd` run inside node i (`ip netns exec <ns> ...`; unchanged in the fallback)."""
        return ["ip", "netns", "exec", self.node_ns(i), *cmd] if self.emulated else list(cmd)

    def describe(self) -> str:
        if self.emulated:
            return (f"{self.nodes} network namespaces behind a switch, each node link {format_bits(self.bandwidth_bits)}"
                    f" (tc tbf, both directions)")
        return f"{self.nodes} 'nodes' on the host loopback, NO bandwidth shaping ({self.reason})"

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> "EmulatedCluster":
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def open(self):
        if self._open:
            return self
        _install_handlers()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._open = True
        reason = netns_unavailable_reason()
        if reason is None:
            try:
                cleanup_stale(self.prefix)
                self._setup_namespaces()
            except Exception as exc:  # noqa: BLE001 - any failure: undo and fall back
                self._teardown_namespaces()
                self.emulated = False
                reason = f"namespace set-up failed: {exc}"
        if not self.emulated:
            self.reason = reason
            if not self.fallback:
                self.close()
                raise RuntimeError(f"cannot emulate a cluster: {reason}")
            log.warning("emulated cluster unavailable (%s): all nodes run on loopback without bandwidth shaping",
                        reason)
        return self

    def _setup_namespaces(self):
        sw = self.switch_ns
        run_cmd(["ip", "netns", "add", sw])
        self._made.append(sw)
        run_cmd(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        run_cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.nodes):
            ns = self.node_ns(i)
            run_cmd(["ip", "netns", "add", ns])
            self._made.append(ns)
            if self.wires:
                self._add_wire(i)
            else:
                run_cmd(["ip", "link", "add", NODE_IF, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns",
                         sw])
            run_cmd(["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0", "up"])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", NODE_IF])
            run_cmd(["ip", "-n", ns, "link", "set", NODE_IF, "up"])
        self.emulated = True  # addresses and link names below refer to the namespaces
        self.set_bandwidth(self.bandwidth_bits)
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0):
        """A TCP connection from every node to node 0 (the bridge needs a moment to forward)."""
        if self.nodes == 1:
            return
        server = subprocess.Popen(
            self.wrap(0, [sys.executable, "-c",
                          "import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                          f"s.bind(('{self.node_addr(0)}',{DEFAULT_PORT + 1}));s.listen(64);print('ok',flush=True)\n"
                          f"for _ in range({self.nodes - 1}): s.accept()[0].close()"]),
            stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()
            code = ("import socket,time,sys\nend=time.time()+%r\n"
                    "while True:\n"
                    "  try: socket.create_connection(('%s',%d),timeout=1).close(); break\n"
                    "  except OSError:\n"
                    "    if time.time()>end: sys.exit('unreachable')\n"
                    "    time.sleep(0.05)\n") % (timeout, self.node_addr(0), DEFAULT_PORT + 1)
            for i in range(1, self.nodes):
                run_cmd(self.wrap(i, [sys.executable, "-c", code]))
            server.wait(timeout=timeout)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()

    def set_bandwidth(self, bandwidth: Union[None, str, float]):
        """Reshape every node link (both directions); None removes the shaping."""
        self.bandwidth_bits = parse_bandwidth_bits(bandwidth)
        if not self.emulated:
            return
        bits = self.bandwidth_bits
        for i in range(self.nodes):
            for ns, dev in ((self.node_ns(i), NODE_IF), (self.switch_ns, f"p{i}")):
                run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                if bits is None:
                    continue
                # The bucket must hold a 64 KiB GSO segment and a few ms of traffic (timer granularity);
                # the queue limit (`latency`) bounds the backlog, it adds no delay.
                burst = self.burst_bytes or max(128 * 1024, int(bits / 8 * 0.002))
                run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(bits)}bit",
                      "burst", str(burst), "latency", "50ms"])

    def link_bytes(self) -> List[Dict[str, int]]:
        """Per node: bytes its link sent (tx) and received (rx) so far (zeros in the fallback)."""
        out = []
        for i in range(self.nodes):
            if not self.emulated:
                out.append({"tx": 0, "rx": 0})
                continue
            stats = {}
            for key in ("tx_bytes", "rx_bytes"):
                proc = run_cmd(self.wrap(i, ["cat", f"/sys/class/net/{NODE_IF}/statistics/{key}"]))
                stats[key[:2]] = int(proc.stdout.strip())
            out.append(stats)
        return out

    def close(self):
        """Kills what the cluster started and deletes its namespaces (idempotent; `emulated` keeps saying
        what was used)."""
        for p in self._procs:
            self._kill(p)
        self._procs.clear()
        self._teardown_namespaces()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self._open = False

    def _teardown_namespaces(self):
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()

    # ------------------------------------------------------------------ processes
    @staticmethod
    def _kill(p: subprocess.Popen):
        if p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)

    def popen(self, i: int, cmd: Sequence[str], env: Optional[Dict[str, str]] = None, **kw) -> subprocess.Popen:
        """Starts `cmd` in node i, in its own process group (killed with the cluster)."""
        full_env = {**os.environ, **self.node_env(i), **(env or {})}
        p = subprocess.Popen(self.wrap(i, cmd), env=full_env, start_new_session=True, **kw)
        self._procs.append(p)
        return p
