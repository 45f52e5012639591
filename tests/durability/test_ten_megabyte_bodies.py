"""durability.md, "Bad input": 10 MB bodies get a clear outcome (or a specific error with the
payload kept) and never stop the worker or other items. The junk-payload suite goes up to
about 1 MB; this sends 10 MB triage and distillation payloads through the real pipelines
(runner in-process, real PostgreSQL, scripted model) via the producers' SQL functions.
"""

from __future__ import annotations

import json

import pytest

from sokratos_worker.model import Queue
from tests.faults.support import assert_exactly_once, exchange
from tests.faults.test_junk_payloads import Rig, _check_outcome, _put, rig

__all__ = ["rig"]  # the fixture

pytestmark = [pytest.mark.faults, pytest.mark.postgres, pytest.mark.slow]

TEN_MB = 10 * 1024 * 1024


@pytest.mark.timeout(240)
def test_ten_megabyte_payloads_each_end_in_one_outcome_and_the_worker_goes_on(
    rig: Rig,
) -> None:
    big_exchange = {"exchange": "user: remember tok77 SAVE\nassistant: " + "word " * (TEN_MB // 5)}
    big_archive = {"archive_text": ("user: I like tok78 and more\n" * (TEN_MB // 28))}
    big_messages = {
        "messages": [
            {"role": "user", "content": "my code word is tok79"},
            {"role": "tool", "name": "dump", "content": "x" * TEN_MB},
        ]
    }
    keys = []
    for queue, source, payload in (
        (Queue.TRIAGE, "conversation", big_exchange),
        (Queue.DISTILLATION, "distillation", big_archive),
        (Queue.DISTILLATION, "distillation", big_messages),
    ):
        assert len(json.dumps(payload)) >= TEN_MB
        key = _put(rig, queue, source, payload)
        assert key is not None, "PostgreSQL accepts these as jsonb"
        keys.append(key)
    rig.drain()
    for key in keys:
        _check_outcome(rig, key)
    # Whatever happened to the big ones, a plain item afterwards is saved.
    plain = _put(rig, Queue.TRIAGE, "conversation", exchange("tok80", save=True))
    assert plain is not None
    rig.drain()
    fig = assert_exactly_once(rig.db, [*keys, plain])
    outcomes = {
        (q, i): o for q, i, o in rig.db.execute("SELECT queue, item_id, outcome FROM work_outcomes")
    }
    assert outcomes[plain] == "saved", (outcomes, fig)
