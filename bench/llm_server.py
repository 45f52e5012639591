"""The local OpenAI-compatible server for W2: ``python -m bench.llm_server LATENCY_S``.

It is the project's :class:`~sokratos_worker.testing.scripted_llm.ScriptedLLM` (a thread per
connection, a fixed latency per request), run in its own process so its CPU does not share a
GIL with the worker under test. It prints its ``/v1`` URL on stdout, then serves until stdin
closes. Chat replies are routed by prompt so the real triage pipeline gets valid answers;
``GET /bench/stats`` returns request counts per purpose.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Any

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import (
    EMBEDDINGS,
    Reply,
    Request,
    ScriptedLLM,
    hash_embedding_responder,
)

EMBED_DIM = 64
_WORD = re.compile(r"[a-z]{4,}")


def main() -> int:
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    # The stdlib default listen backlog is 5: 20 clients connecting at once would lose SYNs
    # (a 1 s retransmit). A real LLM server's backlog is larger.
    ThreadingHTTPServer.request_queue_size = 256
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    embed = hash_embedding_responder(EMBED_DIM, model="bench-embed")

    def count(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def chat(request: Request) -> Reply:
        messages = request.messages
        system = str(messages[0].get("content", "")) if messages else ""
        user = str(messages[-1].get("content", "")) if messages else ""
        if system.startswith(prompts.CONTRADICTION[:40]):
            count("contradiction")
            return Reply.chat({"verdicts": [{"existing": 1, "contradicts": False}]})
        if system.startswith(prompts.CONVERSATION_TRIAGE[:40]):
            count("triage")
            return Reply.chat(_verdict(user))
        count("chat")
        return Reply.chat({"ok": True})

    def embeddings(request: Request) -> Reply:
        count("embeddings")
        return embed(request)

    def stats(_: Request) -> Reply:
        with lock:
            return Reply(json_body=dict(counts))

    server = ScriptedLLM(chat=chat, embed_dim=EMBED_DIM, latency=latency)
    server.on(EMBEDDINGS, embeddings)
    server.on("/bench/stats", stats)
    with server:
        print(server.url, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    return 0


def _verdict(user: str) -> dict[str, Any]:
    words = [w for w in _WORD.findall(user.lower()) if w not in {"user", "assistant"}]
    detail = " ".join(words[-4:])
    return {
        "salience_score": 7,
        "summary": f"The user's daughter started school; noted: {detail}.",
        "category": "personal",
        "tags": ["family"],
        "save": True,
        "paradigm_shift": False,
    }


if __name__ == "__main__":
    raise SystemExit(main())
