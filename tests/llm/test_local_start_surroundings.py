"""The local model server starts whatever surrounds the worker: a proxy in its environment,
files in its working directory, the /proc of systemd's ProcSubset=pid; and it leaves nothing
behind.

The readiness check asks the worker's own child on 127.0.0.1; nothing in the worker's
environment may send it elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sokratos_worker.llm import local
from tests.llm.test_local_process import DRIVER, StandIn, _answers, _ended, _server_of
from tests.support.daemon import ROOT, wait_until

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]


def test_a_proxy_in_the_environment_does_not_hold_up_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With http_proxy set and 127.0.0.1 not in NO_PROXY, the readiness check went to the proxy:
    the start waited its whole timeout (120 s by default) and failed with "did not answer"
    while the server's own output said it was running."""
    unreachable_proxy = f"http://127.0.0.1:{local.free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, unreachable_proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = StandIn(n_threads=1, startup_timeout=15)
    try:
        server.start()
        assert server._process is not None and server._process.poll() is None
        assert local.listens_on(server._process.pid, server.port)
    finally:
        server.stop()
    assert not _answers(server.port)


def test_a_module_in_the_working_directory_is_not_imported_by_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -c`` put the worker's working directory first on the server's import path: an
    argparse.py (a queue.py, a types.py...) there replaced the standard library's module, so the
    server died at its start, or ran whatever anyone who can write that directory put there."""
    (tmp_path / "argparse.py").write_text("raise SystemExit('the working directory imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # (where the stand-in is found)
    server = StandIn(n_threads=1, startup_timeout=30)
    try:
        server.start()
        assert server._process is not None and server._process.poll() is None
        assert _answers(server.port)
    finally:
        server.stop()


# In a /proc mounted as ProcSubset=pid mounts it (the shipped units set it), a socket of this
# process listening: whose it is must still be told.
_OWN_LISTENER = """
import socket
from sokratos_worker.llm.local import listens_on
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print("listens_on:", listens_on(os.getpid(), sock.getsockname()[1]))
"""


def test_the_own_server_is_told_under_procsubset_pid() -> None:
    """/proc/net/tcp is hidden there: listens_on said "cannot tell", and a 200 from any process
    on the port counted once the child had lived a second (the port taken while the model
    loaded went unnoticed)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a /proc with subset=pid")
    script = "mount -o remount,subset=pid /proc && exec " + " ".join(
        [sys.executable, "-c", f"'import os{_OWN_LISTENER}'"]
    )
    done = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "listens_on" not in done.stdout:
        pytest.skip(f"cannot mount a /proc with subset=pid here: {done.stderr.strip()[-300:]}")
    assert done.stdout.strip() == "listens_on: True", (done.stdout, done.stderr[-500:])


def test_a_worker_killed_with_sigkill_leaves_no_server_log_behind(tmp_path: Path) -> None:
    """The server's output went to a named file in $TMPDIR, removed only by a stop: every
    worker killed (kill -9, the OOM killer, a watchdog abort, a second Ctrl-C) left one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    worker = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(module="tests.llm.test_local_process", name="StandIn")],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    pid = 0
    try:
        pid = _server_of(worker)["pid"]
        worker.kill()
        worker.wait(10)
        assert wait_until(lambda: _ended(pid), timeout=30), "the model server outlived its worker"
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    finally:
        worker.kill()
        if pid and not _ended(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_server_gets_as_many_threads_as_the_worker_has_cpus() -> None:
    """os.cpu_count() counts the machine's CPUs, not those the worker may run on (taskset,
    systemd's CPUAffinity=, a container's cpuset): llama.cpp started a thread per CPU of the
    machine, and threads beyond the worker's CPUs only slowed each reply down."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs a machine with two CPUs or more")
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from sokratos_worker.llm.local import LocalModelServer\n"
        "print('n_threads:', LocalModelServer().n_threads)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout.strip() == "n_threads: 1", (done.stdout, done.stderr[-500:])
