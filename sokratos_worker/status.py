"""``sokratos-worker status``: collect one report from the database and render it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from sokratos_worker.build import build_version
from sokratos_worker.cli_failed import terminal_safe
from sokratos_worker.command_database import EmbeddedUnavailable, database_url
from sokratos_worker.config import Settings
from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Outcome, Queue
from sokratos_worker.spool import pending_elsewhere, pending_files, spool_problems
from sokratos_worker.store import status as status_store
from sokratos_worker.store.connection import READ_ONLY_SERVER, connect, is_read_only
from sokratos_worker.store.migrations import pending_migrations


def collect_status(settings: Settings) -> dict[str, Any]:
    """The contract's ``status --json`` object (plus a few more keys)."""
    report: dict[str, Any] = {
        "database": "unreachable",
        "queues": {},
        "failures_24h": {},
        "failures_24h_closed": {},  # (of failures_24h: replayed, or the mail recorded since)
        "outcomes_24h": {},
        "workers": [],
        "email_accounts": [],
        "spooled": pending_files(settings.spool_dir),
        "spool_problems": spool_problems(settings.spool_dir),
        "spooled_for_other_databases": pending_elsewhere(
            settings.spool_dir, settings.database_identity
        ),
        "database_identity": settings.database_identity,
        # "embeddings" and "backends_configured" are this command's own configuration (its
        # environment): a worker's backends and embeddings are in its heartbeat ("workers").
        "configuration_of": CALLER,
        "embeddings": "configured"
        if settings.embeddings_enabled
        else "not configured: memories are saved without embeddings; no contradiction check",
        "backends_configured": [b.name for b in settings.llm_backends],
    }
    caller_has_backend = bool(settings.llm_backends or settings.local_model)
    try:
        with database_url(settings, wait=False) as url, connect(url) as conn:
            report["database"] = "ok"
            if is_read_only(conn):
                report["read_only"] = READ_ONLY_SERVER  # readable, but no worker can work here
            try:
                pending = pending_migrations(conn)
            except pg_errors.InsufficientPrivilege as exc:
                # A role without the worker's grants (sokratos_producer): the report with the
                # problem in it, exit 0 as documented (monitors read it); nothing is readable.
                report["unreadable"] = _lacks_grant(exc, conn)
            else:
                if pending:
                    report["migrations_pending"] = pending
                try:
                    _read_state(settings, conn, report)
                except psycopg.Error as exc:
                    report["unreadable"] = _why_unreadable(exc, conn, pending=bool(pending))
    except (DatabaseUnavailable, EmbeddedUnavailable) as exc:
        # Reported, not raised: scripts read "database" (contract §1), and status exits 0.
        report["error"] = str(exc)
    _warn(report, caller_has_backend=caller_has_backend)
    return report


def _why_unreadable(exc: psycopg.Error, conn: psycopg.Connection, *, pending: bool) -> str:
    """One line, not a traceback: a database not (fully) migrated, or a grant missing."""
    if pending:
        first = (exc.diag.message_primary or str(exc)).splitlines()[0]
        return f"{first}: run 'sokratos-worker migrate'"
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        return _lacks_grant(exc, conn)
    return (exc.diag.message_primary or str(exc)).splitlines()[0]


def _lacks_grant(exc: psycopg.Error, conn: psycopg.Connection) -> str:
    """A permission denial, and the grant that lets ``status`` read the worker's tables."""
    first = (exc.diag.message_primary or str(exc)).splitlines()[0]
    row = conn.execute("SELECT current_user").fetchone()  # (not the login's: SET ROLE)
    role = row[0] if row else conn.info.user
    return (
        f"{first}: role {role} may not read the worker's tables; run status as a role that"
        " has sokratos_worker (sql/roles.sql, docs/production.md §4)"
    )


CALLER = "this command's configuration, not necessarily the worker's"
NO_BACKEND = "no LLM backend configured: items wait"


def _warn(report: dict[str, Any], *, caller_has_backend: bool) -> None:
    """The top-level warning: from the live workers' heartbeats when there are any, else
    (labelled so) from this command's own configuration."""
    workers = report.get("workers") or []
    alive = [w for w in workers if not w.get("overdue")]
    if "read_only" in report:
        # (A live worker's heartbeat cannot be written either: it looked running, then hung.)
        report["warning"] = (
            "the database takes no writes: no worker can claim an item or write its heartbeat"
            " here, so the workers' states below are the last they wrote (a live one waits for"
            " the primary): items wait until the primary is back"
        )
    elif workers and not alive:
        report["warning"] = (
            "every worker listed is silent far past its heartbeat (killed without a word, or"
            " hung): items wait until a worker runs again"
        )
    elif alive:
        if all(w.get("cannot_process") for w in alive):
            report["warning"] = (
                "no live worker can process items (none has an LLM backend configured):"
                " items wait in their queues"
            )
    elif not caller_has_backend:
        read = "no live worker reports its own" if "workers" in report else "workers not read"
        report["warning"] = (
            f"no LLM backend configured ({CALLER}; {read}):"
            " a worker run so leaves items waiting in their queues"
        )


def cannot_process(worker: dict[str, Any]) -> str | None:
    """Why a live, running worker claims nothing, read from its heartbeat (None: it can)."""
    if worker.get("overdue") or worker.get("state") not in ("running", "no backend"):
        return None  # its state (or silence) says it already
    detail = worker.get("detail") or {}
    queues = detail.get("queues")
    if isinstance(queues, list):  # the queues it has handlers for
        if queues:
            return None
        return NO_BACKEND if not detail.get("backends") else "no queue handled: items wait"
    if isinstance(detail.get("backends"), list) and not detail["backends"]:
        return NO_BACKEND  # a heartbeat from before "queues" was recorded
    return None


# A table another session holds ACCESS EXCLUSIVE (a migration) is named, not waited for.
LOCK_TIMEOUT_MS = 2000


def _read_state(settings: Settings, conn: psycopg.Connection, report: dict[str, Any]) -> None:
    conn.execute(f"SET lock_timeout = {LOCK_TIMEOUT_MS}")
    unknown: list[str] = []
    # Tables already held are not read at all: one wait of 2 s each added up to 10 s or more.
    held = {lock["table"] for lock in status_store.locked_tables(conn)}

    def read(key: str, table: str, what: Callable[[], Any]) -> Any:
        if table in held:
            unknown.append(key)
            return None
        try:
            return what()
        except pg_errors.LockNotAvailable:
            unknown.append(key)
            return None

    for q in Queue:
        stats = read(
            q.value, q.value, partial(status_store.queue_stats, conn, (q,), next_retry=True)
        )
        report["queues"].update(stats or {})
    report["failures_24h"], report["failures_24h_closed"] = read(
        "failures_24h", "failed_operations", lambda: status_store.failures_24h_and_closed(conn)
    ) or ({}, {})
    report["outcomes_24h"] = (
        read("outcomes_24h", "work_outcomes", lambda: status_store.outcomes_24h(conn)) or {}
    )
    stale_after_s = max(180.0, settings.heartbeat_interval * 3)
    workers = read(
        "workers",
        "worker_heartbeats",
        lambda: status_store.live_workers(conn, stale_after_s=stale_after_s),
    )
    report["workers"] = workers or []
    for worker in report["workers"]:
        if why := cannot_process(worker):
            worker["cannot_process"] = why
    report["email_accounts"] = (
        read("email_accounts", "email_checkpoints", lambda: _accounts(settings, conn)) or []
    )
    if unknown:
        report["unknown_locked"] = unknown
        report["locked_tables"] = status_store.locked_tables(conn)


def _accounts(settings: Settings, conn: Any) -> list[dict[str, Any]]:
    """The accounts this command is configured with; without any (a shell other than the
    worker's), each account's latest mailbox the database has checked, marked ``from_database``: an
    empty list there hid an account failing every check."""
    from sokratos_worker.email.check import account_statuses  # noqa: PLC0415

    if settings.email_accounts:
        return account_statuses(conn, [(a.name, a.mailbox) for a in settings.email_accounts])
    # One row per account, its latest: the row a renamed mailbox left behind keeps its last
    # error for good, which would read as a failing account.
    latest: dict[str, dict[str, Any]] = {}
    for row in account_statuses(conn):
        seen = max(row["last_check_at"] or "", row["last_error_at"] or "")
        kept = latest.get(row["name"])
        if kept is None or seen > max(kept["last_check_at"] or "", kept["last_error_at"] or ""):
            latest[row["name"]] = row
    return [{**a, "from_database": True} for a in latest.values()]


LOCKED = "its table is locked by another session: see 'locked'"


def render_status(report: dict[str, Any]) -> str:
    """Human-readable text for a terminal."""
    lines = [
        f"database: {report['database']}" + (f" ({report['error']})" if "error" in report else "")
    ]
    if "read_only" in report:
        lines.append(f"read-only: {report['read_only']}")
    if report.get("migrations_pending"):
        lines.append(
            f"schema: lacks {', '.join(report['migrations_pending'])}:"
            " run 'sokratos-worker migrate'"
        )
    if "warning" in report:
        lines.append(f"warning: {report['warning']}")
    lines += _queue_lines(report)
    if report.get("spooled"):
        lines.append(f"spool: {report['spooled']} enqueues waiting for import")
    for problem in report.get("spool_problems") or []:
        lines.append(f"spool: {problem}")
    for meant_for, count in (report.get("spooled_for_other_databases") or {}).items():
        lines.append(
            f"    {count} of them for {meant_for}, not this database"
            f" ({report.get('database_identity')}): only a worker on that one imports them"
            " (a mistyped URL? docs/production.md, 'The enqueue spool')"
        )
    if report["database"] != "ok" or "unreadable" in report:  # nothing below can be known
        why = report.get("unreadable", "no database")
        lines.append(
            f"queues, failures (24h), outcomes (24h), workers, email accounts: unknown ({why})"
        )
        lines.append(_embeddings_line(report))
        return "\n".join(lines)
    unknown = report.get("unknown_locked") or []
    lines += [
        _lock_line(tables, holder)
        for tables, holder in status_store.by_holder(report.get("locked_tables") or [])
    ]
    # An op_type is whatever a producer or Sokratos wrote: shown, never obeyed, by the terminal.
    closed = report.get("failures_24h_closed") or {}
    failures = (
        ", ".join(
            f"{terminal_safe(k)} {v}" + (f" ({closed[k]} closed since)" if closed.get(k) else "")
            for k, v in report["failures_24h"].items()
        )
        or "none"
    )
    lines.append(
        f"failures (24h): {f'unknown ({LOCKED})' if 'failures_24h' in unknown else failures}"
    )
    lines.append(f"outcomes (24h): {_outcomes_text(report, unknown)}")
    lines += _worker_lines(report, unknown)
    if "email_accounts" in unknown:
        lines.append(f"email accounts: unknown ({LOCKED})")
    accounts = report["email_accounts"]
    if any(a.get("from_database") for a in accounts):
        lines.append(
            "email (each account's latest mailbox the database has checked: this command has"
            " no SOKRATOS_EMAIL_ACCOUNTS):"
        )
    for a in accounts:
        err = f", last error: {_one_line(a['last_error'])}" if a.get("last_error") else ""
        mailbox = f" {a['mailbox']}" if a.get("from_database") else ""
        lines.append(f"email {a['name']}{mailbox}: last check {a['last_check_at'] or 'never'}{err}")
    lines.append(_embeddings_line(report))
    return "\n".join(lines)


def _worker_lines(report: dict[str, Any], unknown: list[str]) -> list[str]:
    """One line per worker listed, then the builds line when they run different code."""
    if "workers" in unknown:
        return [f"workers: unknown ({LOCKED})"]
    if not report["workers"]:
        return ["workers: none running"]
    lines = []
    for w in report["workers"]:
        backends = ", ".join(_backend_text(b) for b in w["backends"]) or "none"
        # Heartbeats written before the worker recorded it have no "embeddings".
        embeddings = w.get("detail", {}).get("embeddings")
        lines.append(
            f"worker {w['worker_id']}: {_worker_state(w)}, last tick {w['last_tick_at']},"
            f" backends: {backends}"
            + (f", embeddings: {embeddings}" if embeddings else "")
            + f", version {w['version']}"
        )
    if builds := _builds_line(report["workers"]):
        lines.append(builds)
    return lines


def _builds_line(workers: list[dict[str, Any]]) -> str | None:
    """Said when the live workers run different code (a rolling upgrade part-way, or a
    worker left on the old code), with how many run each."""
    running = Counter(str(w["version"]) for w in workers if not w.get("overdue"))
    if len(running) < 2:
        return None
    each = ", ".join(f"{version} ({n})" for version, n in sorted(running.items()))
    return (
        f"builds: the live workers run {len(running)} different builds: {each}; this command"
        f" is {build_version()} (restart the others once the upgrade is done)"
    )


def _outcomes_text(report: dict[str, Any], unknown: list[str]) -> str:
    """``pending_triage saved 12, skipped 3; pending_distillation archived 1``."""
    if "outcomes_24h" in unknown:
        return f"unknown ({LOCKED})"
    per_queue = [
        f"{queue} " + ", ".join(f"{o} {counts[o]}" for o in _in_outcome_order(counts))
        for queue, counts in sorted((report.get("outcomes_24h") or {}).items())
    ]
    return "; ".join(per_queue) or "none"


def _in_outcome_order(counts: dict[str, int]) -> list[str]:
    """saved, skipped, archived, failed; then any outcome a newer version records."""
    known = [o.value for o in Outcome if o.value in counts]
    return known + sorted(set(counts) - set(known))


def _embeddings_line(report: dict[str, Any]) -> str:
    """The embedding model of whoever's configuration the report holds (this command's)."""
    of = report.get("configuration_of")
    return (
        f"embeddings ({of}): {report['embeddings']}"
        if of
        else f"embeddings: {report['embeddings']}"
    )


def _queue_lines(report: dict[str, Any]) -> list[str]:
    """One line per queue (and per lease owner), in the queues' order; unknown if locked."""
    lines = []
    for name in (q.value for q in Queue):
        q = report["queues"].get(name)
        if q is None:
            if name in (report.get("unknown_locked") or []):
                lines.append(f"{name}: unknown ({LOCKED})")
            continue
        age = q["oldest_ready_age_s"]
        lines.append(
            f"{name}: {q['ready']} ready, {q['backing_off']} backing off, {q['leased']} leased"
            + (f", oldest ready {age:.0f}s" if age is not None else "")
        )
        lines += [f"    leased by {owner}: {n}" for owner, n in q.get("leased_by", {}).items()]
        lines += _never_ending_lines(q)
        if nxt := q.get("next_retry"):
            lines.append(
                f"    next retry: item {nxt['item_id']} {_when(nxt)}, after"
                f" {nxt['attempts']} attempt(s)"
                + (f"; last error: {_one_line(nxt['last_error'])}" if nxt["last_error"] else "")
            )
    return lines


def _when(next_retry: dict[str, Any]) -> str:
    """``in 90s``, or ``never (run_after is infinity)``: a report has no number for never."""
    if next_retry["in_s"] is None:
        return f"never ({next_retry.get('never') or 'no time set'})"
    return f"in {next_retry['in_s']:.0f}s"


def _never_ending_lines(q: dict[str, Any]) -> list[str]:
    """Rows no worker wrote so (store.status._never_ending), as they are, and how to end it."""
    lines = []
    if n := q.get("leased_without_owner"):
        lines.append(f"    leased by no worker (lease_owner is null): {n}")
    if n := q.get("lease_never_ends"):
        lines.append(
            f"    leased for ever: {n} (lease_expires_at is infinity: the lease never expires,"
            " so no worker ever claims it; set lease_expires_at = NULL to release it)"
        )
    if n := q.get("never_due"):
        lines.append(
            f"    never due: {n} (run_after is infinity: no worker claims it; set run_after ="
            " now() to run it)"
        )
    return lines


# A last error is one line of `status`, however long the server's message was.
LAST_ERROR_SHOWN_CHARS = 300


def _one_line(text: str) -> str:
    """An error shown on one line, its control characters escaped (it may quote a server)."""
    flat = terminal_safe(" ".join(str(text).split()))
    if len(flat) <= LAST_ERROR_SHOWN_CHARS:
        return flat
    return flat[:LAST_ERROR_SHOWN_CHARS] + " …"


def _lock_line(tables: str, holder: dict[str, Any]) -> str:
    """Tables another session holds: who, since when, doing what, and how to end it."""
    them = "them" if "," in tables else "it"
    return (
        f"locked: {tables} by {status_store.describe_holder(holder)}: workers wait for {them}"
        f" and {them} read{'' if them == 'them' else 's'} as unknown here; a migration? else"
        f" end it: SELECT pg_terminate_backend({holder['pid']})"
    )


def _worker_state(worker: dict[str, Any]) -> str:
    """``running``, or the state and why (also: silent far past its heartbeat)."""
    state = str(worker["state"])
    if worker.get("overdue"):
        return (
            f"{state}? no heartbeat for {worker['silent_s']:.0f}s (expected every"
            f" {worker['detail']['heartbeat_s']:g}s): killed without a word, or hung"
        )
    idle = worker.get("cannot_process") or cannot_process(worker)
    if idle and state == "running":
        return f"{state}, but {idle}"  # a heartbeat of a worker from before "no backend" said it
    detail = worker.get("detail") or {}
    why = detail.get("why") if state != "running" else detail.get("lock_wait")
    why = why or idle
    return f"{state} ({why})" if why else state


def _backend_text(backend: dict[str, Any]) -> str:
    """``brain closed``, or why it is not: failures, next probe and the last error."""
    text = f"{backend['name']} {backend['circuit']}"
    failures = backend.get("consecutive_failures") or 0
    if backend["circuit"] == "closed" and not failures:
        return text
    why = [f"{failures} failures in a row"]
    if backend.get("retry_in_s"):
        why.append(f"next probe in {backend['retry_in_s']:.0f}s")
    if backend.get("last_error"):
        why.append(f"last error: {_one_line(backend['last_error'])}")
    return f"{text} ({'; '.join(why)})"
