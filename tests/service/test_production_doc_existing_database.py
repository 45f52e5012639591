"""What docs/production.md tells the operator of an existing Sokratos database: the exit code a
role that may not migrate gets (78 since d81d526, which RestartPreventExitStatus=78 keeps down),
and Sokratos's own pruning of failed_operations and processed_emails, which the worker shares.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = (Path(__file__).resolve().parents[2] / "docs" / "production.md").read_text("utf-8")


def _section(number: int) -> str:
    start = re.search(rf"^## {number}\. ", DOC, re.M)
    assert start is not None
    end = re.search(r"^## \d+\. ", DOC[start.end() :], re.M)
    return DOC[start.start() : start.end() + (end.start() if end else len(DOC))]


def test_upgrading_gives_the_exit_code_a_role_that_may_not_migrate_gets() -> None:
    upgrading = " ".join(_section(7).split())
    assert "it exits 1 with `migrations are pending" not in upgrading
    assert "systemd's restart picks the migration up" not in upgrading


def test_turning_sokratos_off_covers_its_pruning_of_the_shared_tables() -> None:
    turn_off = _section(5)
    assert "FAILED_OPS_TTL_DAYS" in turn_off
    assert "PROCESSED_EMAILS_TTL_DAYS" in turn_off
