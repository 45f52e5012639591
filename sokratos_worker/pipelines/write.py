"""Memory-write planning: chunk, embed, guard near-duplicates, check contradictions.

Nothing here writes: the plan becomes :class:`~sokratos_worker.model.Effects` that the
settle commits in one transaction with the item's deletion (behaviour §2, §3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from sokratos_worker.errors import BackendsUnavailable, ItemError
from sokratos_worker.llm.types import (
    ChatClient,
    ContextTooLong,
    Embedder,
    EmbeddingFailed,
    RequestRefused,
)
from sokratos_worker.model import DraftSupersession, Item, NewMemory, Supersession
from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.schemas import ContradictionVerdicts
from sokratos_worker.pipelines.text import chunk_text
from sokratos_worker.store.memories import (
    FACT_DUPLICATE_DISTANCE,
    NEAR_DUPLICATE_DISTANCE,
    MemoryReader,
    MemorySnippet,
)
from sokratos_worker.store.sanitize import clean_text

log = structlog.get_logger(__name__)


# An outage (no backend reachable, circuits open, all refusing) is no verdict: the attempt is
# given back and the check runs with the next one. A request every backend refuses (its
# schema, a parameter) would never get one: the attempt is used and the item ends in
# failed_operations, where the operator sees it. Swallowing either would save the memory for
# good with the contradicted one live.
_NO_VERDICT = (BackendsUnavailable, RequestRefused)


@dataclass(frozen=True)
class PlannedRow:
    """A row planned for an earlier fact of the same item: written in the same transaction,
    so not in the table yet, but compared with as if it were (Sokratos saves facts one by one)."""

    origin: str
    summary: str
    vector: tuple[float, ...]


# What a contradiction check compares with: a saved memory, or an earlier fact's row.
Candidate = MemorySnippet | PlannedRow


@dataclass
class EarlierFacts:
    """The rows an item's earlier facts will write and what they supersede, so that a later
    fact is checked against them as if they were saved (a known fact, a contradiction)."""

    rows: list[PlannedRow] = field(default_factory=list)
    superseded_ids: set[int] = field(default_factory=set)  # saved memories they supersede
    superseded_origins: set[str] = field(default_factory=set)  # their rows later facts do

    def add(self, plan: WritePlan) -> None:
        """Count ``plan``'s rows and supersessions in, once it is planned."""
        self.rows += [
            PlannedRow(m.origin, m.summary, m.embedding)
            for m in plan.memories
            if m.embedding is not None
        ]
        self.superseded_ids.update(s.old_memory_id for s in plan.supersessions)
        self.superseded_origins.update(s.old_origin for s in plan.draft_supersessions)

    def measured(self, vec: Sequence[float]) -> MeasuredFacts:
        """The rows with their distances from ``vec``, computed once for both checks: pure
        Python over every earlier row costs seconds per fact on a long archive."""
        return MeasuredFacts(self, [(cosine_distance(vec, row.vector), row) for row in self.rows])


@dataclass(frozen=True)
class MeasuredFacts:
    """The earlier facts' rows, each with its distance from the fact being planned."""

    earlier: EarlierFacts
    distances: list[tuple[float, PlannedRow]]

    @property
    def superseded_ids(self) -> set[int]:
        """The saved memories the earlier facts supersede."""
        return self.earlier.superseded_ids

    def known(self) -> bool:
        """Whether a row lies within 0.15, superseded or not (as the table's check counts)."""
        return any(distance < FACT_DUPLICATE_DISTANCE for distance, _ in self.distances)

    def live_near(self, max_distance: float) -> list[tuple[float, PlannedRow]]:
        """The rows no later fact superseded within ``max_distance``, with their distances."""
        return [
            (distance, row)
            for distance, row in self.distances
            if distance < max_distance and row.origin not in self.earlier.superseded_origins
        ]


def _superseding(
    contradicted: Sequence[Candidate], new_origin: str
) -> tuple[tuple[Supersession, ...], tuple[DraftSupersession, ...]]:
    """The supersessions of saved memories, then of earlier facts' rows."""
    saved = tuple(
        Supersession(old_memory_id=c.id, new_origin=new_origin)
        for c in contradicted
        if isinstance(c, MemorySnippet)
    )
    planned = tuple(
        DraftSupersession(old_origin=c.origin, new_origin=new_origin)
        for c in contradicted
        if isinstance(c, PlannedRow)
    )
    return saved, planned


@dataclass(frozen=True)
class ContradictionCheck:
    """How one draft's contradiction check went: the candidates judged contradicted, how
    many got a verdict, how many none, and why (no valid verdict only means no supersession
    for those: the memory itself is still worth saving)."""

    contradicted: tuple[Candidate, ...] = ()
    checked: int = 0
    unchecked: int = 0
    failed: str | None = None  # the errors' class names, when some got no verdict


def _unchecked(candidates: Sequence[Candidate], error: str) -> ContradictionCheck:
    return ContradictionCheck(unchecked=len(candidates), failed=error)


class MisnumberedVerdicts(ItemError):
    """The contradiction verdicts name candidates that were not asked about (numbered from
    0): applied, each would supersede another memory than the one judged."""


CONTRADICTION_DISTANCE = 0.4
CONTRADICTION_CANDIDATES = 3
CONTRADICTION_MAX_TOKENS = 1024  # as Sokratos's inline check (behaviour §6.2)


@dataclass(frozen=True)
class MemoryDraft:
    """A memory the pipeline wants written, before chunking and embedding."""

    text: str
    salience: float
    memory_type: str
    source: str
    tags: tuple[str, ...]
    source_date: datetime | None = None
    pipeline_id: int | None = None


@dataclass(frozen=True)
class WritePlan:
    """The rows one draft becomes, or the existing memory that makes it redundant."""

    memories: tuple[NewMemory, ...] = ()
    supersessions: tuple[Supersession, ...] = ()
    draft_supersessions: tuple[DraftSupersession, ...] = ()  # of earlier facts of the item
    duplicate_of: int | None = None
    known_fact: bool = False
    # The saved memory within 0.15 (None when the match is a fact planned earlier in the item).
    known_fact_of: int | None = None
    contradiction_failed: str | None = None  # why some candidates got no verdict (saved anyway)
    checked: int = 0  # contradiction candidates a verdict came for
    unchecked: int = 0  # candidates none came for
    escaped: bool = False  # the model's text held NUL or lone surrogates, escaped to be stored


def contradiction_note(plans: Sequence[WritePlan]) -> str:
    """The outcome detail's word on the contradiction checks that failed among ``plans`` (""
    when none did): why, how many candidates went unchecked and what those checks superseded
    all the same (counted over the plans whose check failed)."""
    failed = [plan for plan in plans if plan.contradiction_failed is not None]
    if not failed:
        return ""
    why = ", ".join(sorted({str(plan.contradiction_failed) for plan in failed}))
    unchecked = sum(plan.unchecked for plan in failed)
    candidates = unchecked + sum(plan.checked for plan in failed)
    superseded = sum(len(p.supersessions) + len(p.draft_supersessions) for p in failed) or "nothing"
    return (
        f"contradiction check failed ({why}): {unchecked} of {candidates} candidates unchecked,"
        f" {superseded} superseded"
    )


def cosine_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """pgvector's ``<=>``: 1 - cosine similarity (1.0 for a zero vector)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return 1.0 - dot / norms if norms else 1.0


def storable(draft: MemoryDraft) -> tuple[MemoryDraft, bool]:
    """The draft with NUL and lone surrogates escaped, and whether any were: a model's
    ``\\u0000`` is valid JSON, but PostgreSQL text cannot hold it and the insert would fail."""
    text = clean_text(draft.text)
    tags = tuple(clean_text(tag) for tag in draft.tags)
    if text == draft.text and tags == draft.tags:
        return draft, False
    return dataclasses.replace(draft, text=text, tags=tags), True


class MemoryWriter:
    """Plans memory writes for one process; without an embedder it saves text only."""

    def __init__(
        self, reader: MemoryReader, chat: ChatClient | None, embedder: Embedder | None
    ) -> None:
        self.reader = reader
        self.chat = chat
        self.embedder = embedder

    def plan(
        self,
        item: Item,
        draft: MemoryDraft,
        *,
        first_chunk: int = 0,
        fact_dedupe: bool = False,
        earlier: EarlierFacts | None = None,
    ) -> WritePlan:
        """Rows for ``draft`` with origins ``item.origin(first_chunk + i)``.

        ``fact_dedupe`` also drops the draft when any memory lies within 0.15 (distillation).
        The facts planned before it from the same item (``earlier``), written in the same
        transaction and so not in the table yet, count as saved memories for that check and
        the contradiction check: a later fact contradicting one supersedes it.
        Embedding and chat-backend outages propagate (the attempt is given back), and so does a
        contradiction request every backend refuses (:class:`RequestRefused`, the attempt
        used); a verdict that failed (no valid reply) does not: the memory is saved without
        supersessions.
        """
        draft, escaped = storable(draft)
        chunks = chunk_text(draft.text)
        if self.embedder is None:
            bare = [(chunk, None) for chunk in chunks]
            return WritePlan(memories=self._rows(item, draft, bare, first_chunk), escaped=escaped)
        first = self._embed(chunks[0])
        vec = first[0][1]
        measured = (earlier or EarlierFacts()).measured(vec)
        if fact_dedupe:
            if measured.known():
                return WritePlan(known_fact=True)
            known = self.reader.known_fact_id(vec, FACT_DUPLICATE_DISTANCE)
            if known is not None:
                return WritePlan(known_fact=True, known_fact_of=known)
        duplicate = self.reader.near_duplicate(vec, NEAR_DUPLICATE_DISTANCE)
        if duplicate is not None:
            return WritePlan(duplicate_of=duplicate)
        embedded = list(first)
        for chunk in chunks[1:]:
            embedded.extend(self._embed(chunk))
        memories = self._rows(item, draft, embedded, first_chunk, fact_check=fact_dedupe)
        check = self._contradictions(item, draft.text, vec, measured)
        saved, planned = _superseding(check.contradicted, memories[0].origin)
        return WritePlan(
            memories=memories,
            supersessions=saved,
            draft_supersessions=planned,
            contradiction_failed=check.failed,
            checked=check.checked,
            unchecked=check.unchecked,
            escaped=escaped,
        )

    def _embed(self, text: str) -> list[tuple[str, list[float]]]:
        """Embed one chunk (split by the server's limit) and check the pinned dimension."""
        assert self.embedder is not None  # noqa: S101 - only called with an embedder
        pairs = self.embedder.embed_splitting(text)
        if not pairs:
            raise EmbeddingFailed("the embedding server returned no vector")
        for _, vec in pairs:
            if len(vec) != self.embedder.dim:
                raise EmbeddingFailed(
                    f"embedding has {len(vec)} dimensions, expected {self.embedder.dim}"
                )
        return pairs

    def _rows(
        self,
        item: Item,
        draft: MemoryDraft,
        chunks: Sequence[tuple[str, Sequence[float] | None]],
        first_chunk: int,
        *,
        fact_check: bool = False,
    ) -> tuple[NewMemory, ...]:
        model = self.embedder.model if self.embedder is not None else None
        return tuple(
            NewMemory(
                origin=item.origin(first_chunk + i),
                summary=text,
                salience=draft.salience,
                memory_type=draft.memory_type,
                source=draft.source,
                tags=draft.tags,
                embedding=tuple(vec) if vec is not None else None,
                embedding_model=model if vec is not None else None,
                source_date=draft.source_date,
                pipeline_id=draft.pipeline_id,
                duplicate_check=i == 0 and vec is not None,  # (the chunk the check compared)
                fact_check=fact_check and i == 0 and vec is not None,
            )
            for i, (text, vec) in enumerate(chunks)
        )

    def _contradictions(
        self, item: Item, summary: str, vec: list[float], earlier: MeasuredFacts
    ) -> ContradictionCheck:
        """The live memories (and earlier facts) the LLM judges contradicted by ``summary``,
        and the candidates no verdict came for (logged)."""
        if self.chat is None:
            return ContradictionCheck()
        candidates = self._candidates(vec, earlier)
        if not candidates:
            return ContradictionCheck()
        check = self._check(self.chat, item, summary, candidates)
        if check.failed is not None:
            log.warning(
                "contradiction_check_failed",
                item_id=item.id,
                candidates=check.unchecked,
                checked=check.checked,
                error=check.failed,
            )
        return check

    def _candidates(self, vec: list[float], earlier: MeasuredFacts) -> list[Candidate]:
        """The nearest live memories within 0.4, the earlier facts' rows among them as if
        saved, and without the memories those supersede (nearest first, saved ones on a tie)."""
        saved = self.reader.similar_live(
            vec, CONTRADICTION_DISTANCE, CONTRADICTION_CANDIDATES + len(earlier.superseded_ids)
        )
        near: list[tuple[float, Candidate]] = [
            (c.distance, c) for c in saved if c.id not in earlier.superseded_ids
        ]
        near += earlier.live_near(CONTRADICTION_DISTANCE)
        near.sort(key=lambda pair: pair[0])  # (stable: the table's order holds on a tie)
        return [candidate for _, candidate in near[:CONTRADICTION_CANDIDATES]]

    def _check(
        self, chat: ChatClient, item: Item, summary: str, candidates: Sequence[Candidate]
    ) -> ContradictionCheck:
        """One call over all ``candidates``, or one per candidate if they are too long
        together for a backend's context."""
        try:
            contradicted = self._ask_contradicted(chat, item, summary, candidates)
        except ContextTooLong:
            if len(candidates) == 1:
                return _unchecked(candidates, ContextTooLong.__name__)
            log.info("contradiction_candidates_one_by_one", item_id=item.id)
            return self._one_by_one(chat, item, summary, candidates)
        except _NO_VERDICT:
            raise
        except ItemError as exc:
            return _unchecked(candidates, type(exc).__name__)
        return ContradictionCheck(tuple(contradicted), checked=len(candidates))

    def _one_by_one(
        self, chat: ChatClient, item: Item, summary: str, candidates: Sequence[Candidate]
    ) -> ContradictionCheck:
        """Each candidate compared on its own: what one call found stands when another fails."""
        contradicted: list[Candidate] = []
        failures: list[str] = []
        for candidate in candidates:
            try:
                contradicted += self._ask_contradicted(chat, item, summary, [candidate])
            except _NO_VERDICT:
                raise
            except ItemError as exc:
                failures.append(type(exc).__name__)
        return ContradictionCheck(
            tuple(contradicted),
            checked=len(candidates) - len(failures),
            unchecked=len(failures),
            failed=", ".join(sorted(set(failures))) or None,
        )

    def _ask_contradicted(
        self, chat: ChatClient, item: Item, summary: str, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        """One contradiction call over ``candidates``."""
        result = chat.complete(
            response_model=ContradictionVerdicts,
            system=prompts.CONTRADICTION,
            user=prompts.contradiction_input(summary, [c.summary for c in candidates]),
            max_tokens=CONTRADICTION_MAX_TOKENS,
            purpose="contradiction",
        )
        misnumbered = result.value.misnumbered(len(candidates))
        if misnumbered:
            raise MisnumberedVerdicts(
                f"verdicts for candidates {misnumbered}, asked about 1 to {len(candidates)}",
                backend=result.backend,
            )
        contradicted = result.value.contradicted(len(candidates))
        log.info(
            "contradiction_checked",
            item_id=item.id,
            candidates=len(candidates),
            contradicted=len(contradicted),
            backend=result.backend,
        )
        return [candidates[n - 1] for n in contradicted]
