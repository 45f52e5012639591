"""The exception tree. Foreign errors (psycopg, httpx) are translated at the boundary.

The classes of this module, and (in brackets) the modules that add to the tree::

    WorkerError
    ├── DatabaseUnavailable          the database cannot be reached now (transient)
    │   ├── TableLocked              another session holds a table the command must write
    │   ├── PoolBusy                 every pooled connection stayed in use (the server answers)
    │   ├── ConnectionLimitReached   the server refused a new connection for a limit
    │   └── ClaimRefused             the server answered a claim with an error (a privilege)
    ├── ItemError                    raised while handling an item (policy.after_failure
    │   │                            decides whether the attempt counts)
    │   ├── InvalidPayload           never retried: straight to failed_operations
    │   ├── BackendsUnavailable      not the item's fault: the attempt is given back
    │   │   ├── BackendsMisconfigured  every backend said 401/403/404
    │   │   │   └── [llm.types] LLMBackendsMisconfigured
    │   │   └── [llm.types] NoBackendReachable, EmbeddingsUnavailable
    │   ├── NoAttemptLeft            a claim past SOKRATOS_MAX_ATTEMPTS: ends the item unrun
    │   └── [llm.types] ChatFailed (RequestRefused, ContextTooLong),
    │                   EmbeddingFailed (EmbeddingReplyInvalid)
    └── [elsewhere] ImapError (email.imap), MessageNotRecorded (email.check),
                    LocalModelError (llm.local), MigrationError (store.migrations),
                    EmbeddedUnavailable (command_database)

Configuration problems are :class:`~sokratos_worker.config_error.ConfigError`, outside the
tree: the CLI exits 78 on them.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error this package raises on purpose."""


class DatabaseUnavailable(WorkerError):
    """PostgreSQL cannot be reached or dropped the connection; try again later."""


class TableLocked(DatabaseUnavailable):
    """A command gave up waiting for a table another session holds locked; the message
    names the session and how to end it."""


class PoolBusy(DatabaseUnavailable):
    """No pooled connection came free in time while every one the pool may open was lent
    out: the database was reached, its statements are slow or wait for locks."""


class ConnectionLimitReached(DatabaseUnavailable):
    """The server answered a new connection and refused it for a limit (the role's or the
    database's CONNECTION LIMIT, max_connections): the connections already open go on."""


class ClaimRefused(DatabaseUnavailable):
    """The server answered a claim with an error no item causes (a privilege revoked from the
    worker's role, a table or function missing): nothing can be claimed until it is fixed."""


def reached_database(exc: DatabaseUnavailable) -> bool:
    """True when ``exc`` shows the database answering (a lock, a full pool, a connection
    limit, a refused claim), not away."""
    return isinstance(exc, TableLocked | PoolBusy | ConnectionLimitReached | ClaimRefused)


class ItemError(WorkerError):
    """Handling this item failed. Whether the attempt counts is policy.after_failure's
    decision: it does for this class itself (retried later), not for BackendsUnavailable."""

    def __init__(self, message: str, *, backend: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend


# How every InvalidPayload message starts: `failed retry --all` and the dead-letter hint match it.
INVALID_PAYLOAD_PREFIX = "invalid payload"


class InvalidPayload(ItemError):
    """The payload is malformed; ``field`` names what is wrong. Not retried."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{INVALID_PAYLOAD_PREFIX}: {field} {problem}")
        self.field = field
        self.problem = problem


class NoAttemptLeft(ItemError):
    """A claim past SOKRATOS_MAX_ATTEMPTS: the item ends unrun, in failed_operations (its
    history already says how its last attempt ended)."""


class BackendsUnavailable(ItemError):
    """No backend (LLM or embeddings) could be reached at all: give the attempt back."""


class BackendsMisconfigured(BackendsUnavailable):
    """Every backend refused with 401/403/404: a configuration problem, not the item's."""
