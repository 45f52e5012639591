"""What libpq refuses in the database's connection options: checked before connecting, and
read from its refusals when it connects.

libpq checks an option's value only when it connects, and psycopg reports the refusal like an
outage: waited out, then exit 75, and restarted by systemd for ever. The options come from
SOKRATOS_DATABASE_URL and from libpq's own PG* variables, which fill what the URL leaves out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cache

from psycopg import pq

# libpq's own lists (libpq 18, fe-connect.c).
_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "load_balance_hosts": ("disable", "random"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "min_protocol_version": ("3.0", "3.2", "latest"),
    "max_protocol_version": ("3.0", "3.2", "latest"),
}
_STRONG_SSLMODES = ("require", "verify-ca", "verify-full")  # what sslnegotiation=direct needs
_READ_ONLY_SESSIONS = ("read-only", "standby", "prefer-standby")
_TLS_VERSIONS = ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3")  # any case; empty: no bound
_INTEGERS = (
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_AUTH_METHODS = ("password", "md5", "gss", "sspi", "scram-sha-256", "oauth", "none")
# What Linux's setsockopt accepts for each (TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT).
_KEEPALIVE_MOST = {"keepalives_idle": 32767, "keepalives_interval": 32767, "keepalives_count": 127}


def option_problem(options: Mapping[str, object], *, combined: bool = True) -> str | None:
    """Why libpq would refuse one of ``options`` (parsed by ``conninfo_to_dict``), or None.

    ``combined=False`` leaves out the sslmode each of sslnegotiation=direct and
    sslrootcert=system needs: a PG* variable may give it (:func:`sslmode_problem`).
    Only option names and values that are not secret are quoted."""
    port = str(options.get("port") or "")
    # (isascii: "²" is a digit to isdigit() but not to int() nor libpq)
    if not all((p.isascii() and p.isdigit()) or not p for p in port.split(",")):  # "5432,5433"
        # libpq would report it as a host it cannot resolve: an outage (exit 75) that
        # systemd restarts for ever, instead of this configuration error.
        return "has a port that is not a number"
    if any(p and not 1 <= int(p) <= 65535 for p in port.split(",")):
        # libpq refuses it at every attempt ("invalid port number"): waiting cannot help.
        return "has a port out of range (1-65535)"
    for key, choices in _CHOICES.items():
        value = options.get(key)
        if value is not None and str(value) not in choices:
            return f"has an invalid {key} {str(value)!r} (libpq accepts {', '.join(choices)})"
    attrs = options.get("target_session_attrs")
    if attrs in _READ_ONLY_SESSIONS:
        # libpq accepts it, then finds only a standby or none: the worker's writes would fail,
        # or the start would wait for a server that never comes (exit 75).
        return (
            f"has target_session_attrs {attrs!r}: sokratos-worker writes to the database"
            " (use read-write, primary or any)"
        )
    weak_sslmode = sslmode_problem(options) if combined else None
    if weak_sslmode is not None:
        return weak_sslmode[1]
    for key in ("ssl_min_protocol_version", "ssl_max_protocol_version"):
        value = options.get(key)
        if value and str(value).lower() not in (v.lower() for v in _TLS_VERSIONS):
            return f"has an invalid {key} {str(value)!r} (libpq accepts {', '.join(_TLS_VERSIONS)})"
    low, high = (
        str(options.get(key) or "").lower()
        for key in ("ssl_min_protocol_version", "ssl_max_protocol_version")
    )
    versions = [v.lower() for v in _TLS_VERSIONS]
    if low and high and versions.index(low) > versions.index(high):
        return "has ssl_min_protocol_version above ssl_max_protocol_version: libpq refuses it"
    for key in _INTEGERS:
        value = options.get(key)
        if value is not None and not re.fullmatch(r"\s*[+-]?\d+\s*", str(value)):
            return f"has an invalid {key} {str(value)!r} (a whole number)"
    if (problem := _keepalive_problem(options)) is not None:
        return problem
    return _require_auth_problem(options.get("require_auth"))


def _keepalive_problem(options: Mapping[str, object]) -> str | None:
    """A keepalive setting the kernel refuses, unless keepalives=0 leaves them unused.

    libpq hands each to setsockopt at every TCP connect, and Linux refuses one out of its
    range ("setsockopt(TCP_KEEPIDLE) failed: Invalid argument"): waited out as an outage,
    exit 75 and restarted for ever, instead of this configuration error."""
    keepalives = options.get("keepalives")
    if keepalives is not None and int(str(keepalives)) == 0:
        return None
    for key, most in _KEEPALIVE_MOST.items():
        value = options.get(key)
        if value is not None and not 1 <= int(str(value)) <= most:
            return f"has {key} {int(str(value))}: the kernel refuses it (Linux accepts 1-{most})"
    return None


def sslmode_problem(options: Mapping[str, object]) -> tuple[str, str] | None:
    """``(option, problem)`` when the sslmode is too weak for sslnegotiation=direct or
    sslrootcert=system (libpq's order), naming the option that asks for more, else None."""
    system = options.get("sslrootcert") == "system"
    # libpq's default: verify-full with sslrootcert=system, else prefer.
    sslmode = str(options.get("sslmode") or ("verify-full" if system else "prefer"))
    if options.get("sslnegotiation") == "direct" and sslmode not in _STRONG_SSLMODES:
        return "sslnegotiation", (
            f"has sslnegotiation=direct with sslmode {sslmode!r}: libpq refuses it (use"
            f" sslmode {', '.join(_STRONG_SSLMODES)})"
        )
    if system and sslmode != "verify-full":
        return "sslrootcert", (
            f"has sslrootcert=system with sslmode {sslmode!r}: libpq refuses it (use sslmode"
            " verify-full)"
        )
    return None


def _require_auth_problem(require_auth: object) -> str | None:
    if not require_auth:
        return None
    methods = str(require_auth).split(",")
    bare = [m.removeprefix("!") for m in methods]
    unknown = [m for m in bare if m not in _AUTH_METHODS]
    if unknown:
        return (
            f"has an invalid require_auth method {unknown[0]!r} (libpq accepts"
            f" {', '.join(_AUTH_METHODS)}, each optionally negated with !)"
        )
    if len({m.startswith("!") for m in methods}) > 1:
        return "has a require_auth that mixes negated (!) and plain methods: libpq refuses it"
    if len(set(bare)) != len(bare):
        return "has a require_auth that names a method twice: libpq refuses it"
    return None


# libpq reads these besides the connection options' own variables: session settings sent
# to the server, and where it looks for service files.
_SESSION_VARIABLES = {"timezone": "PGTZ", "datestyle": "PGDATESTYLE", "geqo": "PGGEQO"}
_FILE_VARIABLES = ("PGSERVICEFILE", "PGSYSCONFDIR")


@cache
def option_variables() -> dict[str, str]:
    """Connection option → the PG* variable libpq takes it from when the URL leaves it out,
    as the linked libpq reports them (``PQconndefaults``)."""
    return {
        option.keyword.decode(): option.envvar.decode()
        for option in pq.Conninfo.get_defaults()
        if option.envvar
    }


def option_source(option: str, url_options: Mapping[str, object]) -> str:
    """The variable that gave ``option`` its value: the URL's, else libpq's PG* variable."""
    variable = option_variables().get(option)
    if option in url_options or variable is None or variable not in os.environ:
        return "SOKRATOS_DATABASE_URL"
    return variable


def session_variable(parameter: str) -> str | None:
    """``PGTZ`` for the server parameter ``TimeZone`` (and so on) when it is set, else None."""
    variable = _SESSION_VARIABLES.get(parameter.lower())
    return variable if variable is not None and variable in os.environ else None


def environment_names() -> frozenset[str]:
    """Every PG* variable libpq reads: connection options, session settings, service files."""
    return frozenset((*option_variables().values(), *_SESSION_VARIABLES.values(), *_FILE_VARIABLES))


def without_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without libpq's PG* variables (for a command that ignores the URL)."""
    names = environment_names()
    return {name: value for name, value in environ.items() if name not in names}


def forget_environment() -> list[str]:
    """Remove libpq's PG* variables from this process's environment; returns their names.

    For the embedded PostgreSQL only: they are meant for another server, and libpq would
    apply them to this one as well (PGOPTIONS, PGSERVICE, PGTARGETSESSIONATTRS or PGPORT
    broke its connection). Call it before any thread connects.
    """
    present = sorted(name for name in environment_names() if name in os.environ)
    for name in present:
        del os.environ[name]
    return present


# What libpq answers when an option's value is wrong (it checks most only as it connects):
# waiting will not help. Each is about the option given, or the one its group names.
_OPTION_REFUSED = (
    (re.compile(r'definition of service "[^"]*" not found'), "service"),
    (re.compile(r'invalid integer value "[^"]*" for connection option "(\w+)"'), None),
    (re.compile(r'invalid "?(\w+)"? value: '), None),
    (re.compile(r"could not match \d+ port numbers"), "port"),
    (re.compile(r'invalid port number: "[^"]*"'), "port"),  # (from a service file)
    # sslnegotiation=direct or sslrootcert=system from a service file (config_validators.py
    # checks the URL's and the variables').
    (re.compile(r'weak sslmode "[^"]*" may not be used with'), "sslmode"),
    # Checked before store/connection.py's login markers, whose "does not exist" would take it.
    (re.compile(r'root certificate file "[^"]*" does not exist'), "sslrootcert"),
)
# Only PGSERVICEFILE names a service file libpq requires to exist.
_SERVICE_FILE_MISSING = re.compile(r'service file "[^"]*" not found')
# The server refusing a setting sent at start-up: from ``options`` (the URL's or PGOPTIONS),
# from PGTZ, PGDATESTYLE or PGGEQO, or an option of its own (client_encoding); a group names
# the parameter when there is one.
_SETTING_REFUSED = re.compile(
    r'FATAL:\s+(?:(?:unrecognized configuration|invalid value for) parameter "(\w+)"'
    r'|parameter "(\w+)" (?:cannot be changed|requires an? \w+ value)'
    r'|[^\n]*? is outside the valid range for parameter "(\w+)"'
    r'|permission denied to set parameter "(\w+)"'
    r"|invalid command-line argument|-+[\w-]+ requires a value)"
)


def refusal(text: str, url_options: Mapping[str, object]) -> tuple[str, str] | None:
    """``(variable, what was refused)`` when libpq's or the server's refusal ``text`` is about
    a connection option (waiting will not help), else None; the variable is the URL's, or
    the PG* variable that gave the option."""
    match = _SERVICE_FILE_MISSING.search(text)
    if match is not None:
        return "PGSERVICEFILE", _refused_line(text, match)
    for pattern, option in _OPTION_REFUSED:
        match = pattern.search(text)
        if match is not None:
            return option_source(option or match.group(1), url_options), _refused_line(text, match)
    match = _SETTING_REFUSED.search(text)
    if match is None:
        return None
    parameter = next((group for group in match.groups() if group), "")
    return _setting_source(parameter, url_options), _refused_line(text, match)


# A connection pooler (PgBouncer) refusing a startup parameter it does not track: ``options``
# (the URL's or PGOPTIONS) or a session setting such as PGGEQO's. Newer PgBouncers name a
# setting inside ``options`` instead ("unsupported startup parameter in options: jit").
_STARTUP_PARAMETER_REFUSED = re.compile(
    r'unsupported startup parameter(?P<in_options> in options)?:\s*"?(?P<name>[\w.-]+)'
)


def startup_parameter_refusal(
    text: str, url_options: Mapping[str, object]
) -> tuple[str, str, str] | None:
    """``(variable, parameter, what was refused)`` when a pooler's refusal ``text`` is about a
    startup parameter, else None; ``parameter`` is the one the client sent (``options`` for a
    setting inside it) and the variable the URL's, or the PG* variable that sent it."""
    match = _STARTUP_PARAMETER_REFUSED.search(text)
    if match is None:
        return None
    parameter = "options" if match.group("in_options") else match.group("name")
    return _setting_source(parameter, url_options), parameter, _refused_line(text, match)


def _setting_source(parameter: str, url_options: Mapping[str, object]) -> str:
    """The variable that sent the server ``parameter``: PGTZ and the like, the option of the
    same name (client_encoding: the URL's or PGCLIENTENCODING), else ``options``'s."""
    session = session_variable(parameter)
    if session is not None:
        return session
    option = parameter.lower()
    variable = option_variables().get(option)
    if variable is not None and (option in url_options or variable in os.environ):
        return option_source(option, url_options)
    return option_source("options", url_options)


def _refused_line(text: str, match: re.Match[str]) -> str:
    """The line of ``text`` from ``match`` on, without the server's ``FATAL:``."""
    line = text[match.start() :].splitlines()[0].removeprefix("FATAL:")
    return " ".join(line.split())
