"""Does this database fit this version and this configuration? Asked by ``run`` and ``check``."""

from __future__ import annotations

import psycopg

from sokratos_worker.config import ConfigError, Settings
from sokratos_worker.store.migrations import pending_migrations
from sokratos_worker.store.status import database_has_fixed_embedding


def schema_problems(settings: Settings, conn: psycopg.Connection) -> list[ConfigError]:
    """What would make the worker fail later, each naming the variable or command to fix it."""
    try:
        pending = pending_migrations(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        # Nothing can be judged by a role that may not read the tables (nor can it work).
        return [
            ConfigError(
                "schema",
                f"role {conn.info.user} may not read the worker's tables"
                f" ({str(exc).splitlines()[0]}): grant it sokratos_worker"
                " (sql/roles.sql, docs/production.md) or connect as a role that has it",
            )
        ]
    if pending:
        # Nothing else can be judged on a schema that is not there yet.
        return [
            ConfigError(
                "schema",
                f"the database lacks migrations {', '.join(pending)}: run 'sokratos-worker"
                " migrate' as the role that owns the tables ('run' skips them with --no-migrate"
                " or SOKRATOS_MIGRATE_ON_START=false)",
            )
        ]
    fixed = database_has_fixed_embedding(conn)
    problems = []
    if fixed is not None and not settings.embeddings_enabled:
        problems.append(
            ConfigError(
                "SOKRATOS_EMBEDDING_URL",
                "is required: this database's memories.embedding is NOT NULL (a Sokratos"
                " database), so memories cannot be saved without an embedding model",
            )
        )
    if fixed and settings.embedding_dim and fixed != settings.embedding_dim:
        problems.append(
            ConfigError(
                "SOKRATOS_EMBEDDING_DIM",
                f"is {settings.embedding_dim} but memories.embedding is vector({fixed})",
            )
        )
    return problems
