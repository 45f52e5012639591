"""The environment of the processes the worker starts: its own, without its secrets.

The embedded PostgreSQL (run as another OS user when the worker is root) and the local model
server need none of the worker's settings, yet inherited them all: API keys, IMAP passwords
and the database URL sat in their ``/proc/PID/environ`` (and superuser SQL can read the
server's). Settings are loaded before any child starts, so the worker itself loses nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

# The worker's own variables (secrets among them) and the places secrets come from.
_WITHHELD_PREFIXES = ("SOKRATOS_", "PG")
_WITHHELD_NAMES = frozenset({"DATABASE_URL", "CREDENTIALS_DIRECTORY"})


def withheld(name: str) -> bool:
    """True for a variable a child process is not given (proxies too: their URLs may carry a
    password, and neither child reaches out)."""
    upper = name.upper()
    return (
        upper.startswith(_WITHHELD_PREFIXES) or upper in _WITHHELD_NAMES or upper.endswith("_PROXY")
    )


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the variables :func:`withheld` names."""
    source = os.environ if environ is None else environ
    return {name: value for name, value in source.items() if not withheld(name)}


@contextmanager
def secrets_withheld() -> Iterator[None]:
    """Take the withheld variables out of ``os.environ`` while the block runs (a library that
    starts processes with the inherited environment, as the embedded PostgreSQL wheel does),
    then put them back."""
    taken = {name: value for name, value in os.environ.items() if withheld(name)}
    for name in taken:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(taken)
