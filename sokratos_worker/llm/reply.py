"""Turn a model's reply text into a validated pydantic value, clamping out-of-range numbers.

Contract §5: out-of-range numbers are clamped and logged; anything else that does not
validate is a failed call (the caller feeds the error back once, then moves on).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sokratos_worker import jsontext
from sokratos_worker.llm.cleaning import clean_llm_json

T = TypeVar("T", bound=BaseModel)

_BOUND_ERRORS = {"less_than_equal", "less_than", "greater_than_equal", "greater_than"}


class ReplyInvalid(ValueError):
    """The reply is not JSON or does not match the model; ``feedback`` is safe to send back."""

    def __init__(self, feedback: str) -> None:
        super().__init__(feedback)
        self.feedback = feedback


def parse_reply(model: type[T], text: str) -> tuple[T, list[str]]:
    """The validated value and the dotted paths of any numbers that were clamped."""
    data = _load(text)
    if not isinstance(data, dict):
        raise ReplyInvalid("the reply must be one JSON object")
    clamped: list[str] = []
    stepped: dict[tuple[int | str, ...], str] = {}  # fields stepped inside a strict bound
    for _ in range(20):  # each round clamps at least one field; bounded for safety
        by_validators: list[str] = []  # the fields the model's own validators clamped
        try:
            value = model.model_validate(data, context={"clamped": by_validators})
            return value, clamped + by_validators
        except ValidationError as exc:
            errors = exc.errors()
            fixes = [e for e in errors if e["type"] in _BOUND_ERRORS]
            # 5.0 for an int field under lt=3 was stepped to 2.999…: the int field refuses it.
            wholes = [e for e in errors if e["type"] == "int_from_float" and e["loc"] in stepped]
            if not (fixes or wholes) or len(fixes) + len(wholes) != len(errors):
                raise ReplyInvalid(_feedback(exc)) from exc
            for error in wholes:
                _whole_inside(data, error["loc"], stepped[error["loc"]])
            for error in fixes:
                _clamp(data, error["loc"], error["ctx"], error["type"])
                stepped[error["loc"]] = error["type"]
                clamped.append(".".join(str(p) for p in error["loc"]))
    raise ReplyInvalid("the reply could not be brought into range")


def _load(text: str) -> Any:
    """The reply parsed strictly, else after cleaning: cleaning a reply that already is JSON
    could cut a string that mentions a code fence or ``</think>`` apart."""
    try:
        strict = _json(text)
    except ValueError:
        strict = None
    if isinstance(strict, dict):
        return strict
    try:
        return _json(clean_llm_json(text))
    except ValueError as exc:
        raise ReplyInvalid(f"the reply is not a JSON object ({exc})") from exc


def _json(text: str) -> Any:
    """``json.loads`` without NaN and Infinity, which JSON does not have and which would slip
    past every range check (NaN compares false with any bound)."""
    return jsontext.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise ValueError(f"{literal} is out of a float's range")
    return number


def _clamp(data: Any, loc: tuple[int | str, ...], ctx: dict[str, Any], kind: str) -> None:
    container = data
    for part in loc[:-1]:
        container = container[part]
    bound = next(iter(ctx.values()))
    if kind in {"less_than", "greater_than"}:
        # A strict bound excludes itself: step to the nearest value inside it.
        down = kind == "less_than"
        if isinstance(container[loc[-1]], int) and isinstance(bound, int):
            bound = bound - 1 if down else bound + 1
        else:
            bound = math.nextafter(float(bound), -math.inf if down else math.inf)
    container[loc[-1]] = bound


def _whole_inside(data: Any, loc: tuple[int | str, ...], kind: str) -> None:
    """The whole number inside the bound a float was clamped to, for an int field that
    refuses the fraction (``kind``: the bound's pydantic error type)."""
    container = data
    for part in loc[:-1]:
        container = container[part]
    stepped = float(container[loc[-1]])
    container[loc[-1]] = math.floor(stepped) if kind.startswith("less") else math.ceil(stepped)


def _feedback(exc: ValidationError) -> str:
    """A short description of what is wrong, without echoing the reply's values."""
    parts = []
    for error in exc.errors()[:10]:
        where = ".".join(str(p) for p in error["loc"]) or "(root)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


__all__ = ["ReplyInvalid", "parse_reply"]
