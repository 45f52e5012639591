"""The environment as a deployment leaves it: blank values, empty credential files, and libpq's
own PG* variables, through the real configuration loading and the real command line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.config import ConfigError, load_settings
from tests.support.db import count

ROOT = Path(__file__).resolve().parents[2]
BLANKS = ["  ", "\t", " \n"]
EXCHANGE = "user: which port is prod on?\nassistant: 5432"


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command with only ``env`` (no SOKRATOS_* or PG* variable of the machine running the
    tests), logs as JSON lines."""
    base = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "SOKRATOS_LOG_FORMAT": "json",
    }
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _refusal(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    return info.value


def _events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _plain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]


# -- 1. a blank value is unset --------------------------------------------------------------


@pytest.mark.parametrize("blank", BLANKS)
@pytest.mark.parametrize("variable", ["SOKRATOS_DATABASE_URL", "DATABASE_URL"])
def test_a_blank_database_url_does_not_hide_the_credential(
    tmp_path: Path, variable: str, blank: str
) -> None:
    """`SOKRATOS_DATABASE_URL="  "` in an env file is unset, as `SOKRATOS_DATABASE_URL=` is:
    the credential is used, not silently the embedded PostgreSQL."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://u@db.example.org/sokratos\n")
    s = load_settings({"CREDENTIALS_DIRECTORY": str(creds), variable: blank})
    assert not s.uses_embedded_postgres
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u@db.example.org/sokratos"


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_variable_or_file_variable_falls_through_to_the_next_place(
    tmp_path: Path, blank: str
) -> None:
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://u@from-file.example.org/sokratos")
    backends = '[{"name": "a", "url": "http://127.0.0.1:1/v1", "model": "m"}]'
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_LLM_BACKENDS").write_text(backends)
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://u@from-creds.example.org/x")
    s = load_settings(
        {
            "CREDENTIALS_DIRECTORY": str(creds),
            "SOKRATOS_DATABASE_URL": blank,
            "SOKRATOS_DATABASE_URL_FILE": str(url_file),
            "SOKRATOS_LLM_BACKENDS": blank,
            "SOKRATOS_LLM_BACKENDS_FILE": blank,
        }
    )
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u@from-file.example.org/sokratos"
    assert [b.name for b in s.llm_backends] == ["a"]
    # A blank X_FILE is unset too: not a file named "  " that cannot be read.
    s = load_settings({"CREDENTIALS_DIRECTORY": str(creds), "SOKRATOS_DATABASE_URL_FILE": blank})
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u@from-creds.example.org/x"


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_variable_means_its_default(blank: str) -> None:
    s = load_settings(
        {
            "SOKRATOS_LEASE": blank,
            "SOKRATOS_LOG_FORMAT": blank,
            "SOKRATOS_MAX_ATTEMPTS": blank,
            "SOKRATOS_EMBEDDING_URL": blank,
            "SOKRATOS_DATABASE_URL_FILE": blank,
            "CREDENTIALS_DIRECTORY": blank,
        }
    )
    assert (s.lease, s.log_format, s.max_attempts) == (300, None, 3)
    assert not s.embeddings_enabled and s.uses_embedded_postgres


@pytest.mark.parametrize("content", ["", "\n", "  \n", "\t"])
def test_an_empty_secret_file_is_refused_not_taken_for_the_default(
    tmp_path: Path, content: str
) -> None:
    """An empty database URL credential (provisioning that failed) would otherwise mean the
    embedded PostgreSQL instead of production, without a word."""
    creds = tmp_path / "creds"
    creds.mkdir()
    credential = creds / "SOKRATOS_DATABASE_URL"
    credential.write_text(content)
    error = _refusal({"CREDENTIALS_DIRECTORY": str(creds)})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert error.message == (
        f"{str(credential)!r} is empty: write the value into it, or remove the credential for"
        " the default"
    )
    error = _refusal({"SOKRATOS_LEASE_FILE": str(credential)})
    assert error.variable == "SOKRATOS_LEASE_FILE"
    assert error.message == (
        f"{str(credential)!r} is empty: write the value into it, or unset SOKRATOS_LEASE_FILE"
        " for the default"
    )


def test_an_empty_database_url_credential_exits_78_naming_it(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("\n")
    data = tmp_path / "data"
    env = {
        "CREDENTIALS_DIRECTORY": str(creds),
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(data),
    }
    proc = cli("status", env=env)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert _plain_lines(proc.stderr) == [
        f"sokratos-worker: invalid configuration: SOKRATOS_DATABASE_URL:"
        f" {str(creds / 'SOKRATOS_DATABASE_URL')!r} is empty: write the value into it, or"
        " remove the credential for the default"
    ]
    assert not (data / "postgres").exists(), "the embedded PostgreSQL was started"


@pytest.mark.postgres
@pytest.mark.parametrize("blank", ["  ", "\t"])
@pytest.mark.parametrize("given_as", ["credential", "file"])
def test_a_blank_database_url_in_the_env_file_still_uses_the_database_of_the_secret(
    db: psycopg.Connection, database_url: str, tmp_path: Path, given_as: str, blank: str
) -> None:
    """The end of the story: the commands really connect to the database the credential or
    SOKRATOS_DATABASE_URL_FILE names (the test PostgreSQL); the embedded one never starts."""
    secret = tmp_path / "creds" / "SOKRATOS_DATABASE_URL"
    secret.parent.mkdir()
    secret.write_text(database_url + "\n")
    data = tmp_path / "data"
    env = {
        "SOKRATOS_DATABASE_URL": blank,
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(data),
        "SOKRATOS_STARTUP_TIMEOUT": "5s",
    }
    if given_as == "credential":
        env["CREDENTIALS_DIRECTORY"] = str(secret.parent)
    else:
        env["SOKRATOS_DATABASE_URL_FILE"] = str(secret)
    check = cli("check", env=env)
    database = [line for line in check.stdout.splitlines() if " database:" in line]
    assert database and database[0].startswith("ok"), check.stdout + check.stderr[-2000:]
    proc = cli("enqueue", "triage", "--exchange", EXCHANGE, "--key", "blank-url", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().isdigit(), proc.stdout
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'blank-url'") == 1
    assert not (data / "postgres").exists(), "the embedded PostgreSQL was started"
    assert not (data / "spool").exists() or not any((data / "spool").iterdir())


# -- 2. libpq's PG* variables ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("PGSSLMODE", "bogus", "has an invalid sslmode 'bogus' (libpq accepts disable, allow"),
        ("PGSSLMODE", "", "has an invalid sslmode ''"),
        ("PGPORT", "notaport", "has a port that is not a number"),
        ("PGPORT", "99999", "has a port out of range (1-65535)"),
        ("PGPORT", "5432,0", "has a port out of range (1-65535)"),
        ("PGPORT", "\u00b2", "has a port that is not a number"),
        ("PGTARGETSESSIONATTRS", "primary-please", "invalid target_session_attrs 'primary-please'"),
        ("PGTARGETSESSIONATTRS", "standby", "target_session_attrs 'standby': sokratos-worker"),
        ("PGGSSENCMODE", "on", "invalid gssencmode 'on'"),
        ("PGREQUIREAUTH", "scram", "invalid require_auth method 'scram'"),
        ("PGSSLNEGOTIATION", "direct", "has sslnegotiation=direct with sslmode 'prefer'"),
    ],
)
def test_an_invalid_libpq_variable_is_refused_naming_it(
    variable: str, value: str, words: str
) -> None:
    """libpq takes an option the URL leaves out from its PG* variable and checks it only when
    it connects, which the worker took for an outage (exit 75, restarted for ever)."""
    url = "postgresql://u:s3cret@db.example.org/sokratos"
    error = _refusal({"SOKRATOS_DATABASE_URL": url, variable: value})
    assert error.variable == variable
    assert words in error.message and "s3cret" not in str(error)
    assert error.message.endswith(f"correct or unset {variable}")


def test_a_libpq_variable_the_url_overrides_is_not_checked() -> None:
    """libpq ignores PGSSLMODE when the URL sets sslmode, and so does the check."""
    url = "postgresql://u@db.example.org/sokratos?sslmode=require&port=5433"
    s = load_settings({"SOKRATOS_DATABASE_URL": url, "PGSSLMODE": "bogus", "PGPORT": "x"})
    assert not s.uses_embedded_postgres
    s = load_settings({"SOKRATOS_DATABASE_URL": url, "PGSSLNEGOTIATION": "direct"})
    assert not s.uses_embedded_postgres


@pytest.mark.parametrize(
    ("query", "variables"),
    [
        ("sslnegotiation=direct", {"PGSSLMODE": "verify-full"}),
        ("sslnegotiation=direct&sslrootcert=system", {}),  # libpq's sslmode is verify-full
        ("sslnegotiation=direct", {"PGSSLROOTCERT": "system"}),
        ("sslmode=require", {"PGSSLNEGOTIATION": "direct"}),
        ("sslrootcert=system", {}),
        ("", {"PGSSLNEGOTIATION": "direct", "PGSSLROOTCERT": "system"}),
    ],
)
def test_a_libpq_variable_may_give_the_sslmode_the_url_needs(
    query: str, variables: dict[str, str]
) -> None:
    """libpq takes the sslmode sslnegotiation=direct needs from PGSSLMODE, or defaults it to
    verify-full with sslrootcert=system: a valid production setup, once refused."""
    url = f"postgresql://u@db.example.org/sokratos?{query}"
    assert not load_settings({"SOKRATOS_DATABASE_URL": url, **variables}).uses_embedded_postgres


@pytest.mark.parametrize(
    ("query", "variables", "named", "words"),
    [
        (
            "sslnegotiation=direct",
            {"PGSSLMODE": "prefer"},
            "PGSSLMODE",
            "has sslnegotiation=direct with sslmode 'prefer'",
        ),
        (
            "sslrootcert=system",
            {"PGSSLMODE": "require"},
            "PGSSLMODE",
            "has sslrootcert=system with sslmode 'require': libpq refuses it (use sslmode"
            " verify-full)",
        ),
        (
            "sslmode=verify-ca",
            {"PGSSLROOTCERT": "system"},
            "PGSSLROOTCERT",
            "has sslrootcert=system with sslmode 'verify-ca'",
        ),
        (
            "sslrootcert=system&sslmode=require",
            {"PGSSLMODE": "verify-full"},  # ignored: the URL sets sslmode
            "SOKRATOS_DATABASE_URL",
            "has sslrootcert=system with sslmode 'require'",
        ),
        ("sslnegotiation=direct", {}, "SOKRATOS_DATABASE_URL", "with sslmode 'prefer'"),
    ],
)
def test_an_sslmode_too_weak_for_what_asks_for_more_is_refused_naming_its_source(
    query: str, variables: dict[str, str], named: str, words: str
) -> None:
    """libpq refuses these as it connects, which was waited out as an outage (exit 75)."""
    url = f"postgresql://u:s3cret@db.example.org/sokratos?{query}"
    error = _refusal({"SOKRATOS_DATABASE_URL": url, **variables})
    assert error.variable == named
    assert words in error.message and "s3cret" not in str(error)


def test_libpq_variables_are_not_checked_for_the_embedded_postgres() -> None:
    assert load_settings({"PGSSLMODE": "bogus", "PGPORT": "x"}).uses_embedded_postgres


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("PGSSLMODE=bogus", "PGSSLMODE: has an invalid sslmode 'bogus'"),
        ("PGPORT=notaport", "PGPORT: has a port that is not a number"),
        ("PGPORT=99999", "PGPORT: has a port out of range (1-65535)"),
        (
            "PGSERVICE=missing",
            'PGSERVICE: a connection option was refused (definition of service "missing" not'
            " found)",
        ),
        (
            "PGOPTIONS=-c no_such_setting=1",
            "PGOPTIONS: a connection option was refused (unrecognized configuration parameter"
            ' "no_such_setting")',
        ),
        (
            "PGTZ=Mars/Olympus",
            'PGTZ: a connection option was refused (invalid value for parameter "TimeZone":'
            ' "Mars/Olympus")',
        ),
        # (PGCLIENTENCODING is overridden: every connection speaks UTF8, test_connection_pool)
        (
            "PGGEQO=maybe",
            'PGGEQO: a connection option was refused (parameter "geqo" requires a Boolean value)',
        ),
        (
            "PGOPTIONS=-c max_parallel_workers_per_gather=100000",
            "PGOPTIONS: a connection option was refused (100000 is outside the valid range for"
            ' parameter "max_parallel_workers_per_gather" (0 .. 1024))',
        ),
    ],
)
def test_an_invalid_libpq_variable_exits_78_at_once_naming_it(
    db: psycopg.Connection, database_url: str, tmp_path: Path, setting: str, words: str
) -> None:
    """Against the real test PostgreSQL: exit 78 in one line naming the variable, without
    waiting out SOKRATOS_STARTUP_TIMEOUT; nothing is spooled or enqueued."""
    variable, _, value = setting.partition("=")
    env = {
        "SOKRATOS_DATABASE_URL": database_url,
        "SOKRATOS_STARTUP_TIMEOUT": "20s",
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
        variable: value,
    }
    run = cli("run", "--once", env=env)
    assert run.returncode == 78, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = _plain_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"sokratos-worker: invalid configuration: {words}"
    )
    assert "correct or unset" in lines[0], lines
    assert not [e for e in _events(run.stderr) if e["event"] == "waiting_for_database"]
    enqueue = cli("enqueue", "triage", "--exchange", EXCHANGE, env=env)
    assert enqueue.returncode == 78 and words in enqueue.stderr, enqueue.stderr[-2000:]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert not (tmp_path / "data" / "spool").exists() or not any(
        (tmp_path / "data" / "spool").iterdir()
    )


@pytest.mark.postgres
def test_a_setting_the_role_may_not_set_exits_78_naming_pgoptions(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """'permission denied to set parameter' was waited out as an outage (exit 75)."""
    role = f"r_{uuid.uuid4().hex[:10]}"
    db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info["user"] = role
        url = psycopg.conninfo.make_conninfo(
            **{k: str(v) for k, v in info.items() if v is not None}
        )
        env = {
            "SOKRATOS_DATABASE_URL": url,
            "PGOPTIONS": "-c log_statement=all",
            "HOME": str(tmp_path),
            "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
            "SOKRATOS_STARTUP_TIMEOUT": "20s",
        }
        proc = cli("migrate", env=env)
    finally:
        db.execute(f"DROP ROLE {role}")
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert _plain_lines(proc.stderr) == [
        "sokratos-worker: invalid configuration: PGOPTIONS: a connection option was refused"
        ' (permission denied to set parameter "log_statement"); libpq applies this variable to'
        " the database connection: correct or unset it"
    ]
    assert not [e for e in _events(proc.stderr) if e["event"] == "waiting_for_database"]


@pytest.mark.postgres
def test_check_names_a_libpq_variable_the_server_refuses(database_url: str, tmp_path: Path) -> None:
    env = {
        "SOKRATOS_DATABASE_URL": database_url,
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
        "PGSERVICE": "missing",
    }
    proc = cli("check", env=env)
    assert proc.returncode == 78, proc.stderr[-2000:]
    database = [line for line in proc.stdout.splitlines() if "database:" in line]
    assert database and database[0].startswith("FAIL"), proc.stdout
    assert 'definition of service "missing" not found' in database[0]
    assert "PGSERVICE" in database[0]
    assert any("llm_backends" in line for line in proc.stdout.splitlines())  # every line


@pytest.mark.postgres
def test_a_service_file_is_used_and_a_missing_or_refused_one_exits_78_naming_it(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A URL with service= reads PGSERVICEFILE; one that does not exist, or a service whose
    sslmode libpq refuses, is a configuration error (exit 78), not an outage waited out."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    services = tmp_path / "pg_service.conf"
    lines = [f"{k}={v}" for k, v in info.items() if v is not None and k != "password"]
    services.write_text(
        "[sokratos]\n" + "\n".join(lines) + "\n[weak]\nsslrootcert=system\n"
        "[far]\nhost=127.0.0.1\nport=99999\n"
    )
    password = {"PGPASSWORD": str(info["password"])} if info.get("password") else {}
    env = {
        "SOKRATOS_DATABASE_URL": "service=sokratos",
        "PGSERVICEFILE": str(services),
        **password,
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
        "SOKRATOS_STARTUP_TIMEOUT": "20s",
    }
    proc = cli("enqueue", "triage", "--exchange", EXCHANGE, "--key", "via-service", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    query = "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'via-service'"
    assert count(db, query) == 1
    missing = str(tmp_path / "missing.conf")
    run = cli("run", "--once", env={**env, "PGSERVICEFILE": missing})
    assert run.returncode == 78, run.stderr[-2000:]
    assert _plain_lines(run.stderr) == [
        "sokratos-worker: invalid configuration: PGSERVICEFILE: a connection option was refused"
        f' (service file "{missing}" not found); libpq applies this variable to the database'
        " connection: correct or unset it"
    ]
    assert not [e for e in _events(run.stderr) if e["event"] == "waiting_for_database"]
    weak = cli("migrate", env={**env, "SOKRATOS_DATABASE_URL": "service=weak sslmode=require"})
    assert weak.returncode == 78, weak.stderr[-2000:]
    assert 'weak sslmode "require" may not be used with sslrootcert=system' in weak.stderr
    # libpq's own 'invalid port number', at every attempt: not an outage to wait out either.
    far = cli("migrate", env={**env, "SOKRATOS_DATABASE_URL": "service=far"})
    assert far.returncode == 78, far.stderr[-2000:]
    assert 'invalid port number: "99999"' in far.stderr


@pytest.mark.parametrize("given_as", ["PGSSLROOTCERT", "SOKRATOS_DATABASE_URL"])
def test_a_missing_root_certificate_exits_78_naming_where_it_was_given(
    tmp_path: Path, given_as: str
) -> None:
    """libpq's 'root certificate file ... does not exist' was taken for a refused login
    ('check the user, password and database name'), waited out, and named the URL."""
    missing = str(tmp_path / "missing-ca.pem")
    with socket.create_server(("127.0.0.1", 0)) as server:  # TLS starts at once: direct
        port = server.getsockname()[1]
        url = (
            f"postgresql://u:s3cret@127.0.0.1:{port}/sokratos"
            "?sslmode=verify-full&sslnegotiation=direct"
        )
        where = {"PGSSLROOTCERT": missing}
        if given_as == "SOKRATOS_DATABASE_URL":
            url, where = f"{url}&sslrootcert={missing}", {}
        env = {
            "SOKRATOS_DATABASE_URL": url,
            **where,
            "HOME": str(tmp_path),
            "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
            "SOKRATOS_STARTUP_TIMEOUT": "20s",
        }
        run = cli("run", "--once", env=env)
    assert run.returncode == 78, run.stderr[-2000:]
    lines = _plain_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"sokratos-worker: invalid configuration: {given_as}: a connection option was refused"
        f' (root certificate file "{missing}" does not exist)'
    ), lines
    assert "s3cret" not in run.stderr
    assert not [e for e in _events(run.stderr) if e["event"] == "waiting_for_database"]


@pytest.mark.postgres
def test_an_invalid_option_in_the_url_itself_is_named_as_the_urls(
    database_url: str, tmp_path: Path
) -> None:
    """The same refusal for an option the URL gives names SOKRATOS_DATABASE_URL, even when a
    PG* variable for it is set (libpq ignores that one)."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info["options"] = "-c no_such_setting=1"
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})
    env = {
        "SOKRATOS_DATABASE_URL": url,
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
        "SOKRATOS_STARTUP_TIMEOUT": "10s",
        "PGOPTIONS": "-c application_name=fine",
    }
    proc = cli("migrate", env=env)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert _plain_lines(proc.stderr) == [
        "sokratos-worker: invalid configuration: SOKRATOS_DATABASE_URL: a connection option was"
        ' refused (unrecognized configuration parameter "no_such_setting"); correct it in the URL'
    ]


@pytest.mark.postgres
def test_a_valid_libpq_variable_still_fills_what_the_url_leaves_out(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """With a URL, libpq's variables keep their meaning: here the database comes from
    PGDATABASE, and the item lands in it."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    dbname = str(info.pop("dbname"))
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})
    env = {
        "SOKRATOS_DATABASE_URL": url,
        "PGDATABASE": dbname,
        "HOME": str(tmp_path),
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
    }
    proc = cli("enqueue", "triage", "--exchange", EXCHANGE, "--key", "via-pgdatabase", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    query = "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'via-pgdatabase'"
    assert count(db, query) == 1


# -- the embedded PostgreSQL ignores them ---------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


@pytest.fixture
def embedded_data_dir() -> Iterator[Path]:
    # Under /tmp, world-traversable: as root the wheel runs the server as its own system user.
    data = Path(f"/tmp/sokratos-pgenv-{uuid.uuid4().hex[:8]}")
    data.mkdir(mode=0o755)
    yield data
    pid_file = data / "postgres" / "postmaster.pid"
    if pid_file.exists():
        left = int(pid_file.read_text().split()[0])
        if _alive(left):
            os.kill(left, signal.SIGINT)  # fast shutdown of what a failed test left behind
            for _ in range(50):
                if not _alive(left):
                    break
                time.sleep(0.1)
    shutil.rmtree(data, ignore_errors=True)


# Each of these broke or bent the connection to the embedded server: a statement timeout of
# 1 ms (a traceback), a read-only session wanted from a primary, a service that is not
# defined, a TCP address instead of its socket, a socket for another port, a time zone the
# server does not know.
FOREIGN_LIBPQ_VARIABLES = {
    "PGOPTIONS": "-c statement_timeout=1",
    "PGTARGETSESSIONATTRS": "read-only",
    "PGSERVICE": "nonexistent",
    "PGHOSTADDR": "127.0.0.1",
    "PGSSLMODE": "bogus",
    "PGTZ": "Mars/Olympus",
    "PGDATABASE": "other",
    "PGUSER": "nobody",
}


@pytest.mark.postgres
@pytest.mark.slow
def test_libpq_variables_meant_for_another_server_do_not_touch_the_embedded_postgres(
    embedded_data_dir: Path,
) -> None:
    env = {
        "HOME": str(embedded_data_dir),
        "SOKRATOS_DATA_DIR": str(embedded_data_dir),
        "SOKRATOS_STARTUP_TIMEOUT": "5s",
        **FOREIGN_LIBPQ_VARIABLES,
    }
    run = cli("run", "--once", env=env, timeout=240)  # migrates the new database too
    assert run.returncode == 0, run.stderr[-3000:]
    events = _events(run.stderr)
    ignored = [e for e in events if e["event"] == "libpq_environment_ignored"]
    assert ignored and ignored[0]["variables"] == sorted(FOREIGN_LIBPQ_VARIABLES)
    assert "tick_finished" in [e["event"] for e in events]
    enqueue = cli("enqueue", "triage", "--exchange", EXCHANGE, "--key", "k1", env=env, timeout=240)
    assert enqueue.returncode == 0, enqueue.stderr[-3000:]
    assert enqueue.stdout.strip().isdigit(), enqueue.stdout
    status = cli("status", "--json", env={**env, "PGPORT": "5433"}, timeout=240)
    assert status.returncode == 0, status.stderr[-3000:]
    report = json.loads(status.stdout)
    assert report["database"] == "ok"
    assert report["queues"]["pending_triage"]["ready"] == 1  # no backend: the item waits


# -- lowercase names, read as pydantic-settings reads them ----------------------------------


@pytest.mark.parametrize("name", ["sokratos_database_url", "Sokratos_Database_Url", "database_url"])
def test_a_lowercase_database_url_wins_over_an_empty_credential_as_the_uppercase_one_does(
    tmp_path: Path, name: str
) -> None:
    """pydantic-settings reads the variable in any case; the check that lets an explicit
    variable win over `_FILE` and the credential looked only at the uppercase name, so the
    empty credential was refused (exit 78) though the URL was set."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("\n")
    url = "postgresql://u@db.example.org/sokratos"
    env = {"CREDENTIALS_DIRECTORY": str(creds), "SOKRATOS_DATABASE_URL_FILE": "/nowhere/url"}
    s = load_settings({**env, name: url})
    assert s.database_url is not None and s.database_url.get_secret_value() == url


def test_a_lowercase_file_variable_is_read_not_silently_the_embedded_postgres(
    tmp_path: Path,
) -> None:
    """`sokratos_database_url_file` counted as known (no typo warning) but was never read:
    the worker used the embedded PostgreSQL instead of the database it names."""
    secret = tmp_path / "url"
    secret.write_text("postgresql://u@db.example.org/sokratos\n")
    s = load_settings({"sokratos_database_url_file": str(secret)})
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u@db.example.org/sokratos"
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty") as refused:
        load_settings({"sokratos_database_url_file": str(empty)})
    assert refused.value.variable == "sokratos_database_url_file"


def test_libpq_variables_are_not_checked_when_the_url_is_not_used() -> None:
    """`demo` never connects to the URL's server: its PG* variables must not stop it."""
    env = {"SOKRATOS_DATABASE_URL": "postgresql://u@db.example.org/s", "PGSSLMODE": "bogus"}
    with pytest.raises(ConfigError, match="PGSSLMODE"):
        load_settings(env)
    assert load_settings(env, libpq_environment=False).database_url is not None


# -- two spellings of one variable -----------------------------------------------------------


def test_two_spellings_with_different_values_exit_78_naming_both(
    tmp_path: Path, database_url: str
) -> None:
    """The one the environment listed last won silently (pydantic-settings folds the names
    to lower case): here an unreachable database over the working one."""
    env = {
        "HOME": str(tmp_path),
        "PATH": os.environ["PATH"],
        "SOKRATOS_DATA_DIR": str(tmp_path / "data"),
        "SOKRATOS_DATABASE_URL": database_url,
        "sokratos_database_url": "postgresql://nobody@127.0.0.1:1/elsewhere",  # listed last
    }
    done = cli("status", "--json", env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 78, done.stderr[-1500:]
    assert last.startswith(
        "sokratos-worker: invalid configuration: SOKRATOS_DATABASE_URL and sokratos_database_url:"
    ), last
    assert "elsewhere" not in done.stderr  # a URL may carry a password: never printed


@pytest.mark.parametrize(
    "env",
    [
        {"SOKRATOS_CONCURRENCY": "2", "sokratos_concurrency": "3"},
        {"SOKRATOS_DATABASE_URL_FILE": "/a", "Sokratos_Database_Url_File": "/b"},
        {"SOKRATOS_LOG_LEVEL": "info", "sokratos_log_level": "debug"},
    ],
)
def test_conflicting_spellings_are_refused_file_forms_too(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="different values") as refused:
        load_settings(env)
    assert set(refused.value.variable.split(" and ")) == set(env)


def test_the_same_value_twice_or_a_blank_spelling_is_no_conflict() -> None:
    same = load_settings({"SOKRATOS_CONCURRENCY": "2", "sokratos_concurrency": "2"})
    assert same.concurrency == 2
    # A blank spelling listed last no longer hides the given one (it means unset).
    blank = load_settings({"sokratos_concurrency": "7", "SOKRATOS_CONCURRENCY": "  "})
    assert blank.concurrency == 7


def test_a_refused_value_names_where_it_was_given(tmp_path: Path) -> None:
    """A bad DATABASE_URL, *_FILE or systemd credential is named as given: the error named
    only SOKRATOS_DATABASE_URL, which the operator had not set (and might set to "fix" it,
    while the bad value stayed where it was)."""
    bad_url = "postgresql://u@db.example.org:notaport/sokratos"
    url_file = tmp_path / "url"
    url_file.write_text(bad_url)
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text(bad_url)
    backends = tmp_path / "backends"
    backends.write_text('[{"name": "a", "url": "http://127.0.0.1:1/v1?x=1", "model": "m"}]')
    given = {
        "SOKRATOS_DATABASE_URL": "SOKRATOS_DATABASE_URL",
        "DATABASE_URL": "SOKRATOS_DATABASE_URL (given as DATABASE_URL)",
        "database_url": "SOKRATOS_DATABASE_URL (given as database_url)",
    }
    for name, expected in given.items():
        assert _refusal({name: bad_url}).variable == expected
    assert (
        _refusal({"SOKRATOS_DATABASE_URL_FILE": str(url_file)}).variable
        == "SOKRATOS_DATABASE_URL (given as SOKRATOS_DATABASE_URL_FILE)"
    )
    assert (
        _refusal({"CREDENTIALS_DIRECTORY": str(creds)}).variable
        == "SOKRATOS_DATABASE_URL (given as $CREDENTIALS_DIRECTORY/SOKRATOS_DATABASE_URL)"
    )
    assert (
        _refusal({"SOKRATOS_LLM_BACKENDS_FILE": str(backends)}).variable
        == "SOKRATOS_LLM_BACKENDS[0].url (given as SOKRATOS_LLM_BACKENDS_FILE)"
    )
    assert _refusal({"SOKRATOS_LEASE": "soon"}).variable == "SOKRATOS_LEASE"
