"""JSON nested deeper than Python's parser goes ("[[[[…" in a loop) is bad input like any other:
named, never a traceback. The worker's own paths (claims, replies, the spool import) were
covered; a review of the spool import found the commands' paths were not."""

from __future__ import annotations

from pathlib import Path

from tests.support.operator import cli_env, run_cli

DEEP = "[" * 100_000 + "]" * 100_000
NOWHERE = "postgresql://x@127.0.0.1:1/none"  # no server: an enqueue would be spooled


def test_enqueue_of_a_file_nested_too_deeply_is_refused_naming_it(tmp_path: Path) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=NOWHERE)
    done = run_cli(
        ["enqueue", "distillation", "--file", "-"], env, stdin=f'{{"archive_text": {DEEP}}}'
    )
    assert done.returncode == 1, (done.stdout, done.stderr[-1500:])
    assert done.stderr.strip() == (
        "sokratos-worker: invalid payload: --file is nested too deeply to read as JSON"
    )
    assert not (tmp_path / "data" / "spool").exists()


def test_status_counts_a_spool_file_too_deep_to_read_without_a_traceback(tmp_path: Path) -> None:
    """`status` looks into each spool file for the database it is meant for; a file it cannot
    parse is left to the import (which rejects it into failed_operations)."""
    spool = tmp_path / "data" / "spool"
    spool.mkdir(parents=True)
    (spool / "20200101T000000000000-deep0000.json").write_text(DEEP, encoding="utf-8")
    done = run_cli(["status"], cli_env(tmp_path, SOKRATOS_DATABASE_URL=NOWHERE))
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert "spool: 1 enqueues waiting for import" in done.stdout.splitlines(), done.stdout
