"""Link faults of an emulated cluster built with `wires=True` (EmulatedCluster's mixin): drop a fraction of a
node's packets (1.0: partition it), slow its link, heal it. Imports no torch.

Where: node i's link runs node veth0 -- `to_node` | bridge | `to_switch` -- switch port p<i>, the middle in the
wire namespace `<base>-w<i>`, and the faults are root qdiscs on `to_node` (what the node receives) and
`to_switch` (what it sends): both directions at once. Neither end sees the drop as its own: a drop on the
sender's own veth would be reported to its TCP at once as local congestion, while a packet lost in a real
network costs a retransmission timeout, doubling at each retry; what these faults emulate is the latter.
The bandwidth shaping of EmulatedCluster.set_bandwidth stays on the node and switch ends, so faults and shaping
do not replace each other.

How, as the kernels this runs on have no netem: a drop is an htb root with two classes, 1:1 (the default: pass)
and 1:2 (a `pfifo limit 0`: every packet sent there is dropped), and a classic-BPF filter that sends a packet to
1:2 when a random 32-bit draw is at most fraction * 2^32. A slow link is a tbf whose queue holds `latency` worth
of the rate (a backlog, not a delay added to every packet)."""

from typing import List, Tuple

from .net import NODE_IF, run_cmd

WIRE_BRIDGE = "wbr"
TO_NODE, TO_SWITCH = "to_node", "to_switch"  # the wire's two veth ends


def _drop_program(fraction: float) -> str:
    """Classic BPF for cls_bpf: return -1 (the filter's class, 1:2: dropped) with probability `fraction`, else 0
    (no match: the default class)."""
    if fraction >= 1.0:
        return "1,6 0 0 4294967295"
    threshold = min(int(fraction * 2 ** 32), 2 ** 32 - 1)
    # A = random u32 (SKF_AD_OFF + SKF_AD_RANDOM = 0xfffff038); if A > threshold return 0, else return -1
    return f"4,32 0 0 4294963256,37 0 1 {threshold},6 0 0 0,6 0 0 4294967295"


class LinkFaults:
    """EmulatedCluster's fault methods (use its base name, `wires`, `emulated`, `_made`, switch_ns and node_ns)."""

    def wire_ns(self, i: int) -> str:
        return f"{self.base}-w{i}"

    def _add_wire(self, i: int):
        """node i's veth0 -- to_node [bridge] to_switch -- p<i> in the switch (the namespace is recorded for the
        tear-down)."""
        wire, node, sw = self.wire_ns(i), self.node_ns(i), self.switch_ns
        run_cmd(["ip", "netns", "add", wire])
        self._made.append(wire)
        run_cmd(["ip", "link", "add", "name", NODE_IF, "netns", node, "type", "veth", "peer", "name", TO_NODE, "netns",
                 wire])
        run_cmd(["ip", "link", "add", "name", TO_SWITCH, "netns", wire, "type", "veth", "peer", "name", f"p{i}",
                 "netns", sw])
        run_cmd(["ip", "-n", wire, "link", "add", WIRE_BRIDGE, "type", "bridge"])
        run_cmd(["ip", "-n", wire, "link", "set", WIRE_BRIDGE, "up"])
        for end in (TO_NODE, TO_SWITCH):
            run_cmd(["ip", "-n", wire, "link", "set", end, "master", WIRE_BRIDGE, "up"])

    def _wire_ends(self, i: int) -> List[Tuple[str, str]]:
        if not (self.emulated and self.wires):
            raise RuntimeError("link faults need an emulated cluster built with wires=True "
                               f"(emulated={self.emulated}, wires={self.wires}, reason: {self.reason})")
        if not 0 <= i < self.nodes:
            raise ValueError(f"node {i} is not one of the cluster's {self.nodes} nodes")
        return [(self.wire_ns(i), TO_NODE), (self.wire_ns(i), TO_SWITCH)]

    def heal(self, i: int):
        """Removes node i's fault (both directions)."""
        for ns, dev in self._wire_ends(i):
            run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def drop(self, i: int, fraction: float):
        """Drops `fraction` of node i's packets at random, both ways (1.0: node i is partitioned off)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.heal(i)
        program = _drop_program(fraction)
        for ns, dev in self._wire_ends(i):
            tc = ["tc", "-n", ns]
            run_cmd([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
            for cls in ("1:1", "1:2"):
                run_cmd([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", "10gbit"])
            run_cmd([*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "pfifo", "limit", "0"])
            run_cmd([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1", "bpf",
                     "bytecode", program, "classid", "1:2"])

    def partition(self, i: int):
        """Cuts node i off from every other node (every packet dropped, both ways; its link stays up)."""
        self.drop(i, 1.0)

    def throttle(self, i: int, rate: str, latency: str = "2s"):
        """Slows node i's link to `rate` ('200kbit') both ways, queueing up to `latency` worth of traffic."""
        self.heal(i)
        for ns, dev in self._wire_ends(i):
            run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "16kb",
                     "latency", latency])
