"""Distillation of ``pending_distillation`` items into lasting facts (behaviour §5)."""

from __future__ import annotations

import structlog

from sokratos_worker.errors import InvalidPayload, ItemError
from sokratos_worker.llm.types import (
    ChatClient,
    ContextTooLong,
    Embedder,
    EmbeddingFailed,
    passed_over,
)
from sokratos_worker.model import DraftSupersession, Effects, Item, NewMemory, Outcome, Supersession
from sokratos_worker.pipelines import payload as fields
from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.archive import (
    Archive,
    Window,
    archive_from_payload,
    header_only,
    windows,
)
from sokratos_worker.pipelines.schemas import NOTABLE_FACT_SALIENCE, Distillation, Fact
from sokratos_worker.pipelines.text import MAX_CHUNK_BYTES, SHORTEST_HALVED_BYTES, byte_len
from sokratos_worker.pipelines.write import (
    EarlierFacts,
    MemoryDraft,
    MemoryWriter,
    WritePlan,
    contradiction_note,
)
from sokratos_worker.store.sanitize import ESCAPED_NOTE

log = structlog.get_logger(__name__)

DISTILL_MAX_BYTES = 16000
# 32 windows: a long conversation with tool results fits; a 10 MB archive would be 700 calls
# (hours with a local model, restarted from zero on every deploy) and, on failure, thousands
# of archive memories. Past this the item is refused whole into failed_operations.
MAX_ARCHIVE_BYTES = 32 * DISTILL_MAX_BYTES
DISTILL_MAX_TOKENS = 2048
# A halved window is never shorter than this: one UTF-8 character is at most 4 bytes.
MIN_HALF_BYTES = 4
ARCHIVE_SALIENCE = 3.0
ARCHIVE_TAG = "conversation_archive"


class DistillationHandler:
    """Extracts facts from an archive and plans them through the shared write path."""

    def __init__(self, writer: MemoryWriter, chat: ChatClient, embedder: Embedder | None) -> None:
        self.writer = writer
        self.chat = chat
        self.embedder = embedder

    def handle(self, item: Item) -> Effects:
        """Skip an empty archive, else plan the new facts it yields."""
        archive = _bounded(item, archive_from_payload(item.payload, item.created_at))
        pipeline_id = fields.optional_int(item.payload, "pipeline_id")
        fields.optional_str(item.payload, "conversation_id")
        if archive.empty:
            log.info("distillation_skipped", item_id=item.id, reason="empty_archive")
            return Effects(Outcome.SKIPPED, detail="empty archive")
        facts, backend, passed = self._distil(item, archive)
        return self._plan(item, facts, backend, pipeline_id).noted(passed)

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        """The raw archive as ``conversation_archive`` memories, so the conversation survives."""
        try:
            archive = _bounded(item, archive_from_payload(item.payload, item.created_at))
        except ItemError:
            return ()  # an invalid payload is kept whole in failed_operations instead
        if archive.empty:
            return ()
        chunks = [piece.text for piece in _pieces(archive.stripped(), MAX_CHUNK_BYTES)]
        rows = self._embed_best_effort(item, chunks)
        model = self.embedder.model if self.embedder is not None else None
        return tuple(
            NewMemory(
                origin=item.origin(i),
                summary=text,
                salience=ARCHIVE_SALIENCE,
                memory_type="general",
                source=ARCHIVE_TAG,
                tags=(ARCHIVE_TAG,),
                embedding=tuple(vec) if vec is not None else None,
                embedding_model=model if vec is not None else None,
            )
            for i, (text, vec) in enumerate(rows)
        )

    def probe(self) -> bool:
        """True when a chat backend and, if configured, the embedding server answer."""
        return self.chat.probe() and (self.embedder is None or self.embedder.probe())

    def _distil(self, item: Item, archive: Archive) -> tuple[list[Fact], str, str]:
        """Ask for the facts of the whole archive, in windows of at most 16 kB.

        A longer archive is read window by window (split at line ends) rather than cut off,
        so nothing in it goes undistilled. Returns the facts, the backend that answered last
        and the backends passed over on the way (each named once).
        """
        pieces = _pieces(archive, DISTILL_MAX_BYTES)
        if len(pieces) > 1:
            log.info(
                "distillation_in_windows",
                item_id=item.id,
                windows=len(pieces),
                bytes=byte_len(archive.text),
            )
        facts: list[Fact] = []
        backend = ""
        passed: dict[str, None] = {}  # (ordered, each once)
        for window in pieces:
            found, backend, passed_here = self._distil_window(item, archive, window)
            facts.extend(found)
            passed.update(dict.fromkeys(passed_here))
        return facts, backend, "; ".join(passed)

    def _distil_window(
        self, item: Item, archive: Archive, window: Window
    ) -> tuple[list[Fact], str, list[str]]:
        """One call; on "context too long", the window's halves, and theirs, down to
        SHORTEST_HALVED_BYTES."""
        text = window.text
        try:
            result = self.chat.complete(
                response_model=Distillation,
                system=prompts.DISTILLATION,
                user=text,
                max_tokens=DISTILL_MAX_TOKENS,
                purpose="distillation",
            )
        except ContextTooLong:
            if byte_len(text) <= SHORTEST_HALVED_BYTES:
                raise
            log.info("distillation_input_halved", item_id=item.id, bytes=byte_len(text))
            facts: list[Fact] = []
            backend = ""
            passed: list[str] = []
            half_bytes = max(MIN_HALF_BYTES, byte_len(text) // 2)
            for half in _pieces(archive, half_bytes, window):
                found, backend, passed_here = self._distil_window(item, archive, half)
                facts.extend(found)
                passed.extend(passed_here)
            return facts, backend, passed
        noted = passed_over(result.tried)
        return result.value.facts, result.backend, [noted] if noted else []

    def _plan(
        self, item: Item, facts: list[Fact], backend: str, pipeline_id: int | None
    ) -> Effects:
        """Dedupe the facts (in the batch, then against memories) and plan the new ones."""
        seen: set[str] = set()
        memories: list[NewMemory] = []
        supersessions: list[Supersession] = []
        later: list[DraftSupersession] = []  # earlier facts a later one contradicts
        existing: list[int] = []
        known = 0  # facts matching one planned earlier in this item (no existing memory)
        plans: list[WritePlan] = []  # (their contradiction checks, for the detail)
        escaped = 0  # facts whose text held NUL or lone surrogates
        earlier = EarlierFacts()  # the facts planned so far, compared with as if saved
        extracted = len(facts)
        facts = _notable(item, facts)
        minor = extracted - len(facts)
        for fact in facts:
            key = fact.text.strip().lower()
            if not key or key in seen:
                continue
            seen.add(key)
            draft = MemoryDraft(
                text=fact.text,
                salience=fact.salience,
                memory_type="general",
                source="conversation",
                tags=tuple(fact.tags),
                pipeline_id=pipeline_id,
            )
            plan = self.writer.plan(
                item, draft, first_chunk=len(memories), fact_dedupe=True, earlier=earlier
            )
            earlier.add(plan)
            if plan.known_fact_of is not None:
                existing.append(plan.known_fact_of)
            elif plan.known_fact:
                known += 1
            elif plan.duplicate_of is not None:
                existing.append(plan.duplicate_of)
            memories.extend(plan.memories)
            supersessions.extend(plan.supersessions)
            later.extend(plan.draft_supersessions)
            plans.append(plan)
            escaped += plan.escaped
        log.info(
            "distillation_planned",
            item_id=item.id,
            facts=extracted,
            below_notable=minor,
            new=len(memories),
            known=known + len(existing),
            superseded=len(supersessions) + len(later),
            backend=backend,
        )
        below = f", {minor} below salience {NOTABLE_FACT_SALIENCE:g}" if minor else ""
        if not memories:
            detail = f"no new fact ({extracted} extracted, {known + len(existing)} known{below})"
            return Effects(
                Outcome.SKIPPED, detail=detail, existing_memory_ids=tuple(existing), backend=backend
            )
        detail = f"{len(seen) - known - len(existing)} new facts of {extracted}{below}"
        if later:
            detail += f"; {len(later)} superseded by a later fact of the same archive"
        note = contradiction_note(plans)
        if note:
            detail += f"; {note}"
        if escaped:
            detail += f"; the model's reply for {escaped}: {ESCAPED_NOTE}"  # contract: noted
        return Effects(
            Outcome.SAVED,
            detail=detail,
            memories=tuple(memories),
            supersessions=tuple(supersessions),
            draft_supersessions=tuple(later),
            existing_memory_ids=tuple(existing),
            backend=backend,
        )

    def _embed_best_effort(
        self, item: Item, chunks: list[str]
    ) -> list[tuple[str, list[float] | None]]:
        """The archive's rows: every chunk with its vector, or all of them without one (a raw
        archive is kept even then). A chunk the server calls too large is embedded in parts,
        each its own row, as every other write does (behaviour §3.3): a failed batch must not
        cost the whole archive its vectors, as Sokratos's NOT NULL column refuses it then."""
        bare: list[tuple[str, list[float] | None]] = [(chunk, None) for chunk in chunks]
        if self.embedder is None:
            return bare
        try:
            try:
                vectors = self.embedder.embed(chunks)
            except EmbeddingFailed:  # this input (one chunk fails its batch), not an outage
                pairs = [pair for chunk in chunks for pair in self.embedder.embed_splitting(chunk)]
                return [(text, vec) for text, vec in pairs]
        except ItemError as exc:
            log.warning("archive_embedding_failed", item_id=item.id, error=type(exc).__name__)
            return bare
        if len(vectors) != len(chunks):
            return bare
        return [(chunk, vec) for chunk, vec in zip(chunks, vectors, strict=True)]


def _pieces(archive: Archive, max_bytes: int, within: Window | None = None) -> list[Window]:
    """The archive (or the part of it ``within`` holds) in pieces of at most ``max_bytes``,
    every message kept (no scrap rule), each piece cut inside a message naming its speaker,
    but none holding only the archive's header: a first message too long to share a piece
    with it leaves the header alone, a memory or a model call that holds nothing."""
    span = (within.start, within.end) if within is not None else (0, None)
    pieces = windows(archive, max_bytes, *span)
    return [piece for piece in pieces if not header_only(piece.text)] or pieces


def _bounded(item: Item, archive: Archive) -> Archive:
    """The archive, or InvalidPayload when it is longer than is distilled."""
    size = byte_len(archive.text)
    if size > MAX_ARCHIVE_BYTES:
        name = "archive_text" if item.payload.get("archive_text") is not None else "messages"
        raise InvalidPayload(
            name,
            f"would make an archive of {size:,} bytes; at most {MAX_ARCHIVE_BYTES:,} are distilled"
            " (a conversation of that size is not one archive: split it into several items)",
        )
    return archive


def _notable(item: Item, facts: list[Fact]) -> list[Fact]:
    """The facts scored 5 or more: Go drops the others as not notable."""
    for fact in facts:
        if fact.salience < NOTABLE_FACT_SALIENCE:
            log.info("fact_below_notable", item_id=item.id, salience=fact.salience)
    return [f for f in facts if f.salience >= NOTABLE_FACT_SALIENCE]
