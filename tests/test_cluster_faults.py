"""The emulated cluster's link faults (decent_train/cluster/faults.py) against what a socket sees: a partitioned
node reaches no other node and is reached by none, a healed one again; `drop(i, 0.5)` loses about half of the
datagrams in each direction; a throttled link carries about its rate. Needs root and `ip`/`tc` (skipped otherwise)."""

import subprocess
import sys

import pytest

from decent_train.cluster import EmulatedCluster
from decent_train.cluster.net import netns_unavailable_reason, run_cmd

pytestmark = pytest.mark.skipif(netns_unavailable_reason() is not None,
                                reason=f"no network namespaces: {netns_unavailable_reason()}")

PORT = 5999

# Waits up to 5 s for the first datagram (the sender is a new interpreter, slow to start on a loaded machine), then
# until none came for 1.5 s.
RECEIVER = ("import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind(('{addr}',%d))\n"
            "s.settimeout(5);print('ok',flush=True);n=0;b=0;t=[]\ntry:\n"
            " while True: b+=len(s.recv(65536)); n+=1; t.append(time.time()); s.settimeout(1.5)\n"
            "except socket.timeout: pass\nprint(n,b,t[-1]-t[0] if t else 0,flush=True)" % PORT)
SENDER = ("import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\nt=time.time()\n"
          "for _ in range({count}): s.sendto(bytes({size}),('{addr}',%d)); time.sleep({gap})" % PORT)


def datagrams(cluster, src, dst, count=400, size=1, gap=0.0005):
    """(datagrams, bytes, seconds from the first to the last) that node dst received of `count` sent by node src."""
    receiver = cluster.popen(dst, [sys.executable, "-c", RECEIVER.format(addr=cluster.node_addr(dst))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ok"
        run_cmd(cluster.wrap(src, [sys.executable, "-c", SENDER.format(count=count, size=size, gap=gap,
                                                                       addr=cluster.node_addr(dst))]))
        got, nbytes, span = receiver.stdout.readline().split()
    finally:
        receiver.wait(timeout=10)
    return int(got), int(nbytes), float(span)


def test_partition_drop_throttle_and_heal():
    with EmulatedCluster(3, wires=True, fallback=False) as cluster:
        assert datagrams(cluster, 1, 2)[0] == 400 and datagrams(cluster, 2, 0)[0] == 400
        cluster.partition(2)
        assert datagrams(cluster, 2, 0)[0] == 0 and datagrams(cluster, 0, 2)[0] == 0
        assert datagrams(cluster, 0, 1)[0] == 400  # the other nodes still reach each other
        cluster.heal(2)
        assert datagrams(cluster, 2, 0)[0] == 400
        cluster.drop(2, 0.5)
        # each datagram crosses node 2's wire once: lost with probability 0.5 (400 draws: 5 sigma = +-50)
        for src, dst in ((2, 1), (1, 2)):
            assert 150 <= datagrams(cluster, src, dst)[0] <= 250
        cluster.heal(2)
        assert datagrams(cluster, 2, 0, count=80, size=1000, gap=0.01)[2] < 2.0  # sent over 0.8 s (+ load)
        cluster.throttle(2, "200kbit")
        # the same at 200 kbit/s: the tbf queues them (up to 2 s of it, more than the 44 KB that build up), none
        # is lost, and they arrive over (80 * 1028 - 16 KiB of burst) * 8 / 200e3 = 2.6 s
        got, nbytes, span = datagrams(cluster, 2, 0, count=80, size=1000, gap=0.01)
        assert got == 80 and nbytes == 80 * 1000
        assert 2.0 < span < 4.0, span
        with pytest.raises(ValueError, match="fraction"):
            cluster.drop(2, 0.0)
    with EmulatedCluster(2, fallback=False) as plain, pytest.raises(RuntimeError, match="wires=True"):
        plain.partition(1)
