"""Configuration: durations, _FILE and credentials, and exit 78 without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sokratos_worker.config import ConfigError, load_settings, parse_duration, unknown_variables

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("5m", 300),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("1d", 86400),
        (2.5, 2.5),
    ],
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "1x", "-5", "m5", "5mm"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_defaults_follow_the_contract() -> None:
    s = load_settings({})
    assert (s.heartbeat_interval, s.tick_budget, s.max_attempts, s.lease) == (60, 300, 3, 300)
    assert (s.retry_base, s.retry_max, s.concurrency, s.shutdown_grace) == (30, 1800, 4, 30)
    assert (s.email_check_interval, s.email_initial_lookback) == (300, 86400)
    assert s.database_url is None and s.llm_backends == [] and not s.local_model
    assert (s.failed_ops_ttl_days, s.processed_emails_ttl_days) == (0, 90)


def test_file_and_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "url").write_text("postgresql://from-file/db\n")
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://from-creds/db")
    (creds / "key").write_text("sk-secret")
    backends = (
        '[{"name": "a", "url": "http://127.0.0.1:1/v1", "model": "m", "api_key_file": "key"}]'
    )
    env = {"CREDENTIALS_DIRECTORY": str(creds), "SOKRATOS_LLM_BACKENDS": backends}
    s = load_settings(env)
    assert (
        s.database_url is not None
        and s.database_url.get_secret_value() == "postgresql://from-creds/db"
    )
    assert (
        s.llm_backends[0].api_key is not None
        and s.llm_backends[0].api_key.get_secret_value() == "sk-secret"
    )
    s = load_settings({**env, "SOKRATOS_DATABASE_URL_FILE": str(tmp_path / "url")})
    assert (
        s.database_url is not None
        and s.database_url.get_secret_value() == "postgresql://from-file/db"
    )
    s = load_settings({**env, "DATABASE_URL": "postgresql://explicit/db"})
    assert (
        s.database_url is not None
        and s.database_url.get_secret_value() == "postgresql://explicit/db"
    )


@pytest.mark.parametrize(
    ("env", "variable", "words"),
    [
        ({"SOKRATOS_LEASE": "soon"}, "SOKRATOS_LEASE", "not a duration"),
        ({"SOKRATOS_LEASE": "0"}, "SOKRATOS_LEASE", "greater than 0"),
        ({"SOKRATOS_CONCURRENCY": "-1"}, "SOKRATOS_CONCURRENCY", "greater than or equal to 1"),
        ({"SOKRATOS_LLM_BACKENDS": "[{"}, "SOKRATOS_LLM_BACKENDS", "JSON"),
        (
            {"SOKRATOS_LLM_BACKENDS": '[{"name": "a", "url": "ftp://x", "model": "m"}]'},
            "SOKRATOS_LLM_BACKENDS[0].url",
            "http",
        ),
        (
            {"SOKRATOS_EMAIL_ACCOUNTS": '[{"name": "a", "host": "h", "username": "u"}]'},
            "SOKRATOS_EMAIL_ACCOUNTS[0]",
            "password",
        ),
        ({"SOKRATOS_LOG_LEVEL": "loud"}, "SOKRATOS_LOG_LEVEL", "debug"),
        ({"SOKRATOS_SHUTDOWN_GRACE": "0"}, "SOKRATOS_SHUTDOWN_GRACE", "greater than 0"),
        ({"SOKRATOS_WORKER_INSTANCE": "a"}, "SOKRATOS_DATABASE_URL", "sokratos-worker@a"),
        (
            {"SOKRATOS_RETRY_BASE": "5m", "SOKRATOS_RETRY_MAX": "1m"},
            "SOKRATOS_RETRY_MAX",
            "smaller than SOKRATOS_RETRY_BASE",
        ),
        (
            {"SOKRATOS_EMBEDDING_URL": "http://127.0.0.1:1/v1"},
            "SOKRATOS_EMBEDDING_URL",
            "needs SOKRATOS_EMBEDDING_MODEL",
        ),
        (
            {"SOKRATOS_DATABASE_URL_FILE": "/nonexistent/x"},
            "SOKRATOS_DATABASE_URL_FILE",
            "cannot read",
        ),
        (
            {"SOKRATOS_DATABASE_URL_FILE": "db-url"},  # a LoadCredential= name, outside systemd
            "SOKRATOS_DATABASE_URL_FILE",
            "$CREDENTIALS_DIRECTORY is not set",
        ),
        (
            {"SOKRATOS_EMBEDDING_DIM": "2560"},
            "SOKRATOS_EMBEDDING_URL",
            "is required when SOKRATOS_EMBEDDING_MODEL or SOKRATOS_EMBEDDING_DIM is set",
        ),
        (
            {"SOKRATOS_DATABASE_URL": "postgresql://x:s3cret@localhost:5432x/db"},
            "SOKRATOS_DATABASE_URL",
            "has a port that is not a number",
        ),
    ],
)
def test_invalid_configuration_names_the_variable(
    env: dict[str, str], variable: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert info.value.variable == variable
    assert words in info.value.message
    assert "s3cret" not in str(info.value)


def test_invalid_configuration_exits_78_in_one_line_without_traceback() -> None:
    env = {**os.environ, "SOKRATOS_LEASE": "soon", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 78
    assert proc.stderr.strip().count("\n") == 0
    assert "SOKRATOS_LEASE" in proc.stderr and "Traceback" not in proc.stderr


def test_an_empty_database_url_means_the_embedded_server() -> None:
    assert load_settings({"SOKRATOS_DATABASE_URL": ""}).uses_embedded_postgres
    assert load_settings({"DATABASE_URL": "  "}).uses_embedded_postgres


def test_unknown_variables_are_the_names_no_setting_reads() -> None:
    env = {
        "SOKRATOS_CONCURENCY": "8",  # a typo
        "SOKRATOS_LEASE": "5m",
        "SOKRATOS_DATABASE_URL_FILE": "/run/x",
        "SOKRATOS_TEST_DATABASE_URL": "postgresql://",
        "PATH": "/usr/bin",
    }
    assert unknown_variables(env) == ["SOKRATOS_CONCURENCY"]
