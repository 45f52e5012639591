"""Pieces the daemon needs to run as a service: sd_notify, metrics and health endpoints.

Self-contained: nothing here schedules or reads settings, and only the watchdog talks to
PostgreSQL (a short connection of its own, to name the lock a stalled dispatcher waits for);
the daemon wires them in (``Notifier`` from the loop that proves progress, ``Metrics``
updated by the drain and the status query, ``MetricsServer`` when ``SOKRATOS_METRICS_ADDR``
is set, ``DatabaseContact`` told by each path how its contact with the database ended,
``DispatcherWatchdog`` told when the dispatcher comes round, ``BackgroundWrites`` running a
change of state's heartbeat row out of the state's report lock).
"""

from __future__ import annotations

from sokratos_worker.service.metrics import (
    CIRCUIT_STATE_VALUES,
    DURATION_BUCKETS,
    Metrics,
    MetricsServer,
    parse_addr,
)
from sokratos_worker.service.reachability import DatabaseContact
from sokratos_worker.service.sdnotify import Notifier

__all__ = [
    "CIRCUIT_STATE_VALUES",
    "DURATION_BUCKETS",
    "DatabaseContact",
    "Metrics",
    "MetricsServer",
    "Notifier",
    "parse_addr",
]
