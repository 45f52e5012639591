"""Test handlers whose behaviour is chosen by the payload, and the daemon entry point using them.

Payload key ``behaviour``: ``ok`` (default; saves one memory), ``skip``, ``fail`` (every
attempt fails), ``fail_once`` (first attempt fails), ``invalid`` (InvalidPayload),
``unavailable`` (BackendsUnavailable), ``sleep:SECONDS`` (then ok), ``crash`` (os._exit).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from sokratos_worker.config import Settings
from sokratos_worker.errors import BackendsUnavailable, InvalidPayload, ItemError
from sokratos_worker.handlers import HandlerContext, Handlers
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue


class ScriptedHandler:
    """Does what the payload says; counts calls (thread-safe)."""

    def __init__(self, *, probe_ok: bool = True) -> None:
        self.calls = 0
        self.probe_ok = probe_ok
        self.lock = threading.Lock()

    def handle(self, item: Item) -> Effects:
        with self.lock:
            self.calls += 1
        behaviour = str(item.payload.get("behaviour", "ok"))
        if behaviour.startswith("sleep:"):
            time.sleep(float(behaviour.split(":", 1)[1]))
            behaviour = "ok"
        if behaviour == "crash":
            os._exit(137)
        if behaviour == "fail" or (behaviour == "fail_once" and item.attempt == 1):
            raise ItemError(f"scripted failure on attempt {item.attempt}", backend="scripted")
        if behaviour == "invalid":
            raise InvalidPayload("payload.exchange", "is scripted to be invalid")
        if behaviour == "unavailable":
            raise BackendsUnavailable("every backend unreachable (scripted)")
        if behaviour == "skip":
            return Effects(Outcome.SKIPPED, detail="scripted skip")
        if behaviour == "noop":
            return Effects(Outcome.SKIPPED)
        memory = NewMemory(origin=item.origin(0), summary=f"memory of item {item.id}", salience=5)
        return Effects(Outcome.SAVED, memories=(memory,), backend="scripted")

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        if item.queue is Queue.DISTILLATION:
            return (
                NewMemory(
                    origin=item.origin(0),
                    summary="raw archive",
                    salience=3,
                    source="conversation_archive",
                    tags=("conversation_archive",),
                ),
            )
        return ()

    def probe(self) -> bool:
        return self.probe_ok


def fast_settings(**overrides: object) -> Settings:
    """Settings for in-process runner tests: retries back off 10-20 ms, a 30 s lease."""
    values: dict[str, object] = {
        "concurrency": 2,
        "retry_base": 0.01,
        "retry_max": 0.02,
        "lease": 30,
        "shutdown_grace": 5,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def scripted_handlers(_: HandlerContext) -> Handlers:
    """Both queues handled by :class:`ScriptedHandler`."""
    handler = ScriptedHandler()
    return {Queue.TRIAGE: handler, Queue.DISTILLATION: handler}


def main() -> int:
    """``python -m tests.support.handlers run …``: the real daemon with scripted handlers."""
    from sokratos_worker.cli import main as cli_main

    return cli_main(sys.argv[1:], handler_factory=scripted_handlers)


if __name__ == "__main__":
    raise SystemExit(main())
