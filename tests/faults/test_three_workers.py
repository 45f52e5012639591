"""Scenario: three daemons on one PostgreSQL (docs/production.md §9), draining ~600 mixed items
against scripted backends while one is killed with SIGKILL and replaced (three times), the
others get a rolling restart by SIGTERM, and PostgreSQL itself is restarted once.

Every item must end in exactly one outcome, no memory twice for one origin, every dead letter
with its payload, every daemon must exit as documented, and ``status`` must list the live
workers and their states while they run.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    POISON,
    Chaos,
    Key,
    assert_exactly_once,
    cli,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    failed_payloads,
    insert_raw,
    messages_archive,
    outcome_count,
    pipeline_env,
    report,
    start_worker,
    stop,
    tail,
    text_archive,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

MAX_ATTEMPTS = 6
QUEUES = ("pending_triage", "pending_distillation")
INVALID = [
    ("pending_triage", '{"exchange": 5}', "conversation"),
    ("pending_triage", '"just a string"', "conversation"),
    ("pending_distillation", '{"messages": "nope"}', None),
    ("pending_distillation", "{}", None),
]


@dataclass
class Arranged:
    keys: list[Key] = field(default_factory=list)
    payloads: dict[Key, Any] = field(default_factory=dict)
    poison_triage: list[Key] = field(default_factory=list)
    poison_distill: list[Key] = field(default_factory=list)
    invalid: list[Key] = field(default_factory=list)


def _arrange(db: psycopg.Connection, n: int = 600) -> Arranged:
    a = Arranged()
    with db.transaction():
        for i in range(n):
            tok = f"tokw{i}"
            kind = i % 10
            if kind in (0, 1, 2):
                payload = exchange(tok, save=True, tools=kind == 1)
                key = enqueue_triage(db, payload)
            elif kind == 3:
                payload = exchange(tok, save=False)
                key = enqueue_triage(db, payload)
            elif kind in (4, 5):
                payload = messages_archive(tok)
                key = enqueue_distillation(db, payload)
            elif kind in (6, 7):
                payload = text_archive(tok)
                key = enqueue_distillation(db, payload)
            elif kind == 8 and i % 30 == 8:  # poison triage: no backend ever answers it
                payload = {"exchange": f"user: my code word is {tok} {POISON}\nassistant: ok"}
                key = enqueue_triage(db, payload)
                a.poison_triage.append(key)
            elif kind == 9 and i % 30 == 9:  # poison distillation: archived raw + dead letter
                payload = messages_archive(tok, poison=True)
                key = enqueue_distillation(db, payload)
                a.poison_distill.append(key)
            else:
                payload = exchange(tok, save=True)
                key = enqueue_triage(db, payload)
            a.keys.append(key)
            a.payloads[key] = payload
        for table, body, source in INVALID:
            key = insert_raw(db, table, body, source)
            a.keys.append(key)
            a.invalid.append(key)
            a.payloads[key] = json.loads(body)
    return a


class Fleet:
    """Three named daemons on one database, each with its own state directory."""

    def __init__(self, base_env: dict[str, str], tmp_path: Path) -> None:
        self.base_env = base_env
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: list[tuple[str, int, int, str]] = []  # (name, pid, code, how)
        self.generation: dict[str, int] = {}

    def env(self, name: str) -> dict[str, str]:
        env = dict(self.base_env)
        env["SOKRATOS_DATA_DIR"] = str(self.tmp_path / f"data-{name}")
        env["SOKRATOS_WORKER_INSTANCE"] = name
        return env

    def log(self, name: str) -> Path:
        return self.tmp_path / f"worker-{name}.log"

    def start(self, name: str) -> subprocess.Popen[bytes]:
        self.generation[name] = self.generation.get(name, 0) + 1
        proc = start_worker(self.env(name), self.log(name))
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> int:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} died on its own: " + tail(self.log(name))
        proc.kill()
        code = proc.wait(10)
        self.exits.append((name, proc.pid, code, "SIGKILL"))
        return proc.pid

    def term(self, name: str) -> int:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} died on its own: " + tail(self.log(name))
        code = stop(proc, timeout=40)
        self.exits.append((name, proc.pid, code, "SIGTERM"))
        return code

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def logs(self) -> str:
        return "\n".join(f"== {n}\n{tail(self.log(n), 2500)}" for n in self.procs)

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.returncode is None:
                code = stop(proc, timeout=40)
                self.exits.append((name, proc.pid, code, "SIGTERM at end"))


def _leased_by(conn: psycopg.Connection, pid: int) -> list[Key]:
    """Items whose lease is held by the process ``pid`` (worker ids are host@inst:pid:rand)."""
    keys: list[Key] = []
    for table in QUEUES:
        rows = conn.execute(
            f"SELECT id FROM {table} WHERE lease_owner LIKE %s", (f"%:{pid}:%",)
        ).fetchall()
        keys += [(table, int(r[0])) for r in rows]
    return keys


def _recovered(conn: psycopg.Connection, pid: int) -> bool:
    """No item still leased by ``pid`` (each settled, or taken over by another worker)."""
    return not _leased_by(conn, pid)


def _status(env: dict[str, str]) -> list[dict[str, Any]]:
    result = cli(env, "status", "--json", timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    return list(json.loads(result.stdout).get("workers", []))


class Db:
    """An autocommit connection that reconnects after PostgreSQL was restarted."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)

    def get(self) -> psycopg.Connection:
        if self.conn.closed or self.conn.broken:
            self.conn.close()
            self.conn = psycopg.connect(self.url, autocommit=True)
        return self.conn

    def outcomes(self) -> int:
        try:
            return outcome_count(self.get())
        except psycopg.OperationalError:
            self.conn.close()
            return -1

    def close(self) -> None:
        self.conn.close()


@pytest.mark.timeout(300)
def test_three_workers_kill9_rolling_restart_and_postgres_restart_exactly_once(
    database_url: str, tmp_path: Path, restart_postgres: Callable[[float], None]
) -> None:
    dbh = Db(database_url)
    arranged = _arrange(dbh.get())
    keys = arranged.keys
    total = len(keys)
    chaos = Chaos(error_rate=0.05, seed=11)
    started = time.monotonic()
    recoveries: list[float] = []
    status_checks = 0
    held_at_kills: list[Key] = []  # items a killed worker was running: attempts counted
    in_flight_at_term: list[int] = []
    with (
        ScriptedLLM(chat=chaos, latency=0.08) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        base = pipeline_env(database_url, tmp_path, [server], embed)
        base["SOKRATOS_CONCURRENCY"] = "4"
        # A kill or two plus a 500 must not dead-letter an item.
        base["SOKRATOS_MAX_ATTEMPTS"] = str(MAX_ATTEMPTS)
        fleet = Fleet(base, tmp_path)
        try:
            for name in ("a", "b", "c"):
                fleet.start(name)

            def reach(fraction: float) -> None:
                target = int(total * fraction)
                assert wait_until(
                    lambda: dbh.outcomes() >= target or not fleet.alive(), timeout=90
                ), fleet.logs()
                assert fleet.alive(), fleet.logs()
                assert dbh.outcomes() < total, "the drain finished too early: slow the model"

            def status_lists_live(expect_absent: frozenset[int] = frozenset()) -> None:
                nonlocal status_checks
                live = {name: p.pid for name, p in fleet.procs.items() if p.poll() is None}
                workers: list[dict[str, Any]] = []

                def listed() -> bool:  # a worker just started shows from its first heartbeat
                    workers[:] = _status(fleet.env("a"))
                    shown = {int(w["pid"]) for w in workers if w["state"] == "running"}
                    return set(live.values()) <= shown

                wait_until(listed, timeout=30, interval=0.5)
                by_pid = {int(w["pid"]): w for w in workers}
                for name, pid in live.items():
                    assert pid in by_pid, (name, pid, workers)
                    w = by_pid[pid]
                    assert w["state"] == "running", w
                    assert not w.get("overdue"), w
                    assert f"@{name}:" in w["worker_id"], w
                for pid in expect_absent:
                    assert pid not in by_pid, (pid, workers)
                status_checks += 1

            def kill_and_replace(name: str) -> None:
                conn = dbh.get()
                pid = fleet.kill9(name)
                killed_at = time.monotonic()
                held = _leased_by(conn, pid)
                held_at_kills.extend(held)
                fleet.start(name)
                assert wait_until(lambda: _recovered(conn, pid), timeout=30), (held, fleet.logs())
                recoveries.append(time.monotonic() - killed_at)

            # All three up and claiming: status shows them, each running.
            assert wait_until(
                lambda: len([w for w in _status(fleet.env("a")) if w["state"] == "running"]) >= 3,
                timeout=60,
            ), fleet.logs()
            reach(0.10)
            status_lists_live()

            kill_and_replace("a")  # kill -9 #1
            reach(0.22)
            # Rolling restart: b, SIGTERM mid-drain, exits 0, starts again.
            b_pid = fleet.procs["b"].pid
            in_flight_at_term.append(len(_leased_by(dbh.get(), b_pid)))
            assert fleet.term("b") == 0, tail(fleet.log("b"))
            fleet.start("b")
            assert wait_until(
                lambda: fleet.procs["b"].pid in {int(w["pid"]) for w in _status(fleet.env("a"))},
                timeout=30,
            ), fleet.logs()
            status_lists_live(expect_absent={b_pid})  # a stopped worker is not listed

            reach(0.35)
            kill_and_replace("a")  # kill -9 #2

            reach(0.45)
            dbh.close()
            restart_postgres(6.0)
            back = time.monotonic()
            assert fleet.alive(), "a worker died with the database: " + fleet.logs()
            before = dbh.outcomes()
            assert wait_until(lambda: dbh.outcomes() > before, timeout=60), fleet.logs()
            pg_recover = time.monotonic() - back
            status_lists_live()

            reach(0.60)
            kill_and_replace("a")  # kill -9 #3
            reach(0.70)
            # Rolling restart, the second half: c.
            in_flight_at_term.append(len(_leased_by(dbh.get(), fleet.procs["c"].pid)))
            assert fleet.term("c") == 0, tail(fleet.log("c"))
            fleet.start("c")
            status_lists_live()

            assert wait_until(lambda: dbh.outcomes() >= total or not fleet.alive(), timeout=120), (
                fleet.logs()
            )
            assert fleet.alive(), fleet.logs()
        finally:
            fleet.stop_all()
    elapsed = time.monotonic() - started

    logs = "".join(fleet.log(n).read_text(errors="replace") for n in ("a", "b", "c"))
    assert "waiting_for_database" in logs, "the restart of PostgreSQL was not noticed"
    assert logs.count('"worker_stopped"') == len([e for e in fleet.exits if e[3] != "SIGKILL"])
    db = dbh.get()
    # Exit codes: every SIGTERM a clean 0, every kill -9 a -9.
    for name, pid, code, how in fleet.exits:
        expected = -9 if how == "SIGKILL" else 0
        assert code == expected, (name, pid, code, how, tail(fleet.log(name)))
    assert sum(1 for e in fleet.exits if e[3] == "SIGKILL") == 3

    fig = assert_exactly_once(db, keys)
    # One memory per origin, and origins of one item never repeat (checked above); also: no
    # item wrote memories under two different attempts' worth of outcomes.
    outcomes = {
        (q, i): o for q, i, o in db.execute("SELECT queue, item_id, outcome FROM work_outcomes")
    }
    failures = failed_payloads(db)
    attempts = {
        (q, i): n for q, i, n in db.execute("SELECT queue, item_id, attempts FROM work_outcomes")
    }
    for key in arranged.invalid:
        assert outcomes[key] == "failed", key
        assert failures[key][1] == arranged.payloads[key], (key, failures[key])
    for key in arranged.poison_triage:
        assert outcomes[key] == "failed", (key, outcomes[key])
        assert failures[key][1] == arranged.payloads[key], (key, failures[key])
    # A poison item's every attempt, whichever worker ran it, is in its dead letter's history.
    history = {
        (str(q), int(i)): (n, h)
        for q, i, n, h in db.execute(
            "SELECT source_queue, item_id, attempts, context_data -> 'attempts'"
            " FROM failed_operations"
        )
    }
    gaps = 0  # attempts counted but not in a history
    for key in arranged.poison_triage:
        n, h = history[key]
        assert n == attempts[key] == MAX_ATTEMPTS, (key, n, attempts[key])
        # Each attempt has its entry, with its ``at``, in order: one that died with its
        # worker too (recorded by the claim that took its expired lease over).
        assert isinstance(h, list) and all(isinstance(e, dict) and e.get("at") for e in h), h
        assert [e["attempt"] for e in h] == list(range(1, MAX_ATTEMPTS + 1)), (key, h)
        gaps += MAX_ATTEMPTS - len(h)
    for key in arranged.poison_distill:
        assert outcomes[key] == "archived", (key, outcomes[key])
        assert failures[key][1] == arranged.payloads[key], (key, failures[key])
    # Every dead letter carries its payload, equal to what was enqueued.
    for key, (error, payload) in failures.items():
        assert key in arranged.payloads, key
        assert payload == arranged.payloads[key], (key, error, payload)
    # Items that are neither poison nor invalid end well (chaos 500s were retried).
    bad = set(arranged.invalid) | set(arranged.poison_triage)
    wrong = {k: outcomes[k] for k in keys if k not in bad and outcomes[k] == "failed"}
    assert not wrong, {k: failures.get(k) for k in wrong}
    # The attempt a kill -9 cut short is counted (production.md §9): every item the killed
    # worker held ended with at least two attempts.
    assert held_at_kills, "no kill caught an item in flight: the kills tested nothing"
    uncounted = {k: attempts[k] for k in held_at_kills if (attempts[k] or 0) < 2}
    assert not uncounted, uncounted
    died = db.execute(
        "SELECT count(*) FROM work_outcomes WHERE detail LIKE '%worker died%'"
    ).fetchone()
    memories = db.execute("SELECT count(*) FROM memories").fetchone()
    dbh.close()
    report(
        "three_workers_kill9x3_rolling_pg_restart",
        fig,
        recoveries,
        pg_recover_s=round(pg_recover, 2),
        dead_letters=len(failures),
        died_on_last_attempt=died[0] if died else 0,
        memories=memories[0] if memories else 0,
        status_checks=status_checks,
        held_at_kills=len(held_at_kills),
        history_gaps=gaps,
        in_flight_at_sigterm=in_flight_at_term,
        exits=[(n, c) for n, _, c, _ in fleet.exits],
        injected=chaos.injected,
        elapsed_s=round(elapsed, 1),
    )
