"""Settings from the environment; the only place that reads ``os.environ``.

Every variable of the contract (``../shared/design/contract.md`` §2) is a field of
:class:`Settings`. Values come, highest precedence first, from the variable itself,
from ``<VARIABLE>_FILE`` (a path), and from a file named ``<VARIABLE>`` in
``$CREDENTIALS_DIRECTORY`` (systemd ``LoadCredential=``).

:func:`load_settings` turns every problem into one :class:`ConfigError` that names the
variable, so the CLI can exit 78 with one line instead of a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

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
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

ENV_PREFIX = "SOKRATOS_"

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


class ConfigError(Exception):
    """Invalid configuration: ``variable`` names what to fix, ``message`` says why."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def parse_duration(value: object) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``250ms`` or compound ``1h30m``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90, 90s, 5m or 1h30m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            seconds = float(text)
        else:
            parts = _DURATION_PART.findall(text)
            if not text or "".join(n + u for n, u in parts) != text:
                raise ValueError(
                    f"{value!r} is not a duration (use 90, 90s, 5m, 1h30m; units ms s m h d)"
                )
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise ValueError("expected a duration such as 90, 90s, 5m or 1h30m")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


PositiveDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_positive)]


def credentials_directory() -> Path | None:
    """``$CREDENTIALS_DIRECTORY`` as systemd sets it for ``LoadCredential=``."""
    value = os.environ.get("CREDENTIALS_DIRECTORY")
    return Path(value) if value else None


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


class BackendConfig(BaseModel):
    """One OpenAI-compatible chat backend, tried in the order of the list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key: SecretStr | None = None
    api_key_file: str | None = None
    timeout: PositiveDuration = 120.0
    max_concurrency: int = Field(default=2, ge=1)
    structured_output: Literal["json_schema", "json_object", "grammar"] = "json_schema"
    temperature: float = Field(default=0.1, ge=0.0, le=2.0)
    ca_file: str | None = None
    tls_verify: bool = True

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

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
    ca_file: str | None = None
    tls_verify: bool = True

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
    if state:
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(state.split(":")[0])
    return Path.home() / ".local" / "share" / "sokratos-worker"


class _SecretFilesSource(PydanticBaseSettingsSource):
    """``X_FILE`` and ``$CREDENTIALS_DIRECTORY/X`` for every variable ``X``."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ does the work

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        creds = credentials_directory()
        for field_name in self.settings_cls.model_fields:
            for variable in _variable_names(field_name):
                if variable in os.environ:
                    break  # an explicit variable wins
                file_var = f"{variable}_FILE"
                if file_var in os.environ:
                    try:
                        values[field_name] = read_secret_file(os.environ[file_var])
                    except ValueError as exc:
                        raise ConfigError(file_var, str(exc)) from exc
                    break
                if creds is not None and (creds / variable).is_file():
                    values[field_name] = read_secret_file(str(creds / variable))
                    break
        return values


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
    )

    database_url: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("SOKRATOS_DATABASE_URL", "DATABASE_URL")
    )
    data_dir: Path = Field(default_factory=_default_data_dir)
    migrate_on_start: bool = True
    startup_timeout: PositiveDuration = 60.0
    heartbeat_interval: PositiveDuration = 60.0
    tick_budget: PositiveDuration = 300.0
    max_attempts: int = Field(default=3, ge=1, le=100)
    retry_base: PositiveDuration = 30.0
    retry_max: PositiveDuration = 1800.0
    lease: PositiveDuration = 300.0
    concurrency: int = Field(default=4, ge=1, le=256)
    shutdown_grace: PositiveDuration = 30.0
    llm_backends: list[BackendConfig] = Field(default_factory=list)
    embedding_url: str | None = None
    embedding_model: str | None = None
    embedding_dim: int | None = Field(default=None, ge=1, le=16000)
    embedding_suffix: str = ""
    local_model: bool = False
    email_accounts: list[EmailAccountConfig] = Field(default_factory=list)
    email_check_interval: Duration = 300.0
    email_initial_lookback: PositiveDuration = 86400.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] | None = None
    metrics_addr: str | None = None
    failed_ops_ttl_days: int = Field(default=0, ge=0)
    processed_emails_ttl_days: int = Field(default=90, ge=1)
    # Set by the template unit sokratos-worker@.service; part of the worker id.
    worker_instance: str | None = None

    @field_validator("database_url", mode="before")
    @classmethod
    def _database_url(cls, value: object) -> object:
        # Empty (`SOKRATOS_DATABASE_URL=` in an env file) means unset (embedded), not libpq's
        # defaults; anything else must parse, checked before any command connects.
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str):
            try:
                parts = conninfo_to_dict(value)
                port = str(parts.get("port") or "5432")
                if not all(p.isdigit() or not p for p in port.split(",")):  # "5432,5433" too
                    # libpq would report it as a host it cannot resolve: an outage (exit 75)
                    # that systemd restarts for ever, instead of this configuration error.
                    raise ValueError("has a port that is not a number")
            except psycopg.ProgrammingError:
                # Not the parser's text: it may quote the URL, password included.
                raise ValueError(
                    "is not a libpq URI (postgresql://user:password@host:5432/dbname)"
                    " or key=value string"
                ) from None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("embedding_url")
    @classmethod
    def _embedding_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

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
        return (init_settings, env_settings, _SecretFilesSource(settings_cls))

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


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Validate the whole configuration or raise one :class:`ConfigError`."""
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
