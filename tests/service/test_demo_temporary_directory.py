"""``demo`` removes its temporary directory (its embedded PostgreSQL's data with it) also when
a second Ctrl-C comes while it is being removed: the removal used to stop half-way, leaving
tens of megabytes in $TMPDIR after every impatient double Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from sokratos_worker.llm.local import llama_cpp_installed
from tests.support.daemon import ROOT, wait_until

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.local_model,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

# Enough files that removing them takes a while: the second Ctrl-C lands during the removal.
BALLAST_FILES = 40_000


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):  # (a line that is not JSON)
            out.append(json.loads(line))
    return out


def _demo_directories(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("sokratos-demo-*"))


def test_a_second_ctrl_c_while_the_demo_cleans_up_leaves_no_directory(tmp_path: Path) -> None:
    if not llama_cpp_installed():
        pytest.skip("llama-cpp-python is not installed (the `local` extra)")
    # Short paths: the embedded PostgreSQL's socket path must fit 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    log = tmp_path / "demo.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp), "TMPDIR": str(tmp)}
    env = {k: v for k, v in env.items() if not k.upper().startswith("SOKRATOS_")}
    with log.open("wb") as err:
        demo = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "demo"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
        try:
            assert wait_until(
                lambda: any(e.get("event") == "demo_enqueued" for e in _events(log))
                or demo.poll() is not None,
                timeout=120,
            )
            assert demo.poll() is None, log.read_text()[-2000:]
            (directory,) = _demo_directories(tmp)
            ballast = directory / "ballast"
            ballast.mkdir()
            for n in range(BALLAST_FILES):
                (ballast / str(n)).write_bytes(b"x")
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
            assert wait_until(
                lambda: any(e.get("event") == "embedded_postgres_stopped" for e in _events(log))
                or demo.poll() is not None,
                timeout=120,
            )
            os.killpg(demo.pid, signal.SIGINT)  # and again, while the directory is removed
            demo.wait(120)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait(10)
    left = _demo_directories(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    assert left == [], (
        f"the demo (exit {demo.returncode}) left {left};"
        f" log tail: {log.read_text(errors='replace')[-1500:]}"
    )
