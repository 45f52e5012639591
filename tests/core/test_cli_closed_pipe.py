"""A reader that closes the pipe early (`status | head -1`) ends the command quietly.

It used to print a BrokenPipeError traceback and exit 1. Now: nothing on stderr, exit 0; and a
BrokenPipeError that is not stdout's (a socket's) is still a real failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.operator import REPO, cli_env


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["failed", "list"]])
def test_reader_closing_the_pipe_gives_no_traceback(
    tmp_path: Path, database_url: str, args: list[str]
) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", *args],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -0`: the reader is gone before the answer is written
    stderr = proc.stderr.read()
    code = proc.wait(timeout=60)
    assert stderr == "", stderr
    assert code == 0, code


def test_help_into_a_closed_pipe_exits_0_quietly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "--help"],
        env=cli_env(tmp_path),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert stderr == "", stderr


# A command that meets a closed socket, run in a child: main() configures logging globally.
SOCKET_GONE = """
from sokratos_worker import cli

def socket_gone(*_):
    raise BrokenPipeError(32, "Broken pipe")  # as a backend's socket would

cli._COMMANDS["status"] = socket_gone
raise SystemExit(cli.main(["status"]))
"""


def test_a_broken_pipe_that_is_not_stdouts_is_not_hidden(tmp_path: Path) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL="postgresql://x@127.0.0.1:1/none")
    done = subprocess.run(
        [sys.executable, "-c", SOCKET_GONE],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "BrokenPipeError" in done.stderr, done.stderr


def _dead_letters(db: psycopg.Connection, n: int) -> None:
    """``n`` replayable triage dead letters, as the worker writes them."""
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts)
           SELECT 'conversation_triage', 'pending_triage item ' || g, 'model said no',
                  jsonb_build_object('queue', 'pending_triage', 'item_id', g,
                                     'source', 'conversation',
                                     'payload', jsonb_build_object(
                                         'exchange', 'user: item ' || g || E'\\nassistant: ok')),
                  'pending_triage', g, 'closed-pipe-' || g, 3
           FROM generate_series(1, %s) g""",
        (n,),
    )


def test_retry_all_into_a_reader_gone_early_still_retries_every_failure(
    tmp_path: Path, database_url: str, db: psycopg.Connection
) -> None:
    """`failed retry --all | head -1`: the retry stopped at the first line that met the closed
    pipe, most failures not retried, and exited 0 as if done. A command that changes state
    finishes what it was asked, its remaining lines unprinted."""
    _dead_letters(db, 2000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "failed", "retry", "--all"],
        env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, stderr
    assert stderr == "", stderr
    assert "re-enqueued as pending_triage item" in first, first
    left = db.execute("SELECT count(*) FROM failed_operations WHERE retried_at IS NULL")
    assert left.fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (2000,)


RETRYABLE = 200


def test_retry_all_into_a_gone_reader_unbuffered_still_retries_every_failure(
    tmp_path: Path, database_url: str, db: psycopg.Connection
) -> None:
    """Unbuffered (PYTHONUNBUFFERED=1, usual in container images), the "skipped ..." line
    printed before the loop met the closed pipe first: nothing retried, exit 0, nothing said."""
    # A failure Sokratos recorded itself (no source_queue): `--all` says it skipped it.
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, context_data)"
        " VALUES ('triage', 'sokratos row', 'boom', '{}'::jsonb)"
    )
    _dead_letters(db, RETRYABLE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "failed", "retry", "--all"],
        env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url, PYTHONUNBUFFERED="1"),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone (`| head -0`, a pager quit at once)
    stderr = proc.stderr.read()
    code = proc.wait(timeout=300)
    retried = db.execute(
        "SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL"
    ).fetchone()
    assert retried == (RETRYABLE,), (code, stderr)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (RETRYABLE,)
    assert code == 0, stderr
