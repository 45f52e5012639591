"""Which process listens on a TCP port here: named when a port the worker wants is taken."""

from __future__ import annotations

import os
from pathlib import Path

# The kernel's tables of TCP sockets; 0A is the LISTEN state.
_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"


def port_holder(port: int) -> str | None:
    """``"name (pid N)"`` of a process listening on ``port``; None when it cannot be told
    (no /proc, or the process belongs to another user and this one is not root)."""
    sockets = _listening_sockets(port)
    if not sockets:
        return None
    for process in _processes():
        if _holds_any(process, sockets):
            return f"{_name(process)} (pid {process.name})"
    return None


def _listening_sockets(port: int) -> set[str]:
    """The fd link targets (``socket:[inode]``) of the sockets listening on ``port``."""
    found: set[str] = set()
    for table in _TCP_TABLES:
        try:
            rows = table.read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and _port_of(fields[1]) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def _port_of(local_address: str) -> int:
    return int(local_address.rsplit(":", 1)[1], 16)


def _processes() -> list[Path]:
    try:
        return [entry for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def _holds_any(process: Path, sockets: set[str]) -> bool:
    try:
        descriptors = list((process / "fd").iterdir())
    except OSError:  # another user's process, or one that just ended
        return False
    for descriptor in descriptors:
        try:
            if os.readlink(descriptor) in sockets:
                return True
        except OSError:
            continue
    return False


def _name(process: Path) -> str:
    try:
        return (process / "comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return "a process"
