"""SIGTERM and SIGHUP end any command but `run` and the demo with one line and exit 1, as
Ctrl-C does (README, Exit codes), also outside its database: `enqueue ... -` waiting on stdin
and `check` probing a hung backend died on the spot, silently (review R1)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.operator import REPO, cli_env

pytestmark = [pytest.mark.subprocess]


def _stop(proc: subprocess.Popen[str], signum: signal.Signals, after_s: float) -> tuple[str, str]:
    time.sleep(after_s)
    proc.send_signal(signum)
    try:
        return proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _assert_stopped_line(proc: subprocess.Popen[str], err: str, signum: signal.Signals) -> None:
    assert proc.returncode == 1, (proc.returncode, err[-800:])
    assert err.strip().splitlines()[-1:] == [
        f"sokratos-worker: stopped by {signum.name} before the command finished"
    ], err[-800:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize(
    "args",
    [["enqueue", "triage", "--exchange", "-"], ["enqueue", "distillation", "--file", "-"]],
    ids=["triage", "distillation"],
)
def test_enqueue_reading_stdin_stopped_exits_1_with_one_line(
    tmp_path: Path, args: list[str], signum: signal.Signals
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", *args],
        env=cli_env(tmp_path),
        cwd=str(REPO),
        stdin=subprocess.PIPE,  # open, nothing written yet: a producer still writing
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _out, err = _stop(proc, signum, 3.0)
    _assert_stopped_line(proc, err, signum)


@pytest.fixture
def silent_backend() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung model server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_check_stopped_while_probing_a_backend_exits_1_with_one_line(
    tmp_path: Path, silent_backend: str
) -> None:
    backends = (
        f'[{{"name": "hung", "url": "{silent_backend}", "model": "m", "timeout": "60s"}}]'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "check"],
        env=cli_env(tmp_path, SOKRATOS_LLM_BACKENDS=backends),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The embedded PostgreSQL starts first (a few s); the backend probe then waits 10 s.
    _out, err = _stop(proc, signal.SIGTERM, 7.0)
    _assert_stopped_line(proc, err, signal.SIGTERM)
