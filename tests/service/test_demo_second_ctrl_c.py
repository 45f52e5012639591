"""A second Ctrl-C during a demo round exits at once (exit 1, as `run`'s) and still removes the
demo's temporary directory: the exit (os._exit) skipped the demo's own removal, leaving its
embedded PostgreSQL's data (some 23 MB) in $TMPDIR after every double Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sokratos_worker.llm.local import llama_cpp_installed
from tests.core.test_demo_edges import _servers_under
from tests.support.daemon import ROOT, wait_until

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.local_model,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The demo's TMPDIR, short: the embedded PostgreSQL's socket path must fit 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="d2c-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):  # (a line that is not JSON)
            out.append(json.loads(line))
    return out


def _seen(log: Path, event: str) -> bool:
    return any(e.get("event") == event for e in _events(log))


def test_a_second_ctrl_c_during_a_round_exits_1_and_removes_the_directory(
    short_tmp: Path, tmp_path: Path
) -> None:
    if not llama_cpp_installed():
        pytest.skip("llama-cpp-python is not installed (the `local` extra)")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SOKRATOS_")}
    env.update(SOKRATOS_LOG_FORMAT="json", TMPDIR=str(short_tmp), PYTHONPATH=str(ROOT))
    # As a terminal runs it: a background shell starts its children with SIGINT ignored.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " sys.argv = ['sokratos-worker', 'demo'];"
        " runpy.run_module('sokratos_worker', run_name='__main__')"
    )
    log = tmp_path / "demo.log"
    with log.open("wb") as err:
        demo = subprocess.Popen(
            [sys.executable, "-c", start],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        try:
            # The first item is done and the others are in flight on the (serial) tiny model.
            assert wait_until(
                lambda: _seen(log, "llm_call_finished") or demo.poll() is not None, timeout=150
            ), log.read_text()[-2000:]
            assert demo.poll() is None, log.read_text()[-2000:]
            assert list(short_tmp.glob("sokratos-demo-*")) != []
            demo.send_signal(signal.SIGINT)
            assert wait_until(
                lambda: _seen(log, "signal_received") or demo.poll() is not None, timeout=30
            ), log.read_text()[-2000:]
            demo.send_signal(signal.SIGINT)  # impatient: the items in flight are not awaited
            demo.wait(60)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait(10)
    text = log.read_text(errors="replace")
    assert _seen(log, "second_signal_exiting_now"), text[-2000:]
    assert demo.returncode == 1, text[-2000:]
    assert _seen(log, "embedded_postgres_stopped"), text[-2000:]
    assert list(short_tmp.glob("sokratos-demo-*")) == [], text[-2000:]
    assert _servers_under(short_tmp) == []
