"""Which build of the worker this is: the package version and a digest of its code.

The version alone is the same for every commit, so during a rolling upgrade ``status`` could
not tell the old workers from the new; the digest of the installed modules and migrations
differs whenever the code does.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from sokratos_worker import __version__
from sokratos_worker.store.migrations import sql_directory

DIGEST_CHARS = 10


@cache
def code_digest() -> str:
    """First ``DIGEST_CHARS`` hex digits of a SHA-256 over every module and migration, by
    relative path (read once: a few milliseconds)."""
    package = Path(__file__).resolve().parent
    files = sorted((p.relative_to(package).as_posix(), p) for p in package.rglob("*.py"))
    files += sorted((f"sql/{p.name}", p) for p in sql_directory().glob("*.sql"))
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:DIGEST_CHARS]


def build_version() -> str:
    """``0.1.0+3f2a9c1e0b``: the version a worker records in its heartbeat."""
    return f"{__version__}+{code_digest()}"
