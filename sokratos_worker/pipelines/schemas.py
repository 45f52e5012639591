"""What the LLM must answer, as pydantic models: numbers clamped to range, never a failure."""

from __future__ import annotations

import math
from typing import Annotated, Any

import structlog
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

log = structlog.get_logger(__name__)

MAX_TAGS = 5
MAX_TAG_CHARS = 60


def _clamper(name: str, low: float, high: float) -> BeforeValidator:
    """A validator that brings a number into [low, high] and logs when it had to."""

    def clamp(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")  # pydantic would take it as 0/1
        if not isinstance(value, int | float | str):
            return value  # let pydantic report the wrong type
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits: beyond any float
            raise ValueError("must be a finite number") from None
        except ValueError:
            return value
        if not math.isfinite(number):
            # json.loads takes NaN and Infinity; NaN would pass every threshold comparison.
            raise ValueError("must be a finite number")
        clamped = min(high, max(low, number))
        if clamped != number:
            # A reply's parser names the clamped fields with the backend (llm_value_clamped).
            if isinstance(info.context, dict) and isinstance(info.context.get("clamped"), list):
                info.context["clamped"].append(name)
            else:
                log.info("value_clamped", field=name, value=number, low=low, high=high)
        return clamped

    return BeforeValidator(clamp)


def _require_all(schema: dict[str, Any]) -> None:
    """Ask the model for every key (as Sokratos's grammar does); validation keeps defaults."""
    schema["required"] = list(schema.get("properties", {}))


# Every schema is closed and fully required: strict json_schema backends demand it.
_STRICT = ConfigDict(extra="ignore", json_schema_extra=_require_all)


def _clean_tags(value: Any) -> Any:
    """Trimmed, non-empty, unique tags, at most a few (the prompt asks for one to three)."""
    if value is None:
        return []
    if not isinstance(value, list):
        return value
    tags: list[str] = []
    for tag in value:
        if not isinstance(tag, str):
            return value  # let pydantic report it
        text = tag.strip()[:MAX_TAG_CHARS]
        if text and text.lower() not in (t.lower() for t in tags):
            tags.append(text)
    return tags[:MAX_TAGS]


Tags = Annotated[list[str], BeforeValidator(_clean_tags)]
TriageScore = Annotated[
    float,
    _clamper("salience_score", 0.0, 10.0),
    Field(json_schema_extra={"minimum": 0, "maximum": 10}),
]
# Below 5 is kept (not raised to 5): Go drops such a fact as not notable (behaviour §5.4),
# and distillation does too; the schema still asks for 5 to 10.
FactSalience = Annotated[
    float, _clamper("salience", 0.0, 10.0), Field(json_schema_extra={"minimum": 5, "maximum": 10})
]
NOTABLE_FACT_SALIENCE = 5.0


class TriageVerdict(BaseModel):
    """Triage of one exchange or email (behaviour §1.5); keys in Sokratos's order."""

    model_config = _STRICT

    salience_score: TriageScore
    summary: str
    category: str = ""
    tags: Tags = Field(default_factory=list)
    save: bool = True
    paradigm_shift: bool = False

    @field_validator("summary")
    @classmethod
    def _summary_trimmed(cls, value: str) -> str:
        # May be empty: a verdict that saves nothing needs no summary (the triage decides).
        return value.strip()

    @field_validator("category")
    @classmethod
    def _category(cls, value: str) -> str:
        return value.strip().lower()[:MAX_TAG_CHARS]


class Fact(BaseModel):
    """One lasting fact about the user, from distillation (behaviour §5.4)."""

    model_config = _STRICT

    text: str
    salience: FactSalience
    tags: Tags = Field(default_factory=list)

    @field_validator("text")
    @classmethod
    def _trimmed(cls, value: str) -> str:
        return value.strip()


class Distillation(BaseModel):
    """The facts one archive yields; usually none to three."""

    model_config = _STRICT

    facts: list[Fact]  # required: a reply without the key did not answer the question


class CandidateVerdict(BaseModel):
    """Whether the new memory contradicts existing memory number ``existing`` (1-based)."""

    model_config = _STRICT

    existing: int
    contradicts: bool


class ContradictionVerdicts(BaseModel):
    """One verdict per candidate memory that the new memory was compared with."""

    model_config = _STRICT

    verdicts: list[CandidateVerdict]

    def misnumbered(self, count: int) -> list[int]:
        """Candidate numbers outside 1..``count``: a model numbering from 0 means another
        memory by each number, so none of its verdicts can be applied."""
        return sorted({v.existing for v in self.verdicts if not 1 <= v.existing <= count})

    def contradicted(self, count: int) -> list[int]:
        """The 1-based candidate numbers judged contradicted (first verdict per number wins)."""
        seen: dict[int, bool] = {}
        for verdict in self.verdicts:
            if 1 <= verdict.existing <= count and verdict.existing not in seen:
                seen[verdict.existing] = verdict.contradicts
        return sorted(n for n, contradicts in seen.items() if contradicts)
