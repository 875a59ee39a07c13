"""Free localhost ports for the two-rank ``mlx.launch --backend ring`` runs of the tests."""

import random
import socket


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (the ring backend listens on one port per rank)."""
    for _ in range(200):
        p = random.randint(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")
