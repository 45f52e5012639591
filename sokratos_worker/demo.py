"""``sokratos-worker demo``: sample items through the real pipelines with the bundled tiny model.

Everything lives in a throw-away data directory (embedded PostgreSQL included), so the demo
can never touch a real memory store.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import structlog

from sokratos_worker.command_database import database_url, stops_while_starting
from sokratos_worker.config import Settings
from sokratos_worker.exit_codes import EXIT_FAILURE, EXIT_OK
from sokratos_worker.model import Queue
from sokratos_worker.service.stop_requests import cleaned_up_at_exit_now
from sokratos_worker.store import report

log = structlog.get_logger(__name__)

DEMO_ROUNDS = 4

SAMPLE_TRIAGE: list[tuple[str, dict[str, Any]]] = [
    (
        "conversation",
        {
            "exchange": "user: My daughter Mia starts school in Graz next week, I'm nervous.\n"
            "assistant: That's a big step! Nervousness is normal.",
            "tools_used": False,
            "pipeline_id": 1001,
        },
    ),
    (
        "conversation",
        {
            "exchange": "[weather result] Vienna: 14°C, light rain\n"
            "user: do I need an umbrella today?\nassistant: Yes, light rain in Vienna.",
            "tools_used": True,
            "pipeline_id": 1002,
        },
    ),
    ("conversation", {"exchange": "user: thanks!\nassistant: :)"}),
    (
        "email",
        {
            "account": "demo",
            "mailbox": "INBOX",
            "uidvalidity": 1,
            "uid": 1,
            "message_id": "<offer-1@example.com>",
            "from": "Recruiting <jobs@example.com>",
            "to": "me@example.com",
            "cc": "",
            "subject": "Your offer from Example GmbH",
            "date": "Mon, 16 Mar 2026 09:00:00 +0100",
            "attachments": [{"name": "offer.pdf", "size": 48213}],
            "text": "From: Recruiting <jobs@example.com>\nTo: me@example.com\n"
            "Subject: Your offer from Example GmbH\nDate: 2026-03-16 09:00\n\n"
            "We are happy to offer you the position of Senior Engineer starting 1 May.",
        },
    ),
]

SAMPLE_ARCHIVE: dict[str, Any] = {
    "conversation_id": "demo-1",
    "messages": [
        {"role": "user", "content": "Find a climbing gym near my new flat in Leipzig."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "maps_search", "arguments": '{"q": "climbing Leipzig"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Kosmos Kletterzentrum, 2.1 km"},
        {"role": "assistant", "content": "Kosmos Kletterzentrum is 2.1 km from you."},
        {"role": "user", "content": "Great, I climb twice a week, I'll go there."},
    ],
}


def demo_settings(settings: Settings, data_dir: Path) -> Settings:
    """Only the bundled model, a private embedded database, quick retries, no email."""
    return settings.model_copy(
        update={
            "data_dir": data_dir,
            "database_url": None,
            "local_model": True,
            "llm_backends": [],
            "email_accounts": [],
            "retry_base": 1.0,
            "retry_max": 2.0,
        }
    )


def run_demo(settings: Settings, *, out: TextIO | None = None) -> int:
    """Enqueue the samples, drain until the queues are empty, print outcomes and memories.

    Ctrl-C, SIGTERM or SIGHUP stops it: during start-up, before the first round, at once
    (exit 0, as ``run``, and nothing is printed); during a round after the items in flight,
    between rounds at once (then the report so far is printed).
    """
    try:
        with stops_while_starting():
            return _run_demo(settings, out or sys.stdout)
    except KeyboardInterrupt:
        # The temporary directory and its embedded PostgreSQL are gone: nothing to report.
        log.warning(
            "stopped_while_starting",
            hint="a stop signal came before the demo's first round: nothing was processed",
        )
        return 0


def _run_demo(settings: Settings, out: TextIO) -> int:
    from sokratos_worker import client  # noqa: PLC0415 - heavy imports only for the demo
    from sokratos_worker.store.migrations import apply_migrations  # noqa: PLC0415

    stopped = threading.Event()
    with _throwaway_directory() as tmp:
        local = demo_settings(settings, tmp)
        with database_url(local) as url:
            apply_migrations(url)
            for n, (source, payload) in enumerate(SAMPLE_TRIAGE):
                client.enqueue(url, Queue.TRIAGE, payload, key=f"demo-triage-{n}", source=source)
            client.enqueue(url, Queue.DISTILLATION, SAMPLE_ARCHIVE, key="demo-archive")
            log.info("demo_enqueued", items=len(SAMPLE_TRIAGE) + 1)
            code = _rounds(local, url, stopped)
            if code != 0:
                return code
            try:
                print_report(url, out)
            except KeyboardInterrupt:
                # (start-up's handler is still in force; this is not "before the first round")
                out.write("\nInterrupted while printing the report.\n")
                log.warning("demo_report_interrupted", second_signal=stopped.is_set())
                return EXIT_FAILURE if stopped.is_set() else EXIT_OK
            if stopped.is_set():
                out.write("\nInterrupted: the report shows what was done until then.\n")
    return 0


@contextmanager
def _throwaway_directory() -> Iterator[Path]:
    """A temporary directory, removed at the end even when a stop signal comes meanwhile: a
    second Ctrl-C cut the removal short and left the demo's database in $TMPDIR. A second
    Ctrl-C during a round exits at once (os._exit), which removes it too."""
    path = Path(tempfile.mkdtemp(prefix="sokratos-demo-"))
    try:
        with cleaned_up_at_exit_now("demo_directory", lambda: _remove(path)):
            yield path
    finally:
        with _stop_signals_ignored():  # (the demo is ending: nothing is left to stop)
            shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove what can be removed, and say when something is left."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise OSError(f"{path} could not be removed entirely")


@contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP do nothing (in the main thread, which gets them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _rounds(local: Settings, url: str, stopped: threading.Event) -> int:
    """Up to DEMO_ROUNDS drains; a stop signal between two (the next one starting) ends
    them, and one before the first is raised (KeyboardInterrupt: still starting)."""
    from sokratos_worker.app import run_worker  # noqa: PLC0415

    done = 0
    try:
        for _ in range(DEMO_ROUNDS):
            code = run_worker(local, url, None, once=True, migrate=False, stopped=stopped)
            done += 1
            if code != 0:
                return code
            if stopped.is_set() or report.pending_count(url) == 0:
                break
    except KeyboardInterrupt:
        if done == 0:
            raise
        stopped.set()
    return 0


def print_report(url: str, out: TextIO) -> None:
    """The outcomes, then the memories, as plain text on stdout."""
    out.write("Outcomes\n")
    for o in report.outcomes(url):
        ids = ",".join(map(str, o.memory_ids)) or "-"
        out.write(f"  {o.queue}#{o.item_id} [{o.source}] {o.outcome} memories={ids} {o.detail}\n")
    out.write("\nMemories\n")
    for m in report.memories(url):
        superseded = f" superseded_by={m.superseded_by}" if m.superseded_by else ""
        tags = ",".join(m.tags)
        out.write(
            f"  #{m.id} ({m.memory_type}/{m.source}, salience {m.salience:g}, tags {tags})"
            f"{superseded}\n    {m.summary}\n"
        )
    left = report.pending_count(url)
    if left:
        out.write(f"\n{left} item(s) still waiting (retrying); the tiny model is slow and weak.\n")
