"""Does this database fit this version and this configuration? Asked by ``run`` and ``check``."""

from __future__ import annotations

import psycopg

from sokratos_worker.config import ConfigError, Settings
from sokratos_worker.store.memories import EMBEDDINGS_COUNTED, EmbeddingGroup, embedding_groups
from sokratos_worker.store.migrations import UPGRADING, encoding_problem, pending_migrations
from sokratos_worker.store.status import embedding_column


def schema_problems(settings: Settings, conn: psycopg.Connection) -> list[ConfigError]:
    """What would make the worker fail later, each naming the variable or command to fix it."""
    if (encoding := encoding_problem(conn)) is not None:
        return [encoding]  # (not even the migrations can be stored: nothing else matters)
    try:
        pending = pending_migrations(conn)
    except ConfigError as exc:  # the tables are out of the search_path's reach
        return [exc]
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
                f"the database lacks migrations {', '.join(pending)}, which this version"
                " needs (no worker runs without them, --no-migrate or not): run"
                " 'sokratos-worker migrate' as the role that owns the tables, then start the"
                f" worker again ({UPGRADING})",
            )
        ]
    problems = _missing_privileges(conn)
    column = embedding_column(conn)
    if column.required and not settings.embeddings_enabled:
        problems.append(
            ConfigError(
                "SOKRATOS_EMBEDDING_URL",
                "is required: this database's memories.embedding is NOT NULL (a Sokratos"
                " database), so memories cannot be saved without an embedding model",
            )
        )
    # Compared whenever both are known: a nullable vector(N) refuses other dimensions too.
    if (
        column.dimension
        and settings.embeddings_enabled
        and settings.embedding_dim
        and column.dimension != settings.embedding_dim
    ):
        problems.append(
            ConfigError(
                "SOKRATOS_EMBEDDING_DIM",
                f"is {settings.embedding_dim} but memories.embedding is vector({column.dimension})",
            )
        )
    return problems


def embedding_mismatch(settings: Settings, conn: psycopg.Connection) -> str | None:
    """A warning when memories carry embeddings of another model or dimension than the
    configured ones: a legitimate change of model, but those memories drop out of reach."""
    model, dimension = settings.embedding_model, settings.embedding_dim
    if not settings.embeddings_enabled or not model or not dimension:
        return None
    groups, bounded = embedding_groups(conn)
    # As store/memories.py compares: the same dimension, and the same model or none recorded.
    others = [
        g for g in groups if g.dimension != dimension or (g.model is not None and g.model != model)
    ]
    if not others:
        return None
    among = f" of the oldest {EMBEDDINGS_COUNTED} with an embedding" if bounded else ""
    return (
        f"{sum(g.count for g in others)} memories{among} carry embeddings of another model or"
        f" dimension than SOKRATOS_EMBEDDING_MODEL {model} and SOKRATOS_EMBEDDING_DIM"
        f" {dimension} ({', '.join(_described(g) for g in others)}): the near-duplicate and"
        " contradiction checks compare only with memories of the configured model and"
        " dimension, so a fact they hold may be saved again and a contradiction of them is"
        " not found; re-embedding them with the configured model brings them back into reach"
        " (or configure the model they were embedded with again)"
    )


def _described(group: EmbeddingGroup) -> str:
    model = group.model if group.model is not None else "no model recorded"
    return f"{group.count} of {model}, {group.dimension} dimensions"


# What the worker does to each table (sql/roles.sql grants the same); a table that does not
# exist (personality_traits outside Sokratos) is not asked for. The queues and the keys are
# inserted into by sokratos_enqueue, which runs with its caller's rights for the worker.
# SELECT, INSERT and UPDATE are met by a grant on some columns too (has_any_column_privilege:
# a DBA may allow only `UPDATE (superseded_by) ON memories`, all the worker updates there);
# DELETE exists only for the whole table.
_WORKER_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "pending_triage": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "pending_distillation": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "work_outcomes": ("SELECT", "INSERT"),
    "failed_operations": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "processed_emails": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "email_checkpoints": ("SELECT", "INSERT", "UPDATE"),
    "worker_heartbeats": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "sokratos_idempotency_keys": ("SELECT", "INSERT", "UPDATE"),
    "memories": ("SELECT", "INSERT", "UPDATE"),
    "adaptive_params": ("SELECT",),
    "personality_traits": ("SELECT",),
    "sokratos_worker_migrations": ("SELECT",),
}


def _missing_privileges(conn: psycopg.Connection) -> list[ConfigError]:
    """Grants the worker's role lacks on the tables it uses and their id sequences: without
    them it would start, then fail every settle with "permission denied" and retry for ever."""
    tables = list(_WORKER_PRIVILEGES)
    privileges = [",".join(p) for p in _WORKER_PRIVILEGES.values()]
    rows = conn.execute(
        """WITH wanted AS (
               SELECT w.name, to_regclass(w.name) AS rel, p.privilege
               FROM unnest(%s::text[], %s::text[]) AS w(name, privileges),
                    unnest(string_to_array(w.privileges, ',')) AS p(privilege))
           SELECT name, string_agg(privilege, ', ' ORDER BY privilege)
           FROM wanted
           WHERE CASE WHEN rel IS NULL THEN false
                      -- A column grant is enough (UPDATE (superseded_by) ON memories).
                      WHEN privilege IN ('SELECT', 'INSERT', 'UPDATE')
                          THEN NOT has_any_column_privilege(rel, privilege)
                      ELSE NOT has_table_privilege(rel, privilege) END
           GROUP BY name
           UNION ALL
           SELECT s.oid::regclass::text, 'USAGE'
           FROM pg_depend d JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
           WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
             -- (a serial's sequence: an identity column's needs no grant to number rows)
             AND d.deptype = 'a'
             AND d.refobjid IN (SELECT rel FROM wanted WHERE privilege = 'INSERT')
             -- CASE: the planner may ask before the join has kept sequences only.
             AND CASE WHEN s.relkind = 'S' THEN NOT has_sequence_privilege(s.oid, 'USAGE')
                      ELSE false END""",
        (tables, privileges),
    ).fetchall()
    if not rows:
        return []
    role = conn.execute("SELECT current_user").fetchone()
    lacks = "; ".join(f"{privilege} on {name}" for name, privilege in rows)
    return [
        ConfigError(
            "schema",
            f"role {role[0] if role else conn.info.user} lacks {lacks}: run sql/roles.sql"
            " again as the owner of the tables (after every 'sokratos-worker migrate' that"
            " adds one; docs/production.md §4)",
        )
    ]
