"""`sokratos-worker demo` at its edges: it ignores PG* variables (they are for the URL's server,
which the demo never uses), and a stop signal during its start ends it as it ends `run`'s:
exit 0, `stopped_while_starting`, its embedded PostgreSQL stopped and its directory removed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

from tests.support.daemon import ROOT

pytestmark = [pytest.mark.subprocess]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The demo's TMPDIR, short: the embedded PostgreSQL's socket path must fit 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="demo-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _demo(tmp_path: Path, **extra: str) -> subprocess.Popen[str]:
    """The demo as a terminal runs it: Ctrl-C raises KeyboardInterrupt (not ignored)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SOKRATOS_")}
    # A background shell starts its children with SIGINT ignored: undo that first.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " sys.argv = ['sokratos-worker', 'demo']; runpy.run_module('sokratos_worker', run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start],
        env={
            **env,
            "SOKRATOS_LOG_FORMAT": "json",
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": str(ROOT),
            **extra,
        },
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop_at(proc: subprocess.Popen[str], event: str, signum: signal.Signals) -> tuple[str, str]:
    """Send ``signum`` once the log shows ``event``; (stdout, stderr) once the demo exited."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # (bounded: the demo ends by itself in any case)
        seen.append(line)
        if f'"event": "{event}"' in line:
            break
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return out, "".join(seen) + err


def _servers_under(folder: Path, *, wait_s: float = 15.0) -> list[str]:
    """Command lines of processes naming a directory under ``folder``, once none is left or
    ``wait_s`` passed: a stopped server's last processes exit a moment after it answers."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [
            " ".join(p.info["cmdline"] or ())
            for p in psutil.process_iter(attrs=["cmdline"])
            if any(str(folder) in part for part in p.info["cmdline"] or ())
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("event", "signum"),
    [
        # As the embedded PostgreSQL starts: held until it is up (a cut initdb kept writing
        # into the directory being removed: a traceback, exit 1, files left), then stopped.
        ("embedded_postgres_starting", signal.SIGINT),
        ("embedded_postgres_ready", signal.SIGTERM),
        ("demo_enqueued", signal.SIGHUP),
    ],
    ids=["sigint-postgres-starting", "sigterm-postgres-ready", "sighup-enqueued"],
)
def test_a_stop_signal_during_the_demo_start_exits_0_and_stops_its_postgres(
    short_tmp: Path, event: str, signum: signal.Signals
) -> None:
    proc = _demo(short_tmp)
    out, err = _stop_at(proc, event, signum)
    assert proc.returncode == 0, err[-3000:]
    assert '"event": "stopped_while_starting"' in err and "Traceback" not in err, err[-3000:]
    assert out == ""  # nothing was processed: no report
    assert not list(short_tmp.glob("sokratos-demo-*"))
    assert _servers_under(short_tmp) == []


def test_the_demo_ignores_a_bad_pg_variable_meant_for_the_url(short_tmp: Path) -> None:
    """With a URL set, PGSSLMODE=bogus made the demo refuse to start (exit 78), though it
    uses its own embedded PostgreSQL, where PG* variables are ignored as for `run`."""
    proc = _demo(
        short_tmp,
        SOKRATOS_DATABASE_URL="postgresql://someone@db.invalid/prod",
        PGSSLMODE="bogus",
    )
    _, err = _stop_at(proc, "embedded_postgres_ready", signal.SIGTERM)
    assert proc.returncode == 0, err[-3000:]
    ignored = [line for line in err.splitlines() if "libpq_environment_ignored" in line]
    assert ignored and "PGSSLMODE" in ignored[0], err[-3000:]
    assert _servers_under(short_tmp) == []


# The rounds end as a first Ctrl-C ends them (or not), then a Ctrl-C lands while the report
# prints; no model is needed for that, so the rounds are stood in for.
_REPORT_INTERRUPTED = """
import os, runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from sokratos_worker import demo
first_ctrl_c = sys.argv[1] == "after-a-first-ctrl-c"
def rounds(local, url, stopped):
    if first_ctrl_c:
        stopped.set()
    return 0
def report(url, out):
    out.write("Outcomes\\n")
    out.flush()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # (interrupted at once)
demo._rounds = rounds
demo.print_report = report
sys.argv = ["sokratos-worker", "demo"]
runpy.run_module("sokratos_worker", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("case", "code"), [("after-a-first-ctrl-c", 1), ("after-the-rounds-ended", 0)]
)
def test_a_ctrl_c_while_the_report_prints_is_not_called_a_stop_during_the_start(
    short_tmp: Path, case: str, code: int
) -> None:
    """It was caught as one: "before the demo's first round: nothing was processed", exit 0,
    even when it was the second Ctrl-C (which exits 1, as `run`'s)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SOKRATOS_")}
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT_INTERRUPTED, case],
        env={**env, "SOKRATOS_LOG_FORMAT": "json", "TMPDIR": str(short_tmp), "PYTHONPATH": str(ROOT)},
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stdout == "Outcomes\n\nInterrupted while printing the report.\n"
    assert '"event": "demo_report_interrupted"' in proc.stderr, proc.stderr[-3000:]
    assert "stopped_while_starting" not in proc.stderr and "Traceback" not in proc.stderr
    assert not list(short_tmp.glob("sokratos-demo-*"))
    assert _servers_under(short_tmp) == []
