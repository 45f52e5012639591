"""A memory write the database refuses after the LLM answered: a failed attempt, never a dead
slot (durability.md: "the memory write fails after the LLM answered → retry; failed on the
last; attempt used")."""

from __future__ import annotations

import pytest

from sokratos_worker.model import Queue
from tests.faults.support import Key, assert_exactly_once, exchange, failed_payloads, report
from tests.faults.test_junk_payloads import Rig, _put, rig  # noqa: F401 - the fixture

pytestmark = [pytest.mark.faults, pytest.mark.postgres]


@pytest.mark.timeout(120)
def test_refused_memory_writes_fail_the_item_and_keep_every_slot(rig: Rig) -> None:  # noqa: F811
    rig.db.execute(
        "ALTER TABLE memories ADD CONSTRAINT faults_refuse CHECK (summary NOT LIKE '%tokrefuse%')"
    )
    refused: list[Key] = []
    good: list[Key] = []
    for i in range(8):  # twice the slots: each refusal used to kill its slot thread
        key = _put(rig, Queue.TRIAGE, "conversation", exchange(f"tokrefuse{i}", save=True))
        assert key is not None
        refused.append(key)
        key = _put(rig, Queue.TRIAGE, "conversation", exchange(f"tokfine{i}", save=True))
        assert key is not None
        good.append(key)
    too_big = {"exchange": "user: remember SAVE tok31 please, it matters", "pipeline_id": 2**64}
    big = _put(rig, Queue.TRIAGE, "conversation", too_big)
    assert big is not None
    rig.drain()
    later = _put(rig, Queue.TRIAGE, "conversation", exchange("toklater1", save=True))
    assert later is not None
    rig.drain()  # the worker still has its slots
    keys = [*refused, *good, big, later]
    fig = assert_exactly_once(rig.db, keys)
    outcomes = {
        (q, i): o for q, i, o in rig.db.execute("SELECT queue, item_id, outcome FROM work_outcomes")
    }
    failures = failed_payloads(rig.db)
    for key in refused:
        assert outcomes[key] == "failed"
        assert "faults_refuse" in failures[key][0] or "check" in failures[key][0].lower()
    assert all(outcomes[k] == "saved" for k in [*good, later])
    assert outcomes[big] == "failed"
    assert failures[big][0].startswith("invalid payload: pipeline_id")
    assert failures[big][1] == too_big
    report("memory_write_refused", fig, None, refused=len(refused), out_of_range=1)
