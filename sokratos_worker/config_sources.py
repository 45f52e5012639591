"""Where a setting's value comes from: the environment, ``*_FILE`` files, systemd credentials.

Highest precedence first: the variable itself (in any letter case; empty or only whitespace
counts as unset), then ``<VARIABLE>_FILE`` (a path), then a file named ``<VARIABLE>`` in
``$CREDENTIALS_DIRECTORY`` (systemd ``LoadCredential=``). :class:`EnvSource` and
:class:`SecretFilesSource` are the pydantic-settings sources that
:class:`~sokratos_worker.config.Settings` reads in that order; :func:`read_secret_file`
also serves the ``*_file`` keys of the JSON settings, and :func:`default_data_dir` the
systemd ``$STATE_DIRECTORY`` default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeGuard

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

from sokratos_worker.config_error import ConfigError

ENV_PREFIX = "SOKRATOS_"


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


def default_data_dir() -> Path:
    """``$STATE_DIRECTORY`` (systemd ``StateDirectory=``), else ~/.local/share/sokratos-worker."""
    state = os.environ.get("STATE_DIRECTORY")
    if _is_given(state):
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(state.split(":")[0])
    return Path.home() / ".local" / "share" / "sokratos-worker"


class EnvSource(EnvSettingsSource):
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
        for name in variable_names(field_name):
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


class SecretFilesSource(PydanticBaseSettingsSource):
    """``X_FILE`` and ``$CREDENTIALS_DIRECTORY/X`` for every variable ``X``.

    An empty or whitespace-only ``X`` or ``X_FILE`` counts as unset, as it does for the
    variables themselves (:class:`EnvSource`): the next place is looked at. A file that
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


def given_as(field_name: str) -> str | None:
    """Where ``field_name``'s value was given when not as its own ``SOKRATOS_X`` variable:
    ``DATABASE_URL``, ``X_FILE`` or ``$CREDENTIALS_DIRECTORY/X``, for an error to name what the
    operator wrote; None for the variable itself or the default."""
    names = variable_names(field_name)
    given = [found[0] for name in names if (found := _environment_value(name))]
    if given:
        return None if given[0].upper() == names[0] else given[0]
    found = _secret_file(field_name)
    if found is None:
        return None
    named = found[0]
    return named if named.upper().endswith("_FILE") else "$CREDENTIALS_DIRECTORY/" + named


def _secret_file_value(field_name: str) -> tuple[str, str, str] | None:
    """``(variable to name in an error, path, text)`` of the file that sets ``field_name``,
    or None when an explicit variable wins or no file is given."""
    found = _secret_file(field_name)
    if found is None:
        return None
    named, path = found
    return named, path, _read_or_refuse(named, path)


def _secret_file(field_name: str) -> tuple[str, str] | None:
    """``(variable to name in an error, path)`` of the file that sets ``field_name``, or None
    when an explicit variable wins or no file is given: a non-blank ``X`` first, then
    ``X_FILE``, then ``$CREDENTIALS_DIRECTORY/X``."""
    names = variable_names(field_name)
    if any(_environment_value(name) is not None for name in names):
        return None  # an explicit variable wins
    for name in names:
        found = _environment_value(f"{name}_FILE")
        if found is not None:
            return found
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
            return name, path
    return None


def shadowed_file_variables(field_names: Iterable[str]) -> list[str]:
    """``X_FILE`` variables and ``$CREDENTIALS_DIRECTORY/X`` files given beside a non-blank
    ``X`` (or its alias: ``DATABASE_URL`` for ``SOKRATOS_DATABASE_URL``), which wins: the file
    is never read. (A DATABASE_URL exported for another program silently took the database
    over from the production credential.)"""
    shadowed = []
    creds = credentials_directory()
    for field_name in field_names:
        names = variable_names(field_name)
        if any(_environment_value(name) is not None for name in names):
            shadowed += [found[0] for n in names if (found := _environment_value(f"{n}_FILE"))]
            if creds is not None:
                shadowed += [f"$CREDENTIALS_DIRECTORY/{n}" for n in names if _is_file(creds / n)]
    return shadowed


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False  # (reading it reports the directory's problem, if it is ever read)


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


def variable_names(field_name: str) -> list[str]:
    names = [ENV_PREFIX + field_name.upper()]
    if field_name == "database_url":
        names.append("DATABASE_URL")
    return names
