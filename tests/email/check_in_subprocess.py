"""Run one email check in a fresh process, optionally blocking inside a message's transaction.

Usage: python check_in_subprocess.py SETTINGS_JSON CONNINFO [BLOCK_AT_UID MARKER_PATH]

With a UID, the process writes MARKER_PATH and sleeps inside the transaction of that
message, after its processed mark and triage item were written but before the commit, so
the test can ``kill -9`` it exactly between fetch and commit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from sokratos_worker.config import Settings
from sokratos_worker.email import check_due_accounts
from sokratos_worker.store import email as store


def _block_at(uid: int, marker: Path) -> None:
    original = store.advance_checkpoint

    def blocking(conn: store.Connection, record: store.MessageRecord) -> None:
        original(conn, record)
        if record.uid == uid:
            marker.write_text("in transaction")
            time.sleep(600)

    store.advance_checkpoint = blocking


def main(argv: list[str]) -> None:
    settings_json, conninfo, *block = argv
    if block:
        _block_at(int(block[0]), Path(block[1]))
    values: dict[str, Any] = json.loads(settings_json)
    # Due at once on every run (below the setting's floor, so set after validation).
    settings = Settings(**values).model_copy(update={"email_check_interval": 0.001})
    reports = check_due_accounts(settings, conninfo)
    print(json.dumps([dataclasses.asdict(r) for r in reports]))


if __name__ == "__main__":
    main(sys.argv[1:])
