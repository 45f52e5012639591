"""deploy/sokratos-worker.env.example lists every variable the worker reads, with its default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sokratos_worker.config import ENV_PREFIX, Settings, load_settings

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "sokratos-worker.env.example"

# Their commented line shows an example value, not the default (the comment above says so).
EXAMPLE_VALUES = {
    "SOKRATOS_DATABASE_URL",
    "SOKRATOS_DATA_DIR",
    "SOKRATOS_EMBEDDING_URL",
    "SOKRATOS_EMBEDDING_MODEL",
    "SOKRATOS_EMBEDDING_DIM",
    "SOKRATOS_EMBEDDING_SUFFIX",
    "SOKRATOS_LOG_FORMAT",
    "SOKRATOS_METRICS_ADDR",
    "SOKRATOS_WORKER_INSTANCE",
}


def _first_values() -> dict[str, str]:
    """Each commented ``#SOKRATOS_X=value`` line's value, the first one per variable."""
    values: dict[str, str] = {}
    for line in EXAMPLE.read_text().splitlines():
        match = re.fullmatch(r"#(SOKRATOS_[A-Z_]+)=(.*)", line)
        if match:
            values.setdefault(match.group(1), match.group(2).strip("'"))
    return values


def _variable(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def test_every_variable_the_worker_reads_is_in_the_env_example() -> None:
    listed = _first_values()
    missing = [_variable(name) for name in Settings.model_fields if _variable(name) not in listed]
    unknown = sorted(set(listed) - {_variable(name) for name in Settings.model_fields})
    assert not missing, f"not in {EXAMPLE.name}: {missing}"
    assert not unknown, f"{EXAMPLE.name} lists variables no setting reads: {unknown}"


@pytest.mark.parametrize(
    "field_name",
    [name for name in Settings.model_fields if _variable(name) not in EXAMPLE_VALUES],
)
def test_the_env_example_shows_the_default(field_name: str) -> None:
    variable = _variable(field_name)
    value = _first_values()[variable]
    default = getattr(load_settings({}), field_name)
    assert getattr(load_settings({variable: value}), field_name) == default, (
        f"{EXAMPLE.name}: #{variable}={value} is not the default ({default!r})"
    )
