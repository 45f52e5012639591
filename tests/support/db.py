"""Small helpers to arrange and count rows in tests."""

from __future__ import annotations

import json
from typing import Any

import psycopg


def enqueue_many(
    conn: psycopg.Connection,
    n: int,
    *,
    behaviour: str = "ok",
    queue: str = "pending_triage",
    prefix: str = "k",
) -> list[int]:
    """Enqueue ``n`` items through the SQL function; returns their ids."""
    ids = []
    for i in range(n):
        payload: dict[str, Any] = (
            {"exchange": f"user: item {i}\nassistant: ok", "behaviour": behaviour}
            if queue == "pending_triage"
            else {"archive_text": f"archive {i}", "behaviour": behaviour}
        )
        fn = (
            "sokratos_enqueue_triage"
            if queue == "pending_triage"
            else "sokratos_enqueue_distillation"
        )
        row = conn.execute(
            f"SELECT {fn}(%s::jsonb, %s)", (json.dumps(payload), f"{prefix}{i}")
        ).fetchone()
        assert row is not None
        ids.append(int(row[0]))
    return ids


def count(conn: psycopg.Connection, query: str, *params: Any) -> int:
    """The single integer a COUNT query returns."""
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def outcomes(conn: psycopg.Connection, queue: str = "pending_triage") -> dict[int, str]:
    """item_id → outcome for every recorded outcome of ``queue``."""
    rows = conn.execute("SELECT item_id, outcome FROM work_outcomes WHERE queue = %s", (queue,))
    return {int(i): str(o) for i, o in rows}


def refuse_triage(
    conn: psycopg.Connection, *, subject: str | None, sqlstate: str = "22P05"
) -> None:
    """A trigger that makes PostgreSQL refuse triage items with ``sqlstate`` (only
    ``subject``'s, if given); the default, untranslatable character, is a refusal for the
    item's content, so the worker dead-letters and passes that mail."""
    when = "true" if subject is None else f"NEW.payload->>'subject' = '{subject}'"
    conn.execute(
        f"""CREATE FUNCTION refuse_item() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF {when} THEN
                    RAISE EXCEPTION 'refused by the test' USING ERRCODE = '{sqlstate}';
                END IF;
                RETURN NEW;
            END $$"""
    )
    conn.execute(
        "CREATE TRIGGER refuse_item BEFORE INSERT ON pending_triage"
        " FOR EACH ROW EXECUTE FUNCTION refuse_item()"
    )


def explain_from_now_on(
    conn: psycopg.Connection, *, nested: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    """Every statement ``conn`` runs from now on has its plan appended to the list returned,
    as (query text, plan) (auto_explain; ``nested``: statements inside functions too)."""
    plans: list[tuple[str, dict[str, Any]]] = []

    def keep(diagnostic: psycopg.errors.Diagnostic) -> None:
        text = diagnostic.message_primary or ""
        if "plan:" in text:
            found = json.loads(text.split("plan:", 1)[1])
            plans.append((found["Query Text"], found["Plan"]))

    conn.add_notice_handler(keep)
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_format = json")
    conn.execute("SET auto_explain.log_level = notice")
    if nested:
        conn.execute("SET auto_explain.log_nested_statements = on")
    return plans
