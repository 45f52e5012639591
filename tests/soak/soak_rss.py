"""Soak: does the daemon's RSS grow per item while the LLM backends keep dropping connections?

Not a defect reproducer; a measurement. Run (about SOAK_MINUTES minutes)::

    cd /work/main && SOAK_MINUTES=30 SOAK_CSV=bench/results/soak-20261205/soak_default.csv \
      PYTHONPATH=/work/main python3 -m pytest tests/soak/soak_rss.py -q -s \
      -p no:cacheprovider

Phases of SOAK_PHASE_S seconds cycle healthy -> dropping -> refusing. ``dropping``: both chat
backends close the socket without answering (Reply.disconnect) for SOAK_DROP_RATE of the chat
requests (probes still answered). ``refusing``: both chat servers are stopped (connection
refused on their ports). Embeddings stay up. Items are fed continuously (SOAK_RATE per second)
through sokratos_enqueue_triage. Every 10 s: daemon RSS/USS (psutil), settled items
(work_outcomes rows), queued items, written to SOAK_CSV.
SOAK_DAEMON_ENV: extra daemon env as JSON (e.g. {"MALLOC_ARENA_MAX": "2"}).
"""

from __future__ import annotations

import csv
import json
import os
import random
import threading
import time
from pathlib import Path

import psutil
import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import CHAT, Reply, Request, ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    answer,
    exchange,
    pipeline_env,
    start_worker,
    stop,
    tail,
)

MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
PHASE_S = float(os.environ.get("SOAK_PHASE_S", "180"))
RATE = float(os.environ.get("SOAK_RATE", "4"))
DROP_RATE = float(os.environ.get("SOAK_DROP_RATE", "0.5"))
CSV_PATH = Path(os.environ.get("SOAK_CSV", "/tmp/sokratos-soak.csv"))
PHASES = os.environ.get("SOAK_PHASES", "healthy,dropping,refusing").split(",")


class FixedPortLLM(ScriptedLLM):
    """A ScriptedLLM that binds a given port, so it can be stopped and started again."""

    def __init__(self, port: int = 0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._want_port = port

    def start(self) -> ScriptedLLM:
        from http.server import ThreadingHTTPServer

        from sokratos_worker.testing import scripted_llm as s

        server = ThreadingHTTPServer(("127.0.0.1", self._want_port), s._make_handler(self))
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self._want_port = self.port
        return self


def dropper(rate: float, seed: int):
    rng = random.Random(seed)
    lock = threading.Lock()

    def respond(request: Request) -> Reply:
        with lock:
            r = rng.random()
        if r < rate:
            return Reply.disconnect()
        return answer(request)

    return respond


@pytest.mark.skipif("SOAK_MINUTES" not in os.environ, reason="a 30-minute soak: set SOAK_MINUTES")
@pytest.mark.timeout(int(MINUTES * 60 + 600))
def test_soak_rss(database_url: str, tmp_path: Path) -> None:  # noqa: PLR0912
    log = tmp_path / "worker.log"
    embed = ScriptedLLM(embed_dim=EMBED_DIM).start()
    servers = [FixedPortLLM(chat=answer).start(), FixedPortLLM(chat=answer).start()]
    ports = [s.port for s in servers]
    env = pipeline_env(database_url, tmp_path, servers, embed)
    env["SOKRATOS_LOG_LEVEL"] = os.environ.get("SOAK_LOG_LEVEL", "warning")
    env.update(json.loads(os.environ.get("SOAK_DAEMON_ENV", "{}")))
    entry = os.environ.get("SOAK_ENTRY")
    if entry:  # another entry module for the daemon (e.g. one that runs tracemalloc)
        import subprocess
        import sys

        from tests.support.daemon import ROOT

        proc = subprocess.Popen(
            [sys.executable, "-m", entry, "run"], env=env, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=log.open("ab"),
        )
    else:
        proc = start_worker(env, log)
    ps = psutil.Process(proc.pid)
    stop_feed = threading.Event()
    fed = [0]

    def feed() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            i = 0
            nxt = time.monotonic()
            while not stop_feed.is_set():
                i += 1
                payload = exchange(f"tok{i}", save=(i % 3 == 0))
                conn.execute(
                    "SELECT sokratos_enqueue_triage(%s::jsonb, NULL, 'conversation')",
                    (json.dumps(payload),),
                )
                fed[0] = i
                nxt += 1.0 / RATE
                time.sleep(max(0.0, nxt - time.monotonic()))

    CSV_PATH.parent.mkdir(parents=True, exist_ok=True)
    out = CSV_PATH.open("w", newline="")
    w = csv.writer(out)
    w.writerow(
        ["t_s", "phase", "cycle", "rss_kb", "uss_kb", "anon_kb", "settled", "queued", "fed",
         "threads", "fds", "chat_requests"]
    )
    db = psycopg.connect(database_url, autocommit=True)
    try:
        # wait until the worker is up (first outcome from a warm-up item)
        feeder = threading.Thread(target=feed, daemon=True)
        t0 = time.monotonic()
        feeder.start()
        total = MINUTES * 60
        phase_idx = -1
        chat_requests = 0
        next_sample = t0
        while True:
            now = time.monotonic()
            el = now - t0
            if el >= total:
                break
            want = int(el // PHASE_S)
            if want != phase_idx:
                phase_idx = want
                phase = PHASES[phase_idx % len(PHASES)]
                # apply phase
                if phase == "refusing":
                    for s in servers:
                        chat_requests += s.count(CHAT)
                        s.close()
                else:
                    for k, s in enumerate(servers):
                        if s._server is None or s._stopping.is_set():
                            chat_requests += 0
                            servers[k] = FixedPortLLM(ports[k], chat=answer).start()
                    for k, s in enumerate(servers):
                        s.on(CHAT, answer if phase == "healthy" else dropper(DROP_RATE, 11 + k))
                print(f"\n[{el:7.1f}s] phase {phase} (cycle {phase_idx})", flush=True)
            if now >= next_sample:
                next_sample += 10
                if proc.poll() is not None:
                    raise AssertionError(f"daemon exited {proc.returncode}: {tail(log)}")
                mem = ps.memory_full_info()
                anon = 0
                try:
                    for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                        if line.startswith("Anonymous:"):
                            anon = int(line.split()[1])
                except OSError:
                    pass
                settled = db.execute("SELECT count(*) FROM work_outcomes").fetchone()[0]
                queued = db.execute("SELECT count(*) FROM pending_triage").fetchone()[0]
                reqs = chat_requests + sum(
                    s.count(CHAT) for s in servers if not s._stopping.is_set()
                )
                for s in servers:  # keep the harness's own memory bounded
                    if not s._stopping.is_set():
                        chat_requests += s.count(CHAT)
                        with s._lock:
                            s._requests.clear()
                w.writerow(
                    [round(el, 1), PHASES[phase_idx % len(PHASES)], phase_idx, mem.rss // 1024,
                     mem.uss // 1024, anon, settled, queued, fed[0], ps.num_threads(),
                     ps.num_fds(), reqs]
                )
                out.flush()
            time.sleep(0.2)
    finally:
        stop_feed.set()
        code = stop(proc, timeout=60)
        out.close()
        db.close()
        for s in servers:
            if not s._stopping.is_set():
                s.close()
        embed.close()
        print(tail(log, 3000))
    assert code == 0
