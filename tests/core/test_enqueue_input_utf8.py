"""`enqueue` reads UTF-8 text wherever it comes from: --exchange's value, stdin, or a --file.

Bytes that are not UTF-8 (a Latin-1 export, a shell's $'\\xe9') were refused from a --file
only: from stdin or the command line they were stored as escapes (`caf\\udce9`, which the LLM
then scored), or, under a strict locale, raised. Now every source is refused alike, naming the
option, and nothing is queued or spooled. Real parts: the command as an operator runs it, the
test's own PostgreSQL database.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.core.test_cli import ROOT, env_for
from tests.support.db import count

LATIN1 = "user: café in Lisbon\nassistant: noted".encode("latin-1")


def _enqueue(args: list[bytes | str], env: dict[str, str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "enqueue", *args],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("source", "option"),
    [("argv", "--exchange"), ("stdin", "--exchange"), ("stdin", "--file"), ("path", "--file")],
)
def test_bytes_that_are_not_utf8_are_refused_from_every_source(
    database_url: str, db: psycopg.Connection, tmp_path: Path, source: str, option: str
) -> None:
    # The locale that decodes stdin strictly, and the one that escapes: the answer is the same.
    for lang in ("C.UTF-8", "C"):
        env = env_for(database_url, tmp_path, LANG=lang, LC_ALL=lang, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
        text = LATIN1 if option == "--exchange" else b'{"archive_text": "' + LATIN1.replace(b"\n", b"\\n") + b'"}'
        kind = "triage" if option == "--exchange" else "distillation"
        byte = text.index(b"\xe9") + 1  # counted from 1, as in every other such message
        stdin = b""
        if source == "argv":
            value: bytes | str = text
        elif source == "stdin":
            value, stdin = "-", text
        else:
            path = tmp_path / "archive.json"
            path.write_bytes(text)
            value = str(path)
        proc = _enqueue([kind, option, value], env, stdin)
        err = os.fsdecode(proc.stderr)
        assert proc.returncode == 1, (lang, err)
        assert "Traceback" not in err, err[-2000:]
        assert f"invalid payload: {option} is not UTF-8 text" in err and f"at byte {byte}" in err, err
    queued = "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)"
    assert count(db, queued) == 0
    assert not (tmp_path / "d" / "spool").exists()


def test_utf8_from_stdin_and_argv_is_queued_as_given(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    env = env_for(database_url, tmp_path, LANG="C", LC_ALL="C")
    text = "user: café in Lisbon\nassistant: noted".encode()
    assert _enqueue(["triage", "--exchange", "-"], env, text).returncode == 0
    assert _enqueue(["triage", "--exchange", text, "--key", "argv"], env).returncode == 0
    rows = db.execute("SELECT payload->>'exchange' FROM pending_triage ORDER BY id").fetchall()
    assert [r[0] for r in rows] == [text.decode()] * 2


@pytest.mark.parametrize("source", ["stdin", "path"])
def test_a_byte_order_mark_from_a_file_or_stdin_is_not_part_of_the_text(
    database_url: str, db: psycopg.Connection, tmp_path: Path, source: str
) -> None:
    """Windows editors and PowerShell's redirection start UTF-8 text with a BOM: a --file was
    refused with Python's "decode using utf-8-sig", and an exchange kept an invisible U+FEFF."""
    env = env_for(database_url, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
    bom = b"\xef\xbb\xbf"
    archive = bom + b'{"archive_text": "user: caf\xc3\xa9 in Lisbon"}'
    exchange = bom + "user: café in Lisbon\nassistant: noted".encode()
    for kind, option, text in (("distillation", "--file", archive), ("triage", "--exchange", exchange)):
        if source == "stdin":
            proc = _enqueue([kind, option, "-"], env, text)
        elif option == "--file":
            path = tmp_path / "archive.json"
            path.write_bytes(text)
            proc = _enqueue([kind, option, str(path)], env)
        else:
            continue  # (--exchange takes no file)
        assert proc.returncode == 0, os.fsdecode(proc.stderr)
    archived = db.execute("SELECT payload->>'archive_text' FROM pending_distillation").fetchall()
    assert archived == [("user: café in Lisbon",)]
    exchanges = db.execute("SELECT payload->>'exchange' FROM pending_triage").fetchall()
    assert exchanges == ([("user: café in Lisbon\nassistant: noted",)] if source == "stdin" else [])
