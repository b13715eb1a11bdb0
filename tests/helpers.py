"""Small helpers that tests import directly (``from helpers import free_port``)."""

from __future__ import annotations

import socket
import uuid


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it).

    Another process may take it before the caller binds it; callers that start a server
    on it should retry with a fresh port when the start fails because the port is busy.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unique_name(prefix: str, hex_chars: int = 8) -> str:
    """``prefix`` plus random hex: topic prefixes, group ids. No ``_`` (the key separator)."""
    return f"{prefix}{uuid.uuid4().hex[:hex_chars]}"
