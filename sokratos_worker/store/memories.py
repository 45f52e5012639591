"""Reads and writes of ``memories`` and the tables the pipelines consult.

The write path runs inside the settle transaction opened by ``store.queue``: it must not
commit, and everything it inserts is keyed by ``origin`` so a replay writes nothing twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog

from sokratos_worker.model import Effects, Item, NewMemory
from sokratos_worker.store.connection import Database

log = structlog.get_logger(__name__)

# Sokratos's reads skip these types: identity and reflections are not compared or superseded.
_COVERAGE_EXCLUDED = ("identity", "reflection")


# Settles that may write a near-duplicate take turns until they commit: the handlers' own
# check runs outside any transaction, so two slots with the same fact would both pass it.
_DUPLICATE_WRITE_LOCK = 0x50C_D0_0B
NEAR_DUPLICATE_DISTANCE = 0.05
NEAR_DUPLICATE_WINDOW_S = 3600.0
FACT_DUPLICATE_DISTANCE = 0.15  # distillation: any memory this close is a known fact


@dataclass(frozen=True)
class Written:
    """What ``write_effects`` did: the item's memory ids, and the drafts it dropped."""

    memory_ids: tuple[int, ...]
    new: int  # memories written (or found written by an earlier attempt of the item)
    duplicate_of: tuple[int, ...] = ()  # live memories that made drafts redundant meanwhile


def write_effects(conn: psycopg.Connection, effects: Effects) -> Written:
    """Insert ``effects.memories`` (idempotent by origin) and apply the supersessions, of
    saved memories and of the item's own earlier facts.

    A draft whose first chunk asks for it (``duplicate_check``) is dropped, with its other
    chunks, when a near-duplicate was committed since the handler checked. In the
    supersessions, that memory stands for the dropped draft (if live and not identity, as the
    contradiction check's candidates are): it says the same, so the contradiction the draft
    resolved stays resolved. The memory ids are those written (existing rows for origins
    already present), then ``effects.existing_memory_ids``, then the near-duplicates. Runs in
    the caller's transaction.
    """
    if any(m.duplicate_check and m.embedding is not None for m in effects.memories):
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DUPLICATE_WRITE_LOCK,))
    by_origin: dict[str, int] = {}
    replaced: dict[str, int] = {}  # a dropped draft's origins: the memory that made it redundant
    duplicates: list[int] = []
    duplicate: int | None = None
    for memory in effects.memories:
        if memory.duplicate_check:
            duplicate = _duplicate_at_settle(conn, memory)
            if duplicate is not None:
                duplicates.append(duplicate)
        if duplicate is None:
            by_origin[memory.origin] = _insert(conn, memory)
        else:
            replaced[memory.origin] = duplicate
    _apply_supersessions(conn, effects, by_origin, _stand_ins(conn, replaced))
    ids = (*by_origin.values(), *effects.existing_memory_ids, *duplicates)
    return Written(memory_ids=ids, new=len(by_origin), duplicate_of=tuple(duplicates))


def _apply_supersessions(
    conn: psycopg.Connection,
    effects: Effects,
    by_origin: dict[str, int],
    stand_ins: dict[str, int],
) -> None:
    """Apply the supersessions of saved memories and of the item's earlier facts, those of
    the memories written first: a stand-in supersedes only what none of them superseded."""
    written = {**stand_ins, **by_origin}
    pairs: list[tuple[int | None, int | None]] = [
        (s.old_memory_id, written.get(s.new_origin)) for s in effects.supersessions
    ]
    pairs += [
        (written.get(s.old_origin), written.get(s.new_origin)) for s in effects.draft_supersessions
    ]
    own = set(by_origin.values())
    for old, new in sorted(pairs, key=lambda pair: pair[1] not in own):
        if old is not None and new is not None and old != new:
            _supersede(conn, old, new)


def _stand_ins(conn: psycopg.Connection, replaced: dict[str, int]) -> dict[str, int]:
    """The dropped origins whose memory may supersede and be superseded: a live one, not an
    identity (the fact check also drops a draft for a superseded or identity memory)."""
    if not replaced:
        return {}
    live = {
        int(row[0])
        for row in conn.execute(
            """SELECT id FROM memories
               WHERE id = ANY(%s) AND superseded_by IS NULL AND memory_type <> 'identity'""",
            (list(set(replaced.values())),),
        )
    }
    return {origin: memory_id for origin, memory_id in replaced.items() if memory_id in live}


def _supersede(conn: psycopg.Connection, old_id: int, new_id: int) -> None:
    """Mark ``old_id`` superseded by ``new_id``, unless something superseded it first."""
    conn.execute(
        "UPDATE memories SET superseded_by = %s WHERE id = %s AND superseded_by IS NULL",
        (new_id, old_id),
    )


def archive_already_saved(
    conn: psycopg.Connection,
    item: Item,
    archive: Sequence[NewMemory],
    *,
    replay_of: int | None,
) -> tuple[tuple[NewMemory, ...], tuple[int, ...]]:
    """``archive`` split into the chunks still to write and the ids of those already saved.

    A dead-lettered item that ``failed retry`` replays is a new item with new origins: when
    it fails again, its raw archive would be saved a second time. The replay holds its
    predecessor's payload byte for byte, and an archive is written whole in one transaction,
    so when any item of its replay chain archived it, those memories are the archive: all
    are reused and none written. Their text is not compared: the header names another time,
    and another version of the worker (or its host's zone) cuts other pieces. The chain is
    followed only along the links ``failed retry`` made (``replay_of``, the item's own, then
    its predecessors' outcomes; failed_operations.retried_as for replays enqueued before
    migration 0044), never along a key's shape: keys are the producer's to choose.
    """
    params = {"queue": item.queue.value, "id": item.id, "replay_of": replay_of}
    earlier = tuple(int(memory_id) for (memory_id,) in conn.execute(_EARLIER_ARCHIVES, params))
    return ((), earlier) if earlier else (tuple(archive), ())


# The archive memories of the items this one replays, walked back from the item's own
# ``replay_of`` (%(replay_of)s) through each earlier item's dead-letter outcome, kept for
# good, and through failed_operations rows whose retry became the next item (the only link
# of replays enqueued before migration 0044; pruning those rows leaves the outcomes' links).
# UNION stops cycles. Each step is an index probe: work_outcomes (queue, item_id) and
# failed_operations (source_queue, retried_as). Each memory is listed once, however many
# items of the chain listed it.
_EARLIER_ARCHIVES = """
WITH RECURSIVE earlier (item_id) AS (
    SELECT %(replay_of)s::bigint WHERE %(replay_of)s::bigint IS NOT NULL
  UNION
    SELECT f.item_id FROM failed_operations f
    WHERE f.source_queue = %(queue)s AND f.retried_as = %(id)s AND f.item_id IS NOT NULL
  UNION
    SELECT back.item_id FROM earlier e
    CROSS JOIN LATERAL (
        SELECT o.replay_of FROM work_outcomes o
        WHERE o.queue = %(queue)s AND o.item_id = e.item_id AND o.replay_of IS NOT NULL
      UNION ALL
        SELECT f.item_id FROM failed_operations f
        WHERE f.source_queue = %(queue)s AND f.retried_as = e.item_id AND f.item_id IS NOT NULL
    ) AS back (item_id)
)
SELECT m.id FROM memories m
WHERE m.id IN (
    SELECT saved.id FROM earlier e
    JOIN work_outcomes o ON o.queue = %(queue)s AND o.item_id = e.item_id
                        AND o.outcome = 'archived' AND o.item_id <> %(id)s
    CROSS JOIN LATERAL unnest(o.memory_ids) AS saved (id))
ORDER BY m.id"""


def _insert(conn: psycopg.Connection, memory: NewMemory) -> int:
    """The memory's id: inserted, or the row an earlier attempt wrote under its origin."""
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
        row = conn.execute("SELECT id FROM memories WHERE origin = %s", (memory.origin,)).fetchone()
    assert row is not None  # noqa: S101 - inserted or already present
    return int(row[0])


def _duplicate_at_settle(conn: psycopg.Connection, memory: NewMemory) -> int | None:
    """A memory another item committed that makes ``memory`` redundant: a near-duplicate, or
    for a distilled fact (``fact_check``) any memory within 0.15. The item's own memories
    (written by an earlier attempt, or earlier in this settle) and raw archives are not
    counted."""
    if memory.embedding is None:
        return None
    params = {
        **_vector_params(memory.embedding, memory.embedding_model),
        "window": NEAR_DUPLICATE_WINDOW_S,
        "own": memory.origin.rsplit(":", 1)[0] + ":%",
    }
    others = " AND (m.origin IS NULL OR m.origin NOT LIKE %(own)s)"
    row = conn.execute(
        _NEAR_DUPLICATE + others + _NEAREST, {**params, "max": NEAR_DUPLICATE_DISTANCE}
    ).fetchone()
    if row is None and memory.fact_check:
        row = conn.execute(
            _ANY_MEMORY + others + _NEAREST, {**params, "max": FACT_DUPLICATE_DISTANCE}
        ).fetchone()
    return int(row[0]) if row is not None else None


def _vector(embedding: tuple[float, ...] | None) -> str | None:
    if embedding is None:
        return None
    return "[" + ",".join(repr(float(x)) for x in embedding) + "]"


@dataclass(frozen=True)
class MemorySnippet:
    """A live memory offered to the contradiction check."""

    id: int
    summary: str
    distance: float = 0.0  # from the vector it was found near


# The cosine distance to %(vec)s, or NULL for rows embedded by another model or dimension
# (pgvector refuses ``<=>`` across dimensions, and CASE keeps it from being evaluated).
_DISTANCE = """(CASE WHEN m.embedding IS NOT NULL
                      AND vector_dims(m.embedding) = %(dim)s
                      AND (m.embedding_model IS NULL OR m.embedding_model = %(model)s)
                 THEN m.embedding <=> %(vec)s::vector END)"""


# Every dedupe query leaves out raw archives (a failed distillation's conversation_archive
# chunks): one holds the words, not the facts, and a replay that now distils the conversation
# found its facts "known" (or near-duplicates) by the archive its own failure saved, so they
# were never saved.
_NOT_RAW_ARCHIVE = "m.source IS DISTINCT FROM 'conversation_archive'"
# A live, non-identity memory within %(max)s written in the last %(window)s seconds.
_NEAR_DUPLICATE = f"""SELECT m.id FROM memories m
    WHERE m.superseded_by IS NULL AND m.memory_type <> 'identity' AND {_NOT_RAW_ARCHIVE}
      AND m.created_at > now() - make_interval(secs => %(window)s)
      AND {_DISTANCE} < %(max)s"""
# Any memory at all within %(max)s (superseded and identity included): a known fact.
_ANY_MEMORY = f"""SELECT m.id FROM memories m
    WHERE {_NOT_RAW_ARCHIVE} AND {_DISTANCE} < %(max)s"""
_NEAREST = f" ORDER BY {_DISTANCE} LIMIT 1"


def _vector_params(vec: Sequence[float], model: str | None) -> dict[str, Any]:
    return {"vec": _vector(tuple(vec)), "dim": len(vec), "model": model}


class MemoryReader:
    """The read queries of the pipelines. A database outage, or a full pool, is raised: decided
    on a fallback (a default threshold, no contradiction check), the item would be recorded so
    for good; the settle decides whether the attempt is given back (a probe finds the database
    away) or is the item's. Any other database error (a table or a privilege missing) would
    meet every item alike: it is logged and the read falls back."""

    def __init__(self, database: Database, *, embedding_model: str | None) -> None:
        self.database = database
        self.embedding_model = embedding_model

    def adaptive_param(self, key: str, default: float) -> float:
        """``adaptive_params.value`` for ``key``; the default on no row, a table or privilege
        missing, or a value that is not a finite number (NaN passes every "salience <
        threshold" test). A database outage or a full pool is raised (see the class)."""
        rows = self._read(
            "adaptive_param",
            "SELECT value FROM adaptive_params WHERE key = %(key)s",
            {"key": key},
            fallback=[],
        )
        if not rows or rows[0][0] is None:
            return default
        value = float(rows[0][0])
        if not math.isfinite(value):
            log.warning("adaptive_param_ignored", key=key, value=str(value), default=default)
            return default
        return value

    def coverage_count(self, vec: Sequence[float], max_distance: float = 0.3) -> int:
        """How many live memories (not identity/reflection) lie within ``max_distance``."""
        rows = self._read(
            "coverage_count",
            f"""SELECT count(*) FROM memories m
                WHERE m.superseded_by IS NULL AND m.memory_type <> ALL(%(excluded)s)
                  AND {_DISTANCE} < %(max)s""",
            {**self._vec(vec), "excluded": list(_COVERAGE_EXCLUDED), "max": max_distance},
            fallback=[(0,)],
        )
        return int(rows[0][0])

    def near_duplicate(
        self,
        vec: Sequence[float],
        max_distance: float = NEAR_DUPLICATE_DISTANCE,
        window_s: float = NEAR_DUPLICATE_WINDOW_S,
    ) -> int | None:
        """A live, non-identity memory within ``max_distance`` written in the last hour (not a
        raw archive)."""
        rows = self._read(
            "near_duplicate",
            _NEAR_DUPLICATE + _NEAREST,
            {**self._vec(vec), "max": max_distance, "window": window_s},
            fallback=[],
        )
        return int(rows[0][0]) if rows else None

    def similar_live(
        self, vec: Sequence[float], max_distance: float = 0.4, limit: int = 3
    ) -> list[MemorySnippet]:
        """The nearest live, non-identity memories within ``max_distance``, nearest first;
        not a raw archive, which holds a conversation's words, not a claim to contradict (a
        replayed distillation's fact would be judged against, and could supersede, the very
        archive its failure saved)."""
        rows = self._read(
            "similar_live",
            f"""SELECT m.id, m.summary, {_DISTANCE} FROM memories m
                WHERE m.superseded_by IS NULL AND m.memory_type <> 'identity'
                  AND {_NOT_RAW_ARCHIVE} AND {_DISTANCE} < %(max)s
                ORDER BY {_DISTANCE}, m.id LIMIT %(limit)s""",
            {**self._vec(vec), "max": max_distance, "limit": limit},
            fallback=[],
        )
        return [MemorySnippet(int(r[0]), str(r[1]), float(r[2])) for r in rows]

    def known_fact_id(
        self, vec: Sequence[float], max_distance: float = FACT_DUPLICATE_DISTANCE
    ) -> int | None:
        """The nearest memory (superseded and identity included, not a raw archive) this close:
        the outcome names it, as the settle's own re-check does."""
        rows = self._read(
            "known_fact_id",
            _ANY_MEMORY + _NEAREST,
            {**self._vec(vec), "max": max_distance},
            fallback=[],
        )
        return int(rows[0][0]) if rows else None

    def preference_traits(self) -> list[tuple[str, str]]:
        """The user's ``preference`` traits by key; empty when Sokratos's table is absent."""
        present = self._read(
            "preference_traits",
            "SELECT to_regclass('personality_traits') IS NOT NULL",
            {},
            fallback=[(False,)],
        )
        if not present[0][0]:
            return []
        rows = self._read(
            "preference_traits",
            """SELECT trait_key, trait_value FROM personality_traits
               WHERE category = 'preference' ORDER BY trait_key""",
            {},
            fallback=[],
        )
        return [(str(r[0]), str(r[1])) for r in rows]

    def _vec(self, vec: Sequence[float]) -> dict[str, Any]:
        return _vector_params(vec, self.embedding_model)

    def _read(
        self, query: str, sql: str, params: dict[str, Any], *, fallback: list[Any]
    ) -> list[Any]:
        """Run one read; on a database error that is not DatabaseUnavailable (a table or a
        privilege missing), log it and return ``fallback``. DatabaseUnavailable (an outage, a
        full pool, an error the server gave this query: its backend killed, out of memory, a
        deadlock) is raised, never decided on the fallback: the settle gives the attempt back
        when a probe finds the database away, else it is the item's (retried, then
        failed_operations), so a read that fails every time cannot run for ever."""
        try:
            with self.database.connection() as conn:
                return list(conn.execute(sql, params).fetchall())
        except psycopg.Error as exc:  # (DatabaseUnavailable is not one: it passes)
            self._failed(query, exc)
            return fallback

    def _failed(self, query: str, exc: Exception) -> None:
        log.warning(
            "memory_read_failed",
            query=query,
            error=f"{type(exc).__name__}: {str(exc).strip()}"[:300],
            hint="the item is handled without this read (fewer memories to compare with,"
            " or a default threshold): fix the database error above",
        )


# How many embedded memories the configuration check reads at most: each read fetches the
# vector from TOAST (6 KB at 1536 dimensions), and nothing indexes the model or dimension.
EMBEDDINGS_COUNTED = 10_000


@dataclass(frozen=True)
class EmbeddingGroup:
    """Embedded memories of one model (None: not recorded) and dimension, and how many."""

    model: str | None
    dimension: int
    count: int


def embedding_groups(conn: psycopg.Connection) -> tuple[list[EmbeddingGroup], bool]:
    """The (model, dimension) of the oldest EMBEDDINGS_COUNTED embedded memories, by the
    primary key, and whether there were that many (the rest not counted): the oldest are
    the ones a change of model leaves behind."""
    rows = conn.execute(
        """SELECT embedding_model, vector_dims(embedding), count(*)
           FROM (SELECT embedding_model, embedding FROM memories
                 WHERE embedding IS NOT NULL ORDER BY id LIMIT %(bound)s) AS oldest
           GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2""",
        {"bound": EMBEDDINGS_COUNTED},
    ).fetchall()
    groups = [EmbeddingGroup(r[0], int(r[1]), int(r[2])) for r in rows]
    return groups, sum(g.count for g in groups) >= EMBEDDINGS_COUNTED
