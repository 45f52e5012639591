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
    shown = repr(without_credentials(value))  # a URL may carry basic-auth credentials
    try:
        parts = urlsplit(value)
        port_is_zero = parts.port == 0  # .port raises for one that is not 0 to 65535
    except ValueError as exc:
        # (urlsplit's words quote the part it could not read: a password's, after an "@")
        why = (
            f" ({exc})"
            if "@" not in value
            else " (a '/', '#', '?' or '@' in its password must be percent-encoded)"
        )
        raise ValueError(f"{shown} is not a valid URL{why}") from None
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


def without_credentials(url: str) -> str:
    """``url`` as it may be shown: ``user:password@`` (HTTP basic auth) taken out, also when
    the password holds a '/', '#' or '?' or the scheme is missing (an '@' in a query stays)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    host = rest.partition("/")[0]
    if "@" in host:
        shown = host.rpartition("@")[2] + rest[len(host) :]
    elif "@" in rest and _USER_PASSWORD.match(rest.rpartition("@")[0]):
        shown = rest.rpartition("@")[2]  # a '/' in the password cut the host short
    else:
        return url
    return f"{scheme}://{shown}" if sep else shown


# ``user:password`` before an '@' (not ``host:port``, whose port is digits only).
_USER_PASSWORD = re.compile(r"[^:/?#@]*:(?!\d+(?:[/?#]|$))")


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
