"""A `SOKRATOS_*` credential file (systemd LoadCredential=, named after the variable) that no
setting reads is a typo, reported as a variable of that name is: a misnamed
`SOKRATOS_DATABSE_URL` was ignored without a word, `check` said "configuration: valid", and
the worker ran on the embedded PostgreSQL instead of production (review R1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.operator import cli_env, run_cli

pytestmark = [pytest.mark.subprocess]


def test_check_names_a_misspelt_sokratos_credential(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    (creds / "SOKRATOS_DATABSE_URL").write_text("postgresql://sokratos@db.example.org/sokratos")
    (creds / "llm-api-key").write_text("sk-test")  # an api_key_file name: not a typo
    env = cli_env(tmp_path, CREDENTIALS_DIRECTORY=str(creds))

    result = run_cli(["check"], env)

    assert "FAIL  configuration" in result.stdout, result.stdout
    assert "SOKRATOS_DATABSE_URL" in result.stdout, result.stdout
    assert "llm-api-key" not in result.stdout + result.stderr


def test_other_commands_name_a_misspelt_sokratos_credential_on_stderr(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    (creds / "SOKRATOS_DATABSE_URL").write_text("postgresql://sokratos@db.example.org/sokratos")
    env = cli_env(tmp_path, CREDENTIALS_DIRECTORY=str(creds))

    result = run_cli(["status"], env)

    assert result.returncode == 0, result.stderr[-800:]
    assert "SOKRATOS_DATABSE_URL" in result.stderr, result.stderr[-800:]


def test_unknown_variables_lists_credentials_after_variables(tmp_path: Path) -> None:
    from sokratos_worker.config import unknown_variables

    creds = tmp_path / "credentials"
    creds.mkdir()
    for name in ("SOKRATOS_DATABASE_URL", "SOKRATOS_DATABASE_URL_FILE", "sokratos_lease", "pw"):
        (creds / name).write_text("x")
    env = {"SOKRATOS_LEASEE": "1", "CREDENTIALS_DIRECTORY": str(creds)}
    assert unknown_variables(env) == [
        "SOKRATOS_LEASEE",
        "$CREDENTIALS_DIRECTORY/SOKRATOS_DATABASE_URL_FILE",  # a credential is read as X only
        "$CREDENTIALS_DIRECTORY/sokratos_lease",  # read under its exact name only
    ]
    assert unknown_variables({"CREDENTIALS_DIRECTORY": str(tmp_path / "gone")}) == []


def test_a_credential_a_secret_file_setting_names_is_not_unknown(tmp_path: Path) -> None:
    """`api_key_file` and `password_file` may name a credential SOKRATOS_*: it is read, no typo
    (review R5: `check` failed on it)."""
    import json

    from sokratos_worker.config import load_settings, unknown_variables

    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "SOKRATOS_LLM_API_KEY").write_text("sk-test")
    (creds / "SOKRATOS_LLM_API_KEY_OLD").write_text("sk-old")
    backends = [{"name": "remote", "url": "http://127.0.0.1:9/v1", "model": "m",
                 "api_key_file": "SOKRATOS_LLM_API_KEY"}]  # fmt: skip
    env = {"SOKRATOS_LLM_BACKENDS": json.dumps(backends), "CREDENTIALS_DIRECTORY": str(creds)}
    settings = load_settings(env)
    assert unknown_variables(env, settings) == ["$CREDENTIALS_DIRECTORY/SOKRATOS_LLM_API_KEY_OLD"]


def test_status_does_not_call_a_read_credential_a_typo(tmp_path: Path) -> None:
    import json

    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    (creds / "SOKRATOS_IMAP_PASSWORD").write_text("app-password")
    accounts = [{"name": "personal", "host": "127.0.0.1", "port": 9, "username": "me",
                 "password_file": "SOKRATOS_IMAP_PASSWORD"}]  # fmt: skip
    env = cli_env(
        tmp_path, CREDENTIALS_DIRECTORY=str(creds), SOKRATOS_EMAIL_ACCOUNTS=json.dumps(accounts)
    )
    result = run_cli(["status"], env)
    assert result.returncode == 0, result.stderr[-800:]
    assert "unknown variables" not in result.stderr, result.stderr[-800:]
