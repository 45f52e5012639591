"""`failed purge --older-than DAYS` and `failed list --limit N` are bounded: past what
PostgreSQL's interval or bigint holds they failed with a traceback, or (DAYS over 2**31-1)
told the operator to run `migrate` on a migrated database (review R1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.operator import cli_env, run_cli

pytestmark = [pytest.mark.subprocess]


@pytest.mark.parametrize(
    "args",
    [
        ["failed", "purge", "--older-than", "10000000"],
        ["failed", "purge", "--older-than", "3000000000"],
        ["failed", "list", "--limit", "9223372036854775808"],
    ],
    ids=["purge-10M-days", "purge-over-int32", "list-limit-over-int64"],
)
def test_large_numbers_get_a_one_line_usage_error(
    tmp_path: Path, database_url: str, args: list[str]
) -> None:
    result = run_cli(args, cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    err = result.stderr
    assert "Traceback" not in err, err[-600:]
    assert "migrate" not in err, err[-600:]  # the schema is complete: do not send them there
    assert result.returncode == 1, (result.returncode, err[-600:])
    assert len(err.strip().splitlines()) <= 3, err[-600:]  # argparse: usage (may wrap), error
    assert "must be from 1 to " in err, err[-600:]


def test_the_largest_purge_age_is_accepted(tmp_path: Path, database_url: str) -> None:
    args = ["failed", "purge", "--older-than", "36500"]
    result = run_cli(args, cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    assert result.returncode == 0, result.stderr[-600:]
