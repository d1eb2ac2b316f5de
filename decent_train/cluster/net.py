"""The host-side commands of the emulated cluster (ip netns / tc, run as root) and the units it takes: bandwidth
parsing and formatting, free ports, listing, deleting and cleaning up stale `dcn-<pid>-...` namespaces, and
whether namespaces can be used here at all."""

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import List, Optional, Sequence, Union

PREFIX = "dcn"
SUBNET = "198.18.0"
NODE_IF = "veth0"
DEFAULT_PORT = 29500

log = logging.getLogger(__name__)


def parse_bandwidth_bits(bandwidth: Union[None, str, float, int]) -> Optional[float]:
    """bits/s from '1Gbit', '200Mbit', '100MB/s' (decent_comm.runtime_model.units) or a number of bits/s."""
    if bandwidth is None:
        return None
    if isinstance(bandwidth, (int, float)):
        return float(bandwidth)
    text = bandwidth.strip().lower()
    if text in ("", "none", "inf", "unshaped", "0"):
        return None
    from decent_comm.runtime_model.units import parse_bandwidth  # lazy: only when a bandwidth is given
    return 8.0 * parse_bandwidth(bandwidth)


def format_bits(bits: Optional[float]) -> str:
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_cmd(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> List[str]:
    if shutil.which("ip") is None:
        return []
    proc = run_cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def delete_namespace(ns: str):
    """Kill what still runs in `ns` (processes a cluster of ours started there), then delete it."""
    pids = run_cmd(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run_cmd(["ip", "netns", "delete", ns], check=False)


def cleanup_stale(prefix: str = PREFIX) -> List[str]:
    """Deletes the `<prefix>-<pid>-...` namespaces whose owner process is gone; returns their names."""
    if os.geteuid() != 0:
        return []
    removed = []
    for ns in list_namespaces():
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if pid_alive(int(parts[1])):
            continue
        delete_namespace(ns)
        removed.append(ns)
    if removed:
        log.warning("removed %d namespaces left by dead runs: %s", len(removed), " ".join(removed))
    return removed


def netns_unavailable_reason() -> Optional[str]:
    """None when namespaces can be tried, else why not."""
    if os.environ.get("DECENT_COMM_NETNS", "1") == "0":
        return "DECENT_COMM_NETNS=0"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    return None
