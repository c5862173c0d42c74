"""Free TCP ports for servers a test starts later (Ray Serve's proxy, a Ray head's ports)."""

from __future__ import annotations

import random
import socket

# Below the kernel's ephemeral range (32768 and up) and above Ray's worker ports
# (10002-19999): a port the kernel hands to an outgoing connection or to one of Ray's own
# servers could be taken again between this choice and its use (a flaky bind).
PORT_RANGE = range(20000, 32768)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (all held open while choosing)."""
    socks: list[socket.socket] = []
    try:
        for port in random.sample(PORT_RANGE, 200):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
        raise RuntimeError(f"no {n} free ports in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
