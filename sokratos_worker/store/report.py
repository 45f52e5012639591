"""Read-only listings for the demo: what the queues still hold, the outcomes, the memories."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from sokratos_worker.model import Queue


@dataclass(frozen=True)
class OutcomeRow:
    """One ``work_outcomes`` row."""

    queue: str
    item_id: int
    source: str
    outcome: str
    memory_ids: tuple[int, ...]
    detail: str


@dataclass(frozen=True)
class MemoryRow:
    """The columns of a memory a person wants to see."""

    id: int
    summary: str
    salience: float
    memory_type: str
    source: str
    tags: tuple[str, ...]
    superseded_by: int | None


def pending_count(conninfo: str) -> int:
    """Items still waiting in either queue (ready or backing off)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        total = 0
        for queue in Queue:
            row = conn.execute(f"SELECT count(*) FROM {queue.value}").fetchone()
            total += int(row[0]) if row else 0
        return total


def outcomes(conninfo: str) -> list[OutcomeRow]:
    """Every recorded outcome, oldest first."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT queue, item_id, source, outcome, coalesce(memory_ids, '{}'),
                      coalesce(detail, '')
               FROM work_outcomes ORDER BY decided_at, queue, item_id"""
        ).fetchall()
    return [OutcomeRow(r[0], int(r[1]), r[2], r[3], tuple(r[4]), r[5]) for r in rows]


def memories(conninfo: str) -> list[MemoryRow]:
    """Every memory, oldest first."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT id, summary, coalesce(salience, 0), coalesce(memory_type, ''),
                      coalesce(source, ''), coalesce(tags, '{}'), superseded_by
               FROM memories ORDER BY id"""
        ).fetchall()
    return [MemoryRow(int(r[0]), r[1], float(r[2]), r[3], r[4], tuple(r[5]), r[6]) for r in rows]
