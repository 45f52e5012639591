"""An unexpected error while claiming must not end claiming for good (the dispatcher thread)."""

from __future__ import annotations

from typing import Any

import pytest

from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from tests.faults.support import assert_exactly_once, exchange, report
from tests.faults.test_junk_payloads import Rig, _put, rig  # noqa: F401 - the fixture

pytestmark = [pytest.mark.faults, pytest.mark.postgres]


@pytest.mark.timeout(120)
def test_a_claim_that_raises_is_retried_and_the_drain_goes_on(
    rig: Rig,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = [
        _put(rig, Queue.TRIAGE, "conversation", exchange(f"tokc{i}", save=True)) for i in range(6)
    ]
    real_claim = store.claim
    failures = {"left": 2}

    def flaky_claim(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("scripted claim failure")
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(store, "claim", flaky_claim)
    rig.drain()
    assert failures["left"] == 0
    fig = assert_exactly_once(rig.db, [k for k in keys if k is not None])
    assert fig.by_outcome == {"saved": len(keys)}
    report("claim_raises_twice", fig, None)
