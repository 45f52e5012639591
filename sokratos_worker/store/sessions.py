"""Refuse a connection pooler that shares server sessions between the worker's connections.

The worker needs one server session per connection: LISTEN, the migration and email
advisory locks, and psycopg's prepared statements all live in the session. Behind PgBouncer
in transaction or statement pooling they fail quietly (a lost LISTEN, a lock leaked on a
pooled server connection for later clients to wait on, an attempt used up by
``prepared statement "_pg3_0" does not exist``). Such a pooler is found by asking two open
connections for their server process: a direct connection or session pooling never gives
two connections the same one, and PgBouncer hands the server connection one client has just
released to the next (LIFO), so under transaction pooling the two answers match.
"""

from __future__ import annotations

from sokratos_worker.config import ConfigError
from sokratos_worker.store.connection import connect, translated

# Each round asks both connections once; PgBouncer's LIFO reuse matches on the first round,
# the others cover a pooler that spreads statements over its idle server connections.
_ROUNDS = 3


class SessionsShared(ConfigError):
    """Two of the worker's connections reached one server session: a pooler in transaction
    or statement mode, which the worker cannot run behind."""

    def __init__(self, server_pid: int) -> None:
        super().__init__(
            "SOKRATOS_DATABASE_URL",
            f"two separate connections were served by one server process (pid {server_pid}):"
            " the URL points at a connection pooler in transaction or statement mode"
            " (PgBouncer pool_mode = transaction); LISTEN, advisory locks and prepared"
            " statements need one server session per connection, so use session pooling"
            " (pool_mode = session) or connect to PostgreSQL directly (docs/production.md)",
        )


def shared_server_session(conninfo: str) -> int | None:
    """The server process two fresh connections to ``conninfo`` shared, or None."""
    with connect(conninfo) as first, connect(conninfo) as second, translated():
        for _ in range(_ROUNDS):
            mine = first.execute("SELECT pg_backend_pid()").fetchone()
            theirs = second.execute("SELECT pg_backend_pid()").fetchone()
            if mine is not None and theirs is not None and mine[0] == theirs[0]:
                return int(mine[0])
    return None


def refuse_shared_sessions(conninfo: str) -> None:
    """Raise :class:`SessionsShared` (exit 78) when a pooler shares server sessions."""
    pid = shared_server_session(conninfo)
    if pid is not None:
        raise SessionsShared(pid)
