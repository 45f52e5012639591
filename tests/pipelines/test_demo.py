"""The newcomer's path: the demo drains its samples through the real tiny model."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.demo import SAMPLE_TRIAGE, run_demo
from sokratos_worker.llm.local import llama_cpp_installed

pytestmark = [
    pytest.mark.local_model,
    pytest.mark.slow,
    pytest.mark.skipif(not llama_cpp_installed(), reason="needs the local extra"),
]


def test_demo_prints_an_outcome_for_every_sample() -> None:
    out = io.StringIO()
    assert run_demo(load_settings({}), out=out) == 0
    text = out.getvalue()
    outcomes = re.findall(r"^  pending_\w+#\d+ \[\w+\] (\w+) ", text, flags=re.MULTILINE)
    waiting = re.search(r"(\d+) item\(s\) still waiting", text)
    assert len(outcomes) + (int(waiting.group(1)) if waiting else 0) == len(SAMPLE_TRIAGE) + 1
    assert set(outcomes) <= {"saved", "skipped", "archived", "failed"}
    assert "\nMemories\n" in text


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The demo's TMPDIR, short: the embedded PostgreSQL's socket must fit in a Unix socket
    path (107 bytes), and pytest's tmp_path grows with its run counter (pytest-136/...)."""
    path = Path(tempfile.mkdtemp(prefix="demo-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _demo(tmp_path: Path) -> subprocess.Popen[str]:
    """The demo as a terminal runs it: Ctrl-C raises KeyboardInterrupt (not ignored)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOKRATOS_")}
    # A background shell starts its children with SIGINT ignored: undo that first.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " sys.argv = ['sokratos-worker', 'demo']; runpy.run_module('sokratos_worker', run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start],
        env={**env, "SOKRATOS_LOG_FORMAT": "json", "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.subprocess
def test_ctrl_c_during_start_up_exits_0_without_a_traceback_or_leftovers(short_tmp: Path) -> None:
    tmp_path = short_tmp
    proc = _demo(tmp_path)
    assert proc.stderr is not None
    for line in proc.stderr:  # (bounded: the demo ends by itself in any case)
        if "embedded_postgres_starting" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]  # as `run` (tests/core/test_demo_edges.py)
    assert "stopped_while_starting" in err and "Traceback" not in err
    assert not list(tmp_path.glob("sokratos-demo-*"))


@pytest.mark.subprocess
def test_ctrl_c_during_a_round_prints_the_report_so_far_and_runs_no_more_rounds(
    short_tmp: Path,
) -> None:
    tmp_path = short_tmp
    proc = _demo(tmp_path)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "local_demonstration_model_enabled" in line:  # (the round's handlers come next)
            break
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 0, err[-2000:]
    assert "Outcomes" in out and "Interrupted:" in out
    assert err.count("local_model_starting") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("sokratos-demo-*"))
