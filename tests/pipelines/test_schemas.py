"""LLM reply schemas: numbers clamped (and logged), tags cleaned, verdicts mapped."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from sokratos_worker.pipelines.schemas import (
    ContradictionVerdicts,
    Distillation,
    TriageVerdict,
)


def test_triage_score_is_clamped_and_logged() -> None:
    with capture_logs() as logs:
        verdict = TriageVerdict.model_validate({"salience_score": 14.5, "summary": "s"})
    assert verdict.salience_score == 10.0
    assert logs[0]["event"] == "value_clamped"
    assert logs[0]["field"] == "salience_score"
    assert TriageVerdict.model_validate({"salience_score": -2, "summary": "s"}).salience_score == 0


def test_triage_defaults_and_cleaning() -> None:
    verdict = TriageVerdict.model_validate(
        {
            "salience_score": "6",
            "summary": "  Fact.  ",
            "category": " Work ",
            "tags": ["a", "A", " ", "b"],
        }
    )
    assert verdict.summary == "Fact."
    assert verdict.category == "work"
    assert verdict.tags == ["a", "b"]
    assert verdict.save is True
    assert verdict.paradigm_shift is False


@pytest.mark.parametrize(
    "reply",
    [
        {"summary": "missing score"},
        {"salience_score": "high", "summary": "s"},
        {"salience_score": True, "summary": "s"},
        {"salience_score": 5, "summary": "s", "tags": "notalist"},
    ],
)
def test_triage_rejects_what_cannot_be_repaired(reply: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TriageVerdict.model_validate(reply)


@pytest.mark.parametrize(
    "score",
    [float("nan"), float("inf"), float("-inf"), "NaN", 10**400],
    ids=["nan", "inf", "-inf", "NaN-text", "10**400"],
)
def test_a_non_finite_salience_is_rejected_not_clamped(score: object) -> None:
    """NaN < threshold is False: a NaN salience would clear every threshold and be saved."""
    with pytest.raises(ValidationError, match="finite"):
        TriageVerdict.model_validate({"salience_score": score, "summary": "s"})
    with pytest.raises(ValidationError, match="finite"):
        Distillation.model_validate({"facts": [{"text": "a", "salience": score}]})


def test_an_empty_summary_is_a_valid_reply() -> None:
    # Nothing worth keeping, and said so: the triage skips it below the threshold (Sokratos
    # decodes it the same way) instead of retrying and dead-lettering a valid answer.
    verdict = TriageVerdict.model_validate({"salience_score": 0, "summary": "  "})
    assert verdict.summary == ""


def test_schemas_ask_for_every_key() -> None:
    schema = TriageVerdict.model_json_schema()
    assert schema["required"] == [
        "salience_score",
        "summary",
        "category",
        "tags",
        "save",
        "paradigm_shift",
    ]
    fact = Distillation.model_json_schema()["$defs"]["Fact"]
    assert fact["required"] == ["text", "salience", "tags"]
    assert fact["properties"]["salience"]["minimum"] == 5


def test_fact_salience_is_clamped_to_0_10_and_below_5_kept_for_distillation_to_drop() -> None:
    with capture_logs() as logs:
        facts = Distillation.model_validate(
            {
                "facts": [
                    {"text": "a", "salience": 3},
                    {"text": "b", "salience": 11, "tags": []},
                    {"text": "c", "salience": -2, "tags": []},
                ]
            }
        ).facts
    assert [f.salience for f in facts] == [3.0, 10.0, 0.0]
    assert [e["event"] for e in logs] == ["value_clamped", "value_clamped"]


def test_contradiction_verdicts_map_to_candidates() -> None:
    verdicts = ContradictionVerdicts.model_validate(
        {
            "verdicts": [
                {"existing": 2, "contradicts": True},
                {"existing": 1, "contradicts": False},
                {"existing": 2, "contradicts": False},  # the first verdict per number wins
                {"existing": 7, "contradicts": True},  # no such candidate
            ]
        }
    )
    assert verdicts.contradicted(3) == [2]
    assert ContradictionVerdicts.model_validate({"verdicts": []}).contradicted(3) == []


@pytest.mark.parametrize("model", [Distillation, ContradictionVerdicts])
def test_a_reply_without_the_list_is_invalid(model: type[Distillation]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate({"not": "what was asked"})
