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
