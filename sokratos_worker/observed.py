"""A chat client wrapper that feeds every backend attempt into the Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sokratos_worker.llm.types import BackendAttempt, BackendState, ChatClient, ChatResult, T
from sokratos_worker.service.metrics import Metrics


class ObservedChat:
    """Delegates to ``inner``; records LLM call durations and circuit states."""

    def __init__(self, inner: ChatClient, metrics: Metrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def complete(
        self,
        *,
        response_model: type[T],
        system: str,
        user: str,
        max_tokens: int,
        purpose: str,
    ) -> ChatResult[T]:
        """The inner call, observed whether it succeeds or not."""
        try:
            result = self.inner.complete(
                response_model=response_model,
                system=system,
                user=user,
                max_tokens=max_tokens,
                purpose=purpose,
            )
        except Exception as exc:
            self._observe(getattr(exc, "tried", ()))
            raise
        self._observe(result.tried)
        return result

    def _observe(self, tried: Iterable[BackendAttempt]) -> None:
        for attempt in tried:
            if attempt.result != "skipped":
                self.metrics.observe_llm_call(
                    attempt.backend, attempt.duration_ms / 1000, ok=attempt.result == "answered"
                )

    def probe(self) -> bool:
        """The inner client's probe."""
        return self.inner.probe()

    def states(self) -> list[BackendState]:
        """The inner client's circuits, mirrored into the metrics."""
        states = self.inner.states()
        for state in states:
            self.metrics.set_circuit(state.name, state.circuit)
        return states

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
