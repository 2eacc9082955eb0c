"""What every HTTP service of the package shares: the listening socket it hands to uvicorn."""

from __future__ import annotations

import socket

from stragglers.errors import EnvironmentFailure


def listen_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A bound, listening TCP socket; EnvironmentFailure naming host:port when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Linux copies TCP_NODELAY to accepted sockets; without it Nagle + delayed ACK add ~40 ms
    # to every keep-alive request whose response uvicorn writes in two pieces.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EnvironmentFailure(f"{host}:{port}", f"cannot listen there ({exc.strerror})") from None
    sock.listen(backlog)
    return sock
