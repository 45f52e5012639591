"""The pipelines: one handler per queue, item in, :class:`~sokratos_worker.model.Effects` out."""

from __future__ import annotations

import structlog

from sokratos_worker.handlers import Handler, HandlerContext
from sokratos_worker.model import Queue
from sokratos_worker.pipelines.distill import DistillationHandler
from sokratos_worker.pipelines.triage import TriageHandler
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.store.memories import MemoryReader

log = structlog.get_logger(__name__)

__all__ = ["DistillationHandler", "TriageHandler", "build_handlers"]


def build_handlers(ctx: HandlerContext) -> dict[Queue, Handler]:
    """The handlers of both queues; none without a chat backend, so items wait for one."""
    if ctx.chat is None:
        log.debug("pipelines_disabled", reason="no_llm_backend")  # the daemon says it at start
        return {}
    model = ctx.embedder.model if ctx.embedder is not None else None
    reader = MemoryReader(ctx.database, embedding_model=model)
    writer = MemoryWriter(reader, ctx.chat, ctx.embedder)
    return {
        Queue.TRIAGE: TriageHandler(reader, writer, ctx.chat, ctx.embedder),
        Queue.DISTILLATION: DistillationHandler(writer, ctx.chat, ctx.embedder),
    }
