"""Checks of single configuration values that must hold before any command runs.

Each one turns what would later be a raw traceback, or a refusal only at connect time, into
a message naming the value: HTTP base URLs (:data:`HttpBaseUrl`, and
:func:`without_credentials` to show one safely), CA bundles (:data:`CaFile`), whether this
user can create and write the data directory (:func:`unusable_directory`), and libpq's PG*
variables that would fill options the database URL leaves out
(:func:`refuse_bad_libpq_environment`).
"""

from __future__ import annotations

import os
import re
import ssl
import tempfile
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

from sokratos_worker import libpq
from sokratos_worker.config_error import ConfigError


def http_base_url(value: str) -> str:
    """An ``http(s)://host[:port][/path]`` base URL without its trailing slash, or why not."""
    if "@" in _after_authority(value):
        # A password's raw '/', '?' or '#' ends the host early, and a password that starts
        # with digits reads as a port: what precedes the last '@' may be part of one.
        raise ValueError(
            f"{_after_last_at(value)!r} has an '@' after its host: a '/', '#', '?' or '@' in"
            " its password must be percent-encoded (%2F, %23, %3F, %40); a base URL holds no"
            " other '@' there"
        )
    shown = repr(without_credentials(value))  # a URL may carry basic-auth credentials
    try:
        parts = urlsplit(value)
        port_is_zero = parts.port == 0  # .port raises for one that is not 0 to 65535
    except ValueError as exc:
        raise ValueError(f"{shown} is not a valid URL ({_unparsable(value, exc)})") from None
    if port_is_zero:
        raise ValueError(f"{shown} has port 0: give the server's port")
    if parts.scheme not in ("http", "https"):
        hint = f" (http://{without_credentials(value)}?)" if "://" not in value else ""
        raise ValueError(f"{shown} must start with http:// or https://{hint}")
    if not parts.hostname:
        raise ValueError(f"{shown} has no host (e.g. http://127.0.0.1:8080/v1)")
    if parts.query or parts.fragment:
        # The request's path is appended to the URL: a query would swallow it.
        raise ValueError(
            f"{shown} has a query or fragment ('?' or '#'): give the base URL only (e.g."
            " http://127.0.0.1:8080/v1); a '?' or '#' in a password is percent-encoded"
        )
    return value.rstrip("/")


def _unparsable(value: str, error: ValueError) -> str:
    """Why urlsplit refused ``value``, in words without its password: urlsplit's own about the
    URL without credentials when that fails too (a port, a bracket), else the credentials'."""
    bare = without_credentials(value)
    if bare == value:
        return str(error)
    try:
        urlsplit(bare).port  # noqa: B018 - read for the ValueError it raises
    except ValueError as bare_error:
        return str(bare_error)
    return (
        "its user name or password holds a character that must be percent-encoded, e.g. '[' as %5B"
    )


def without_credentials(url: str) -> str:
    """``url`` as it may be shown: the ``user:password@`` (HTTP basic auth) that
    :func:`url_credentials` finds taken out; any other URL unchanged."""
    head, credentials, tail = _split_credentials(url)
    return url if credentials is None else head + tail


def url_credentials(url: str) -> str | None:
    """The ``user:password`` (as spelled, percent-encoded) before a URL's host, or None.

    RFC 3986's reading: up to the last '@' of the authority (what follows ``scheme://`` up to
    the first '/', '?' or '#'). A password holding a raw '/', '?' or '#' ends the authority
    early: when what precedes it cannot be ``host[:port]``, it is taken to the last '@' of
    the URL. A password of digits before such a character reads as a port: ambiguous, and
    :func:`http_base_url` refuses it."""
    return _split_credentials(url)[1]


def _split_credentials(url: str) -> tuple[str, str | None, str]:
    """``url`` as ``scheme://``, the credentials (or None) and what follows their '@'."""
    head, rest = _scheme_and_rest(url)
    authority = _authority(rest)
    if "@" in authority:
        credentials = authority.rpartition("@")[0]
    elif "@" in rest and not _HOST_PORT.fullmatch(authority):
        credentials = rest.rpartition("@")[0]  # a '/', '?' or '#' in the password
    else:
        return head, None, rest
    return head, credentials, rest[len(credentials) + 1 :]


def _scheme_and_rest(url: str) -> tuple[str, str]:
    """``url`` as its ``scheme://`` ("" without one) and the rest (a "://" further on, in a
    query, is not a scheme's)."""
    scheme = _SCHEME.match(url)
    head = scheme[0] if scheme else ""
    return head, url[len(head) :]


def _authority(rest: str) -> str:
    """The authority at the start of ``rest`` (a URL after its ``scheme://``): up to the first
    '/', '?' or '#'."""
    return _AUTHORITY_END.split(rest, maxsplit=1)[0]


def _after_authority(url: str) -> str:
    """What follows a URL's authority: its path, query and fragment."""
    rest = _scheme_and_rest(url)[1]
    return rest[len(_authority(rest)) :]


def _after_last_at(url: str) -> str:
    """``url`` with all before its last '@' left out (shown as ``...``): none of a password."""
    return f"{_scheme_and_rest(url)[0]}...@{url.rpartition('@')[2]}"


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_AUTHORITY_END = re.compile(r"[/?#]")
# An authority without credentials: a host (a bracketed IPv6 address) and an optional port.
_HOST_PORT = re.compile(r"(?:\[[^\]]*\]|[^:\[\]]*)(?::\d*)?")


def database_url_at_sign_problem(url: str, parts: Mapping[str, object]) -> str | None:
    """Why a database URL whose host or port holds an '@' is refused (libpq's host would never
    resolve, an outage for ever, its name quoting a password), or None."""
    host = str(parts.get("host") or "")
    if "@" not in host + str(parts.get("port") or ""):
        return None
    authority = re.split(r"[/?]", url.partition("://")[2], maxsplit=1)[0] if "://" in url else ""
    if authority.count("@") > 1:
        # libpq split at the first '@' (a user name's or a password's): its tail became the
        # host, or the port.
        return (
            "has an '@' in its user name or password: percent-encode it as %40"
            " (postgresql://user:pass%40word@host/dbname)"
        )
    if host.startswith("@"):
        return (
            "names an abstract Unix socket (a host starting with '@'), which psycopg cannot"
            " connect to (it looks the name up as a host): give the socket's directory"
            " (host=/var/run/postgresql) or a TCP host"
        )
    return "has a host with an '@' in it, which is neither a host name nor a socket directory"


def header_value_problem(secret: str) -> str | None:
    """Why ``secret`` cannot be sent in an HTTP header (``Authorization: Bearer ...``), or
    None. Said now, without the secret: at the first call it was a raw UnicodeEncodeError,
    or a protocol error quoting the key into the item's outcome."""
    for position, char in enumerate(secret, start=1):
        if not "\x21" <= char <= "\x7e":
            return (
                f"character {position} of {len(secret)} is {_character_name(char)}, which an"
                " HTTP header cannot carry (a pasted space or line end?)"
            )
    return None


def _character_name(char: str) -> str:
    """``U+00A0 (NO-BREAK SPACE)``: a character named, as an operator can search for it."""
    controls = {"\t": "TAB", "\n": "LINE FEED", "\r": "CARRIAGE RETURN"}
    name = controls.get(char) or unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" ({name})" if name else "")


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


def unusable_directory(path: Path) -> str | None:
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


def refuse_bad_libpq_environment(url_options: Mapping[str, object]) -> None:
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
