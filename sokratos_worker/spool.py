"""The enqueue spool: durable local files for enqueues made while PostgreSQL is unreachable.

Each file is written with fsync and an atomic rename, always carries an idempotency key,
and is deleted only after the enqueue that imports it has committed, so an import that
crashes half-way is repeated without doubling anything.
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from sokratos_worker.errors import DatabaseUnavailable, InvalidPayload
from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from sokratos_worker.store.failures import record_failure

log = structlog.get_logger(__name__)


def spool_enqueue(
    spool_dir: Path,
    queue: Queue,
    payload: dict[str, Any],
    *,
    idempotency_key: str | None,
    source: str | None,
) -> Path:
    """Write one enqueue durably; returns the file's path."""
    spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = idempotency_key or f"spool:{uuid.uuid4()}"
    record = {
        "queue": queue.value,
        "payload": payload,
        "idempotency_key": key,
        "source": source,
        "spooled_at": datetime.now(UTC).isoformat(),
    }
    name = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}.json"
    final = spool_dir / name
    temp = spool_dir / f".{name}.tmp"
    with temp.open("w", encoding="utf-8") as handle:
        json.dump(record, handle, ensure_ascii=False)
        handle.flush()
        os.fsync(handle.fileno())
    temp.rename(final)
    _fsync_dir(spool_dir)
    log.warning("enqueue_spooled", queue=queue.value, path=str(final))
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def import_spool(spool_dir: Path, database: Database) -> int:
    """Enqueue every spooled file, deleting each after its commit; returns files imported."""
    if not spool_dir.is_dir():
        return 0
    imported = 0
    for path in sorted(spool_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            queue = Queue(record["queue"])
            payload = record["payload"]
            key = record["idempotency_key"]
            source = record.get("source")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _reject(path, database, f"unreadable spool file: {exc}", None)
            continue
        try:
            with database.connection() as conn:
                item_id = store.enqueue(conn, queue, payload, idempotency_key=key, source=source)
        except InvalidPayload as exc:
            _reject(path, database, str(exc), record)
            continue
        except DatabaseUnavailable:
            log.warning("spool_import_paused", reason="database unavailable", left=str(path))
            break
        path.unlink()
        imported += 1
        log.info("spool_imported", queue=queue.value, item_id=item_id, path=path.name)
    if imported:
        _fsync_dir(spool_dir)
    return imported


def _reject(path: Path, database: Database, error: str, record: Any) -> None:
    """A spool file that can never be enqueued becomes a failed_operations row."""
    context = record if record is not None else {"raw": path.read_text("utf-8", "replace")}
    with database.connection() as conn:
        record_failure(conn, op_type="spool_import", label=path.name, error=error, context=context)
    path.unlink()
    log.error("spool_file_rejected", path=path.name, error=error)


def pending_files(spool_dir: Path) -> int:
    """How many enqueues wait in the spool."""
    return len(list(spool_dir.glob("*.json"))) if spool_dir.is_dir() else 0
