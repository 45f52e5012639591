"""Connections, pools and the translation of psycopg errors into ours."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from sokratos_worker import libpq
from sokratos_worker.config import ConfigError
from sokratos_worker.errors import ConnectionLimitReached, DatabaseUnavailable, PoolBusy

# SQLSTATE classes that mean "the database is not reachable now", not "the query is wrong".
# 25006: a server that takes no writes (a standby before or after a failover) is waited out.
_READ_ONLY = "25006"
# 53100, 53200, 53300: the server short of a resource (a full disk, memory, connections) is
# waited out, never counted against the item being settled (53400, a configured limit such
# as max_locks_per_transaction, one item's statement can exceed: it stays the item's).
# 57P05 and 25P03: a connection the server ended for idling.
_TRANSIENT_PREFIXES = (
    "08",
    "53100",
    "53200",
    "53300",
    "57P01",
    "57P02",
    "57P03",
    "57P05",
    "25P03",
    "40001",
    "40P01",
    _READ_ONLY,
)

# Settings an operator may have set on the role or database for other clients, which would
# turn waits the worker is built for into failures: pooled connections closed while idle,
# a claim or a settle cancelled while it waits for a lock. The worker bounds its own
# statements where it needs to (SET LOCAL). Only those the server has (PostgreSQL 14+: the
# idle session timeout; 17+: the transaction timeout).
# And a commit must be durable before the worker acts on it (a spool file is deleted after
# its item's commit): synchronous_commit = off is raised to on; 'local' and the replica
# levels are as durable on the primary, and kept.
# And transactions are READ COMMITTED, whatever the default: a settle's near-duplicate check
# under its lock must see what another settle committed while it waited (under REPEATABLE
# READ two slots each saved the same fact), and a claim must not fail for a row another
# worker changed (serialization failures, taken for an outage).
# And the server's own TCP keepalives, unless its configuration sets them: a worker whose
# host vanished (power lost, a network cut) kept its session, and the locks it held (an
# email account's), for the kernel's two hours; now about a minute, as KEEPALIVES on the
# worker's side (the server ignores them on a Unix socket).
_SESSION_SETTINGS = """SELECT set_config(name, '0', false) FROM pg_settings
    WHERE name IN ('idle_session_timeout', 'statement_timeout', 'lock_timeout',
                   'transaction_timeout')
    UNION ALL
    SELECT set_config('synchronous_commit', 'on', false)
    WHERE current_setting('synchronous_commit') = 'off'
    UNION ALL
    SELECT set_config('default_transaction_isolation', 'read committed', false)
    WHERE current_setting('default_transaction_isolation') <> 'read committed'
    UNION ALL
    SELECT set_config(s.name, wanted.value, false)
    FROM (VALUES ('tcp_keepalives_idle', '30'), ('tcp_keepalives_interval', '10'),
                 ('tcp_keepalives_count', '3'), ('tcp_user_timeout', '60000'))
        AS wanted(name, value)
    JOIN pg_settings s ON s.name = wanted.name AND s.source = 'default'"""

READ_ONLY_SERVER = (
    "the server is read-only (a standby, or default_transaction_read_only is on); the worker"
    " needs the primary: point SOKRATOS_DATABASE_URL at it (with several hosts, add"
    " target_session_attrs=read-write)"
)


# SQLSTATE classes that blame the values sent, not the database: data exceptions (22P05 a NUL
# in jsonb, 22023 a missing field) and program limits (54000 an oversized jsonb or index row).
# Any other refusal (a missing privilege or table, a full disk) would refuse every input alike.
_REFUSED_CONTENT = ("22", "54")


def refused_for_its_content(exc: BaseException) -> bool:
    """True when a statement was refused for the values it carried: SQLSTATE class 22 or 54,
    or a DataError psycopg raised itself before sending (no SQLSTATE: a NUL in a text
    parameter)."""
    if not isinstance(exc, psycopg.Error):
        return False
    if exc.sqlstate is None:
        return isinstance(exc, psycopg.DataError)
    return exc.sqlstate.startswith(_REFUSED_CONTENT)


# SQLSTATE classes of a refusal the setup causes, not an item: 42 (a privilege revoked, a
# table or function missing), 3F (a schema missing).
_REFUSED_BY_SETUP = ("42", "3F")


def claim_refusal(exc: psycopg.Error) -> str:
    """The claim's refusal in one line: the server's message and its SQLSTATE."""
    first = (exc.diag.message_primary or str(exc) or type(exc).__name__).splitlines()[0]
    return f"the database refuses the claim: {first} (SQLSTATE {exc.sqlstate})"


def refused_by_setup(exc: BaseException) -> bool:
    """True when the server refused a statement for the setup (a privilege, a missing table
    or schema), which no item causes and every item would meet."""
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "")[:2] in _REFUSED_BY_SETUP


def is_transient(exc: BaseException) -> bool:
    """True for errors that go away by themselves: lost connections, restarts, conflicts."""
    if isinstance(exc, PoolTimeout | DatabaseUnavailable):
        return True
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        sqlstate: str | None = exc.sqlstate
        if sqlstate is None:
            # No SQLSTATE: the client lost or never had a connection (refused, reset, closed).
            return not isinstance(exc, pg_errors.InsufficientPrivilege)
        return sqlstate.startswith(_TRANSIENT_PREFIXES)
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate or ""
        return sqlstate.startswith(_TRANSIENT_PREFIXES)
    return False


# The server short of a full disk or memory (53100, 53200): it refused the statement, so
# its transaction rolled back, and nothing the item did caused it.
_SHORT_OF_A_RESOURCE = ("53100", "53200")


def server_short_of_a_resource(exc: BaseException) -> bool:
    """True when ``exc`` (or what it was translated from) is the server refusing a statement
    for a full disk or no memory: the transaction surely rolled back, unlike a lost connection."""
    found: BaseException | None = exc
    while found is not None:
        if isinstance(found, psycopg.Error) and (found.sqlstate or "") in _SHORT_OF_A_RESOURCE:
            return True
        found = found.__cause__
    return False


# What the server answers a new connection when a limit, not an outage, refuses it: the role's
# or database's CONNECTION LIMIT, max_connections (libpq gives these as text, no SQLSTATE).
CONNECTION_LIMIT_REFUSALS = (
    "too many connections for role",
    "too many connections for database",
    "sorry, too many clients already",
    "remaining connection slots are reserved",
)


def refused_for_a_connection_limit(exc: BaseException) -> bool:
    """True when the server answered a new connection and refused it for a limit."""
    text = str(exc)
    return any(refusal in text for refusal in CONNECTION_LIMIT_REFUSALS)


@contextmanager
def translated() -> Iterator[None]:
    """Re-raise transient psycopg errors as :class:`DatabaseUnavailable` (a refusal for a
    connection limit as :class:`ConnectionLimitReached`: the server answered it)."""
    try:
        yield
    except (psycopg.Error, PoolTimeout) as exc:
        if is_transient(exc):
            reason = READ_ONLY_SERVER if _sqlstate(exc) == _READ_ONLY else _first_line(exc)
            if refused_for_a_connection_limit(exc):
                raise ConnectionLimitReached(f"database unavailable: {reason}") from exc
            raise DatabaseUnavailable(f"database unavailable: {reason}") from exc
        raise


@contextmanager
def time_limited(conn: psycopg.Connection, timeout_ms: int) -> Iterator[None]:
    """A transaction whose statements PostgreSQL cancels past ``timeout_ms`` (QueryCanceled)."""
    with conn.transaction():
        conn.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
        yield


@contextmanager
def lock_wait_limited(conn: psycopg.Connection, timeout_ms: int) -> Iterator[None]:
    """A transaction whose statements give up waiting for a lock past ``timeout_ms``
    (LockNotAvailable), however long they take once they hold it."""
    with conn.transaction():
        conn.execute(f"SET LOCAL lock_timeout = {int(timeout_ms)}")
        yield


def is_read_only(conn: psycopg.Connection) -> bool:
    """True when this session takes no writes (a standby, default_transaction_read_only)."""
    row = conn.execute("SHOW transaction_read_only").fetchone()
    return row is not None and row[0] == "on"


def _sqlstate(exc: BaseException) -> str | None:
    return exc.sqlstate if isinstance(exc, psycopg.Error) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


# A server that vanished without closing the TCP connection (a host down, a network cut)
# is noticed in about a minute instead of never (libpq ignores these on Unix sockets).
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    # Keepalives stay silent while sent data is unacknowledged (a claim sent into a network
    # cut would wait ~15 minutes of retransmissions): give up after the same minute then.
    "tcp_user_timeout": (30 + 10 * 3) * 1000,
}


def with_keepalives(conninfo: str) -> str:
    """``conninfo`` with TCP keepalives, unless it sets them itself, and UTF-8 always: under
    another client_encoding (the URL's, PGCLIENTENCODING) a message in Japanese could not be
    sent at all, and its account's check would stop at it for good."""
    given = conninfo_to_dict(conninfo)
    keepalives = {k: v for k, v in KEEPALIVES.items() if k not in given}
    return make_conninfo(conninfo, **keepalives, client_encoding="UTF8")


# What the server answers when the URL itself is wrong: waiting will not help. These come
# without a SQLSTATE (libpq reports start-up failures as text), like a refused connection.
_LOGIN_REFUSED = (
    "authentication failed",
    "no pg_hba.conf entry",
    "does not exist",  # the role or the database
    "permission denied for database",
)


class DatabaseLoginRefused(ConfigError):
    """The server answered and refused this URL's login: fix SOKRATOS_DATABASE_URL."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            "SOKRATOS_DATABASE_URL",
            f"the server refused the login ({detail}): check the user, password and database name",
        )


class DatabaseOptionRefused(ConfigError):
    """libpq or the server refused a connection option: fix the variable that gave it."""

    def __init__(self, variable: str, detail: str, remedy: str | None = None) -> None:
        if remedy is None:
            remedy = (
                "correct it in the URL"
                if variable == "SOKRATOS_DATABASE_URL"
                else "libpq applies this variable to the database connection: correct or unset it"
            )
        super().__init__(variable, f"a connection option was refused ({detail}); {remedy}")


def option_refused(text: str, conninfo: str) -> DatabaseOptionRefused | None:
    """The configuration error in libpq's or the server's refusal ``text``, or None."""
    options = conninfo_to_dict(conninfo)
    pooled = libpq.startup_parameter_refusal(text, options)
    if pooled is not None:
        variable, parameter, detail = pooled
        return DatabaseOptionRefused(variable, detail, _pooler_remedy(variable, parameter, options))
    found = libpq.refusal(text, options)
    return DatabaseOptionRefused(*found) if found is not None else None


def _pooler_remedy(variable: str, parameter: str, url_options: Mapping[str, object]) -> str:
    """What to do when a pooler refuses ``parameter``: say who sent it and how to stop that."""
    if variable != "SOKRATOS_DATABASE_URL":
        sender, stop = f"{variable} sends {parameter}", f"unset {variable}"
    elif parameter in url_options:
        sender = f"SOKRATOS_DATABASE_URL sends it as {parameter}="
        stop = f"remove {parameter}= from the URL"
    else:
        # Neither the URL nor a PG* variable: a service file, or a bug of ours.
        sender = f"neither SOKRATOS_DATABASE_URL nor a PG* variable sets {parameter}"
        stop = (
            "remove it from the service file that the URL's service= or PGSERVICE names"
            " (without one, sokratos-worker sent it itself: please report it)"
        )
    return (
        "a connection pooler such as PgBouncer refuses startup parameters it does not track,"
        f" and {sender}: {stop} and make the setting the role's default on the server instead"
        f" (ALTER ROLE ... SET), or add {parameter} to PgBouncer's ignore_startup_parameters"
        " (it then drops the parameter unapplied)"
    )


def connect(
    conninfo: str,
    *,
    autocommit: bool = True,
    timeout: float = 10.0,
    worker_settings: bool = False,
) -> psycopg.Connection:
    """One connection outside any pool (migrations, LISTEN, CLI commands).

    ``worker_settings``: apply :func:`worker_session`, for the daemon's own connections only,
    made once a transaction pooler was refused (store/sessions.py): the settings stay on the
    server session, which such a pooler would hand on to other clients with them.
    """
    try:
        with translated():
            conn = psycopg.connect(
                with_keepalives(conninfo), autocommit=autocommit, connect_timeout=int(timeout)
            )
            if worker_settings:
                try:
                    worker_session(conn)
                except BaseException:
                    conn.close()
                    raise
            return conn
    except DatabaseUnavailable as exc:
        cause = exc.__cause__
        text = str(cause or exc)
        refused = option_refused(text, conninfo) if cause is not None else None
        if refused is not None:
            raise refused from cause
        if cause is not None and any(marker in text for marker in _LOGIN_REFUSED):
            raise DatabaseLoginRefused(_fatal_line(text)) from cause
        raise


def worker_session(conn: psycopg.Connection) -> None:
    """Turn off the role's or database's timeouts for this session, and make its commits
    durable (see _SESSION_SETTINGS)."""
    conn.execute(_SESSION_SETTINGS)
    if not conn.autocommit:
        conn.commit()


def _fatal_line(text: str) -> str:
    """``FATAL:  password authentication failed for user "x"`` out of libpq's message."""
    _, sep, fatal = text.partition("FATAL:")
    return " ".join((fatal if sep else text).split())


def make_pool(
    conninfo: str,
    *,
    size: int,
    keep_open: int = 1,
    name: str = "sokratos-worker",
    configure: Callable[[psycopg.Connection], None] | None = None,
) -> _ReconnectingPool:
    """A pool whose connections are probed before use and replaced when broken.

    Each new connection gets :func:`worker_session` (the pool is the daemon's, made after
    ``refuse_shared_sessions``), then ``configure``, before the pool lends it out.

    ``keep_open`` connections are opened at start (in the background) and kept; the pool
    grows beyond them one connection at a time, on demand, up to ``size``.
    """

    def configure_session(conn: psycopg.Connection) -> None:
        worker_session(conn)
        if configure is not None:
            configure(conn)

    return _ReconnectingPool(
        with_keepalives(conninfo),
        min_size=max(1, min(keep_open, size)),
        max_size=max(1, size),
        kwargs={"autocommit": True, "connect_timeout": 10},
        check=ConnectionPool.check_connection,
        configure=configure_session,
        name=name,
        timeout=5.0,  # past this a caller sees DatabaseUnavailable and says it is waiting
        open=True,
    )


# The longest wait between two attempts to reopen a pooled connection.
RECONNECT_DELAY_MAX_S = 5.0


class _CappedBackoff(AttemptWithBackoff):
    """psycopg_pool's backoff doubles without a cap (1, 2, 4 ... 64 s): after a 70 s outage
    the pool reopened its connections some 45 s after PostgreSQL was back."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_DELAY_MAX_S)


class _ReconnectingPool(ConnectionPool):
    """A pool that retries a lost connection at least every RECONNECT_DELAY_MAX_S seconds.

    It overrides a private method of psycopg_pool (hence its pin below 3.4 in pyproject.toml);
    test_the_pool_reopens_its_connections_soon_after_a_long_outage proves it still works.
    """

    # Why its latest attempt to open a connection failed, and when (None: it succeeded): a
    # checkout that timed out meanwhile tells a connection limit from an outage by it.
    _last_connect_failure: tuple[float, BaseException] | None = None

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        if attempt is None:
            attempt = _CappedBackoff(timeout=self.reconnect_timeout)
        super()._add_connection(attempt, growing)

    def _connect(self, timeout: float | None = None) -> psycopg.Connection:
        try:
            conn = super()._connect(timeout)
        except Exception as exc:
            self._last_connect_failure = (time.monotonic(), exc)
            raise
        self._last_connect_failure = None
        return conn

    def limit_refusal_within(self, seconds: float) -> BaseException | None:
        """The refusal for a connection limit its latest attempt to open a connection met
        within the last ``seconds``, or None (it succeeded, failed otherwise, or long ago)."""
        failure = self._last_connect_failure
        if failure is None or time.monotonic() - failure[0] > seconds:
            return None
        return failure[1] if refused_for_a_connection_limit(failure[1]) else None


def wait_for_database(
    conninfo: str,
    *,
    deadline_s: float,
    on_wait: Callable[[float, str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once a connection succeeds; raise :class:`DatabaseUnavailable` at the deadline."""
    started = time.monotonic()
    delay = 0.25
    while True:
        try:
            with connect(conninfo, timeout=min(10.0, max(1.0, deadline_s))) as conn, translated():
                read_only = is_read_only(conn)
            if read_only:
                raise DatabaseUnavailable(f"database unavailable: {READ_ONLY_SERVER}")
            return
        except (DatabaseUnavailable, DatabaseLoginRefused) as exc:
            # A refused login is waited out too (a directory server behind the database's
            # authentication may be restarting), but ends as the configuration error it is.
            waited = time.monotonic() - started
            left = deadline_s - waited
            if left <= 0:  # (the last try is at the deadline, not a backoff step before it)
                if isinstance(exc, DatabaseLoginRefused):
                    raise
                reason = str(exc).removeprefix("database unavailable: ")
                raise DatabaseUnavailable(
                    f"database still unreachable after {waited:.0f}s"
                    f" (SOKRATOS_STARTUP_TIMEOUT {deadline_s:g}s): {reason}"
                ) from exc
            if on_wait is not None:
                on_wait(waited, str(exc))
            sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


# A thread holding its connection (a busy slot) keeps it from one use to the next, since the
# pool's check costs a round trip per checkout; one idle longer than this is checked out afresh.
HELD_IDLE_S = 2.0


class Database:
    """The process's connection pool; ``connection()`` lends one autocommit connection."""

    def __init__(
        self,
        conninfo: str,
        *,
        size: int,
        keep_open: int = 1,
        configure: Callable[[psycopg.Connection], None] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.pool = make_pool(conninfo, size=size, keep_open=keep_open, configure=configure)
        self._held = threading.local()  # .conn, .used, .depth of a thread inside holding()
        self._lent = 0  # connections this process's threads hold now
        self._lent_lock = threading.Lock()
        # The server process of each connection a thread holds (a slot's), by thread: what a
        # look at pg_stat_activity asks about (a settle waiting on a lock).
        self._held_pids: dict[int, int] = {}
        self._before_close: list[Callable[[], None]] = []

    def before_close(self, action: Callable[[], None]) -> None:
        """Have ``action`` run when :meth:`close` is called, before the pool closes."""
        self._before_close.append(action)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the connections kept open are open (and configured); False at timeout.

        Polls the pool's idle count: ``ConnectionPool.wait`` would close the pool at its
        timeout, and a worker whose role may open fewer connections should still run.
        """
        deadline = time.monotonic() + timeout
        while self.pool.get_stats()["pool_available"] < self.pool.min_size:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Inside, every ``connection()`` of this thread lends the same pooled connection.

        A worker slot handles its run of items inside: the pipelines' reads and the settles
        share one connection, so N busy slots need N connections, never 2N.
        """
        held = self._held
        held.conn, held.used, held.depth = None, time.monotonic(), 0
        try:
            yield
        finally:
            self._return_held()
            del held.depth

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection (the held one inside ``holding``); transient failures surface
        as DatabaseUnavailable."""
        if getattr(self._held, "depth", None) is None:
            with (
                translated(),
                self._busy_or_away(),
                self.pool.connection() as conn,
                self._counted_as_lent(),
            ):
                yield conn
            return
        held = self._held
        idle = time.monotonic() - held.used
        if held.depth == 0 and held.conn is not None and idle > HELD_IDLE_S:
            self._return_held()
        if held.conn is None:
            with translated(), self._busy_or_away():
                held.conn = self.pool.getconn()
            self._count_lent(+1)
            self._held_pids[threading.get_ident()] = held.conn.pgconn.backend_pid
        held.depth += 1
        try:
            with translated():
                yield held.conn
        except BaseException:
            if held.depth == 1:
                self._return_held()  # the pool discards it if the failure broke it
            raise
        finally:
            held.depth -= 1
        held.used = time.monotonic()

    def lend_if_wanted(self) -> None:
        """Inside ``holding``, between two uses: give the held connection back if another
        thread is waiting for one (the pool is short: a role's CONNECTION LIMIT, say).

        A slot otherwise keeps its connection through its handler's LLM calls, and the lease
        renewer, waiting behind the slots, let leases expire under running items.
        """
        held = self._held
        if getattr(held, "depth", None) != 0 or held.conn is None:
            return
        if self.pool.get_stats().get("requests_waiting", 0) > 0:
            self._return_held()

    def held_backend_pids(self) -> list[int]:
        """The server processes of the connections threads hold now (busy slots')."""
        return list(self._held_pids.values())

    def _return_held(self) -> None:
        conn, self._held.conn = self._held.conn, None
        if conn is not None:
            self._held_pids.pop(threading.get_ident(), None)
            self._count_lent(-1)
            self.pool.putconn(conn)

    @contextmanager
    def _busy_or_away(self) -> Iterator[None]:
        """A checkout that timed out while every connection was lent is :class:`PoolBusy`:
        the server answers, so the wait is no outage (``/readyz`` stays ready)."""
        try:
            yield
        except PoolTimeout as exc:
            with self._lent_lock:
                all_lent = self._lent >= self.pool.max_size
            # (The pool's attempts during the wait are at most RECONNECT_DELAY_MAX_S apart.)
            refused = self.pool.limit_refusal_within(self.pool.timeout + RECONNECT_DELAY_MAX_S)
            if not all_lent and refused is not None:
                raise ConnectionLimitReached(
                    f"database unavailable: the server refused another connection for a limit"
                    f" ({_fatal_line(_first_line(refused))}) while the pool's were in use for"
                    f" {self.pool.timeout:g}s: is the role's CONNECTION LIMIT or max_connections"
                    " too low for SOKRATOS_CONCURRENCY ('sokratos-worker check' compares them)?"
                ) from exc
            if not all_lent:
                raise  # some are being (re)opened and failing: an outage, as translated
            raise PoolBusy(
                f"all {self.pool.max_size} pooled connections stayed in use for"
                f" {self.pool.timeout:g}s (the server answers: pg_stat_activity shows what the"
                " worker's sessions are doing or waiting for)"
            ) from exc

    @contextmanager
    def _counted_as_lent(self) -> Iterator[None]:
        self._count_lent(+1)
        try:
            yield
        finally:
            self._count_lent(-1)

    def _count_lent(self, change: int) -> None:
        with self._lent_lock:
            self._lent += change

    def close(self) -> None:
        """Run the :meth:`before_close` actions, then close every pooled connection."""
        for action in self._before_close:
            action()
        self.pool.close(timeout=5.0)


# The connection type handed to store functions (so callers need not import psycopg).
Connection = psycopg.Connection
