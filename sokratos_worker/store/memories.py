"""Reads and writes of ``memories`` and the tables the pipelines consult.

The write path runs inside the settle transaction opened by ``store.queue``: it must not
commit, and everything it inserts is keyed by ``origin`` so a replay writes nothing twice.
"""

from __future__ import annotations

import psycopg

from sokratos_worker.model import Effects


def write_effects(conn: psycopg.Connection, effects: Effects) -> tuple[int, ...]:
    """Insert ``effects.memories`` (idempotent by origin) and apply the supersessions.

    Returns the ids of every memory the item wrote (existing rows for origins already
    present), followed by ``effects.existing_memory_ids``. Runs in the caller's transaction.
    """
    ids: list[int] = []
    for memory in effects.memories:
        row = conn.execute(
            """INSERT INTO memories (summary, embedding, salience, tags, memory_type, entities,
                                     source, source_date, pipeline_id, origin, embedding_model)
               VALUES (%s, %s::vector, %s, %s, %s, %s, %s, %s, %s, %s, %s)
               ON CONFLICT (origin) WHERE origin IS NOT NULL DO NOTHING
               RETURNING id""",
            (
                memory.summary,
                _vector(memory.embedding),
                memory.salience,
                list(memory.tags),
                memory.memory_type,
                list(memory.entities) if memory.entities is not None else None,
                memory.source,
                memory.source_date,
                memory.pipeline_id,
                memory.origin,
                memory.embedding_model,
            ),
        ).fetchone()
        if row is None:
            row = conn.execute(
                "SELECT id FROM memories WHERE origin = %s", (memory.origin,)
            ).fetchone()
        assert row is not None  # noqa: S101 - inserted or already present
        ids.append(int(row[0]))
    by_origin = {m.origin: i for m, i in zip(effects.memories, ids, strict=True)}
    for supersession in effects.supersessions:
        conn.execute(
            "UPDATE memories SET superseded_by = %s WHERE id = %s AND superseded_by IS NULL",
            (by_origin[supersession.new_origin], supersession.old_memory_id),
        )
    return (*ids, *effects.existing_memory_ids)


def _vector(embedding: tuple[float, ...] | None) -> str | None:
    if embedding is None:
        return None
    return "[" + ",".join(repr(float(x)) for x in embedding) + "]"
