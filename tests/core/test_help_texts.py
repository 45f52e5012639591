"""`status --help` says when status does not exit 0; every `failed` action has a description."""

from __future__ import annotations

import argparse

from sokratos_worker.cli import build_parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found: argparse.ArgumentParser = commands.choices[name]
    return found


def test_status_help_names_the_refused_login_exit() -> None:
    text = " ".join(_subcommand(build_parser(), "status").format_help().split())
    assert "exits 0 even when the database is unreachable (78 when the server refuses the login)" in text


def test_every_failed_action_has_a_description() -> None:
    failed = _subcommand(build_parser(), "failed")
    for action in ("list", "show", "retry", "purge"):
        assert _subcommand(failed, action).description, action


def test_check_help_names_every_line_check_prints() -> None:
    # `check` prints a `sessions` line (a transaction pooler in between); its help left it out.
    text = " ".join(_subcommand(build_parser(), "check").format_help().split())
    for line in ("configuration", "database", "pgvector", "connections", "sessions", "schema"):
        assert f"{line} (" in text or f"{line}," in text, line


def test_top_level_help_names_the_other_exit_75s() -> None:
    # `run` also exits 75 when its local model server keeps dying, and any command when the
    # server ends its transaction for a deadlock or lacks a resource: the help left both out.
    text = " ".join(build_parser().format_help().split())
    assert "the local model server kept dying" in text
    assert "deadlock" in text
