"""Redaction of keys and overlapping secrets.

1. A password equal to (or inside) a key every line carries (``event``, ``level``,
   ``timestamp``, ``logger``) renamed that key to ``[redacted]`` in EVERY line, and the JSON lines
   lost their ``event`` field (contract.md: every JSON line has ``event``). Those keys are never
   renamed; ``event``'s value is still masked.
2. Two keys of a logged dict that both masked to ``[redacted]`` collided and one value was
   dropped. Both are kept, a renamed key suffixed with ``_`` as at the top level.
3. Overlapping secrets (an API key ending where a password begins, in one token): the longer one
   was replaced first and the rest of the other stayed visible. Every secret's spans are merged
   first, then replaced.
"""

from __future__ import annotations

import io
import json

import structlog

from sokratos_worker.logs import REDACTED, SecretRedactor, mask_secrets, maskable


def _line(redactor: SecretRedactor, event: str, **fields: object) -> dict[str, object]:
    out = io.StringIO()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redactor,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    try:
        structlog.get_logger().warning(event, **fields)
    finally:
        structlog.reset_defaults()
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def test_a_password_equal_to_the_event_key_keeps_the_event_field() -> None:
    line = _line(SecretRedactor(maskable([], ["event"])), "claiming_paused", reason="x")
    assert line["event"] == "claiming_paused", f"every line lost its event field: {line}"
    assert {"level", "timestamp"} <= set(line)


def test_a_password_inside_a_fixed_key_renames_none_of_them() -> None:
    line = _line(SecretRedactor(maskable([], ["stamp", "evel"])), "x_stamped", reason="a stamp")
    assert {"event", "level", "timestamp"} <= set(line), line
    assert line["event"] == "x_stamped"  # the worker's own event name: code, not a secret
    assert line["reason"] == f"a {REDACTED}"


def test_a_common_word_password_leaves_event_and_field_names_alone() -> None:
    """A password "worker" turned worker_started into [redacted]_started and worker_id into
    [redacted]_id on every line, which showed the password (found by a config hunt); values
    are still masked, and a library's message (not a code name) too."""
    redactor = SecretRedactor(maskable([], ["worker"]))
    line = _line(redactor, "worker_started", worker_id="w1", detail="the worker's role")
    assert line["event"] == "worker_started" and line["worker_id"] == "w1", line
    assert line["detail"] == f"the {REDACTED}'s role"
    library = _line(redactor, "connection for worker refused", reason="x")
    assert library["event"] == f"connection for {REDACTED} refused"


def test_a_secret_only_in_the_kept_keys_costs_no_walk() -> None:
    event = {"event": "claiming_paused", "level": "info", "d": {"a": 1}}
    redacted = SecretRedactor(maskable([], ["event"]))(None, "", event)
    assert redacted is event and event["d"] == {"a": 1}


def test_nested_keys_masking_to_the_same_text_keep_both_values() -> None:
    redactor = SecretRedactor(maskable([], ["hunter2!"]))
    event = redactor(None, "", {"event": "x", "d": {"hunter2!": 1, REDACTED: 2}})
    assert sorted(event["d"].values()) == [1, 2], f"a value was dropped: {event['d']}"
    assert event["d"][REDACTED] == 2  # the key that was not renamed keeps its name
    event = redactor(None, "", {"event": "x", "d": {"a hunter2!": 1, f"a {REDACTED}": 2, "b": 3}})
    assert sorted(event["d"].values()) == [1, 2, 3], event["d"]


def test_overlapping_secrets_are_both_masked_whole() -> None:
    key, password = "sk-live-AAAABBBB", "BBBBCCCCdd"
    redactor = SecretRedactor(maskable([key], [password]))
    event = redactor(None, "", {"event": "x", "reason": "echoed sk-live-AAAABBBBCCCCdd"})
    assert event["reason"] == f"echoed {REDACTED}"
    # The chat client's own masking (reasons quoting a server) merges them too.
    assert mask_secrets("echoed sk-live-AAAABBBBCCCCdd!", maskable([key], [password])) == (
        f"echoed {REDACTED}!"
    )


def test_repeated_and_separate_secrets_are_each_masked() -> None:
    secrets = maskable(["sk-live-AAAABBBB"], ["hunter2!"])
    text = "a sk-live-AAAABBBB b hunter2!hunter2! c sk-live-AAAABBBB"
    assert mask_secrets(text, secrets) == f"a {REDACTED} b {REDACTED}{REDACTED} c {REDACTED}"
