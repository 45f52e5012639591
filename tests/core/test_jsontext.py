"""Every JSON parse in the worker fails with ValueError only (sokratos_worker/jsontext.py)."""

from __future__ import annotations

import ast
import json
from decimal import Decimal
from pathlib import Path

import pytest

import sokratos_worker
from sokratos_worker import jsontext

PACKAGE = Path(sokratos_worker.__file__).parent


def test_nesting_past_pythons_limit_is_a_value_error_that_says_so() -> None:
    """"[[[[…" deeper than the recursion limit raises NestedTooDeeply, a ValueError, not
    RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)  # what every caller catching ValueError would have let through
    with pytest.raises(ValueError, match="nested too deeply to read as JSON") as caught:
        jsontext.loads(deep.encode())
    assert isinstance(caught.value, jsontext.NestedTooDeeply)


def test_options_and_ordinary_errors_pass_through() -> None:
    """Keyword options reach json.loads, and bad JSON is json's own ValueError."""
    assert jsontext.loads('{"a": 0.1}', parse_float=Decimal) == {"a": Decimal("0.1")}
    with pytest.raises(json.JSONDecodeError):
        jsontext.loads("{")


def _json_parses(tree: ast.AST) -> list[int]:
    """Lines calling ``json.loads(...)`` or ``<response>.json()``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func
            json_loads = (target.attr == "loads" and isinstance(target.value, ast.Name)
                          and target.value.id == "json")
            if json_loads or (target.attr == "json" and not node.args):
                lines.append(node.lineno)
    return lines


def test_no_module_parses_json_around_jsontext() -> None:
    """A new parse site calling json.loads or httpx's Response.json() would bring
    RecursionError back past its ``except ValueError``."""
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "jsontext.py" and "testing" not in path.parts
        for line in _json_parses(ast.parse(path.read_text("utf-8")))
    }
    assert found == set()


def test_the_check_finds_what_it_looks_for() -> None:
    """The scan above is not blind: it sees both forms."""
    sample = "import json\njson.loads(x)\nresponse.json()\njson.dumps(x)\n"
    assert _json_parses(ast.parse(sample)) == [2, 3]
