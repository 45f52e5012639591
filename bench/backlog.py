"""What a large backlog costs the worker's periodic queries: ``python3 bench/backlog.py [N]``.

Fills ``pending_triage`` with N items (default 1,000,000) on an embedded PostgreSQL and times,
three to five times each: the /metrics scrape's queue reads (``queue_stats``), the
dispatcher's look for the next ready item (``next_ready_in``), the lease renewer's check
for orphaned leases (``release_orphans``) and a claim of 10, with every item ready and then
with every item backing off. Prints one line per query (median and each run, in ms).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.run import postgres  # noqa: E402
from sokratos_worker.model import Queue  # noqa: E402
from sokratos_worker.store import queue as store  # noqa: E402
from sokratos_worker.store import status  # noqa: E402
from sokratos_worker.store.migrations import apply_migrations  # noqa: E402

QUEUES = [Queue.TRIAGE, Queue.DISTILLATION]


def timed(label: str, fn: Callable[[], object], runs: int = 3) -> None:
    took = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        took.append((time.perf_counter() - started) * 1000)
    each = ", ".join(f"{t:.0f}" for t in took)
    print(f"{label:42s} {statistics.median(took):8.1f} ms  ({each})", flush=True)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    with postgres(None) as uri:
        apply_migrations(uri)
        with psycopg.connect(uri, autocommit=True) as conn:
            started = time.perf_counter()
            conn.execute(
                """INSERT INTO pending_triage (payload, source, idempotency_key)
                   SELECT jsonb_build_object('kind', 'conversation',
                              'user_message', repeat('x', 150), 'assistant_message', 'ok'),
                          'conversation', 'backlog-' || g
                   FROM generate_series(1, %s) AS g""",
                (n,),
            )
            conn.execute("VACUUM ANALYZE pending_triage")
            print(f"{n:,} items enqueued in {time.perf_counter() - started:.1f} s", flush=True)
            for state in ("ready", "backing off"):
                if state == "backing off":
                    conn.execute("UPDATE pending_triage SET run_after = now() + interval '1 hour'")
                    conn.execute("VACUUM ANALYZE pending_triage")
                timed(f"scrape's queue reads, all {state}", lambda: status.queue_stats(conn))
                timed(f"next ready item, all {state}", lambda: store.next_ready_in(conn, QUEUES))
                timed(
                    f"orphaned leases, all {state}",
                    lambda: store.release_orphans(
                        conn, Queue.TRIAGE, owner="bench", keep=[], lease_s=300, older_than_s=60
                    ),
                )
                timed(
                    f"claim 10, all {state}",
                    lambda: store.claim(conn, Queue.TRIAGE, owner="bench", limit=10, lease_s=300),
                    runs=5,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
