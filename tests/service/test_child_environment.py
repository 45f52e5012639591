"""The processes the worker starts do not get its secrets.

The worker reads its secrets from SOKRATOS_* variables (and libpq's PGPASSWORD); the local
model server (llama-cpp-python, a third-party HTTP server) and the embedded PostgreSQL (run as
another OS user when the worker is root) were started with the worker's whole environment, so
every API key, IMAP password and the database password sat in /proc/<child>/environ.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.llm.test_local_process import StandIn

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

API_KEY = "sk-r6-secret-api-key-0123456789"
IMAP_PASSWORD = "r6-imap-password-secret"
DB_PASSWORD = "r6-db-password-secret"


def _secret_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "SOKRATOS_LLM_BACKENDS",
        json.dumps([{"name": "a", "url": "http://127.0.0.1:9/v1", "model": "m",
                     "api_key": API_KEY}]),
    )  # fmt: skip
    monkeypatch.setenv(
        "SOKRATOS_EMAIL_ACCOUNTS",
        json.dumps([{"name": "me", "host": "imap.example.org", "username": "me",
                     "password": IMAP_PASSWORD}]),
    )  # fmt: skip
    monkeypatch.setenv("SOKRATOS_DATABASE_URL", f"postgresql://u:{DB_PASSWORD}@db.example/x")


def _environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode("utf-8", "replace")


def test_local_model_server_does_not_inherit_the_workers_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _secret_environment(monkeypatch)
    server = StandIn(n_threads=1, startup_timeout=60)
    server.start()
    try:
        assert server._process is not None
        environ = _environ(server._process.pid)
    finally:
        server.stop()
    leaked = [s for s in (API_KEY, IMAP_PASSWORD, DB_PASSWORD) if s in environ]
    assert leaked == [], f"the local model server's environment holds {leaked}"


def test_embedded_postgres_does_not_inherit_the_workers_secrets(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Embedded mode: no database URL, but the backends' keys and the IMAP passwords are set.
    _secret_environment(monkeypatch)
    monkeypatch.delenv("SOKRATOS_DATABASE_URL")
    from sokratos_worker.store.embedded import start_embedded

    data_dir = Path("/tmp") / f"childenv-{tmp_path_factory.getbasetemp().name}"
    handle = start_embedded(data_dir)
    try:
        pid = handle.server.get_pid()
        environ = _environ(pid)
    finally:
        handle.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    leaked = [s for s in (API_KEY, IMAP_PASSWORD) if s in environ]
    assert leaked == [], f"the embedded PostgreSQL's environment holds {leaked}"
    assert API_KEY in os.environ["SOKRATOS_LLM_BACKENDS"]  # the worker's own is back


def test_proxy_variables_are_withheld_too() -> None:
    # A proxy URL may carry a password (production.md counts it a secret); neither child
    # reaches out.
    from sokratos_worker.child_environment import child_environment

    given = child_environment(
        {
            "HTTPS_PROXY": "http://u:proxy-secret@proxy:3128",
            "all_proxy": "socks5://u:pw@proxy:1080",
            "PGPASSWORD": "x",
            "SOKRATOS_LLM_BACKENDS": "[]",
            "HOME": "/root",
            "PATH": "/usr/bin",
        }
    )
    assert given == {"HOME": "/root", "PATH": "/usr/bin"}
