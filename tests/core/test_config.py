"""Configuration: durations, _FILE and credentials, and exit 78 without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import certifi
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
        ({"SOKRATOS_LEASE": "0"}, "SOKRATOS_LEASE", "0s is too short: at least 1s"),
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
        ({"SOKRATOS_SHUTDOWN_GRACE": "0"}, "SOKRATOS_SHUTDOWN_GRACE", "too short: at least 1s"),
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


def _backends(*extra: dict[str, object]) -> str:
    """Two backends, the second with ``extra`` fields: errors must name the right index."""
    first = {"name": "a", "url": "http://127.0.0.1:1/v1", "model": "m"}
    return json.dumps([first, *({**first, "name": "b", **e} for e in extra)])


def _account(**extra: object) -> str:
    account = {"name": "a", "host": "imap.example.org", "username": "u", "password": "p"}
    return json.dumps([{**account, **extra}])


def _refusal(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    return info.value


def test_a_missing_ca_file_names_the_field_and_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "ca.pem")
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"ca_file": missing})})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[1].ca_file"
    assert error.message == f"{missing!r} does not exist"
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": _account(ca_file=missing)})
    assert error.variable == "SOKRATOS_EMAIL_ACCOUNTS[0].ca_file"
    assert error.message == f"{missing!r} does not exist"


def test_a_relative_ca_file_says_where_it_was_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": _account(ca_file="ca.pem")})
    assert f"looked up in the current directory {tmp_path}" in error.message


def test_a_ca_file_that_is_no_pem_bundle_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"ca_file": str(garbage)})})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[1].ca_file"
    assert f"{str(garbage)!r} is not a PEM certificate bundle" in error.message
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": _account(ca_file=str(tmp_path))})
    assert error.message == f"{str(tmp_path)!r} is a directory, not a PEM file"


# (A file without read permission takes the same path; root, as CI runs, reads it anyway.)
def test_a_ca_file_behind_a_file_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "certs").write_text("")
    behind = str(tmp_path / "certs" / "ca.pem")
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"ca_file": behind})})
    assert error.message == f"{behind!r} cannot be read: Not a directory"


def test_a_pem_bundle_is_accepted_and_an_empty_ca_file_means_none() -> None:
    bundle = certifi.where()
    settings = load_settings(
        {
            "SOKRATOS_LLM_BACKENDS": _backends({"ca_file": bundle}),
            "SOKRATOS_EMAIL_ACCOUNTS": _account(ca_file=""),
        }
    )
    assert settings.llm_backends[1].ca_file == bundle
    assert settings.email_accounts[0].ca_file is None


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("SOKRATOS_LEASE", "1ms", "1ms is too short: at least 1s (renewals are 0.5s apart"),
        ("SOKRATOS_LEASE", "1000000d", "1000000d is too long: at most 1d"),
        ("SOKRATOS_HEARTBEAT_INTERVAL", "1ms", "1ms is too short: at least 1s"),
        ("SOKRATOS_HEARTBEAT_INTERVAL", "2h", "2h is too long: at most 1h"),
        ("SOKRATOS_STARTUP_TIMEOUT", "500ms", "500ms is too short: at least 1s"),
        ("SOKRATOS_STARTUP_TIMEOUT", "1h1s", "1h1s is too long: at most 1h"),
        ("SOKRATOS_TICK_BUDGET", "0.5", "500ms is too short: at least 1s"),
        ("SOKRATOS_TICK_BUDGET", "2d", "2d is too long: at most 1d"),
        ("SOKRATOS_RETRY_BASE", "1ms", "1ms is too short: at least 10ms"),
        ("SOKRATOS_RETRY_BASE", "25h", "1d1h is too long: at most 1d"),
        ("SOKRATOS_RETRY_MAX", "8d", "8d is too long: at most 7d"),
        ("SOKRATOS_SHUTDOWN_GRACE", "90m", "1h30m is too long: at most 1h"),
        ("SOKRATOS_EMAIL_CHECK_INTERVAL", "10s", "10s is too short: at least 30s"),
        ("SOKRATOS_EMAIL_CHECK_INTERVAL", "30d", "30d is too long: at most 7d"),
        ("SOKRATOS_EMAIL_INITIAL_LOOKBACK", "0", "0s is too short: at least 1s"),
        ("SOKRATOS_EMAIL_INITIAL_LOOKBACK", "1000000d", "at most 3650d"),
        ("SOKRATOS_LEASE", "-5s", "cannot be negative"),
        ("SOKRATOS_HEARTBEAT_INTERVAL", "-5", "cannot be negative"),
        ("SOKRATOS_FAILED_OPS_TTL_DAYS", "1000000", "less than or equal to 36500"),
    ],
)
def test_durations_outside_their_range_are_refused(variable: str, value: str, words: str) -> None:
    error = _refusal({variable: value})
    assert error.variable == variable
    assert words in error.message


def test_a_backend_timeout_outside_its_range_names_the_backend() -> None:
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"timeout": "1ms"})})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[1].timeout"
    assert error.message.startswith("1ms is too short: at least 100ms")
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"timeout": -5})})
    assert "cannot be negative" in error.message
    nan = '[{"name": "a", "url": "http://h", "model": "m", "timeout": NaN}]'  # JSON allows it
    error = _refusal({"SOKRATOS_LLM_BACKENDS": nan})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[0].timeout"
    assert "not a finite duration" in error.message


def test_the_bounds_themselves_and_the_values_the_tests_use_are_accepted() -> None:
    shortest = load_settings(
        {
            "SOKRATOS_LEASE": "1s",
            "SOKRATOS_HEARTBEAT_INTERVAL": "1s",
            "SOKRATOS_STARTUP_TIMEOUT": "1s",
            "SOKRATOS_TICK_BUDGET": "1s",
            "SOKRATOS_RETRY_BASE": "10ms",
            "SOKRATOS_RETRY_MAX": "10ms",
            "SOKRATOS_SHUTDOWN_GRACE": "1s",
            "SOKRATOS_EMAIL_CHECK_INTERVAL": "0",
            "SOKRATOS_EMAIL_INITIAL_LOOKBACK": "1s",
            "SOKRATOS_LLM_BACKENDS": _backends({"timeout": "100ms"}),
        }
    )
    assert (shortest.lease, shortest.retry_base, shortest.email_check_interval) == (1, 0.01, 0)
    longest = load_settings(
        {
            "SOKRATOS_LEASE": "1d",
            "SOKRATOS_HEARTBEAT_INTERVAL": "1h",
            "SOKRATOS_STARTUP_TIMEOUT": "60m",
            "SOKRATOS_TICK_BUDGET": "24h",
            "SOKRATOS_RETRY_BASE": "1d",
            "SOKRATOS_RETRY_MAX": "7d",
            "SOKRATOS_SHUTDOWN_GRACE": "1h",
            "SOKRATOS_EMAIL_CHECK_INTERVAL": "7d",
            "SOKRATOS_EMAIL_INITIAL_LOOKBACK": "3650d",
            "SOKRATOS_LLM_BACKENDS": _backends({"timeout": "1h"}),
        }
    )
    assert (longest.lease, longest.retry_max) == (86400, 7 * 86400)
    assert load_settings({"SOKRATOS_LEASE": "1.5"}).lease == 1.5  # in-process runner tests


def test_log_format_and_level_ignore_case() -> None:
    settings = load_settings({"SOKRATOS_LOG_FORMAT": "JSON", "SOKRATOS_LOG_LEVEL": "INFO"})
    assert (settings.log_format, settings.log_level) == ("json", "info")
    assert load_settings({"SOKRATOS_LOG_FORMAT": "Console"}).log_format == "console"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("localhost:8080", "must start with http:// or https:// (http://localhost:8080?)"),
        ("http://", "'http://' has no host"),
        ("ftp://x", "'ftp://x' must start with http:// or https://"),
        ("http://h:99999/v1", "is not a valid URL (Port out of range"),
        ("http://h:0/v1", "has port 0"),
        # The request's path was appended to the query: every call went to a wrong path.
        ("https://h/openai/v1?api-version=2024-10-21", "has a query or fragment"),
        ("http://h/v1#main", "has a query or fragment"),
    ],
)
def test_malformed_urls_are_refused_naming_the_field(url: str, words: str) -> None:
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"url": url})})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[1].url"
    assert words in error.message
    embedding = {"SOKRATOS_EMBEDDING_MODEL": "m", "SOKRATOS_EMBEDDING_DIM": "8"}
    error = _refusal({**embedding, "SOKRATOS_EMBEDDING_URL": url})
    assert error.variable == "SOKRATOS_EMBEDDING_URL"
    assert words in error.message


def test_a_refused_url_does_not_show_its_password() -> None:
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"url": "http://u:s3cret@h:x/v1"})})
    assert "'http://h:x/v1' is not a valid URL" in error.message
    assert "s3cret" not in str(error)


@pytest.mark.parametrize(
    "url",
    [
        "http://u:Tr0/ub4dor@h:x/v1",  # a '/' in the password hid the '@' from the mask
        "http://u:Tr0ub#4dor@h/v1",  # urlsplit's own words quoted the part before the '#'
        "u:Tr0ub4dor@h/v1",  # no scheme: the hint repeated the whole URL
    ],
)
def test_no_refusal_of_a_url_shows_any_part_of_its_password(url: str) -> None:
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"url": url})})
    assert "Tr0" not in str(error) and "4dor" not in str(error), str(error)


def test_an_at_sign_in_the_database_password_is_refused_naming_the_fix() -> None:
    """libpq split at it: the password's tail became the host, which never resolved (exit 75
    for ever), and every waiting_for_database line quoted it."""
    error = _refusal({"SOKRATOS_DATABASE_URL": "postgresql://w:Tr0ub@4dor@db.example/x"})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert "%40" in error.message and "4dor" not in str(error) and "Tr0ub" not in str(error)
    assert load_settings({"SOKRATOS_DATABASE_URL": "postgresql://w:Tr0ub%404dor@db.example/x"})


def test_an_empty_key_or_password_file_is_refused(tmp_path: Path) -> None:
    """An empty key sent no Authorization header (401 at every call), an empty password
    failed every login: refused now, as an empty X_FILE or credential is."""
    (tmp_path / "key").write_text("\n")
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"api_key_file": str(tmp_path / "key")})})
    assert "is empty" in error.message
    account = {"name": "a", "host": "imap.example.org", "username": "u"}
    accounts = json.dumps([{**account, "password_file": str(tmp_path / "key")}])
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": accounts})
    assert "is empty" in error.message


def test_good_urls_lose_their_trailing_slash() -> None:
    settings = load_settings({"SOKRATOS_LLM_BACKENDS": _backends({"url": "https://[::1]:8/v1/"})})
    assert settings.llm_backends[1].url == "https://[::1]:8/v1"


@pytest.mark.parametrize(
    ("host", "words"),
    [
        ("imaps://imap.example.org", "must be a host name or address, not a URL"),
        ("imap.example.org/INBOX", "not a URL"),
        ("imap.example.org:993", 'must not carry a port: set "port": 993'),
    ],
)
def test_an_imap_host_that_is_not_a_host_is_refused(host: str, words: str) -> None:
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": _account(host=host)})
    assert error.variable == "SOKRATOS_EMAIL_ACCOUNTS[0].host"
    assert words in error.message


@pytest.mark.parametrize(
    ("mailbox", "words"),
    [("", 'must name a mailbox (the default is "INBOX")'), ("  ", "must name a mailbox"),
     ("INBOX\r\nA1 LOGOUT", "holds a control character")],
    ids=["empty", "blank", "crlf"],
)
def test_a_mailbox_name_the_server_would_refuse_at_every_check_is_refused(
    mailbox: str, words: str
) -> None:
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": _account(mailbox=mailbox)})
    assert error.variable == "SOKRATOS_EMAIL_ACCOUNTS[0].mailbox"
    assert words in error.message
    assert load_settings({"SOKRATOS_EMAIL_ACCOUNTS": _account(mailbox="Überweisungen")})


def test_a_repeated_backend_or_account_name_is_named() -> None:
    backends = [{"name": "gpu", "url": f"http://127.0.0.1:{p}/v1", "model": "m"} for p in (1, 2)]
    error = _refusal({"SOKRATOS_LLM_BACKENDS": json.dumps(backends)})
    assert "backend names must be unique ('gpu' given twice)" in error.message
    accounts = json.loads(_account()) * 2
    error = _refusal({"SOKRATOS_EMAIL_ACCOUNTS": json.dumps(accounts)})
    assert "account names must be unique ('a' given twice)" in error.message


def test_an_ipv6_imap_host_is_accepted() -> None:
    assert load_settings({"SOKRATOS_EMAIL_ACCOUNTS": _account(host="::1")}).email_accounts


def test_a_data_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "data"
    file.write_text("")
    error = _refusal({"SOKRATOS_DATA_DIR": str(file)})
    assert error.variable == "SOKRATOS_DATA_DIR"
    assert error.message == f"{str(file)!r} is a file, not a directory"
    not_yet = tmp_path / "new"  # created on first use
    assert load_settings({"SOKRATOS_DATA_DIR": str(not_yet)}).data_dir == not_yet


def test_a_data_dir_too_long_for_the_embedded_servers_socket_is_refused(tmp_path: Path) -> None:
    # The wheel moved the socket to a directory it made world-writable under /tmp, where any
    # local user connected without a password (initdb --auth=trust).
    # The socket is data_dir/postgres/.s.PGSQL.5432: 107 bytes fit, 108 do not.
    fits = tmp_path / ("d" * (107 - len("/postgres/.s.PGSQL.5432") - len(str(tmp_path)) - 1))
    assert load_settings({"SOKRATOS_DATA_DIR": str(fits)}).data_dir == fits
    long_dir = tmp_path / ("d" * (108 - len("/postgres/.s.PGSQL.5432") - len(str(tmp_path)) - 1))
    error = _refusal({"SOKRATOS_DATA_DIR": str(long_dir)})
    assert error.variable == "SOKRATOS_DATA_DIR"
    assert "too long for the embedded PostgreSQL's socket" in error.message
    assert "bytes shorter" in error.message
    # With a database URL the embedded server is not used: any length will do.
    url = "postgresql://u@db.example.org/sokratos"
    assert load_settings({"SOKRATOS_DATA_DIR": str(long_dir), "SOKRATOS_DATABASE_URL": url})
    # A caller that starts it without the configuration is refused the same way, before the
    # wheel runs anything.
    from sokratos_worker.store.embedded import start_embedded

    with pytest.raises(ValueError, match="too long for the embedded PostgreSQL's socket"):
        start_embedded(long_dir)
    assert not long_dir.exists()


def test_an_empty_variable_means_its_default() -> None:
    """`KEY=` in an env file (a value deleted, the line kept) is the default, not an error."""
    settings = load_settings(
        {"SOKRATOS_LEASE": "", "SOKRATOS_LOG_FORMAT": "", "SOKRATOS_LLM_BACKENDS": ""}
    )
    assert (settings.lease, settings.log_format, settings.llm_backends) == (300, None, [])


def _cli_78(env: dict[str, str], *command: str) -> str:
    """Run a command that must stop at the configuration: exit 78, one line, its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", *command],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 78, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    return proc.stderr


def test_the_json_lists_are_read_from_a_file_and_from_the_credentials_directory(
    tmp_path: Path,
) -> None:
    """Contract §2: any variable X can be given as X_FILE or $CREDENTIALS_DIRECTORY/X, the
    JSON lists (which carry api_key and password) too: decoded as the variable would be."""
    backends = tmp_path / "backends.json"
    backends.write_text(_backends({"api_key": "sk-secret"}) + "\n")
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_EMAIL_ACCOUNTS").write_text(_account())
    s = load_settings(
        {"SOKRATOS_LLM_BACKENDS_FILE": str(backends), "CREDENTIALS_DIRECTORY": str(creds)}
    )
    assert [b.name for b in s.llm_backends] == ["a", "b"]
    assert s.llm_backends[1].api_key is not None
    assert s.llm_backends[1].api_key.get_secret_value() == "sk-secret"
    assert [(a.name, a.host) for a in s.email_accounts] == [("a", "imap.example.org")]
    # Errors inside the list name the entry, as for the variable, and where it was given.
    (creds / "SOKRATOS_LLM_BACKENDS").write_text(_backends({"url": "ftp://x"}))
    error = _refusal({"CREDENTIALS_DIRECTORY": str(creds)})
    assert error.variable == (
        "SOKRATOS_LLM_BACKENDS[1].url (given as $CREDENTIALS_DIRECTORY/SOKRATOS_LLM_BACKENDS)"
    )
    assert "http" in error.message


def test_a_json_list_file_that_is_not_json_names_the_variable_and_the_file(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "backends.json"
    bad.write_text('[{"name": "a", "api_key": "s3cret"')
    error = _refusal({"SOKRATOS_LLM_BACKENDS_FILE": str(bad)})
    assert error.variable == "SOKRATOS_LLM_BACKENDS_FILE"
    assert error.message.startswith(f"{str(bad)!r} is not valid JSON (")
    assert "s3cret" not in str(error)
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_EMAIL_ACCOUNTS").write_text("not json")
    error = _refusal({"CREDENTIALS_DIRECTORY": str(creds)})
    assert error.variable == "SOKRATOS_EMAIL_ACCOUNTS"
    assert error.message.startswith(f"{str(creds / 'SOKRATOS_EMAIL_ACCOUNTS')!r} is not valid JSON")
    stderr = _cli_78({"SOKRATOS_LLM_BACKENDS_FILE": str(bad), "HOME": str(tmp_path)}, "status")
    assert "SOKRATOS_LLM_BACKENDS_FILE" in stderr and "is not valid JSON" in stderr


def test_an_empty_variable_does_not_hide_its_file_or_credential(tmp_path: Path) -> None:
    """`SOKRATOS_DATABASE_URL=` (a value deleted, the line kept) is unset: the credential is
    used, not silently the embedded PostgreSQL. An empty X_FILE= is unset too."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://u@db.example.org/sokratos")
    (creds / "SOKRATOS_LLM_BACKENDS").write_text(_backends())
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://u@from-file.example.org/sokratos")
    base = {"CREDENTIALS_DIRECTORY": str(creds), "SOKRATOS_LLM_BACKENDS": ""}
    for empty in ("SOKRATOS_DATABASE_URL", "DATABASE_URL", "SOKRATOS_DATABASE_URL_FILE"):
        s = load_settings({**base, empty: ""})
        assert s.database_url is not None, empty
        assert s.database_url.get_secret_value() == "postgresql://u@db.example.org/sokratos"
        assert [b.name for b in s.llm_backends] == ["a"]
    s = load_settings(
        {**base, "SOKRATOS_DATABASE_URL": "", "SOKRATOS_DATABASE_URL_FILE": str(url_file)}
    )
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u@from-file.example.org/sokratos"
    # Nothing anywhere: the empty values are the defaults.
    s = load_settings({"SOKRATOS_DATABASE_URL_FILE": "", "SOKRATOS_LLM_BACKENDS_FILE": ""})
    assert s.uses_embedded_postgres and s.llm_backends == []


def test_a_credential_that_is_not_utf8_is_a_configuration_error(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    secret = creds / "SOKRATOS_DATABASE_URL"
    secret.write_bytes(b"postgresql://u:s3cret\xff@h/db")
    error = _refusal({"CREDENTIALS_DIRECTORY": str(creds)})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert error.message == f"secret file {str(secret)!r} is not UTF-8 text (byte 22 is not)"
    error = _refusal({"SOKRATOS_DATABASE_URL_FILE": str(secret)})
    assert error.variable == "SOKRATOS_DATABASE_URL_FILE" and "not UTF-8" in error.message
    stderr = _cli_78({"CREDENTIALS_DIRECTORY": str(creds), "HOME": str(tmp_path)}, "status")
    assert "SOKRATOS_DATABASE_URL: secret file" in stderr and "s3cret" not in stderr


def test_a_credential_that_cannot_be_read_is_a_configuration_error(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    # A file whose read fails even for root (EIO), as an unreadable one fails for the worker.
    (creds / "SOKRATOS_DATABASE_URL").symlink_to("/proc/self/mem")
    error = _refusal({"CREDENTIALS_DIRECTORY": str(creds)})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert error.message.startswith(
        f"cannot read secret file {str(creds / 'SOKRATOS_DATABASE_URL')!r}"
    )
    stderr = _cli_78({"CREDENTIALS_DIRECTORY": str(creds), "HOME": str(tmp_path)}, "check")
    assert "SOKRATOS_DATABASE_URL: cannot read secret file" in stderr


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ("sslmode=bogus", "invalid sslmode 'bogus' (libpq accepts disable, allow, prefer"),
        ("target_session_attrs=bogus", "invalid target_session_attrs 'bogus'"),
        ("sslmode=", "invalid sslmode ''"),
        ("gssencmode=on", "invalid gssencmode 'on'"),
        ("channel_binding=yes", "invalid channel_binding 'yes'"),
        ("keepalives_idle=30s", "invalid keepalives_idle '30s' (a whole number)"),
        ("ssl_min_protocol_version=TLS1.2", "invalid ssl_min_protocol_version 'TLS1.2'"),
        ("require_auth=scram", "invalid require_auth method 'scram'"),
        ("require_auth=!password,md5", "mixes negated (!) and plain methods"),
        ("sslnegotiation=direct", "has sslnegotiation=direct with sslmode 'prefer'"),
        ("target_session_attrs=read-only", "target_session_attrs 'read-only': sokratos-worker"),
        ("target_session_attrs=prefer-standby", "(use read-write, primary or any)"),
    ],
)
def test_an_invalid_libpq_option_in_the_database_url_is_refused(option: str, words: str) -> None:
    """libpq checks these only when it connects, and psycopg reports that like an outage:
    exit 75 after SOKRATOS_STARTUP_TIMEOUT and systemd restarts for ever."""
    error = _refusal({"SOKRATOS_DATABASE_URL": f"postgresql://u:s3cret@db.example.org/db?{option}"})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert words in error.message and "s3cret" not in str(error)


@pytest.mark.parametrize("option", ["sslmode=bogus", "target_session_attrs=bogus"])
def test_an_invalid_libpq_option_exits_78_at_once(tmp_path: Path, option: str) -> None:
    env = {
        "SOKRATOS_DATABASE_URL": f"postgresql://u@127.0.0.1:1/db?{option}",
        "SOKRATOS_STARTUP_TIMEOUT": "30s",
        "HOME": str(tmp_path),
    }
    stderr = _cli_78(env, "migrate")
    assert f"SOKRATOS_DATABASE_URL: has an invalid {option.partition('=')[0]} 'bogus'" in stderr


def test_the_libpq_options_a_production_url_uses_are_accepted() -> None:
    url = (
        "postgresql://u@db1.example.org:5432,db2.example.org:5433/sokratos?sslmode=verify-full"
        "&target_session_attrs=read-write&sslrootcert=/etc/ssl/ca.pem&channel_binding=require"
        "&gssencmode=disable&keepalives_idle=30&ssl_min_protocol_version=tlsv1.2"
        "&require_auth=scram-sha-256&load_balance_hosts=random&application_name=w"
        "&sslnegotiation=direct"
    )
    assert not load_settings({"SOKRATOS_DATABASE_URL": url}).uses_embedded_postgres
    keywords = "host=/run/postgresql dbname=sokratos sslmode=disable require_auth=!password,!md5"
    assert not load_settings({"DATABASE_URL": keywords}).uses_embedded_postgres


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("sk-live-0123\n", "character 13 of 13 is U+000A (LINE FEED)"),
        ("sk-live\u00a00123", "character 8 of 12 is U+00A0 (NO-BREAK SPACE)"),
        ("sk live", "character 3 of 7 is U+0020 (SPACE)"),
    ],
)
def test_an_api_key_no_http_header_can_carry_is_refused_without_quoting_it(
    tmp_path: Path, key: str, said: str
) -> None:
    """Accepted, it failed at the first call: a raw UnicodeEncodeError that skipped the
    fallback backends, or a protocol error quoting the key into the item's outcome."""
    error = _refusal({"SOKRATOS_LLM_BACKENDS": _backends({"api_key": key})})
    assert error.variable == "SOKRATOS_LLM_BACKENDS[1].api_key"
    assert said in error.message and "HTTP header" in error.message
    assert key.strip() not in str(error)
    (tmp_path / "key").write_text(key)
    from_file = {"SOKRATOS_LLM_BACKENDS": _backends({"api_key_file": str(tmp_path / "key")})}
    if key.endswith("\n"):  # a file's line end is no part of its key
        assert load_settings(from_file).llm_backends[1].api_key is not None
        return
    error = _refusal(from_file)
    assert said in error.message and "api_key_file" in error.message


@pytest.mark.parametrize("relative", ["data", "./data", "~/sokratos"])
def test_a_relative_data_dir_is_refused(relative: str) -> None:
    """enqueue spooled under its own working directory and a worker started elsewhere never
    imported those files (found by an ingress hunt)."""
    with pytest.raises(ConfigError) as err:
        load_settings({"SOKRATOS_DATA_DIR": relative, "HOME": "/nonexistent"})
    assert "SOKRATOS_DATA_DIR" in str(err.value)
    assert "is relative" in str(err.value) and "absolute path" in str(err.value)
