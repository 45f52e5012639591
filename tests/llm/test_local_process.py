"""The local model server's process: out of the worker's process group, gone with the worker.

A "worker" here is a small driver process (its own session, as a shell gives a foreground job)
that starts the server and waits. A stand-in server (this module run as ``__main__``: a tiny
HTTP server taking llama-cpp-python's arguments) keeps the tests cheap; one test runs the real
llama-cpp-python server, as it reacts to signals in its own way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sokratos_worker.llm.local import MODEL_ALIAS, LocalModelServer, llama_cpp_installed
from tests.support.daemon import ROOT, wait_until

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]


class StandIn(LocalModelServer):
    """A LocalModelServer serving this module's stand-in instead of llama-cpp-python."""

    server_module = "tests.llm.test_local_process"

    def model_file(self) -> Path:
        return Path(os.devnull)  # the stand-in loads nothing

    def environment(self) -> dict[str, str]:
        # The server does not import from its working directory: the stand-in is found this way.
        found = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {**super().environment(), "PYTHONPATH": os.pathsep.join(found)}


SLOW_MODEL = "slow-to-load"


class SlowStandIn(StandIn):
    """A stand-in that takes a minute to load its model before it answers."""

    def model_file(self) -> Path:
        return Path(SLOW_MODEL)


# The worker: starts the server, says where it is, and finishes its "items" (waits for a line on
# stdin) before stopping it. A Ctrl-C is recorded, as the daemon's handler does.
DRIVER = """
import json, os, signal, sys
from {module} import {name} as Server
signal.signal(signal.SIGINT, lambda *_: os.write(1, b"interrupted\\n"))
server = Server(n_threads=1)
server.start()
print(json.dumps({{"pid": server._process.pid, "port": server.port}}), flush=True)
sys.stdin.readline()
server.stop()
print("stopped", flush=True)
"""


# The worker interrupted (SIGINT raises KeyboardInterrupt, as in a terminal) while the server
# loads; it lives on after that, so only the interrupted start can have stopped the server.
DRIVER_INTERRUPTED_WHILE_LOADING = """
import signal, sys
from tests.llm.test_local_process import SlowStandIn
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    SlowStandIn().start()
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.readline()
"""


def _start_worker(code: str) -> subprocess.Popen[str]:
    """The driver in a session of its own: its pid is the process group a terminal signals."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip


def _server_of(worker: subprocess.Popen[str]) -> dict[str, int]:
    """The server's pid and port, once the worker has started it."""
    assert worker.stdout is not None
    for line in worker.stdout:  # (the log lines of the start come first)
        if line.startswith('{"pid": '):
            return {key: int(value) for key, value in json.loads(line).items()}
    pytest.fail(f"the worker exited ({worker.wait(10)}) before its model server answered")


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ended(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped has exited too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int, module: str) -> bool:
    """``pid`` runs ``module`` (it has exec'd the server command): the module is one of its
    arguments. A child forked but not yet exec'd shows the driver's command line, whose code
    names the module inside a longer argument (CI once saw two "servers" that way)."""
    try:
        return module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Pids to SIGKILL after the test if still running (a failing test leaves no server)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not _ended(pid):
            os.kill(pid, signal.SIGKILL)


def _start(module: str, name: str, cleanup: list[int]) -> tuple[subprocess.Popen[str], int, int]:
    worker = _start_worker(DRIVER.format(module=module, name=name))
    cleanup.append(worker.pid)
    server = _server_of(worker)
    cleanup.append(server["pid"])
    return worker, server["pid"], server["port"]


def test_ctrl_c_leaves_the_model_server_to_the_worker(cleanup: list[int]) -> None:
    """A terminal's Ctrl-C signals the worker's process group; the server, in that group,
    died while the worker was still finishing the items that needed it."""
    worker, pid, port = _start(__name__, "StandIn", cleanup)
    assert os.getsid(pid) == pid, "the model server is not in a session of its own"
    os.killpg(worker.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    assert worker.stdout is not None and worker.stdin is not None
    assert worker.stdout.readline().strip() == "interrupted"
    for _ in range(10):  # the worker finishing its items in flight, for 2 s
        assert _answers(port), "the model server died of the worker's Ctrl-C"
        time.sleep(0.2)
    worker.stdin.write("items done\n")
    worker.stdin.flush()
    assert worker.stdout.readline().strip() == "stopped"
    assert worker.wait(30) == 0
    assert _ended(pid) and not _answers(port)


def test_a_worker_killed_with_sigkill_takes_its_model_server_along(cleanup: list[int]) -> None:
    """kill -9 of the worker used to leave the server running, holding its port and memory."""
    worker, pid, port = _start(__name__, "StandIn", cleanup)
    worker.kill()
    worker.wait(10)
    assert wait_until(lambda: _ended(pid), timeout=30), "the model server outlived its worker"
    assert not _answers(port)


def test_the_server_outlives_the_thread_that_started_it() -> None:
    """The server's end is tied to the worker process, not to the thread that started it
    (which PR_SET_PDEATHSIG would be)."""
    server = StandIn()
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join(60)
    try:
        assert server._process is not None
        time.sleep(1.0)  # a guard tied to the thread would have stopped it by now
        assert server._process.poll() is None
        assert _answers(server.port)
    finally:
        server.stop()
    assert not _answers(server.port)


def test_a_ctrl_c_while_the_model_loads_stops_the_server(cleanup: list[int]) -> None:
    """The server, in a session of its own, no longer gets a Ctrl-C meant for the worker: the
    interrupted start must stop it (it used to be left running until the worker exited)."""
    worker = _start_worker(DRIVER_INTERRUPTED_WHILE_LOADING)
    cleanup.append(worker.pid)
    # The server is the child that has exec'd its module (another child may come and go
    # meanwhile: counting children raced it).
    def servers() -> list[int]:
        return [p for p in _children(worker.pid) if _running(p, StandIn.server_module)]

    assert wait_until(lambda: len(servers()) == 1, timeout=30)
    (pid,) = servers()
    cleanup.append(pid)
    os.kill(worker.pid, signal.SIGINT)
    assert wait_until(lambda: _ended(pid), timeout=30), "the interrupted start left it running"
    assert worker.poll() is None
    out, _ = worker.communicate("go on\n", timeout=30)
    assert "interrupted" in out.splitlines()


@pytest.mark.local_model
@pytest.mark.slow
def test_the_real_model_server_ends_with_a_killed_worker(cleanup: list[int]) -> None:
    """llama-cpp-python's server (uvicorn) handles SIGTERM itself: it still ends."""
    if not llama_cpp_installed():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("llama-cpp-python is not installed (the `local` extra) but CI=true")
        pytest.skip("llama-cpp-python is not installed (the `local` extra)")
    worker, pid, port = _start("sokratos_worker.llm.local", "LocalModelServer", cleanup)
    assert os.getsid(pid) == pid
    worker.kill()
    worker.wait(10)
    assert wait_until(lambda: _ended(pid), timeout=30), "the model server outlived its worker"
    assert not _answers(port)


# -- the stand-in server, run as ``python -m tests.llm.test_local_process --port N ...`` --------


class _StandInHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body: dict[str, Any] = (
            {"data": [{"id": MODEL_ALIAS, "object": "model"}]}
            if self.path == "/v1/models"
            else {"status": "ok"}
        )
        data = json.dumps(body).encode()
        self.send_response(200 if self.path in ("/v1/models", "/health") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve_stand_in() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="")
    known, _ = parser.parse_known_args()
    if known.model == SLOW_MODEL:
        time.sleep(60)
    ThreadingHTTPServer(("127.0.0.1", known.port), _StandInHandler).serve_forever()


if __name__ == "__main__":
    _serve_stand_in()
