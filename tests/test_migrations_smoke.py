"""The schema applies on an empty database and twice is a no-op."""

from __future__ import annotations

import psycopg

from sokratos_worker.store.migrations import apply_migrations, load_migrations


def test_migrations_apply_once(empty_database_url: str) -> None:
    first = apply_migrations(empty_database_url)
    second = apply_migrations(empty_database_url)
    assert first and not second
    assert len(first) == len(load_migrations())  # every migration, on the first run
    with psycopg.connect(empty_database_url) as conn:
        item = conn.execute(
            "SELECT sokratos_enqueue_triage('{\"exchange\": \"user: hi\\nassistant: hello\"}', 'k1')"
        ).fetchone()
        again = conn.execute(
            "SELECT sokratos_enqueue_triage('{\"exchange\": \"user: x\"}', 'k1')"
        ).fetchone()
        assert item is not None and item[0] is not None and item == again
        rows = conn.execute("SELECT id, payload->>'exchange' FROM pending_triage").fetchall()
        assert rows == [(item[0], "user: hi\nassistant: hello")]  # the first payload, once
