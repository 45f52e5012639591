"""ScriptedLLM.close() cuts kept-alive connections too (review, 2026-12-05).

The RSS soak (tests/soak/soak_rss.py) makes its "refusing" phase with ``s.close()`` and
later scripts faults on *new* server objects; but the worker's transport keeps connections
alive, and ThreadingHTTPServer.shutdown() only stops accepting: the handler threads of
established connections go on answering with the old responder. So after close(), a client
with a kept-alive connection is still answered (by the old, healthy script), and the
soak's refusing/dropping phases largely never reached the worker.
"""

from __future__ import annotations

import http.client
import json

from sokratos_worker.testing.scripted_llm import CHAT, Reply, ScriptedLLM


def _post(conn: http.client.HTTPConnection) -> int:
    body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
    conn.request("POST", CHAT, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status


def test_a_closed_scripted_server_answers_no_kept_alive_connection() -> None:
    server = ScriptedLLM(chat=lambda r: Reply.chat("ok")).start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        assert _post(conn) == 200  # connection now kept alive
        server.close()
        answered: int | None
        try:
            answered = _post(conn)
        except (OSError, http.client.HTTPException):
            answered = None
        assert answered is None, (
            f"after close() the kept-alive connection was still answered ({answered})"
        )
    finally:
        conn.close()
