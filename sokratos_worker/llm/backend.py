"""One configured chat backend as the fallback client holds it, and the bounds it runs under.

:class:`Backend` bundles a backend's settings with what the client keeps per backend: one HTTP
client per thread, a semaphore of concurrency slots, the one-token probe's deadline and the
circuit breaker. :class:`RetryPolicy` sets the bounds of the per-backend retry loop, the breaker
and the health probe; the client builds every :class:`Backend` from it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.breaker import CircuitBreaker
from sokratos_worker.llm.http import ClientPerThread, make_client, tls_verification
from sokratos_worker.logs import maskable, url_password


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds of the per-backend retry loop, the breaker and the health probe."""

    attempts: int = 3  # HTTP attempts per backend for transient errors
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    retry_after_max: float = 30.0  # a longer Retry-After moves on to the next backend now
    probe_timeout: float = 15.0  # the health probe's deadline (also the half-open trial)
    breaker_threshold: int = 3
    breaker_cooldown: float = 120.0
    breaker_max_cooldown: float = 600.0


class Backend:
    """One configured backend with its HTTP client, slots and circuit."""

    def __init__(
        self, config: BackendConfig, policy: RetryPolicy, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.name = config.name
        # Parsed once: httpx parses a string URL on every request (half of build_request).
        self.chat_url = httpx.URL(f"{config.url}/chat/completions")
        key = config.api_key.get_secret_value() if config.api_key else None
        # What a server may echo back (LiteLLM: "Received=<key>") and no reason may repeat.
        self.secrets = tuple(maskable([key], [url_password(config.url)]))
        self.clients = ClientPerThread(
            functools.partial(
                make_client,
                name=config.name,
                timeout=config.timeout,
                api_key=key,
                verify=tls_verification(
                    name=config.name, ca_file=config.ca_file, tls_verify=config.tls_verify
                ),
            )
        )
        self.slots = threading.BoundedSemaphore(config.max_concurrency)
        self.probe_timeout = min(config.timeout, policy.probe_timeout)
        self.breaker = CircuitBreaker(
            config.name,
            threshold=policy.breaker_threshold,
            cooldown=policy.breaker_cooldown,
            max_cooldown=policy.breaker_max_cooldown,
            # The trial waits for a slot up to the probe's timeout, then probes within it.
            probe_deadline=2 * self.probe_timeout + 5.0,
            clock=clock,
        )

    def moved(self, url: str) -> None:
        """Send later requests to ``url`` (a local model server restarted on another port)."""
        self.config = self.config.model_copy(update={"url": url})
        self.chat_url = httpx.URL(f"{url}/chat/completions")


__all__ = ["Backend", "RetryPolicy"]
