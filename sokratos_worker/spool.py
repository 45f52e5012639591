"""The enqueue spool: durable local files for enqueues made while PostgreSQL is unreachable.

Each file is written with fsync and an atomic rename, always carries an idempotency key,
and is deleted only after the enqueue that imports it has committed, so an import that
crashes half-way is repeated without doubling anything.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from sokratos_worker import jsontext
from sokratos_worker.config import identities_match, normalised_identity
from sokratos_worker.errors import DatabaseUnavailable, InvalidPayload
from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import (
    Database,
    lock_wait_limited,
    refused_by_setup,
    refused_for_its_content,
)
from sokratos_worker.store.failures import record_failure
from sokratos_worker.store.locks import COMMAND_LOCK_TIMEOUT_MS
from sokratos_worker.store.sanitize import clean_text, sanitize_payload

log = structlog.get_logger(__name__)

# An enqueue waits no longer than a command does behind a lock on the queue (a migration): the
# import runs in the tick, and at start in the main thread, which must stay free to act on a
# stop. A lock_timeout set for its transaction only (the connection is the pool's), not a
# statement timeout: a large conversation takes seconds to store, and was cancelled at every
# tick, holding up every file spooled after it.
ENQUEUE_TIMEOUT_MS = COMMAND_LOCK_TIMEOUT_MS
# Files one import enqueues or rejects at most: the import runs in the tick, and at start in
# the main thread, so a large backlog must not hold up a stop, READY=1 or the heartbeat; the
# rest are imported at the next tick.
SPOOL_FILES_PER_IMPORT = 1000
# And the time one import takes at most, checked between files: a file can take seconds (a
# large conversation), so the file limit alone held a stop for minutes behind a large backlog.
SPOOL_IMPORT_BUDGET_S = 5.0


def storable_payload(payload: Any) -> dict[str, Any]:
    """A copy PostgreSQL can store (NUL and lone surrogates escaped, noted in ``_sanitized``).

    Raises :class:`InvalidPayload` for what cannot be stored at all (not an object, NaN...).
    """
    clean, notes = sanitize_payload(payload)
    if not isinstance(clean, dict):
        raise InvalidPayload("payload", "must be a JSON object")
    if notes:
        clean["_sanitized"] = notes
    return clean


def spool_enqueue(
    spool_dir: Path,
    queue: Queue,
    payload: dict[str, Any],
    *,
    idempotency_key: str | None,
    source: str | None,
    database: str | None = None,
) -> Path:
    """Write one enqueue durably; returns the file's path.

    The payload is sanitized first, so the spool never holds what the import would be refused.
    ``database`` names the database it was meant for (``Settings.database_identity``): only a
    worker on that database imports it.
    """
    clean = storable_payload(payload)
    spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = idempotency_key or f"spool:{uuid.uuid4()}"
    record = {
        # First, so an importer on another database reads a few bytes, not the payload.
        "database": normalised_identity(database) if database is not None else None,
        "queue": queue.value,
        "payload": clean,
        "idempotency_key": key,
        "source": source,
        "spooled_at": datetime.now(UTC).isoformat(),
    }
    name = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}.json"
    final = spool_dir / name
    temp = spool_dir / f".{name}.tmp"
    try:
        # 0600 whatever the umask or the directory's mode: it holds a person's conversation.
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(record, handle, ensure_ascii=False)
            handle.flush()
            os.fsync(handle.fileno())
        temp.rename(final)
    except BaseException:
        # (A full disk, or a record that cannot be written, left a partial file behind.)
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(spool_dir)
    log.warning("enqueue_spooled", queue=queue.value, path=str(final), meant_for=record["database"])
    return final


# Spool files meant for another database, already reported by this process.
_SAID_ELSEWHERE: set[str] = set()
# Files of an earlier version (their "database" last) found meant for another database, by
# path and identity, with the (mtime, size) they had: passed over unread until edited.
_FOREIGN: dict[tuple[str, str], tuple[int, int]] = {}
# A spool file's first bytes when it names its database first (what this version writes).
_DATABASE_FIRST = re.compile(r'\{\s*"database"\s*:\s*("(?:[^"\\]|\\.)*"|null)\s*[,}]')
_HEAD_BYTES = 4096
# Spool files whose rejection could not be recorded, and when: left in place, said once, and
# passed over by this process for REJECTION_RETRY_S (the error may pass: a statement an
# administrator cancelled, an I/O error), so they hold up no file after them.
_REJECTION_FAILED: dict[str, float] = {}
REJECTION_RETRY_S = 600.0
# Spool files this user cannot delete or rename, already reported by this process.
_SAID_UNDELETABLE: set[str] = set()
# The suffix of a file the database refused and whose payload was too large to keep in its
# failed_operations row: set aside whole, so nothing is lost.
REFUSED_SUFFIX = ".refused"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def import_spool(spool_dir: Path, database: Database, identity: str | None = None) -> int:
    """Enqueue the spooled files, oldest first, deleting each after its commit, until
    SPOOL_FILES_PER_IMPORT files or SPOOL_IMPORT_BUDGET_S; returns files imported.

    A file meant for another database than ``identity`` is left where it is (and said once).
    """
    if not spool_dir.is_dir():
        return 0
    try:
        files = _spooled(spool_dir)
    except OSError as exc:
        log.error(
            "spool_unreadable",
            path=str(spool_dir),
            error=exc.strerror or str(exc),
            hint="enqueues spooled there are never imported until the worker's user can"
            " read the directory (chown it to that user)",
        )
        return 0
    _remove_abandoned_writes(spool_dir)
    imported = handled = 0
    deadline = time.monotonic() + SPOOL_IMPORT_BUDGET_S
    for position, path in enumerate(files):
        if handled >= SPOOL_FILES_PER_IMPORT or time.monotonic() > deadline:
            _say_left_for_next_tick(len(files) - position, imported)
            break
        if time.monotonic() < _REJECTION_FAILED.get(str(path), 0.0) + REJECTION_RETRY_S:
            continue  # (said when it failed; tried again once its wait is over)
        # (A file left for another database's worker is no work here: it counts for nothing,
        # and is told by its first bytes, or remembered, not parsed whole at every tick.)
        if identity and _known_elsewhere(path, identity):
            continue
        try:
            loaded = _load(path, database)
        except DatabaseUnavailable:
            log.warning("spool_import_paused", reason="database unavailable", left=str(path))
            break
        if loaded is not None and _meant_elsewhere(path, loaded[0], identity):
            _remember_elsewhere(path, identity)
            continue
        handled += 1
        if loaded is None:
            continue
        outcome = _import_one(path, database, *loaded)
        if outcome is None:
            break
        imported += outcome
    if imported:
        _fsync_dir(spool_dir)
    return imported


def _import_one(
    path: Path, database: Database, record: Any, fields: tuple[Queue, Any, str, str | None]
) -> bool | None:
    """Enqueue one file and delete it: True when imported here, False when rejected or taken
    by another importer, None when the import must pause (the database away or locked)."""
    queue, payload, key, source = fields
    try:
        with database.connection() as conn, lock_wait_limited(conn, ENQUEUE_TIMEOUT_MS):
            known = store.key_known(conn, queue, key)
            item_id = store.enqueue(conn, queue, payload, idempotency_key=key, source=source)
    except DatabaseUnavailable:
        log.warning("spool_import_paused", reason="database unavailable", left=str(path))
        return None
    except pg_errors.LockNotAvailable:
        log.warning(
            "spool_import_paused",
            reason=f"{queue.value} stayed locked by another session for"
            f" {ENQUEUE_TIMEOUT_MS // 1000} s (a migration, a transaction left open?)",
            left=str(path),
            hint="the files stay in the spool and are imported at the next tick",
        )
        return None
    except (InvalidPayload, ValueError, TypeError, psycopg.Error) as exc:
        # A file refused for what it holds must not hold up the files after it; any other
        # database error (no migrations, no privilege) blames no file and is raised.
        if isinstance(exc, psycopg.Error) and not refused_for_its_content(exc):
            raise
        _reject_or_leave(path, database, _refusal(exc), record)
        return False
    if not _delete_imported(path):
        return False
    if known:
        # (An enqueue whose COMMIT landed though its answer was lost, spooled all the same.)
        log.info(
            "spool_key_known",
            queue=queue.value,
            item_id=item_id,
            path=path.name,
            hint="its key was enqueued before, as this item: the file's payload was not"
            " enqueued again (a key is accepted once)",
        )
        return True
    log.info("spool_imported", queue=queue.value, item_id=item_id, path=path.name)
    return True


def _say_left_for_next_tick(left: int, imported: int) -> None:
    """One import reached its file or time limit: say how many files wait for the next."""
    log.info(
        "spool_import_limited",
        imported=imported,
        left=left,
        limit=SPOOL_FILES_PER_IMPORT,
        budget_s=SPOOL_IMPORT_BUDGET_S,
        hint="the rest are imported at the next ticks, up to this many files or seconds each",
    )


# Errors of the moment, not of the file: it is read again at the next tick, never set aside.
_TRY_AGAIN = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.EMFILE, errno.ENFILE})


def _load(path: Path, database: Database) -> tuple[Any, tuple[Queue, Any, str, str | None]] | None:
    """The file's record and its fields; None when it is gone, busy (left for the next tick)
    or was rejected as unreadable."""
    try:
        record = jsontext.loads(_read(path).decode("utf-8"))
        return record, _parse(record)
    except FileNotFoundError:
        _taken(path)
    except OSError as exc:
        if exc.errno not in _TRY_AGAIN:
            _reject_or_leave(path, database, f"unreadable spool file: {exc}", None)
            return None
        # Not the file's fault: another's lease on it (Samba, NFS), no descriptor left.
        log.warning(
            "spool_file_busy",
            path=path.name,
            error=str(exc),
            hint="left for the next tick",
        )
    except KeyError as exc:  # (str(KeyError) is the bare name: say what it is)
        _reject_or_leave(path, database, f"unreadable spool file: no {exc} field", None)
    except (ValueError, TypeError) as exc:
        _reject_or_leave(path, database, f"unreadable spool file: {exc}", None)
    return None


def _known_elsewhere(path: Path, identity: str) -> bool:
    """True for a file meant for another database, told without parsing it: by the database
    its first bytes name, or as a file of an earlier version found so before and unchanged."""
    meant_for = _declared_database(path)
    if meant_for is not _UNDECLARED:
        return _meant_elsewhere(path, {"database": meant_for}, identity)
    seen = _FOREIGN.get((str(path), identity))
    return seen is not None and seen == _signature(path)


def _remember_elsewhere(path: Path, identity: str | None) -> None:
    if identity and (signature := _signature(path)) is not None:
        _FOREIGN[(str(path), identity)] = signature


def _signature(path: Path) -> tuple[int, int] | None:
    """A file's (mtime, size): an edit (its "database" corrected) makes it another file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


_UNDECLARED = object()


def _declared_database(path: Path) -> object:
    """The database a file names in its first bytes (a string or None), read without the
    payload; ``_UNDECLARED`` when it does not start with it (an earlier version's file) or
    cannot be read (the import reports that)."""
    try:
        head = _read(path, _HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return _UNDECLARED
    found = _DATABASE_FIRST.match(head)
    if found is None:
        return _UNDECLARED
    try:
        meant_for = jsontext.loads(found.group(1))
    except ValueError:
        return _UNDECLARED
    return meant_for if isinstance(meant_for, str | None) else _UNDECLARED


def _meant_elsewhere(path: Path, record: Any, identity: str | None) -> bool:
    """True for a file meant for another database than ``identity`` (said once).

    Both are compared as :func:`~sokratos_worker.config.normalised_identity` spells them, so a
    file an earlier version named ``embedded:/srv/../srv/x`` is still this database's."""
    meant_for = record.get("database")
    if not (identity and isinstance(meant_for, str)):
        return False
    if identities_match(meant_for, identity):
        return False
    if path.name not in _SAID_ELSEWHERE:
        _SAID_ELSEWHERE.add(path.name)
        log.warning(
            "spool_file_for_another_database",
            path=str(path),
            meant_for=meant_for,
            this_worker=identity,
            hint="left in the spool: a worker on that database (same data directory) imports it",
        )
    return True


def _delete_imported(path: Path) -> bool:
    """Delete a file whose enqueue committed; False when another importer deleted it first
    (its enqueue here was a no-op: the key was already known)."""
    try:
        path.unlink()
    except FileNotFoundError:
        _taken(path)
        return False
    except OSError as exc:
        _say_undeletable(path, exc, "imported")
        return False
    return True


def _say_undeletable(path: Path, exc: OSError, done: str) -> None:
    """A file this user can read but not delete or rename (the spool made by another user):
    said once per process; the next imports repeat it harmlessly (its key makes the enqueue a
    no-op, its failure is recorded once) and go on with the files after it."""
    if path.name in _SAID_UNDELETABLE:
        log.debug("spool_file_still_undeletable", path=path.name)
        return
    _SAID_UNDELETABLE.add(path.name)
    log.error(
        "spool_file_undeletable",
        path=str(path),
        done=done,
        error=exc.strerror or str(exc),
        hint="the spool belongs to the worker's user: chown the spool directory and its files"
        " to that user (and make the directory writable by it); until then the file is"
        " imported again at every tick, without doubling anything (its idempotency key)",
    )


def _taken(path: Path) -> None:
    """Another importer (the start tick and a heartbeat, or a second process on this data
    directory) took the file after the listing: it is not a failure, and not ours to count."""
    log.debug("spool_file_taken_by_another_import", path=path.name)


def _parse(record: Any) -> tuple[Queue, Any, str, str | None]:
    """The fields of a spool record; TypeError/KeyError/ValueError when it is malformed."""
    queue = Queue(record["queue"])
    key, source = record["idempotency_key"], record.get("source")
    if not isinstance(key, str) or not isinstance(source, str | None):
        raise TypeError("idempotency_key and source must be strings")
    return queue, record["payload"], key, source


def _refusal(exc: Exception) -> str:
    """Why a file was refused, without the payload excerpt PostgreSQL's CONTEXT line quotes."""
    if isinstance(exc, psycopg.Error) and exc.sqlstate is None:
        return f"refused by psycopg before sending: {exc}"
    if isinstance(exc, psycopg.Error):
        detail = f": {exc.diag.message_detail}" if exc.diag.message_detail else ""
        return f"refused by the database ({exc.sqlstate}): {exc.diag.message_primary}{detail}"
    if isinstance(exc, InvalidPayload):
        return str(exc)
    return f"cannot be stored as jsonb: {exc}"


def _reject_or_leave(path: Path, database: Database, error: str, record: Any) -> None:
    """:func:`_reject`, except that a failure to record the rejection leaves the file in place
    (said once, passed over for REJECTION_RETRY_S) instead of stopping every file after it."""
    try:
        _reject(path, database, error, record)
    except DatabaseUnavailable:
        raise
    except psycopg.Error as exc:
        if refused_by_setup(exc):
            raise  # (no migrations, no privilege: no file's fault, every file would meet it)
        said_before = str(path) in _REJECTION_FAILED
        _REJECTION_FAILED[str(path)] = time.monotonic()
        (log.debug if said_before else log.error)(
            "spool_file_rejection_failed",
            path=str(path),
            error=error,
            failure=_refusal(exc),
            retry_in_s=REJECTION_RETRY_S,
            hint="the file stays in the spool, passed over for a while and then tried again;"
            " the files after it are imported. If it keeps failing, move it out of the spool"
            " and enqueue what it holds again once fixed",
        )


def _reject(path: Path, database: Database, error: str, record: Any) -> None:
    """A spool file that can never be enqueued becomes a failed_operations row.

    What it held is kept in a form PostgreSQL accepts: the record sanitized, else the raw text.
    A file this user cannot even read is renamed aside instead of deleted; so is one whose
    content the database refuses to store even in the failure (too large for jsonb, 54000):
    its row then says where the file is and how large it was.
    """
    try:
        context, unreadable = _rejection_context(path, record)
    except FileNotFoundError:
        _taken(path)
        return
    readable = unreadable is None
    if unreadable is not None:
        error = f"{error} ({unreadable})"
    aside: str | None = None if readable else f"{path}.unreadable"
    try:
        already = _record_rejection(database, path.name, error, context)
    except psycopg.Error as exc:
        if not refused_for_its_content(exc) or not readable:
            raise
        # The database refuses what the file holds even as a failure's context (a payload
        # over its 256 MB jsonb limit): record a note of it and keep the file itself aside.
        aside = f"{path}{REFUSED_SUFFIX}"
        already = _record_rejection(database, path.name, error, _note_of(path, record, aside))
    try:
        if aside is None:
            path.unlink(missing_ok=True)
        else:
            path.rename(aside)
    except FileNotFoundError:
        _taken(path)  # (the failure is recorded all the same: the file could not be read)
    except OSError as exc:
        _say_undeletable(path, exc, "rejected: its failure is recorded")
        aside = None  # (not set aside: still where it was)
    if already:
        log.info("spool_file_rejected_already_recorded", path=path.name)
    else:
        log.error("spool_file_rejected", path=path.name, error=error, set_aside_as=aside)


def _rejection_context(path: Path, record: Any) -> tuple[dict[str, Any], str | None]:
    """What a rejected file held, in a form PostgreSQL accepts, and why it could not be read
    (None when it could); FileNotFoundError when another importer took it."""
    if isinstance(record, dict):
        try:
            context, notes = sanitize_payload(record)
        except InvalidPayload:
            pass
        else:
            return ({**context, "_sanitized": notes} if notes else context), None
    try:
        return {"raw": clean_text(_read(path).decode("utf-8", "replace"))}, None
    except FileNotFoundError:
        raise
    except OSError as exc:
        return {"raw": None, "kept_as": f"{path}.unreadable"}, str(exc.strerror)


def _record_rejection(database: Database, name: str, error: str, context: Any) -> bool:
    """Record a rejected file's failure once; True when it was already recorded."""
    with database.connection() as conn, conn.transaction():
        if _rejection_recorded(conn, name, context):
            return True
        record_failure(
            conn, op_type="spool_import", label=name, error=clean_text(error), context=context
        )
    return False


def _note_of(path: Path, record: Any, aside: str) -> dict[str, Any]:
    """A failure's context for a file too large to store: its fields but the payload, the
    payload's size, and where the whole file is kept."""
    try:
        size = path.stat().st_size
    except OSError:
        size = -1
    fields = record if isinstance(record, dict) else {}
    kept = {
        name: clean_text(value)
        for name in ("queue", "idempotency_key", "source", "spooled_at", "database")
        if isinstance(value := fields.get(name), str)
    }
    return {
        **kept,
        "payload_omitted": f"the spool file is {size:,} bytes, more than the database stores"
        f" in one value; it is kept whole as {aside}: split what it holds into smaller items",
        "set_aside_as": aside,
    }


def _rejection_recorded(conn: psycopg.Connection, name: str, context: Any) -> bool:
    """True when this file's failure, with what it holds, is already recorded: by another
    importer rejecting it at the same moment, or by one that died before deleting it.

    The lock makes the check and the insert one step, so a file is one failure, never two; a
    file set aside as unreadable and later put back holds more than its first record, so it
    is recorded again.
    """
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtext('sokratos-spool-reject'), hashtext(%s))", (name,)
    )
    row = conn.execute(
        "SELECT 1 FROM failed_operations"
        " WHERE op_type = 'spool_import' AND label = %s AND context_data = %s LIMIT 1",
        (name, Jsonb(context)),
    ).fetchone()
    return row is not None


def _read(path: Path, limit: int = -1) -> bytes:
    """A spool file's bytes (its first ``limit``); OSError unless it is a regular file itself.

    A spool shared with producers under other users may hold what one of them planted: a
    symbolic link would have its target, a file only the worker may read (a credential),
    copied into failed_operations, and a FIFO would block the import (and the start) for ever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link (never followed)") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return handle.read(limit)


def _spooled(spool_dir: Path) -> list[Path]:
    """The spool's files, oldest first; OSError when the directory cannot be read
    (``Path.glob`` would say nothing and find nothing)."""
    with os.scandir(spool_dir) as entries:
        names = [e.name for e in entries if e.name.endswith(".json") and e.name[0] != "."]
    return [spool_dir / name for name in sorted(names)]


# A spool write's temporary file this old was abandoned (its producer killed before the
# rename, so it was never told "spooled"): removed, as it holds part of a conversation.
ABANDONED_WRITE_AGE_S = 3600.0


def _remove_abandoned_writes(spool_dir: Path) -> None:
    """Delete the temporary files of spool writes that never finished (see above)."""
    try:
        with os.scandir(spool_dir) as entries:
            stale = [
                e.path
                for e in entries
                if e.name.startswith(".")
                and e.name.endswith(".json.tmp")
                and time.time() - e.stat(follow_symlinks=False).st_mtime > ABANDONED_WRITE_AGE_S
            ]
        for path in stale:
            os.unlink(path)
            log.info(
                "spool_abandoned_write_removed",
                path=path,
                hint="a producer was stopped while it wrote this file, before it was told"
                " the enqueue was spooled; it held part of one enqueue, never a whole one",
            )
    except OSError as exc:  # (the import itself says what keeps it from the directory)
        log.debug("spool_abandoned_writes_not_removed", error=str(exc))


def pending_files(spool_dir: Path) -> int:
    """How many enqueues wait in the spool (0 when it cannot be read: see spool_problems)."""
    try:
        return len(_spooled(spool_dir)) if spool_dir.is_dir() else 0
    except OSError:
        return 0


def spool_problems(spool_dir: Path) -> list[str]:
    """What keeps spooled enqueues from being imported, for ``status``."""
    try:
        # Inside the try: is_dir() raises too when the data directory cannot be searched.
        if not spool_dir.is_dir():
            return []
        with os.scandir(spool_dir) as entries:
            names = [e.name for e in entries]
    except OSError as exc:
        return [
            f"cannot read {spool_dir} ({exc.strerror or exc}): what is spooled there is never"
            " imported; chown it to the worker's user"
        ]
    aside = sorted(n for n in names if n.endswith(".json.unreadable"))
    refused = sorted(n for n in names if n.endswith(f".json{REFUSED_SUFFIX}"))
    problems = []
    if aside:
        problems.append(
            f"{len(aside)} spool files set aside as unreadable ({_first_of(aside)}): make them"
            " readable by the worker's user and rename them to end in .json"
        )
    if refused:
        problems.append(
            f"{len(refused)} spool files set aside as too large for the database"
            f" ({_first_of(refused)}; 'failed list --op-type spool_import' lists their"
            " failures, 'failed show ID' names each file): split what each holds into smaller"
            " items and enqueue them, then delete the file"
        )
    return problems


def _first_of(names: list[str]) -> str:
    return names[0] + (", …" if len(names) > 1 else "")


def pending_elsewhere(spool_dir: Path, identity: str) -> dict[str, int]:
    """Spooled enqueues meant for another database than ``identity``, counted by database.

    No worker here imports them; ``status`` names them so a mistyped URL is not waited on.
    """
    counts: dict[str, int] = {}
    try:
        files = _spooled(spool_dir) if spool_dir.is_dir() else []
    except OSError:
        files = []  # said by spool_problems
    for path in files:
        meant_for = _declared_database(path)  # (this version's files: a few bytes read)
        if meant_for is _UNDECLARED:
            try:
                meant_for = jsontext.loads(_read(path).decode("utf-8")).get("database")
            except (OSError, ValueError, AttributeError):
                continue  # unreadable: the next import reports it as a failure
        if isinstance(meant_for, str) and not identities_match(meant_for, identity):
            counts[meant_for] = counts.get(meant_for, 0) + 1
    return counts
