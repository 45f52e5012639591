"""The schema applies on an empty database and twice is a no-op."""

from __future__ import annotations

import psycopg

from sokratos_worker.store.migrations import apply_migrations


def test_migrations_apply_once(empty_database_url: str) -> None:
    first = apply_migrations(empty_database_url)
    second = apply_migrations(empty_database_url)
    assert first and not second
    with psycopg.connect(empty_database_url) as conn:
        item = conn.execute(
            "SELECT sokratos_enqueue_triage('{\"exchange\": \"user: hi\\nassistant: hello\"}', 'k1')"
        ).fetchone()
        again = conn.execute(
            "SELECT sokratos_enqueue_triage('{\"exchange\": \"user: x\"}', 'k1')"
        ).fetchone()
        assert item == again
