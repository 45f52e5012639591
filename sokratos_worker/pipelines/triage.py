"""Triage of ``pending_triage`` items: conversation exchanges and emails (behaviour §1)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import structlog

from sokratos_worker.errors import InvalidPayload, ItemError
from sokratos_worker.llm.types import (
    ChatClient,
    ContextTooLong,
    Embedder,
    EmbeddingFailed,
    passed_over,
)
from sokratos_worker.model import PARADIGM_SHIFT_FLAG, Effects, Item, NewMemory, Outcome
from sokratos_worker.pipelines import payload as fields
from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.schemas import TriageVerdict
from sokratos_worker.pipelines.text import (
    SHORTEST_HALVED_BYTES,
    TRIAGE_MAX_BYTES,
    bound_triage_input,
    byte_len,
    cap_assistant_reply,
    is_trivial,
    prefix_bytes,
    truncate_within,
)
from sokratos_worker.pipelines.write import MemoryDraft, MemoryWriter, contradiction_note
from sokratos_worker.store.memories import MemoryReader
from sokratos_worker.store.sanitize import ESCAPED_NOTE

log = structlog.get_logger(__name__)

TRIAGE_MAX_TOKENS = 2048
COVERAGE_SNIPPET_BYTES = 500
COVERAGE_DISTANCE = 0.3
COVERAGE_MIN_COUNT = 3

# Adaptive threshold keys and their defaults (behaviour §1.6).
TOOLS_USED_THRESHOLD = ("triage_conversation_threshold", 3.0)
# Go calls an exchange without tools "parametric": the answer came from the model unverified.
NO_TOOLS_THRESHOLD = ("triage_conversation_unverified_threshold", 5.0)
EMAIL_THRESHOLD = ("triage_email_threshold", 1.0)


@dataclass(frozen=True)
class TriageRequest:
    """Everything that differs between a conversation and an email triage."""

    text: str
    system: str
    domain: str
    memory_type: str
    threshold: tuple[str, float]
    honour_save_flag: bool
    is_exchange: bool  # a conversation's turns (and tool context), bounded as such
    source_date: datetime | None
    pipeline_id: int | None


class TriageHandler:
    """Scores an exchange or an email and, when it clears the threshold, plans its memory."""

    def __init__(
        self,
        reader: MemoryReader,
        writer: MemoryWriter,
        chat: ChatClient,
        embedder: Embedder | None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.chat = chat
        self.embedder = embedder

    def handle(self, item: Item) -> Effects:
        """Skip, or plan the memory of, one triage item."""
        if item.source == "conversation":
            exchange = fields.required_str(item.payload, "exchange")
            if is_trivial(exchange):
                log.info(
                    "triage_skipped", item_id=item.id, reason="trivial", bytes=byte_len(exchange)
                )
                return Effects(Outcome.SKIPPED, detail="trivial exchange")
            request = self._conversation(item, exchange)
        elif item.source == "email":
            request = self._email(item)
        else:
            raise InvalidPayload("source", f"must be conversation or email, not {item.source!r}")
        return self._triage(item, request)

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        """Triage keeps nothing beside the failed_operations row (its payload is kept there)."""
        return ()

    def probe(self) -> bool:
        """True when a chat backend and, if configured, the embedding server answer."""
        return self.chat.probe() and (self.embedder is None or self.embedder.probe())

    def _conversation(self, item: Item, exchange: str) -> TriageRequest:
        tools_used = fields.optional_bool(item.payload, "tools_used")
        return TriageRequest(
            text=cap_assistant_reply(exchange),
            system=prompts.CONVERSATION_TRIAGE,
            domain="conversation",
            memory_type="general",
            threshold=TOOLS_USED_THRESHOLD if tools_used else NO_TOOLS_THRESHOLD,
            honour_save_flag=False,
            is_exchange=True,
            source_date=fields.optional_iso_datetime(item.payload, "occurred_at"),
            pipeline_id=fields.optional_int(item.payload, "pipeline_id"),
        )

    def _email(self, item: Item) -> TriageRequest:
        text = fields.required_str(item.payload, "text")
        for name in ("subject", "from", "message_id", "account"):
            fields.optional_str(item.payload, name)
        return TriageRequest(
            text=text,
            system=prompts.email_system_prompt(self.reader.preference_traits()),
            domain="email",
            memory_type="email",
            threshold=EMAIL_THRESHOLD,
            honour_save_flag=True,
            is_exchange=False,
            source_date=fields.lenient_datetime(item.payload.get("date")),
            pipeline_id=None,
        )

    def _triage(self, item: Item, request: TriageRequest) -> Effects:
        key, default = request.threshold
        threshold = self.reader.adaptive_param(key, default)
        note = self._coverage_note(item, request.text)
        verdict, backend, passed = self._score(item, request, note)
        return self._judge(item, request, (key, threshold), verdict, backend).noted(passed)

    def _judge(
        self,
        item: Item,
        request: TriageRequest,
        threshold_in_force: tuple[str, float],
        verdict: TriageVerdict,
        backend: str,
    ) -> Effects:
        """Skip or save by the verdict, against the adaptive threshold (its key and value)."""
        key, threshold = threshold_in_force
        if request.honour_save_flag and not verdict.save:
            return self._skip(item, backend, verdict, "save=false")
        if verdict.salience_score < threshold:
            reason = f"salience {_number(verdict.salience_score)} below {key} {_number(threshold)}"
            return self._skip(item, backend, verdict, reason)
        if not verdict.summary:
            score = _number(verdict.salience_score)
            raise ItemError(
                f"the model scored salience {score} but gave no summary to save",
                backend=backend,
            )
        draft = MemoryDraft(
            text=verdict.summary,
            salience=verdict.salience_score,
            memory_type=request.memory_type,
            source=request.domain,
            tags=_tags(request.domain, verdict.tags),
            source_date=request.source_date,
            pipeline_id=request.pipeline_id,
        )
        plan = self.writer.plan(item, draft)
        if plan.duplicate_of is not None:
            log.info("triage_skipped", item_id=item.id, reason="near_duplicate", backend=backend)
            return Effects(
                Outcome.SKIPPED,
                detail=f"near-duplicate of memory {plan.duplicate_of}" + _flagged(verdict),
                existing_memory_ids=(plan.duplicate_of,),
                backend=backend,
            )
        log.info(
            "triage_planned",  # saved when the settle commits: item_settled (debug), tick counts
            item_id=item.id,
            salience=verdict.salience_score,
            chunks=len(plan.memories),
            superseded=len(plan.supersessions),
            backend=backend,
        )
        detail = f"salience {_number(verdict.salience_score)} (threshold {_number(threshold)})"
        note = contradiction_note([plan])
        if note:
            detail += f"; {note}"
        if plan.escaped:
            detail += f"; the model's reply: {ESCAPED_NOTE}"  # contract: escaping is noted
        return Effects(
            Outcome.SAVED,
            detail=detail + _flagged(verdict),
            memories=plan.memories,
            supersessions=plan.supersessions,
            backend=backend,
        )

    def _coverage_note(self, item: Item, text: str) -> str:
        """The "already N similar memories" note, or "" (also when embedding this fails)."""
        if self.embedder is None:
            return ""
        try:
            vec = self.embedder.embed([prefix_bytes(text, COVERAGE_SNIPPET_BYTES)])[0]
        except EmbeddingFailed as exc:
            log.info("coverage_check_skipped", item_id=item.id, error=type(exc).__name__)
            return ""
        count = self.reader.coverage_count(vec, COVERAGE_DISTANCE)
        return prompts.coverage_note(count) if count >= COVERAGE_MIN_COUNT else ""

    def _score(
        self, item: Item, request: TriageRequest, note: str
    ) -> tuple[TriageVerdict, str, str]:
        """Ask the LLM; on "context too long" halve the input and ask again, down to
        SHORTEST_HALVED_BYTES.

        Returns the verdict, the backend that gave it and the backends passed over on the way.
        """
        limit = TRIAGE_MAX_BYTES
        while True:
            user = _bounded(request, note, limit)
            try:
                result = self.chat.complete(
                    response_model=TriageVerdict,
                    system=request.system,
                    user=user,
                    max_tokens=TRIAGE_MAX_TOKENS,
                    purpose=f"{request.domain}_triage",
                )
            except ContextTooLong:
                sent = byte_len(user)
                if min(limit, sent) <= SHORTEST_HALVED_BYTES:
                    raise
                log.info("triage_input_shortened", item_id=item.id, bytes=sent)
                limit = min(limit, sent) // 2  # (an input shorter than the limit: its own half)
                continue
            return result.value, result.backend, passed_over(result.tried)

    def _skip(self, item: Item, backend: str, verdict: TriageVerdict, reason: str) -> Effects:
        log.info(
            "triage_skipped",
            item_id=item.id,
            reason=reason,
            salience=verdict.salience_score,
            backend=backend,
        )
        return Effects(Outcome.SKIPPED, detail=reason, backend=backend)


def _bounded(request: TriageRequest, note: str, limit: int) -> str:
    """The triage input within ``limit`` bytes (tool context bounded for conversations)."""
    if request.is_exchange:
        return bound_triage_input(request.text, note, limit)
    suffix = f"\n{note}" if note else ""
    return truncate_within(request.text, max(0, limit - byte_len(suffix))) + suffix


def _number(value: float) -> str:
    """A score or threshold as short as it reads exactly: ``:g`` keeps 6 digits, which showed
    a salience of 6.9999999 skipped as "salience 7 below ... 7"."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _flagged(verdict: TriageVerdict) -> str:
    """The paradigm-shift flag, last in the detail, where docs/production.md tells the main
    application to look: its transitions (contract §5), which Sokratos runs for a
    near-duplicate too."""
    return PARADIGM_SHIFT_FLAG if verdict.paradigm_shift else ""


def _tags(domain: str, tags: list[str]) -> tuple[str, ...]:
    """The domain tag first, then the LLM's tags without repeating it."""
    return (domain, *(t for t in tags if t.lower() != domain))
