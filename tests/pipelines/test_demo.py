"""The newcomer's path: the demo drains its samples through the real tiny model."""

from __future__ import annotations

import io
import re

import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.demo import SAMPLE_TRIAGE, run_demo
from sokratos_worker.llm.local import llama_cpp_installed

pytestmark = [
    pytest.mark.local_model,
    pytest.mark.slow,
    pytest.mark.skipif(not llama_cpp_installed(), reason="needs the local extra"),
]


def test_demo_prints_an_outcome_for_every_sample() -> None:
    out = io.StringIO()
    assert run_demo(load_settings({}), out=out) == 0
    text = out.getvalue()
    outcomes = re.findall(r"^  pending_\w+#\d+ \[\w+\] (\w+) ", text, flags=re.MULTILINE)
    waiting = re.search(r"(\d+) item\(s\) still waiting", text)
    assert len(outcomes) + (int(waiting.group(1)) if waiting else 0) == len(SAMPLE_TRIAGE) + 1
    assert set(outcomes) <= {"saved", "skipped", "archived", "failed"}
    assert "\nMemories\n" in text
