"""Settings from the environment: what each SOKRATOS_* variable means, loaded in one go.

Every variable of the contract (``../shared/design/contract.md`` §2) is a field of
:class:`Settings`. Values come, highest precedence first, from the variable itself,
from ``<VARIABLE>_FILE`` (a path), and from a file named ``<VARIABLE>`` in
``$CREDENTIALS_DIRECTORY`` (systemd ``LoadCredential=``): see
:mod:`~sokratos_worker.config_sources`. Durations are parsed in
:mod:`~sokratos_worker.durations`, single values checked in
:mod:`~sokratos_worker.config_validators`.

:func:`load_settings` turns every problem into one :class:`ConfigError` that names the
variable, so the CLI can exit 78 with one line instead of a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from sokratos_worker import libpq
from sokratos_worker.config_error import ConfigError
from sokratos_worker.config_sources import (
    ENV_PREFIX,
    EnvSource,
    SecretFilesSource,
    default_data_dir,
    given_as,
    read_secret_file,
    shadowed_file_variables,
    variable_names,
)
from sokratos_worker.config_validators import (
    CaFile,
    HttpBaseUrl,
    database_url_at_sign_problem,
    header_value_problem,
    http_base_url,
    refuse_bad_libpq_environment,
    unusable_directory,
    without_credentials,
)
from sokratos_worker.durations import DAY, HOUR, Duration, parse_duration, within
from sokratos_worker.store.embedded import socket_path_problem

# Each check logs in to the IMAP server: more often looks like abuse to most providers.
_EMAIL_CHECK_SHORTEST = 30.0


class BackendConfig(BaseModel):
    """One OpenAI-compatible chat backend, tried in the order of the list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    url: HttpBaseUrl
    model: str = Field(min_length=1)
    api_key: SecretStr | None = None
    api_key_file: str | None = None
    # Tests time out in 200 ms; a local CPU model may think for many minutes, not hours.
    timeout: Annotated[
        Duration,
        within(
            0.1,
            HOUR,
            too_short="no model answers sooner",
            too_long="a call silent for an hour has hung",
        ),
    ] = 120.0
    max_concurrency: int = Field(default=2, ge=1)
    structured_output: Literal["json_schema", "json_object", "grammar"] = "json_schema"
    temperature: float = Field(default=0.1, ge=0.0, le=2.0)
    ca_file: CaFile = None
    tls_verify: bool = True

    # Both given: api_key wins and the file is never read, which start-up says.
    _key_file_ignored: bool = PrivateAttr(default=False)

    @field_validator("api_key")
    @classmethod
    def _key_fits_a_header(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and (problem := header_value_problem(value.get_secret_value())):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _load_key_file(self) -> BackendConfig:
        if self.api_key is None and self.api_key_file:
            key = read_secret_file(self.api_key_file)
            if not key:  # (no Authorization header at all: a 401 at every call)
                raise ValueError(f"api_key_file {self.api_key_file!r} is empty")
            if problem := header_value_problem(key):
                raise ValueError(f"the key in api_key_file {self.api_key_file!r}: {problem}")
            object.__setattr__(self, "api_key", SecretStr(key))
        elif self.api_key_file:
            self._key_file_ignored = True
        return self

    @property
    def key_file_ignored(self) -> bool:
        """api_key_file was given beside api_key, which wins."""
        return self._key_file_ignored


class EmailAccountConfig(BaseModel):
    """One IMAP mailbox checked for new mail."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.@+-]+$")
    host: str = Field(min_length=1)
    port: int | None = Field(default=None, ge=1, le=65535)
    username: str = Field(min_length=1)
    password: SecretStr | None = None
    password_file: str | None = None
    mailbox: str = "INBOX"
    security: Literal["tls", "starttls", "none"] = "tls"
    ca_file: CaFile = None
    tls_verify: bool = True

    @field_validator("host")
    @classmethod
    def _bare_host(cls, value: str) -> str:
        # imaplib would fail on these with an error naming neither the account nor the field.
        if "://" in value or "/" in value or any(c.isspace() for c in value):
            raise ValueError(f"{value!r} must be a host name or address, not a URL")
        name, colon, port = value.rpartition(":")
        if colon and name.count(":") == 0 and port.isdigit():
            raise ValueError(f'{value!r} must not carry a port: set "port": {port}')
        return value

    @field_validator("mailbox")
    @classmethod
    def _mailbox_name(cls, value: str) -> str:
        # Refused by the server at every check otherwise ("Invalid mailbox name"), for ever.
        if not value.strip():
            raise ValueError('must name a mailbox (the default is "INBOX")')
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"{value!r} holds a control character, which IMAP cannot send")
        return value

    # Both given: password wins and the file is never read, which start-up says.
    _password_file_ignored: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _complete(self) -> EmailAccountConfig:
        if self.password is None and self.password_file:
            password = read_secret_file(self.password_file)
            if not password:  # (every login would fail)
                raise ValueError(f"password_file {self.password_file!r} is empty")
            object.__setattr__(self, "password", SecretStr(password))
        elif self.password_file:
            self._password_file_ignored = True
        if self.password is None:
            raise ValueError(f"account {self.name!r} needs password or password_file")
        if self.port is None:
            object.__setattr__(self, "port", 993 if self.security == "tls" else 143)
        return self

    @property
    def password_file_ignored(self) -> bool:
        """password_file was given beside password, which wins."""
        return self._password_file_ignored

    @property
    def imap_port(self) -> int:
        """The port after defaults were applied."""
        assert self.port is not None  # noqa: S101 - set by the validator
        return self.port


class Settings(BaseSettings):
    """The whole configuration, validated before any command does anything else."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        extra="ignore",
        frozen=True,
        populate_by_name=True,
        env_ignore_empty=True,  # KEY= in an env file means the default, as systemd users expect
    )

    database_url: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("SOKRATOS_DATABASE_URL", "DATABASE_URL")
    )
    data_dir: Path = Field(default_factory=default_data_dir)
    migrate_on_start: bool = True
    # Tests give up after 1 s; systemd's TimeoutStartSec (120 s) ends a start long before an hour.
    startup_timeout: Annotated[
        Duration,
        within(
            1,
            HOUR,
            too_short="a healthy database needs a moment to answer",
            too_long="exit 75 and let systemd restart instead of waiting so long",
        ),
    ] = 60.0
    # Every tick queries every queue; it is the only wake-up for missed notifications.
    heartbeat_interval: Annotated[
        Duration,
        within(
            1,
            HOUR,
            too_short="each tick queries the database",
            too_long="work whose notification was missed would wait that long",
        ),
    ] = 60.0
    # One item must fit in a tick; `run --once` must end the same day.
    tick_budget: Annotated[
        Duration,
        within(
            1,
            DAY,
            too_short="a tick must have time for an item",
            too_long="one tick must not outlive the day",
        ),
    ] = 300.0
    max_attempts: int = Field(default=3, ge=1, le=100)
    # Tests back off for 10 ms; a first retry more than a day out hides a failure.
    retry_base: Annotated[
        Duration,
        within(
            0.01,
            DAY,
            too_short="sooner is a busy loop against a failing backend",
            too_long="the first retry should come within a day",
        ),
    ] = 30.0
    # A retry more than a week out is a dead letter in all but name.
    retry_max: Annotated[
        Duration,
        within(
            0.01,
            7 * DAY,
            too_short="sooner is a busy loop against a failing backend",
            too_long="lower SOKRATOS_MAX_ATTEMPTS instead of waiting longer",
        ),
    ] = 1800.0
    # Renewed every max(0.5 s, lease/3) (tests use 1.5 s); a crashed worker's items wait it out.
    lease: Annotated[
        Duration,
        within(
            1,
            DAY,
            too_short="renewals are 0.5s apart at best: a shorter lease expires mid-item",
            too_long="a crashed worker's items would stay reserved that long",
        ),
    ] = 300.0
    concurrency: int = Field(default=4, ge=1, le=256)
    # Items need a moment to settle; systemd's TimeoutStopSec (60 s) kills long before an hour.
    shutdown_grace: Annotated[
        Duration,
        within(
            1,
            HOUR,
            too_short="items in flight need a moment to finish",
            too_long="keep it below the unit's TimeoutStopSec",
        ),
    ] = 30.0
    llm_backends: list[BackendConfig] = Field(default_factory=list)
    embedding_url: str | None = None
    embedding_model: str | None = None
    embedding_dim: int | None = Field(default=None, ge=1, le=16000)
    embedding_suffix: str = ""
    # Bounds one batch's whole answer; a CPU embedding server may need more than 10 s for 32.
    embedding_timeout: Annotated[
        Duration,
        within(
            0.1,
            HOUR,
            too_short="no embedding server answers sooner",
            too_long="a batch silent for an hour has hung",
        ),
    ] = 10.0
    local_model: bool = False
    email_accounts: list[EmailAccountConfig] = Field(default_factory=list)
    # 0 turns checks off; see _EMAIL_CHECK_SHORTEST for the floor, and mail checked weekly is late.
    email_check_interval: Annotated[
        Duration,
        within(
            _EMAIL_CHECK_SHORTEST,
            7 * DAY,
            too_short="each check logs in to the IMAP server; 0 turns email checks off",
            too_long="mail would arrive a week late",
            zero_means_off=True,
        ),
    ] = 300.0
    # The IMAP SINCE date must stay a real date; ten years is a whole mailbox in practice.
    email_initial_lookback: Annotated[
        Duration,
        within(
            1,
            3650 * DAY,
            too_short="a window of nothing would triage no mail",
            too_long="that would triage a decade of mail",
        ),
    ] = 86400.0
    # One account's whole IMAP session (a trickling server never trips a read's timeout).
    email_check_deadline: Annotated[
        Duration,
        within(
            1,
            DAY,
            too_short="connecting and logging in alone take a moment",
            too_long="a stuck server would hold the other accounts back that long",
        ),
    ] = 300.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] | None = None
    metrics_addr: str | None = None
    # At most a century: PostgreSQL must still subtract it from now().
    failed_ops_ttl_days: int = Field(default=0, ge=0, le=36500)
    processed_emails_ttl_days: int = Field(default=90, ge=1, le=36500)
    # Set by the template unit sokratos-worker@.service; part of the worker id.
    worker_instance: str | None = None

    @field_validator("database_url", mode="before")
    @classmethod
    def _database_url(cls, value: object) -> object:
        # Blank means unset (embedded), not libpq's defaults; anything else must parse, and
        # libpq must accept its options and the PG* variables that fill the ones it leaves
        # out, checked before any command connects.
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str):
            try:
                parts = conninfo_to_dict(value)
            except psycopg.ProgrammingError:
                # Not the parser's text: it may quote the URL, password included.
                raise ValueError(
                    "is not a libpq URI (postgresql://user:password@host:5432/dbname)"
                    " or key=value string"
                ) from None
            problem = database_url_at_sign_problem(value, parts) or libpq.option_problem(
                parts, combined=False
            )
            if problem is not None:
                raise ValueError(problem)
            refuse_bad_libpq_environment(parts)  # and the URL's sslmode with them
        return value

    @field_validator("data_dir")
    @classmethod
    def _directory(cls, value: Path, info: ValidationInfo) -> Path:
        if not value.is_absolute():  # enqueue would spool where run never looks
            raise ValueError(
                f"{str(value)!r} is relative (~ is not expanded): each command would read it"
                " from its own working directory (enqueue spools there, run imports from its"
                " own); give an absolute path"
            )
        # Caught now: later the embedded PostgreSQL or the spool would fail with a raw OSError.
        try:
            is_something_else = value.exists() and not value.is_dir()
        except OSError as exc:
            raise ValueError(f"{str(value)!r} cannot be examined: {exc.strerror}") from None
        if is_something_else:
            raise ValueError(f"{str(value)!r} is a file, not a directory")
        # Only the embedded PostgreSQL needs it at once (an invalid URL is the error shown).
        if "database_url" in info.data and info.data["database_url"] is None:
            problem = unusable_directory(value) or socket_path_problem(value)
            if problem is not None:
                raise ValueError(
                    f"{problem}; the embedded PostgreSQL keeps its data there (no database URL"
                    " is set): choose a directory this user may create and write"
                )
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("embedding_url")
    @classmethod
    def _embedding_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        return http_base_url(value)

    @field_validator("metrics_addr")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if not value:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port, e.g. 127.0.0.1:9464")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.retry_max < self.retry_base:
            raise ValueError("SOKRATOS_RETRY_MAX must not be smaller than SOKRATOS_RETRY_BASE")
        if self.embedding_url and not (self.embedding_model and self.embedding_dim):
            raise ValueError(
                "SOKRATOS_EMBEDDING_URL needs SOKRATOS_EMBEDDING_MODEL and SOKRATOS_EMBEDDING_DIM"
            )
        if (self.embedding_model or self.embedding_dim) and not self.embedding_url:
            # Without the URL the others were ignored: memories saved with no embeddings.
            raise ValueError(
                "SOKRATOS_EMBEDDING_URL is required when SOKRATOS_EMBEDDING_MODEL or"
                " SOKRATOS_EMBEDDING_DIM is set (set all three, or none for no embeddings)"
            )
        if twice := _repeated(b.name for b in self.llm_backends):
            raise ValueError(f"SOKRATOS_LLM_BACKENDS: backend names must be unique ({twice})")
        if twice := _repeated(a.name for a in self.email_accounts):
            raise ValueError(f"SOKRATOS_EMAIL_ACCOUNTS: account names must be unique ({twice})")
        if self.worker_instance and self.database_url is None:
            # Each instance has its own state directory: embedded servers would split the queues.
            raise ValueError(
                f"SOKRATOS_DATABASE_URL: is required for sokratos-worker@{self.worker_instance}:"
                " the instances on a host share one PostgreSQL"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, EnvSource(settings_cls), SecretFilesSource(settings_cls))

    @property
    def uses_embedded_postgres(self) -> bool:
        """True when no database URL was given, so the embedded PostgreSQL is used."""
        return self.database_url is None

    @property
    def pool_size(self) -> int:
        """The most connections a worker opens: one per slot, the dispatcher, the lease
        renewer and two to spare (``check`` compares it with the server's limits)."""
        return self.concurrency + 4

    @property
    def connections_needed(self) -> int:
        """The pool, the ``LISTEN`` connection, and the email checks' own when mail is set."""
        return self.pool_size + 1 + (1 if self.email_accounts else 0)

    @property
    def embeddings_enabled(self) -> bool:
        """True when an embedding model is configured."""
        return self.embedding_url is not None

    @property
    def database_identity(self) -> str:
        """Which database this is, without credentials: a spool file is imported only there."""
        if self.database_url is None:
            return embedded_identity(self.data_dir)
        return database_identity_of(self.database_url.get_secret_value())

    @property
    def spool_dir(self) -> Path:
        """Where enqueues wait while PostgreSQL is unreachable."""
        return self.data_dir / "spool"

    def effective_log_format(self) -> Literal["json", "console"]:
        """JSON for journald, readable console output on a terminal."""
        if self.log_format is not None:
            return self.log_format
        return "console" if sys.stderr.isatty() else "json"


_EMBEDDED = "embedded:"
_URL = "postgresql://"


def embedded_identity(data_dir: Path | str) -> str:
    """The embedded PostgreSQL's identity: its data directory, resolved (a relative path, a
    symlink or ``..`` named another database, and its spool files were never imported)."""
    return _as_text(f"{_EMBEDDED}{os.path.realpath(data_dir)}")


def _as_text(identity: str) -> str:
    """``identity`` with any byte that is not UTF-8 (a path's, kept by Python as a lone
    surrogate) written as ``\\xff``: a spool file must be able to hold it, and a producer and
    a worker spell it alike."""
    return identity.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def database_identity_of(conninfo: str) -> str:
    """The identity of the database a URL or conninfo names (host, port, name; no
    credentials), spelled the same whatever the spelling of its host: the worker's own, and
    the one a producer's spool file names."""
    info = conninfo_to_dict(conninfo)
    host = str(info.get("host") or info.get("hostaddr") or "localhost")
    dbname = info.get("dbname") or info.get("user") or ""
    return f"{_URL}{_normal_hosts(host)}:{info.get('port') or 5432}/{dbname}"


def normalised_identity(identity: str) -> str:
    """An identity as :func:`database_identity_of` spells it now, also one an earlier version
    wrote literally (``/tmp/../tmp/x``, ``DB.example.org``, a socket directory's trailing
    slash); what it cannot read is returned as it is."""
    if identity.startswith(_EMBEDDED):
        return embedded_identity(identity.removeprefix(_EMBEDDED))
    rest = identity.removeprefix(_URL)
    where, slash, dbname = rest.rpartition("/")
    host, colon, port = where.rpartition(":")
    if rest == identity or not slash or not colon or not host:
        return identity
    return f"{_URL}{_normal_hosts(host)}:{port}/{dbname}"


def identities_match(meant_for: str, identity: str) -> bool:
    """True when a spool file meant for ``meant_for`` belongs to the database ``identity``:
    the same once both are normalised, or, for the embedded server, its own socket's URL (what
    a Python producer given that URL names)."""
    if meant_for == identity:
        return True
    ours, theirs = normalised_identity(identity), normalised_identity(meant_for)
    if theirs == ours:
        return True
    if ours.startswith(_EMBEDDED):
        socket_dir = os.path.join(ours.removeprefix(_EMBEDDED), "postgres")
        socket_url = make_conninfo(host=socket_dir, port=5432, dbname="postgres")
        return theirs == database_identity_of(socket_url)
    return False


def _normal_hosts(hosts: str) -> str:
    """Each host of a (comma-separated) list as one spelling: a socket directory resolved, a
    name in lower case (DNS is not asked: two names of one server stay two)."""
    return ",".join(
        os.path.realpath(host) if host.startswith("/") else host.strip().lower()
        for host in hosts.split(",")
    )


def _variable_for(loc: tuple[int | str, ...]) -> str:
    """``('llm_backends', 0, 'url')`` → ``SOKRATOS_LLM_BACKENDS[0].url``."""
    if not loc:
        return "configuration"
    head = str(loc[0])
    # An alias such as SOKRATOS_DATABASE_URL is already the variable's name.
    variable = head if head.isupper() else ENV_PREFIX + head.upper()
    for part in loc[1:]:
        variable += f"[{part}]" if isinstance(part, int) else f".{part}"
    source = given_as(variable.removeprefix(ENV_PREFIX).split("[")[0].split(".")[0].lower())
    return variable if source is None else f"{variable} (given as {source})"


def load_settings(
    environ: Mapping[str, str] | None = None, *, libpq_environment: bool = True, **overrides: Any
) -> Settings:
    """Validate the whole configuration or raise one :class:`ConfigError`.

    ``libpq_environment=False`` leaves libpq's PG* variables out, for a command that never
    connects to the URL's server (``demo``): they are meant for that server only."""
    if not libpq_environment:
        environ = libpq.without_environment(os.environ if environ is None else environ)
    if environ is not None:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(environ)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "is required"
        elif error["type"] == "extra_forbidden":
            message = "is not a known field (a typo? see deploy/sokratos-worker.env.example)"
        variable = _variable_for(error["loc"])
        if variable == "configuration" and message.startswith(ENV_PREFIX):
            # A cross-field check names its variable first: "SOKRATOS_X must …", "SOKRATOS_X: …".
            head, sep, rest = message.partition(": ")
            if not sep or " " in head:
                head, _, rest = message.partition(" ")
            variable, message = head, rest
        raise ConfigError(variable, message) from None
    except SettingsError as exc:
        raise ConfigError(_settings_error_variable(str(exc)), _settings_error_reason(exc)) from None
    finally:
        if environ is not None:
            os.environ.clear()
            os.environ.update(saved)


def unknown_variables(
    environ: Mapping[str, str] | None = None, settings: Settings | None = None
) -> list[str]:
    """``SOKRATOS_*`` names no setting reads: most likely typos, which would be ignored.

    ``settings`` names the secret files the backends and mail accounts read, which may be
    credentials of any name."""
    names = {name for field_name in Settings.model_fields for name in variable_names(field_name)}
    known = names | {name + "_FILE" for name in names}
    known |= {"SOKRATOS_TEST_DATABASE_URL", "SOKRATOS_TEST_PGDATA_BASE"}  # the test suite's
    env = os.environ if environ is None else environ
    unknown = [
        name for name in env if name.upper().startswith(ENV_PREFIX) and name.upper() not in known
    ]
    directory = env.get("CREDENTIALS_DIRECTORY")
    return sorted(unknown) + _unknown_credentials(directory, names | _secret_files(settings))


def _secret_files(settings: Settings | None) -> set[str]:
    """The file names the backends' ``api_key_file`` and the accounts' ``password_file`` give
    (a relative one is a credential)."""
    if settings is None:
        return set()
    files = [b.api_key_file for b in settings.llm_backends]
    files += [a.password_file for a in settings.email_accounts]
    return {Path(f).name for f in files if f}


def _unknown_credentials(directory: str | None, read: set[str]) -> list[str]:
    """``$CREDENTIALS_DIRECTORY/SOKRATOS_*`` files nothing reads (systemd's LoadCredential=
    named after the variable: a typo there left the database URL unset, so the worker ran
    on the embedded PostgreSQL). Other names are secret files a setting names itself."""
    if directory is None or not directory.strip():
        return []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []  # reading a credential reports that directory's problem
    return [
        f"$CREDENTIALS_DIRECTORY/{entry}"
        for entry in entries
        if entry.upper().startswith(ENV_PREFIX) and entry not in read  # read as spelt
    ]


def ignored_database_url(settings: Settings, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``DATABASE_URL`` holds another URL than the one used: ``SOKRATOS_DATABASE_URL``
    wins, and a DATABASE_URL exported for another program would otherwise pass unnoticed."""
    env = os.environ if environ is None else environ
    other = (env.get("DATABASE_URL") or "").strip()
    used = settings.database_url.get_secret_value() if settings.database_url else None
    return bool(other) and used is not None and other != used.strip()


def keys_replaced_by_url_credentials(settings: Settings) -> list[str]:
    """Backends given an api_key and a URL with ``user:password@``: httpx sends the URL's
    credentials as Basic authorization, in place of the key (a request has one
    Authorization header), and the key is never sent."""
    return [
        backend.name
        for backend in settings.llm_backends
        if backend.api_key is not None and _has_userinfo(backend.url)
    ]


def _has_userinfo(url: str) -> bool:
    """Whether ``url`` carries ``user[:password]@`` before its host (as httpx reads it)."""
    import httpx  # noqa: PLC0415 - only when a backend has a key: --help stays quick

    return bool(httpx.URL(url).userinfo)


def ignored_secret_files(settings: Settings) -> list[str]:
    """Secret files given beside the secret itself, which wins: a key rotated by rewriting the
    file would go unnoticed until the old one is refused."""
    ignored = shadowed_file_variables(Settings.model_fields)
    ignored += [
        f"api_key_file of backend {backend.name!r}"
        for backend in settings.llm_backends
        if backend.key_file_ignored
    ]
    ignored += [
        f"password_file of email account {account.name!r}"
        for account in settings.email_accounts
        if account.password_file_ignored
    ]
    return ignored


def _settings_error_variable(text: str) -> str:
    match = re.search(r'field "(\w+)"', text)
    return _variable_for((match.group(1),)) if match else "configuration"


def _settings_error_reason(exc: SettingsError) -> str:
    cause = exc.__cause__
    if cause is not None:
        return f"is not valid JSON ({cause})"
    return str(exc)


def _repeated(names: Iterable[str]) -> str:
    """The names given more than once, quoted and joined ("" when none is)."""
    seen: set[str] = set()
    twice: dict[str, None] = {}
    for name in names:
        if name in seen:
            twice[name] = None
        seen.add(name)
    return ", ".join(f"{name!r} given twice" for name in twice)


__all__ = [
    "ENV_PREFIX",
    "BackendConfig",
    "ConfigError",
    "Duration",
    "EmailAccountConfig",
    "Settings",
    "database_identity_of",
    "embedded_identity",
    "identities_match",
    "load_settings",
    "normalised_identity",
    "parse_duration",
    "read_secret_file",
    "unknown_variables",
    "without_credentials",
]
