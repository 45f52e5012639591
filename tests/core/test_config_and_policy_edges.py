"""Edges of the configuration and the queue policy no other test pins: integer bounds, defaults,
secret precedence, the connection check's boundary, how long a queue found empty is passed over,
and the one line an error is recorded as."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.checks import connections_line
from sokratos_worker.config import ConfigError, load_settings
from sokratos_worker.errors import ItemError
from sokratos_worker.model import Queue
from sokratos_worker.policy import describe
from sokratos_worker.queue_shares import QueueShares

T, D = Queue.TRIAGE, Queue.DISTILLATION


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SOKRATOS_MAX_ATTEMPTS", "0"),
        ("SOKRATOS_MAX_ATTEMPTS", "101"),
        ("SOKRATOS_CONCURRENCY", "0"),
        ("SOKRATOS_CONCURRENCY", "257"),
        ("SOKRATOS_PROCESSED_EMAILS_TTL_DAYS", "0"),
        ("SOKRATOS_PROCESSED_EMAILS_TTL_DAYS", "36501"),
        ("SOKRATOS_FAILED_OPS_TTL_DAYS", "36501"),
        ("SOKRATOS_METRICS_ADDR", "127.0.0.1:0"),
        ("SOKRATOS_METRICS_ADDR", "127.0.0.1:65536"),
    ],
)
def test_integers_outside_their_range_are_refused_naming_the_variable(
    variable: str, value: str
) -> None:
    """A count the contract gives no meaning for (0 attempts, port 0, …) is exit 78, not run."""
    with pytest.raises(ConfigError) as info:
        load_settings({variable: value})
    assert info.value.variable == variable


def test_the_integer_bounds_themselves_are_accepted() -> None:
    """The largest values each integer setting takes, and 0 where the contract says what it means."""
    s = load_settings(
        {
            "SOKRATOS_MAX_ATTEMPTS": "100",
            "SOKRATOS_CONCURRENCY": "256",
            "SOKRATOS_PROCESSED_EMAILS_TTL_DAYS": "36500",
            "SOKRATOS_FAILED_OPS_TTL_DAYS": "36500",
            "SOKRATOS_METRICS_ADDR": "127.0.0.1:65535",
        }
    )
    assert (s.max_attempts, s.concurrency, s.processed_emails_ttl_days) == (100, 256, 36500)
    assert s.metrics_addr == "127.0.0.1:65535"
    s = load_settings({"SOKRATOS_MAX_ATTEMPTS": "1", "SOKRATOS_FAILED_OPS_TTL_DAYS": "0"})
    assert (s.max_attempts, s.failed_ops_ttl_days) == (1, 0)


_ACCOUNT = json.dumps([{"name": "a", "host": "127.0.0.1", "username": "u", "password": "p"}])


@pytest.mark.parametrize(
    ("env", "need"),
    [({}, 9), ({"SOKRATOS_EMAIL_ACCOUNTS": _ACCOUNT}, 10)],
)
def test_check_accepts_a_connection_limit_of_exactly_the_workers_need(
    db: psycopg.Connection, database_url: str, env: dict[str, str], need: int
) -> None:
    """`check` passes a role limit equal to what a worker opens (mail adds one), fails one below."""
    settings = load_settings({"SOKRATOS_DATABASE_URL": database_url, **env})
    assert settings.connections_needed == need
    role = "edges_limited"
    db.execute(f"DROP ROLE IF EXISTS {role}")
    db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'test-only-password'")
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info.update(user=role, password="test-only-password")
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    lines = {}
    try:
        for limit in (need, need - 1):
            db.execute(f"ALTER ROLE {role} CONNECTION LIMIT {limit}")
            with psycopg.connect(url, autocommit=True) as conn:
                lines[limit] = connections_line(settings, conn)
    finally:
        db.execute(f"DROP ROLE IF EXISTS {role}")
    assert lines[need].ok, lines[need]
    assert f"opens up to {need}" in lines[need].detail
    assert not lines[need - 1].ok, lines[need - 1]
    assert f"role {role} has CONNECTION LIMIT {need - 1}" in lines[need - 1].detail


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_queue_found_empty_is_passed_over_for_one_second() -> None:
    """A settle avoids a queue found empty for one second (the module's promise), not longer."""
    clock = Clock()
    shares = QueueShares([T, D], clock)
    shares.found_empty(D)
    clock.now += 0.9
    assert shares.for_settle(T, Counter({T: 1})) is T
    clock.now += 0.2
    assert shares.for_settle(T, Counter({T: 1})) is D


def test_an_explicit_variable_wins_without_its_file_being_read(tmp_path: Path) -> None:
    """``X`` beside an ``X_FILE`` that cannot be read (a stale path) is used; the file is not read."""
    url = "postgresql://u@db.example/sokratos"
    s = load_settings(
        {
            "SOKRATOS_DATABASE_URL": url,
            "SOKRATOS_DATABASE_URL_FILE": str(tmp_path / "gone"),
            "SOKRATOS_LLM_BACKENDS_FILE": str(tmp_path / "gone-too"),
            "SOKRATOS_LLM_BACKENDS": "[]",
        }
    )
    assert s.database_url is not None and s.database_url.get_secret_value() == url
    assert s.llm_backends == []


def test_the_first_of_several_state_directories_is_the_data_dir(tmp_path: Path) -> None:
    """systemd passes every StateDirectory= colon-separated: the worker's is the first."""
    first, second = tmp_path / "first", tmp_path / "second"
    url = "postgresql://u@db.example/sokratos"  # (the embedded server's socket is not at issue)
    s = load_settings({"STATE_DIRECTORY": f"{first}:{second}", "SOKRATOS_DATABASE_URL": url})
    assert s.data_dir == first
    assert s.spool_dir == first / "spool"


def test_the_defaults_the_other_defaults_test_leaves_out_follow_the_contract() -> None:
    """SOKRATOS_STARTUP_TIMEOUT 60s, SOKRATOS_MIGRATE_ON_START true, SOKRATOS_LOG_LEVEL info."""
    s = load_settings({})
    assert (s.startup_timeout, s.migrate_on_start, s.log_level) == (60, True, "info")


def test_an_error_of_several_lines_is_recorded_as_its_first_line() -> None:
    """last_error and failed_operations get one line: a traceback-like text keeps only its first."""
    error = RuntimeError("connection reset\n  File 'x.py', line 1\n    raise")
    assert describe(error) == "RuntimeError: connection reset"
    assert describe(ItemError("backend said no\nbody: <html>")) == "backend said no"
