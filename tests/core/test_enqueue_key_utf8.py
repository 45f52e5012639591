"""`enqueue --key` with bytes that are not UTF-8 (a Latin-1 file name or message id in a shell
variable) is refused as --exchange's and --file's text is: naming the option and the first bad
byte, exit 1, nothing queued or spooled. It said "invalid payload: key contains a lone surrogate
('\\udce9' at 3), which is not valid UTF-8: decode the key's bytes strictly", advice for Python
callers about an escape the command itself made (found by an ingresshunt hunt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.core.test_cli import ROOT, env_for
from tests.support.db import count

EXCHANGE = b"user: my sister Ana moved to Porto\nassistant: noted"
KEY = "café-42".encode("latin-1")
BAD_BYTE = KEY.index(0xE9) + 1  # counted from 1, as in every other such message


def _enqueue(args: list[bytes | str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "enqueue", *args],
        env=env,
        input=b'{"archive_text": "user: my sister Ana moved to Porto"}',
        capture_output=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize("database", ["up", "down"])
def test_a_key_that_is_not_utf8_is_refused_naming_the_option_and_byte(
    database_url: str, db: psycopg.Connection, tmp_path: Path, database: str
) -> None:
    url = database_url if database == "up" else "postgresql://127.0.0.1:1/nowhere"
    env = env_for(url, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
    for args in (
        ["triage", "--exchange", EXCHANGE, "--key", KEY],
        ["distillation", "--file", "-", "--key", KEY],
    ):
        proc = _enqueue(args, env)
        err = os.fsdecode(proc.stderr)
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err[-2000:]
        assert "invalid payload: --key is not UTF-8 text" in err, err
        assert f"at byte {BAD_BYTE}" in err, err
    queued = "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)"
    assert count(db, queued) == 0
    assert not (tmp_path / "d" / "spool").exists()


def test_a_utf8_key_is_queued_as_given(database_url: str, db: psycopg.Connection, tmp_path: Path) -> None:
    env = env_for(database_url, tmp_path, LANG="C", LC_ALL="C")
    proc = _enqueue(["triage", "--exchange", EXCHANGE, "--key", "café-42".encode()], env)
    assert proc.returncode == 0, os.fsdecode(proc.stderr)
    assert db.execute("SELECT idempotency_key FROM pending_triage").fetchall() == [("café-42",)]
