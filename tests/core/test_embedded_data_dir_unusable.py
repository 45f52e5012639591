"""With the embedded PostgreSQL (no URL), an unusable SOKRATOS_DATA_DIR is bad configuration.

It used to be blamed on the unset SOKRATOS_DATABASE_URL ("Check SOKRATOS_DATABASE_URL and that
PostgreSQL is running", exit 75 from enqueue; `run` exited 1, a restart loop under systemd).
Now: one line naming SOKRATOS_DATA_DIR and what is wrong, exit 78, for every command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sokratos_worker.config import ConfigError, load_settings
from tests.support.operator import REPO, cli_env, run_cli


@pytest.mark.parametrize("args", [["enqueue", "triage", "--exchange", "user: hi\nassistant: hello"], ["run", "--once"]])
def test_uncreatable_data_dir_is_named_as_configuration(tmp_path: Path, args: list[str]) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATA_DIR="/proc/sokratos-r3-review")
    done = run_cli(args, env)
    last = done.stderr.strip().splitlines()[-1]
    assert "SOKRATOS_DATABASE_URL" not in last, f"blames the unset URL: {last}"
    assert last.startswith(
        "sokratos-worker: invalid configuration: SOKRATOS_DATA_DIR: '/proc/sokratos-r3-review'"
        " cannot be created: /proc refuses a new directory"
    ), last
    assert done.returncode == 78, done.returncode


def _refusal(data_dir: Path | str, **more: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_settings({"SOKRATOS_DATA_DIR": str(data_dir), **more})
    assert caught.value.variable == "SOKRATOS_DATA_DIR"
    return caught.value


def test_a_path_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    error = _refusal(tmp_path / "file" / "data")
    assert f"{tmp_path / 'file'} is not a directory" in error.message


def test_a_directory_this_user_may_not_write_is_refused() -> None:
    # /proc/self exists and is not writable, also for root (whom a chmod would not stop).
    locked = Path("/proc/self")
    assert "is not writable by this user" in _refusal(locked).message
    assert "refuses a new directory" in _refusal(locked / "data").message


def test_a_creatable_data_dir_is_accepted_and_not_created_at_load(tmp_path: Path) -> None:
    wanted = tmp_path / "a" / "b"
    assert load_settings({"SOKRATOS_DATA_DIR": str(wanted)}).data_dir == wanted
    assert list(tmp_path.iterdir()) == []  # the probe left nothing behind


def test_with_a_database_url_the_data_dir_is_not_probed() -> None:
    settings = load_settings(
        {"SOKRATOS_DATA_DIR": "/proc/sokratos-r3-review", "SOKRATOS_DATABASE_URL": "postgresql://u@h/db"}
    )
    assert settings.data_dir == Path("/proc/sokratos-r3-review")  # only the spool would use it


# The database away, with no URL set; in a child: main() configures logging globally.
AWAY = """
from sokratos_worker import cli
from sokratos_worker.errors import DatabaseUnavailable

def away(*_):
    raise DatabaseUnavailable("the database did not answer")

cli._COMMANDS["status"] = away
raise SystemExit(cli.main(["status"]))
"""


def test_an_unreachable_embedded_database_is_not_blamed_on_the_url(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AWAY],
        env=cli_env(tmp_path),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 75, done.stderr
    said = done.stderr.strip()
    assert "SOKRATOS_DATABASE_URL" not in said
    assert said == (
        "sokratos-worker: the database did not answer. Check the embedded PostgreSQL under"
        f" {tmp_path / 'data' / 'postgres'} (no database URL is set) and that SOKRATOS_DATA_DIR"
        " is writable."
    )


def test_a_dangling_symlink_is_named_as_configuration(tmp_path: Path) -> None:
    """A disk not mounted: the probe called the link usable (it looked at the nearest existing
    parent), and `run` then exited 1 for ever with "[Errno 17] File exists"."""
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "unmounted-disk" / "sokratos")
    env = cli_env(tmp_path, SOKRATOS_DATA_DIR=str(link), SOKRATOS_STARTUP_TIMEOUT="2s")
    done = run_cli(["run", "--once"], env, timeout=90)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 78, (done.returncode, done.stderr[-1200:])
    assert last.startswith(
        f"sokratos-worker: invalid configuration: SOKRATOS_DATA_DIR: '{link}' is a symlink to"
        f" '{tmp_path / 'unmounted-disk' / 'sokratos'}', which does not exist (not mounted?)"
    ), last


def test_a_dangling_symlink_above_the_directory_is_named(tmp_path: Path) -> None:
    mount = tmp_path / "mnt"
    mount.symlink_to(tmp_path / "absent")
    problem = _refusal(mount / "sokratos" / "data")
    assert f"lies under '{mount}', a symlink to '{tmp_path / 'absent'}'" in problem.message
    assert "not mounted?" in problem.message


def test_a_symlink_to_a_directory_that_exists_is_fine(tmp_path: Path) -> None:
    target = tmp_path / "disk"
    target.mkdir()
    link = tmp_path / "data"
    link.symlink_to(target)
    assert load_settings({"SOKRATOS_DATA_DIR": str(link)}).data_dir == link
