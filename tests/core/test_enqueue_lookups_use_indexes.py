"""An enqueue's lookups stay on their indexes, however many keys and outcomes are kept.

The queue triggers compared the text column ``queue`` with ``TG_TABLE_NAME`` (type name,
collation "C"), which no index on ``queue`` can serve: every enqueue read the key table's and
work_outcomes' indexes whole (PostgreSQL 15-17 scan every entry; 18 skips through them), so an
enqueue grew slower with every key and outcome ever recorded. And a plan cached in a long
session when the queue was empty kept a sequential scan of the queue for each id probed, so a
bulk enqueue (the spool import, ``failed retry --all``, a producer's pool) became quadratic.
The plans of every statement the enqueue functions and triggers run are read here with
auto_explain.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.support.db import explain_from_now_on

PAYLOAD = json.dumps({"exchange": "user: my sister moved to Porto\nassistant: noted"})
ARCHIVE = json.dumps({"archive_text": "user: I moved to Lisbon\nassistant: noted"})
OUR_TABLES = {"pending_triage", "pending_distillation", "sokratos_idempotency_keys", "work_outcomes"}
KEYED_BY_QUEUE = {"sokratos_idempotency_keys", "work_outcomes"}  # indexes led by `queue`


def _scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan] if plan.get("Relation Name") in OUR_TABLES else []
    for child in plan.get("Plans", []):
        nodes += _scans(child)
    return nodes


def test_every_lookup_of_an_enqueue_uses_its_index_in_full(db: psycopg.Connection) -> None:
    db.execute(
        "INSERT INTO sokratos_idempotency_keys (queue, key, item_id) SELECT q, 'old-' || g, g"
        " FROM generate_series(1, 5000) g, unnest(ARRAY['pending_triage', 'pending_distillation']) q"
    )
    db.execute(
        "INSERT INTO work_outcomes (queue, item_id, source, outcome) SELECT q, g, 'conversation',"
        " 'saved' FROM generate_series(1, 5000) g,"
        " unnest(ARRAY['pending_triage', 'pending_distillation']) q"
    )
    for queue in ("pending_triage", "pending_distillation"):
        db.execute(f"SELECT setval(pg_get_serial_sequence('{queue}', 'id'), 5001)")
    db.execute("ANALYZE")  # the queues analysed empty, as on a fresh install
    # A long session: the plans are cached while the queue grows past its statistics.
    for i in range(300):
        db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, %s)", (PAYLOAD, f"bulk-{i}"))
        db.execute(
            "INSERT INTO pending_distillation (payload, idempotency_key) VALUES (%s::jsonb, %s)",
            (ARCHIVE, f"direct-{i}"),
        )

    plans = explain_from_now_on(db, nested=True)
    db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, 'after-bulk')", (PAYLOAD,))
    db.execute(
        "INSERT INTO pending_distillation (payload, idempotency_key) VALUES (%s::jsonb, 'direct')",
        (ARCHIVE,),
    )
    db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, 'bulk-7')", (PAYLOAD,))  # a repeat

    scans = [(query, node) for query, plan in plans for node in _scans(plan)]
    tables = {node["Relation Name"] for _, node in scans}
    assert {"pending_triage", "pending_distillation", "sokratos_idempotency_keys",
            "work_outcomes"} <= tables, tables  # (the lookups were seen)
    for query, node in scans:
        where = f"{node['Node Type']} on {node['Relation Name']} for {' '.join(query.split())}"
        assert node["Node Type"] != "Seq Scan", where
        if node["Relation Name"] in KEYED_BY_QUEUE and "Index Name" in node:
            assert "queue =" in node.get("Index Cond", ""), (where, node.get("Index Cond"))
