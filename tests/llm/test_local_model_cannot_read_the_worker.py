"""The local model server cannot read the worker's secrets through /proc.

The server runs as the worker's OS user, with an environment stripped of secrets; yet it could
read ``/proc/WORKER_PID/environ`` (the database URL with its password, API keys) and open
``/proc/WORKER_PID/mem``. The worker now marks itself non-dumpable before it starts the server.

Root passes those checks, so the worker here runs as ``nobody`` (as the current user when the
tests do not run as root). The server is a spy: this module run as ``__main__``, which tries to
read the worker's files, prints what it got (into the server's output), then serves as the
stand-in of test_local_process does.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from sokratos_worker import process_protection
from sokratos_worker.llm.local import llama_cpp_installed
from tests.llm.test_local_process import StandIn, _answers, _serve_stand_in
from tests.support.daemon import ROOT

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(180)]

SECRET = "s3cret-0f-the-worker"


class Spy(StandIn):
    """A LocalModelServer whose server first tries to read the worker's /proc files."""

    server_module = "tests.llm.test_local_model_cannot_read_the_worker"


# The worker: starts the server through LocalModelServer.start(), then reports what the server
# saw and what it can itself still read from /proc.
DRIVER = """
import ctypes, json, os, socket
from pathlib import Path
from sokratos_worker.llm.local import listens_on
from sokratos_worker.service.port_holder import port_holder
from {module} import {name} as Server

server = Server(n_threads=1, startup_timeout=120)
server.start()
own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen()
own_port = own.getsockname()[1]
report = {{
    "pid": os.getpid(),
    "uid": os.getuid(),
    "server_output": server.output(),
    "dumpable": ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0),  # PR_GET_DUMPABLE
    "listens_on_server": listens_on(server._process.pid, server.port),
    "listens_on_own": listens_on(os.getpid(), own_port),
    "port_holder_own": port_holder(own_port),
    "own_status_has_rss": "VmRSS:" in Path("/proc/self/status").read_text(),
    "own_fds": len(os.listdir("/proc/self/fd")),
}}
server.stop()
print("REPORT " + json.dumps(report), flush=True)
"""


def _as_unprivileged_user() -> dict[str, Any]:
    """Popen arguments that run the process as ``nobody`` when the tests run as root."""
    if os.geteuid() != 0:
        return {}
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("needs a user `nobody` to run the worker unprivileged")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def _run_worker(module: str, name: str) -> dict[str, Any]:
    """Run the driver as an unprivileged worker holding SECRET in its environment."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",  # (nobody cannot write the worktree's __pycache__)
        "HOME": "/tmp",  # (only for libraries that look for a home)
        "SOKRATOS_DATABASE_URL": f"postgresql://worker:{SECRET}@db.example.org/sokratos",
    }
    done = subprocess.run(
        [sys.executable, "-c", DRIVER.format(module=module, name=name)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, check=False,
        **_as_unprivileged_user(),
    )  # fmt: skip
    reports = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and reports, (done.returncode, done.stdout, done.stderr[-2000:])
    report: dict[str, Any] = json.loads(reports[-1].removeprefix("REPORT "))
    assert report["uid"] != 0, "root passes the kernel's checks: the test would prove nothing"
    return report


def test_the_model_server_cannot_read_the_workers_environment_or_memory() -> None:
    """The server read the worker's /proc/PID/environ, SOKRATOS_DATABASE_URL's password in it,
    and could open its /proc/PID/mem: both are now refused with PermissionError."""
    report = _run_worker(__name__, "Spy")
    said = report["server_output"]
    assert "environ: PermissionError" in said, said
    assert "mem: PermissionError" in said, said
    assert SECRET not in said
    assert report["dumpable"] == 0


def test_the_worker_still_reads_its_own_proc_files_once_protected() -> None:
    """Non-dumpable, the worker's own /proc files that are not world-readable become root's:
    what the worker reads (the server's sockets and fds, its own fds and net/tcp for the
    metrics port's holder, its status) must still read."""
    report = _run_worker(__name__, "Spy")
    assert report["dumpable"] == 0
    assert report["listens_on_server"] is True
    assert report["listens_on_own"] is True
    assert report["port_holder_own"].endswith(f"(pid {report['pid']})"), report
    assert report["own_status_has_rss"] is True
    assert report["own_fds"] > 0


@pytest.mark.local_model
@pytest.mark.slow
def test_the_worker_is_not_dumpable_once_the_real_model_server_runs() -> None:
    """With llama-cpp-python's server started the real way, the worker is non-dumpable."""
    if not llama_cpp_installed():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("llama-cpp-python is not installed (the `local` extra) but CI=true")
        pytest.skip("llama-cpp-python is not installed (the `local` extra)")
    report = _run_worker("sokratos_worker.llm.local", "LocalModelServer")
    assert report["dumpable"] == 0
    assert report["listens_on_server"] is True


def test_a_failing_prctl_is_warned_about_once_and_the_server_still_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the worker cannot protect itself (prctl refused, as a seccomp filter answering
    EPERM would), it says so once, not at every start of the server, and serves the model."""
    monkeypatch.setattr(process_protection, "_prctl", lambda option, value=0: (-1, errno.EPERM))
    monkeypatch.setattr(process_protection, "_warned", threading.Event())
    server = StandIn(n_threads=1, startup_timeout=30)
    with capture_logs() as logs:
        try:
            for _ in range(2):  # a start, and a start again (as the watcher's restart does)
                server.start()
                assert _answers(server.port)
                server.stop()
        finally:
            server.stop()
    warnings = [e for e in logs if e["event"] == "process_protection_unavailable"]
    assert len(warnings) == 1, logs
    assert warnings[0]["log_level"] == "warning"
    assert f"errno {errno.EPERM}" in warnings[0]["reason"] and "/proc" in warnings[0]["hint"]


# -- the spy server, run as ``python -m tests.llm.test_local_model_cannot_read_the_worker`` --


def _spy_on_the_worker() -> None:
    """Print what this process can get from its parent's (the worker's) /proc files."""
    worker = os.getppid()
    for name in ("environ", "mem"):
        try:
            with Path(f"/proc/{worker}/{name}").open("rb") as file:
                got = file.read(1 << 16) if name == "environ" else b"(opened)"
            print(f"{name}: {got.decode(errors='replace')}", flush=True)
        except OSError as exc:
            print(f"{name}: {type(exc).__name__}", flush=True)


if __name__ == "__main__":
    _spy_on_the_worker()
    _serve_stand_in()
