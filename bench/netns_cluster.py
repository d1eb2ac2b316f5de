"""Emulated cluster utilities (root): delete the namespaces dead runs left behind, or build a 2-node cluster and
time a TCP transfer over its shaped link. The cluster itself is decent_train.cluster.

    sudo .venv/bin/python bench/netns_cluster.py --cleanup
    sudo .venv/bin/python bench/netns_cluster.py --check 200Mbit
"""

import argparse
import logging
import sys
import time

from decent_train.cluster import EmulatedCluster, cleanup_stale
from decent_train.cluster.net import run_cmd


def check_link(bandwidth: str):
    """A 2-node cluster at `bandwidth`; prints the rate of a 16 MiB TCP send from node 0 to node 1."""
    with EmulatedCluster(2, bandwidth) as c:
        print(c.describe())
        nbytes = 16 << 20
        srv = c.popen(1, [sys.executable, "-c",
                          "import socket\ns=socket.socket();s.bind(('%s',5001));s.listen(1);c=s.accept()[0]\n"
                          "n=0\nwhile n<%d:\n  d=c.recv(1<<20)\n  if not d: break\n  n+=len(d)\nc.sendall(b'k')"
                          % (c.node_addr(1), nbytes)])
        time.sleep(0.5)
        code = ("import socket,time\ns=socket.create_connection(('%s',5001));b=bytes(1<<20);t=time.time()\n"
                "for _ in range(%d): s.sendall(b)\ns.recv(1);print('%%.1f Mbit/s'%%(%d*8/(time.time()-t)/1e6))"
                % (c.node_addr(1), nbytes >> 20, nbytes))
        print(run_cmd(c.wrap(0, [sys.executable, "-c", code])).stdout.strip())
        srv.wait(timeout=30)


def main(argv=None):
    p = argparse.ArgumentParser(description="Emulated cluster utilities (root): clean up, or check a link.")
    p.add_argument("--cleanup", action="store_true", help="delete namespaces left by dead runs (any owner pid gone)")
    p.add_argument("--check", default=None, metavar="BW", help="build a 2-node cluster at BW and time a 16 MiB TCP send")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.cleanup:
        print("removed:", " ".join(cleanup_stale()) or "nothing")
    if args.check:
        check_link(args.check)


if __name__ == "__main__":
    main()
