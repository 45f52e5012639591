"""Stop signals to a command using SOKRATOS_DATABASE_URL: the README's "stopped by SIGTERM
before the command finished", exit 1, one line. Only Ctrl-C was handled there: SIGTERM and
SIGHUP took their default action while ``migrate`` waited for the database (-15 / -1, nothing
printed). The embedded PostgreSQL's case is in test_embedded_start_stop_signals.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.operator import REPO, cli_env
from tests.support.ports import unused_port

pytestmark = [pytest.mark.subprocess]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_migrate_stopped_while_waiting_for_the_database_exits_1_with_one_line(
    tmp_path: Path, signum: signal.Signals
) -> None:
    env = cli_env(
        tmp_path,
        SOKRATOS_DATABASE_URL=f"postgresql://nobody@127.0.0.1:{unused_port()}/nodb",
        SOKRATOS_STARTUP_TIMEOUT="60s",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "migrate"],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:  # (ends at the process's exit: bounded by the 60 s wait)
            seen.append(line)
            if "waiting_for_database" in line:
                proc.send_signal(signum)
                break
        out, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + rest
    assert any("waiting_for_database" in line for line in seen), err[-800:]
    assert proc.returncode == 1, (proc.returncode, err[-800:])
    assert err.strip().splitlines()[-1] == (
        f"sokratos-worker: stopped by {signum.name} before the command finished"
    ), err[-800:]
    assert "Traceback" not in err
    assert out == ""
