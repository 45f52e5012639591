"""deploy/install.sh: syntax, --help, and a staged run under --prefix (no /opt, no /etc)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "install.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False, timeout=60
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_syntax() -> None:
    result = subprocess.run(
        ["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False, timeout=30
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck() -> None:
    result = subprocess.run(
        ["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout


def test_help() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for word in ("--prefix", "--python", "--skip-venv", "/opt/sokratos-worker", "daemon-reload"):
        assert word in result.stdout


def test_unknown_option_is_refused() -> None:
    result = _run("--frobnicate")
    assert result.returncode == 2
    assert "unknown option" in result.stderr


def test_staged_install_is_idempotent(tmp_path: Path) -> None:
    first = _run("--prefix", str(tmp_path), "--skip-venv")
    assert first.returncode == 0, first.stderr
    assert "not calling systemctl" in first.stdout

    units = tmp_path / "etc" / "systemd" / "system"
    for unit in ("sokratos-worker.service", "sokratos-worker@.service"):
        assert (units / unit).read_text() == (REPO / "systemd" / unit).read_text()
        dropin = units / f"{unit}.d" / "credentials.conf"
        assert "[Service]" in dropin.read_text()
        assert "LoadCredential=" not in dropin.read_text()  # no secrets yet

    etc = tmp_path / "etc" / "sokratos-worker"
    env = etc / "env"
    assert _mode(env) == 0o640
    assert env.read_text() == (REPO / "deploy" / "sokratos-worker.env.example").read_text()
    creds = etc / "credentials"
    assert _mode(creds) == 0o700
    assert "LoadCredential" in (creds / "README").read_text()

    # An operator edits the env file and adds a secret; the second run keeps the one and
    # passes the other on.
    env.write_text("SOKRATOS_CONCURRENCY=8\n")
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://example/db\n")
    (creds / "bad name").write_text("x")
    second = _run("--prefix", str(tmp_path), "--skip-venv")
    assert second.returncode == 0, second.stderr
    assert env.read_text() == "SOKRATOS_CONCURRENCY=8\n"
    assert _mode(creds / "SOKRATOS_DATABASE_URL") == 0o600
    for unit in ("sokratos-worker.service", "sokratos-worker@.service"):
        lines = (units / f"{unit}.d" / "credentials.conf").read_text().splitlines()
        assert (
            "LoadCredential=SOKRATOS_DATABASE_URL:"
            "/etc/sokratos-worker/credentials/SOKRATOS_DATABASE_URL"
        ) in lines
        assert not any("bad name" in line or "README" in line for line in lines)
    assert "skipped credential bad name" in second.stdout
    # The roles.sql to run is named as on the target, wherever the operator stands: with no
    # staged venv, by the target's venv (tests/service/test_install_roles_path.py runs it).
    roles = next(line for line in second.stdout.splitlines() if "roles.sql" in line and "-f" in line)
    path = roles.split("-f", 1)[1].strip()
    assert path.startswith('"$(/opt/sokratos-worker/venv/bin/python -I -c '), roles
    assert str(REPO) not in path and str(tmp_path) not in path, roles


@pytest.mark.parametrize(
    ("source", "requirement"),
    [
        ("sokratos-worker==0.1.0", "sokratos-worker[local]==0.1.0"),
        ("sokratos-worker>=0.1,<0.2", "sokratos-worker[local]>=0.1,<0.2"),
        ("sokratos-worker[demo]~=0.1", "sokratos-worker[demo,local]~=0.1"),
        ("sokratos-worker", "sokratos-worker[local]"),
        (
            "./dist/sokratos_worker-0.1.0-py3-none-any.whl",
            "./dist/sokratos_worker-0.1.0-py3-none-any.whl[local]",
        ),
        ("/srv/src/sokratos-worker", "/srv/src/sokratos-worker[local]"),
        (
            "https://example.org/sokratos_worker-0.1.0.whl",
            "sokratos-worker[local] @ https://example.org/sokratos_worker-0.1.0.whl",
        ),
        (
            "sokratos-worker @ git+https://example.org/w.git@v0.1.0",
            "sokratos-worker[local] @ git+https://example.org/w.git@v0.1.0",
        ),
    ],
)
def test_extras_go_where_pip_reads_them(tmp_path: Path, source: str, requirement: str) -> None:
    """`--extras local sokratos-worker==0.1.0` once asked pip for `sokratos-worker==0.1.0[local]`."""

    venv_bin = tmp_path / "opt" / "sokratos-worker" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    asked = tmp_path / "pip-args"
    # The venv exists already (so it is not created): its python records what pip was asked
    # (and nothing else: the script also asks it where roles.sql is).
    (venv_bin / "python").write_text(
        f'#!/bin/sh\n[ "$1" = -m ] && printf "%s\\n" "$@" >> {asked}\nexit 0\n'
    )
    (venv_bin / "sokratos-worker").write_text("#!/bin/sh\nexit 0\n")
    for script in venv_bin.iterdir():
        script.chmod(0o755)
    result = _run(
        "--prefix", str(tmp_path), "--python", sys.executable, "--extras", "local", source
    )
    assert result.returncode == 0, result.stderr
    upgrade = ["-m", "pip", "install", "--quiet", "--upgrade", requirement]
    # A wheel is installed again at the same version (every build is 0.1.0).
    again = ["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", requirement]
    expected = upgrade + (again if source.endswith(".whl") else [])
    assert asked.read_text().splitlines() == expected
    assert f"installing {requirement}" in result.stdout


def test_the_env_example_with_every_line_uncommented_can_be_sourced_by_a_shell() -> None:
    """docs/production.md §8 sources the env file in bash: every example value must survive."""
    example = (REPO / "deploy" / "sokratos-worker.env.example").read_text()
    uncommented = "\n".join(
        line[1:] if line.startswith("#SOKRATOS_") else line for line in example.splitlines()
    )
    result = subprocess.run(
        ["bash", "-c", 'set -ea; eval "$1"; printf "%s" "$SOKRATOS_EMBEDDING_SUFFIX"', "-",
         uncommented],
        capture_output=True, text=True, check=False, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "<|endoftext|>"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_staged_venv_names_where_the_unit_runs_it(tmp_path: Path) -> None:
    # pip wrote the staging directory into the launcher's #! line: once the staged tree was
    # copied to /, the unit's ExecStart=/opt/sokratos-worker/venv/bin/sokratos-worker failed
    # (203/EXEC). A real venv and pip install, from a clean copy of the checkout.

    clone = tmp_path / "clone"
    shutil.copytree(
        REPO, clone, ignore=shutil.ignore_patterns("__pycache__", "_review", ".git", "*.pyc")
    )
    stage = tmp_path / "stage"
    done = subprocess.run(
        ["bash", str(clone / "deploy" / "install.sh"), "--prefix", str(stage),
         "--python", sys.executable],
        capture_output=True, text=True, check=False, timeout=540, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    venv_bin = stage / "opt" / "sokratos-worker" / "venv" / "bin"
    launcher = (venv_bin / "sokratos-worker").read_text("utf-8").splitlines()[0]
    assert launcher == "#!/opt/sokratos-worker/venv/bin/python", launcher
    naming_stage = [p.name for p in venv_bin.iterdir()
                    if p.is_file() and str(stage) in p.read_text("utf-8", errors="replace")]
    assert naming_stage == [], naming_stage
    # roles.sql is named where the copied tree has it: the staged file, without the prefix.
    roles = next(line for line in done.stdout.splitlines() if "roles.sql" in line and "-f" in line)
    path = roles.split(" -f ", 1)[1].strip().strip('"')
    assert path.startswith("/opt/sokratos-worker/venv/") and path.endswith("/roles.sql"), roles
    assert (stage / path.lstrip("/")).is_file(), roles
    # The venv itself still works in the staging root (its python is a link to the base's).
    assert subprocess.run(
        [str(venv_bin / "python"), "-c", "import sokratos_worker"], check=False, timeout=60
    ).returncode == 0


def test_a_second_staged_install_with_nothing_to_upgrade_succeeds(tmp_path: Path) -> None:
    venv_bin = tmp_path / "opt" / "sokratos-worker" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    # A venv whose pip has nothing to do (already satisfied): its python runs a script it is
    # given (the launcher's --version) and exits 0, and never rewrites the scripts, as pip
    # does not when the requirement is already installed.
    (venv_bin / "python").write_text("#!/bin/sh\nexit 0\n")
    # What pip wrote into the launcher in the staging root (its own venv's python).
    (venv_bin / "sokratos-worker").write_text(f"#!{venv_bin}/python\n# launcher\n")
    for script in venv_bin.iterdir():
        script.chmod(0o755)
    # (The launcher is checked through the venv's python: a re-run where pip has nothing to
    # do left the relocated launcher naming /opt/..., which failed with "does not run".)
    args = ("--prefix", str(tmp_path), "--python", sys.executable, "sokratos-worker==0.1.0")
    first = _run(*args)
    assert first.returncode == 0, first.stderr
    # The relocation happened (what fd8f410 wants).
    assert (venv_bin / "sokratos-worker").read_text().startswith(
        "#!/opt/sokratos-worker/venv/bin/python"
    )
    second = _run(*args)
    assert second.returncode == 0, second.stderr


def test_a_staged_install_prints_the_commands_as_they_run_once_copied(tmp_path: Path) -> None:
    # The staged launcher names /opt/... in its #! line: the printed migrate command, the
    # staged path, no longer existed once the tree was copied to / (nor ran before).
    stage = tmp_path / "stage"
    venv_bin = stage / "opt" / "sokratos-worker" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    staged_roles = stage / "opt" / "sokratos-worker" / "venv" / "lib" / "sql" / "roles.sql"
    staged_roles.parent.mkdir(parents=True)
    staged_roles.write_text("-- roles\n")
    # A venv whose pip has nothing to do; asked where roles.sql is, it names the staged file
    # (read from outside the venv's bin/, whose staged paths the relocation rewrites).
    (tmp_path / "roles-path").write_text(f"{staged_roles}\n")
    (venv_bin / "python").write_text(
        f'#!/bin/sh\n[ "$1" = -c ] && cat {tmp_path / "roles-path"}\nexit 0\n'
    )
    (venv_bin / "sokratos-worker").write_text(f"#!{venv_bin}/python\n# launcher\n")
    for script in venv_bin.iterdir():
        script.chmod(0o755)
    result = _run("--prefix", str(stage), "--python", sys.executable, "sokratos-worker==0.1.0")
    assert result.returncode == 0, result.stderr
    next_steps = result.stdout.split("install.sh: done. Next:")[1]
    assert (
        "SOKRATOS_DATABASE_URL='postgresql://OWNER@HOST/DB'"
        " /opt/sokratos-worker/venv/bin/sokratos-worker migrate"
    ) in next_steps, next_steps
    assert '-f "/opt/sokratos-worker/venv/lib/sql/roles.sql"' in next_steps, next_steps
    assert "once the tree is copied to /" in next_steps, next_steps
    step_2 = next_steps.split("  2. ")[1].split("  3. ")[0]
    assert str(stage) not in step_2, step_2


def test_a_wheel_is_installed_again_even_at_the_same_version(tmp_path: Path) -> None:
    # Every build is 0.1.0, and pip keeps an installed wheel of the same version: an upgrade
    # from a new wheel (docs/production.md §7) left the old code installed without a word.
    venv_bin = tmp_path / "opt" / "sokratos-worker" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    calls = tmp_path / "pip-calls"
    (venv_bin / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    (venv_bin / "sokratos-worker").write_text(f"#!{venv_bin}/python\n# launcher\n")
    for script in venv_bin.iterdir():
        script.chmod(0o755)
    wheel = tmp_path / "sokratos_worker-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    result = _run("--prefix", str(tmp_path), "--python", sys.executable, str(wheel))
    assert result.returncode == 0, result.stderr
    pip = [line for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    assert pip == [
        f"-m pip install --quiet --upgrade {wheel}",
        f"-m pip install --quiet --force-reinstall --no-deps {wheel}",
    ], pip
    # A name or a checkout is not reinstalled: pip upgrades a name, and rebuilds a directory.
    calls.unlink()
    assert _run("--prefix", str(tmp_path), "--python", sys.executable, "sokratos-worker").returncode == 0
    assert "--force-reinstall" not in calls.read_text()
