"""A private Dovecot on 127.0.0.1 for the email tests: IMAP (plain + STARTTLS) and IMAPS.

Everything lives in one temporary directory: config, passwd-file, maildirs, sockets, state,
log and a self-signed certificate. As root, Dovecot's login processes run as ``dovenull``
and mail is owned by ``dovecot`` (both created by Debian's dovecot-core), because Dovecot
refuses to run login processes or mail access as root; as any other user, everything runs
as that user.
"""

from __future__ import annotations

import contextlib
import imaplib
import os
import pwd
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sokratos_worker.config import EmailAccountConfig, Settings

# Builds an account on the test Dovecot; keyword arguments override the defaults.
AccountFactory = Callable[..., EmailAccountConfig]

USER = "alice"
PASSWORD = "correct horse battery staple"
# A second login whose password is not ASCII (sent with SASL PLAIN, not LOGIN).
UTF8_USER = "bjorn"
UTF8_PASSWORD = "pässwörd-ø"
# A third whose name needs quoting in LOGIN (an Exchange-style domain\user, a space).
QUOTED_USER = "corp\\alice smith"  # (lower case: Dovecot lowercases names)
QUOTED_PASSWORD = "open sesame"


def _passwd_file_name(user: str) -> str:
    """``user`` as passwd-file keys it: Dovecot escapes a backslash in the name it looks up."""
    return user.replace("\\", "\\\\")


def dovecot_binary() -> str | None:
    """The dovecot executable, if installed (Debian puts it in /usr/sbin)."""
    return shutil.which("dovecot") or next(
        (p for p in ("/usr/sbin/dovecot", "/usr/local/sbin/dovecot") if os.path.exists(p)), None
    )


def _free_ports(count: int) -> list[int]:
    """Distinct free ports: every socket stays bound until all are picked, so none repeats."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _users() -> tuple[str, str, int, int]:
    """(login user, internal user, mail uid, mail gid) for the current privileges."""
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid())
        return me.pw_name, me.pw_name, me.pw_uid, me.pw_gid
    internal = pwd.getpwnam("dovecot")
    login = "dovenull"
    try:
        pwd.getpwnam(login)
    except KeyError:
        login = "nobody"
    return login, internal.pw_name, internal.pw_uid, internal.pw_gid


def _make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "2",
            "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@dataclass
class Dovecot:
    """A running Dovecot: ports, the CA file that trusts its certificate, and IMAP helpers."""

    root: Path
    imap_port: int
    imaps_port: int
    ca_file: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, binary: str, attempts: int = 3) -> Dovecot:
        """Start one, on fresh ports again if another process took a port before Dovecot bound it."""
        for attempt in range(1, attempts + 1):
            try:
                return cls._start_once(binary)
            except RuntimeError as error:
                if attempt == attempts or "Address already in use" not in str(error):
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, binary: str) -> Dovecot:
        root = Path(tempfile.mkdtemp(prefix="sokratos-dovecot-"))
        root.chmod(0o755)  # the mail user must be able to reach its maildir
        login_user, internal_user, uid, gid = _users()
        for sub in ("run", "state", "mail"):
            (root / sub).mkdir()
        os.chown(root / "mail", uid, gid)
        cert, key = _make_certificate(root)
        (root / "passwd").write_text(
            f"{USER}:{{PLAIN}}{PASSWORD}::::\n{UTF8_USER}:{{PLAIN}}{UTF8_PASSWORD}::::\n"
            f"{_passwd_file_name(QUOTED_USER)}:{{PLAIN}}{QUOTED_PASSWORD}::::\n",
            encoding="utf-8",
        )
        imap_port, imaps_port = _free_ports(2)
        server = cls(root, imap_port, imaps_port, cert)
        (root / "dovecot.conf").write_text(
            f"""
protocols = imap
listen = 127.0.0.1
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
info_log_path = {root}/dovecot.log
ssl = yes
ssl_cert = <{cert}
ssl_key = <{key}
disable_plaintext_auth = no
auth_mechanisms = plain login
auth_failure_delay = 0
# Any character in a user name, as Exchange takes domain-backslash-user (QUOTED_USER).
auth_username_chars =
login_trusted_networks = 127.0.0.1
default_login_user = {login_user}
default_internal_user = {internal_user}
default_internal_group = {internal_user}
first_valid_uid = {min(uid, 100)}
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {root}/passwd
}}
userdb {{
  driver = static
  args = uid={uid} gid={gid} home={root}/mail/%u
}}
mail_location = maildir:~/Maildir
service imap-login {{
  chroot =
  inet_listener imap {{
    address = 127.0.0.1
    port = {server.imap_port}
  }}
  inet_listener imaps {{
    address = 127.0.0.1
    port = {server.imaps_port}
    ssl = yes
  }}
}}
service anvil {{
  chroot =
}}
"""
        )
        log = (root / "stderr.log").open("wb")
        server.process = subprocess.Popen(
            [binary, "-F", "-c", str(root / "dovecot.conf")], stdout=log, stderr=log
        )
        server._wait_ready()
        return server

    def _wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                break
            try:
                client = self.client()
            except (OSError, imaplib.IMAP4.error):
                time.sleep(0.1)
                continue
            client.logout()
            return
        logs = self.logs()  # read before stop() removes the directory they live in
        self.stop()
        raise RuntimeError(f"dovecot did not start:\n{logs}")

    def logs(self) -> str:
        parts = []
        for name in ("stderr.log", "dovecot.log"):
            path = self.root / name
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- IMAP helpers for arranging and asserting mailbox state -----------------------

    def client(self) -> imaplib.IMAP4:
        """A logged-in plaintext client (the tests' own, not the code under test)."""
        client = imaplib.IMAP4("127.0.0.1", self.imap_port, timeout=10)
        client.login(USER, PASSWORD)
        return client

    def create_mailbox(self, name: str) -> None:
        with contextlib.closing(_Closer(self.client())) as c:
            typ, data = c.imap.create(name)
            assert typ == "OK", data

    def delete_mailbox(self, name: str) -> None:
        with contextlib.closing(_Closer(self.client())) as c:
            typ, data = c.imap.delete(name)
            assert typ == "OK", data

    def append(
        self, mailbox: str, raw: bytes, *, when: datetime | None = None, flags: str = ""
    ) -> None:
        """APPEND a message; ``when`` sets its INTERNALDATE (arrival date)."""
        date = imaplib.Time2Internaldate(when.timestamp() if when else time.time())
        with contextlib.closing(_Closer(self.client())) as c:
            typ, data = c.imap.append(mailbox, f"({flags})" if flags else None, date, raw)
            assert typ == "OK", data

    def uidvalidity(self, mailbox: str) -> int:
        with contextlib.closing(_Closer(self.client())) as c:
            c.imap.select(mailbox, readonly=True)
            _, data = c.imap.response("UIDVALIDITY")
            assert data[0] is not None
            return int(data[0])

    def flags(self, mailbox: str) -> dict[int, str]:
        """UID → FLAGS text of every message, read with EXAMINE so reading changes nothing."""
        with contextlib.closing(_Closer(self.client())) as c:
            typ, _ = c.imap.select(mailbox, readonly=True)
            assert typ == "OK"
            typ, data = c.imap.uid("FETCH", "1:*", "(UID FLAGS)")
            out: dict[int, str] = {}
            for line in data:
                if isinstance(line, bytes):
                    text = line.decode()
                    uid = int(text.split("UID ")[1].split()[0].rstrip(")"))
                    flags = text.split("FLAGS (")[1].split(")")[0].split()
                    # \Recent is per session, not a stored flag: leave it out of comparisons.
                    out[uid] = " ".join(sorted(f for f in flags if f != "\\Recent"))
            return out

    def maildir(self, mailbox: str) -> Path:
        """The Maildir folder that holds ``mailbox`` on disk."""
        path = self.root / "mail" / USER / "Maildir" / f".{mailbox}"
        assert path.is_dir(), path
        return path

    def backup(self, mailbox: str, to: Path) -> None:
        """Copy the mailbox's folder to ``to`` with ``cp -a``, as a backup does (owners kept)."""
        subprocess.run(["cp", "-a", str(self.maildir(mailbox)), str(to)], check=True)

    def restore(self, mailbox: str, backup: Path) -> None:
        """Put the folder ``backup()`` copied back in place of the mailbox's, as restoring a
        backup does: UIDVALIDITY stays, the UIDs handed out since are handed out again."""
        folder = self.maildir(mailbox)
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        subprocess.run(["cp", "-a", str(backup), str(folder)], check=True)

    def tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


class _Closer:
    def __init__(self, imap: imaplib.IMAP4) -> None:
        self.imap = imap

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.imap.logout()


def make_settings(*accounts: EmailAccountConfig, **overrides: Any) -> Settings:
    """Settings for a check: the accounts, every check due, a one-day lookback."""
    values: dict[str, Any] = {
        "email_accounts": list(accounts),
        "email_check_interval": 300,
        "email_initial_lookback": 86400,
    }
    values.update(overrides)
    return Settings(**values)
