"""Settings from the environment; the only place that reads ``os.environ``.

Every variable of the contract (``../shared/design/contract.md`` §2) is a field of
:class:`Settings`. Values come, highest precedence first, from the variable itself,
from ``<VARIABLE>_FILE`` (a path), and from a file named ``<VARIABLE>`` in
``$CREDENTIALS_DIRECTORY`` (systemd ``LoadCredential=``).

:func:`load_settings` turns every problem into one :class:`ConfigError` that names the
variable, so the CLI can exit 78 with one line instead of a traceback.
"""

from __future__ import annotations

import math
import os
import re
import ssl
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeGuard
from urllib.parse import urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from sokratos_worker import libpq

ENV_PREFIX = "SOKRATOS_"

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_HOUR, _DAY = 3600.0, 86400.0
# Each check logs in to the IMAP server: more often looks like abuse to most providers.
_EMAIL_CHECK_SHORTEST = 30.0
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


class ConfigError(Exception):
    """Invalid configuration: ``variable`` names what to fix, ``message`` says why."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def parse_duration(value: object) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``250ms`` or compound ``1h30m``."""
    seconds = _seconds(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds < 0:
        raise ValueError(f"{value!r}: a duration cannot be negative")
    return seconds


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("expected a duration such as 90, 90s, 5m or 1h30m")
    if not isinstance(value, str):
        return float(value)
    text = value.strip().lower()
    # Parsed without the sign, so "-5s" is called negative rather than malformed.
    unsigned = text.removeprefix("-")
    seconds = _unsigned_seconds(unsigned)
    if seconds is None:
        raise ValueError(f"{value!r} is not a duration (use 90, 90s, 5m, 1h30m; units ms s m h d)")
    return -seconds if unsigned != text else seconds


def _unsigned_seconds(text: str) -> float | None:
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """``90`` → ``1m30s``, ``0.25`` → ``250ms``: a duration as an operator would write it."""
    if 0 < seconds < 1:
        return f"{_number(seconds * 1000)}ms"
    parts: list[str] = []
    rest = seconds
    for unit in ("d", "h", "m"):
        count, rest = divmod(rest, _UNIT_SECONDS[unit])
        if count:
            parts.append(f"{_number(count)}{unit}")
    if rest or not parts:
        parts.append(f"{_number(rest)}s")
    return "".join(parts)


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


Duration = Annotated[float, BeforeValidator(parse_duration)]


def within(
    shortest: float, longest: float, *, too_short: str, too_long: str, zero_means_off: bool = False
) -> AfterValidator:
    """Refuse a duration outside ``[shortest, longest]``, saying why in the words given."""

    def check(seconds: float) -> float:
        if seconds == 0 and zero_means_off:
            return seconds
        if seconds < shortest:
            raise ValueError(
                f"{format_duration(seconds)} is too short: at least"
                f" {format_duration(shortest)} ({too_short})"
            )
        if seconds > longest:
            raise ValueError(
                f"{format_duration(seconds)} is too long: at most"
                f" {format_duration(longest)} ({too_long})"
            )
        return seconds

    return AfterValidator(check)


def _is_given(value: str | None) -> TypeGuard[str]:
    """Whether an environment value says something: empty or only whitespace is unset."""
    return value is not None and value.strip() != ""


def credentials_directory() -> Path | None:
    """``$CREDENTIALS_DIRECTORY`` as systemd sets it for ``LoadCredential=``."""
    value = os.environ.get("CREDENTIALS_DIRECTORY")
    return Path(value) if _is_given(value) else None


def read_secret_file(name: str) -> str:
    """A secret from a file; a relative name is looked up in ``$CREDENTIALS_DIRECTORY``."""
    path = Path(name)
    where = ""
    if not path.is_absolute():
        creds = credentials_directory()
        if creds is not None:
            path = creds / path
        else:
            # Relative names are meant for systemd's LoadCredential=; outside it, say so.
            where = (
                f" (looked in the current directory {Path.cwd()}: $CREDENTIALS_DIRECTORY is"
                " not set; outside systemd give an absolute path or set it)"
            )
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"cannot read secret file {str(path)!r}: {exc.strerror}{where}") from exc
    except UnicodeDecodeError as exc:
        # Not str(exc): it would quote the secret's bytes around the bad one.
        raise ValueError(
            f"secret file {str(path)!r} is not UTF-8 text (byte {exc.start + 1} is not)"
        ) from None


def http_base_url(value: str) -> str:
    """An ``http(s)://host[:port][/path]`` base URL without its trailing slash, or why not."""
    shown = repr(without_credentials(value))  # a URL may carry basic-auth credentials
    try:
        parts = urlsplit(value)
        port_is_zero = parts.port == 0  # .port raises for one that is not 0 to 65535
    except ValueError as exc:
        raise ValueError(f"{shown} is not a valid URL ({exc})") from None
    if port_is_zero:
        raise ValueError(f"{shown} has port 0: give the server's port")
    if parts.scheme not in ("http", "https"):
        hint = f" (http://{value}?)" if "://" not in value else ""
        raise ValueError(f"{shown} must start with http:// or https://{hint}")
    if not parts.hostname:
        raise ValueError(f"{shown} has no host (e.g. http://127.0.0.1:8080/v1)")
    return value.rstrip("/")


def without_credentials(url: str) -> str:
    """``url`` as it may be shown: ``user:password@`` (HTTP basic auth) taken out."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if not sep or "@" not in host:
        return url
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"


def readable_ca_file(value: str | None) -> str | None:
    """A CA bundle the TLS client can load, checked now so a bad one is not a traceback later."""
    if not value:
        return None
    try:
        with open(value, "rb"):
            pass
    except FileNotFoundError:
        raise ValueError(f"{value!r} does not exist{_relative_to_cwd(value)}") from None
    except IsADirectoryError:
        raise ValueError(f"{value!r} is a directory, not a PEM file") from None
    except OSError as exc:
        raise ValueError(f"{value!r} cannot be read: {exc.strerror}") from None
    try:
        ssl.create_default_context(cafile=value)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{value!r} is not a PEM certificate bundle ({exc.reason or exc})"
        ) from None
    return value


def _relative_to_cwd(name: str) -> str:
    if Path(name).is_absolute():
        return ""
    return f" (a relative path, looked up in the current directory {Path.cwd()})"


HttpBaseUrl = Annotated[str, AfterValidator(http_base_url)]
CaFile = Annotated[str | None, AfterValidator(readable_ca_file)]


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
            _HOUR,
            too_short="no model answers sooner",
            too_long="a call silent for an hour has hung",
        ),
    ] = 120.0
    max_concurrency: int = Field(default=2, ge=1)
    structured_output: Literal["json_schema", "json_object", "grammar"] = "json_schema"
    temperature: float = Field(default=0.1, ge=0.0, le=2.0)
    ca_file: CaFile = None
    tls_verify: bool = True

    @model_validator(mode="after")
    def _load_key_file(self) -> BackendConfig:
        if self.api_key is None and self.api_key_file:
            object.__setattr__(self, "api_key", SecretStr(read_secret_file(self.api_key_file)))
        return self


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

    @model_validator(mode="after")
    def _complete(self) -> EmailAccountConfig:
        if self.password is None and self.password_file:
            object.__setattr__(self, "password", SecretStr(read_secret_file(self.password_file)))
        if self.password is None:
            raise ValueError(f"account {self.name!r} needs password or password_file")
        if self.port is None:
            object.__setattr__(self, "port", 993 if self.security == "tls" else 143)
        return self

    @property
    def imap_port(self) -> int:
        """The port after defaults were applied."""
        assert self.port is not None  # noqa: S101 - set by the validator
        return self.port


def _default_data_dir() -> Path:
    state = os.environ.get("STATE_DIRECTORY")
    if _is_given(state):
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(state.split(":")[0])
    return Path.home() / ".local" / "share" / "sokratos-worker"


def _dangling_link(path: Path) -> str | None:
    """Why ``path`` cannot exist: it, or a directory above it, is a symlink whose target is
    missing (a disk not mounted), else None. mkdir would fail there with a bare "File exists"."""
    absolute = path.absolute()
    for candidate in (*reversed(absolute.parents), absolute):
        try:
            dangling = candidate.is_symlink() and not candidate.exists()
            target = os.readlink(candidate) if dangling else ""
        except OSError:
            continue  # not examinable here: the probe below says why
        if dangling:
            missing = f"a symlink to {target!r}, which does not exist (not mounted?)"
            if candidate == absolute:
                return f"{str(path)!r} is {missing}"
            return f"{str(path)!r} lies under {str(candidate)!r}, {missing}"
    return None


def _unusable_directory(path: Path) -> str | None:
    """Why this user cannot write ``path`` (or create it), else None; nothing is left behind."""
    dangling = _dangling_link(path)
    if dangling is not None:
        return dangling
    if path.is_dir():
        # access() suffices for a directory that exists: it sees modes and read-only mounts.
        if os.access(path, os.W_OK | os.X_OK):
            return None
        return f"{str(path)!r} is not writable by this user"
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        return f"{str(path)!r} cannot be created: {parent} is not a directory"
    try:
        # A real attempt: for root, access() calls even /proc writable, where mkdir fails.
        os.rmdir(tempfile.mkdtemp(prefix=".sokratos-probe-", dir=parent))
    except OSError as exc:
        refused = f"{parent} refuses a new directory ({exc.strerror})"
        return f"{str(path)!r} cannot be created: {refused}"
    return None


def _refuse_bad_libpq_environment(url_options: Mapping[str, object]) -> None:
    """Raise a :class:`ConfigError` naming a PG* variable whose value libpq would refuse
    for an option the URL leaves out (libpq would only say so as it connects).

    The sslmode sslnegotiation=direct or sslrootcert=system needs is checked with the
    variables' values (PGSSLMODE=verify-full completes a URL's sslnegotiation=direct); a
    ValueError (the URL's) when none of them is to blame."""
    merged = dict(url_options)
    sources: dict[str, str] = {}
    for option, variable in libpq.option_variables().items():
        value = os.environ.get(variable)
        if value is None or option in url_options:
            continue
        merged[option] = value
        sources[option] = variable
        problem = libpq.option_problem(merged, combined=False)
        if problem is not None:
            raise _libpq_variable_refused(variable, option, problem)
    found = libpq.sslmode_problem(merged)
    if found is None:
        return
    asking, problem = found
    for option in (asking, "sslmode"):
        if option in sources:
            raise _libpq_variable_refused(sources[option], option, problem)
    raise ValueError(problem)


def _libpq_variable_refused(variable: str, option: str, problem: str) -> ConfigError:
    return ConfigError(
        variable,
        f"{problem}; libpq uses it because SOKRATOS_DATABASE_URL sets no {option}:"
        f" correct or unset {variable}",
    )


class _EnvSource(EnvSettingsSource):
    """The variables themselves, where one that is empty or only whitespace is unset.

    ``env_ignore_empty`` drops only ``X=``: ``X=" "`` would hide ``X_FILE`` and the
    credential (an unset database URL means the embedded PostgreSQL, not production).
    """

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        _refuse_conflicting_spellings(settings_cls)
        # Names are read in any letter case; built here so that a blank spelling never
        # hides a given one (pydantic-settings keeps whichever the environment lists last).
        self.env_vars = {
            name.lower(): value for name, value in os.environ.items() if _is_given(value)
        }


def _refuse_conflicting_spellings(settings_cls: type[BaseSettings]) -> None:
    """A :class:`ConfigError` when two spellings of one variable (``SOKRATOS_DATABASE_URL``
    and ``sokratos_database_url``, or their ``_FILE`` forms) hold different non-blank
    values: names are read in any letter case, and the one the environment lists last would
    win without a word. The same value twice is fine."""
    known: set[str] = set()
    for field_name in settings_cls.model_fields:
        for name in _variable_names(field_name):
            known |= {name, name + "_FILE"}
    spellings: dict[str, list[str]] = {}
    for name, value in os.environ.items():
        if name.upper() in known and _is_given(value):
            spellings.setdefault(name.upper(), []).append(name)
    for upper, names in sorted(spellings.items()):
        if len({os.environ[name] for name in names}) > 1:
            ordered = sorted(names, key=lambda n: (n != upper, n))  # the upper-case one first
            raise ConfigError(
                " and ".join(ordered),
                "are set with different values (names are read in any letter case, so one"
                " would win silently): keep one of them",
            )


class _SecretFilesSource(PydanticBaseSettingsSource):
    """``X_FILE`` and ``$CREDENTIALS_DIRECTORY/X`` for every variable ``X``.

    An empty or whitespace-only ``X`` or ``X_FILE`` counts as unset, as it does for the
    variables themselves (:class:`_EnvSource`): the next place is looked at. A file that
    holds nothing is refused. A complex field (the JSON lists) is decoded from the file's
    text as pydantic-settings decodes it from a variable.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ does the work

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for field_name, field in self.settings_cls.model_fields.items():
            found = _secret_file_value(field_name)
            if found is None:
                continue
            named, path, text = found
            if self.field_is_complex(field):
                try:
                    values[field_name] = self.decode_complex_value(field_name, field, text)
                except ValueError as exc:  # json.JSONDecodeError: its text never quotes ours
                    raise ConfigError(named, f"{path!r} is not valid JSON ({exc})") from None
            else:
                values[field_name] = text
        return values


def _secret_file_value(field_name: str) -> tuple[str, str, str] | None:
    """``(variable to name in an error, path, text)`` of the file that sets ``field_name``,
    or None when an explicit variable wins or no file is given: a non-blank ``X`` first,
    then ``X_FILE``, then ``$CREDENTIALS_DIRECTORY/X``."""
    names = _variable_names(field_name)
    if any(_environment_value(name) is not None for name in names):
        return None  # an explicit variable wins
    for name in names:
        found = _environment_value(f"{name}_FILE")
        if found is not None:
            file_var, path = found
            return file_var, path, _read_or_refuse(file_var, path)
    creds = credentials_directory()
    if creds is None:
        return None
    for name in names:
        file = creds.absolute() / name
        path = str(file)
        try:
            present = file.is_file()
        except OSError as exc:  # not ENOENT: e.g. a directory the worker may not search
            raise ConfigError(
                name, f"cannot examine the credential file {path!r}: {exc.strerror or exc}"
            ) from None
        if present:
            return name, path, _read_or_refuse(name, path)
    return None


def _environment_value(name: str) -> tuple[str, str] | None:
    """``(name as set, value)`` of the variable ``name`` in any letter case, when it is not
    blank: pydantic-settings reads the variables themselves case-insensitively, and their
    ``_FILE`` forms must agree (``sokratos_database_url`` set must win over a credential)."""
    exact = os.environ.get(name)
    if _is_given(exact):
        return name, exact
    return next(
        (
            (key, value)
            for key, value in os.environ.items()
            if key.upper() == name and _is_given(value)
        ),
        None,
    )


def _read_or_refuse(variable: str, path: str) -> str:
    try:
        text = read_secret_file(path)
    except ValueError as exc:
        raise ConfigError(variable, str(exc)) from None
    if not text.strip():
        # Not the default: an empty database URL credential would mean the embedded
        # PostgreSQL instead of production, without a word.
        remedy = f"unset {variable}" if variable.endswith("_FILE") else "remove the credential"
        raise ConfigError(
            variable, f"{path!r} is empty: write the value into it, or {remedy} for the default"
        )
    return text


def _variable_names(field_name: str) -> list[str]:
    names = [ENV_PREFIX + field_name.upper()]
    if field_name == "database_url":
        names.append("DATABASE_URL")
    return names


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
    data_dir: Path = Field(default_factory=_default_data_dir)
    migrate_on_start: bool = True
    # Tests give up after 1 s; systemd's TimeoutStartSec (120 s) ends a start long before an hour.
    startup_timeout: Annotated[
        Duration,
        within(
            1,
            _HOUR,
            too_short="a healthy database needs a moment to answer",
            too_long="exit 75 and let systemd restart instead of waiting so long",
        ),
    ] = 60.0
    # Every tick queries every queue; it is the only wake-up for missed notifications.
    heartbeat_interval: Annotated[
        Duration,
        within(
            1,
            _HOUR,
            too_short="each tick queries the database",
            too_long="work whose notification was missed would wait that long",
        ),
    ] = 60.0
    # One item must fit in a tick; `run --once` must end the same day.
    tick_budget: Annotated[
        Duration,
        within(
            1,
            _DAY,
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
            _DAY,
            too_short="sooner is a busy loop against a failing backend",
            too_long="the first retry should come within a day",
        ),
    ] = 30.0
    # A retry more than a week out is a dead letter in all but name.
    retry_max: Annotated[
        Duration,
        within(
            0.01,
            7 * _DAY,
            too_short="sooner is a busy loop against a failing backend",
            too_long="lower SOKRATOS_MAX_ATTEMPTS instead of waiting longer",
        ),
    ] = 1800.0
    # Renewed every max(0.5 s, lease/3) (tests use 1.5 s); a crashed worker's items wait it out.
    lease: Annotated[
        Duration,
        within(
            1,
            _DAY,
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
            _HOUR,
            too_short="items in flight need a moment to finish",
            too_long="keep it below the unit's TimeoutStopSec",
        ),
    ] = 30.0
    llm_backends: list[BackendConfig] = Field(default_factory=list)
    embedding_url: str | None = None
    embedding_model: str | None = None
    embedding_dim: int | None = Field(default=None, ge=1, le=16000)
    embedding_suffix: str = ""
    local_model: bool = False
    email_accounts: list[EmailAccountConfig] = Field(default_factory=list)
    # 0 turns checks off; see _EMAIL_CHECK_SHORTEST for the floor, and mail checked weekly is late.
    email_check_interval: Annotated[
        Duration,
        within(
            _EMAIL_CHECK_SHORTEST,
            7 * _DAY,
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
            3650 * _DAY,
            too_short="a window of nothing would triage no mail",
            too_long="that would triage a decade of mail",
        ),
    ] = 86400.0
    # One account's whole IMAP session (a trickling server never trips a read's timeout).
    email_check_deadline: Annotated[
        Duration,
        within(
            1,
            _DAY,
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
            problem = libpq.option_problem(parts, combined=False)
            if problem is not None:
                raise ValueError(problem)
            _refuse_bad_libpq_environment(parts)  # and the URL's sslmode with them
        return value

    @field_validator("data_dir")
    @classmethod
    def _directory(cls, value: Path, info: ValidationInfo) -> Path:
        # Caught now: later the embedded PostgreSQL or the spool would fail with a raw OSError.
        try:
            is_something_else = value.exists() and not value.is_dir()
        except OSError as exc:
            raise ValueError(f"{str(value)!r} cannot be examined: {exc.strerror}") from None
        if is_something_else:
            raise ValueError(f"{str(value)!r} is a file, not a directory")
        # Only the embedded PostgreSQL needs it at once (an invalid URL is the error shown).
        if "database_url" in info.data and info.data["database_url"] is None:
            problem = _unusable_directory(value)
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
        names = [b.name for b in self.llm_backends]
        if len(names) != len(set(names)):
            raise ValueError("SOKRATOS_LLM_BACKENDS: backend names must be unique")
        accounts = [a.name for a in self.email_accounts]
        if len(accounts) != len(set(accounts)):
            raise ValueError("SOKRATOS_EMAIL_ACCOUNTS: account names must be unique")
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
        return (init_settings, _EnvSource(settings_cls), _SecretFilesSource(settings_cls))

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
            return f"embedded:{self.data_dir}"
        info = conninfo_to_dict(self.database_url.get_secret_value())
        host = info.get("host") or info.get("hostaddr") or "localhost"
        dbname = info.get("dbname") or info.get("user") or ""
        return f"postgresql://{host}:{info.get('port') or 5432}/{dbname}"

    @property
    def spool_dir(self) -> Path:
        """Where enqueues wait while PostgreSQL is unreachable."""
        return self.data_dir / "spool"

    def effective_log_format(self) -> Literal["json", "console"]:
        """JSON for journald, readable console output on a terminal."""
        if self.log_format is not None:
            return self.log_format
        return "console" if sys.stderr.isatty() else "json"


def _variable_for(loc: tuple[int | str, ...]) -> str:
    """``('llm_backends', 0, 'url')`` → ``SOKRATOS_LLM_BACKENDS[0].url``."""
    if not loc:
        return "configuration"
    head = str(loc[0])
    # An alias such as SOKRATOS_DATABASE_URL is already the variable's name.
    variable = head if head.isupper() else ENV_PREFIX + head.upper()
    for part in loc[1:]:
        variable += f"[{part}]" if isinstance(part, int) else f".{part}"
    return variable


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


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SOKRATOS_*`` names no setting reads: most likely typos, which would be ignored."""
    known = {"SOKRATOS_TEST_DATABASE_URL", "SOKRATOS_TEST_PGDATA_BASE"}  # the test suite's
    for field_name in Settings.model_fields:
        for name in _variable_names(field_name):
            known |= {name, name + "_FILE"}
    env = os.environ if environ is None else environ
    return sorted(
        name for name in env if name.upper().startswith(ENV_PREFIX) and name.upper() not in known
    )


def _settings_error_variable(text: str) -> str:
    match = re.search(r'field "(\w+)"', text)
    return _variable_for((match.group(1),)) if match else "configuration"


def _settings_error_reason(exc: SettingsError) -> str:
    cause = exc.__cause__
    if cause is not None:
        return f"is not valid JSON ({cause})"
    return str(exc)


__all__ = [
    "BackendConfig",
    "ConfigError",
    "Duration",
    "EmailAccountConfig",
    "Settings",
    "load_settings",
    "parse_duration",
    "read_secret_file",
]
