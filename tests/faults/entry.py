"""``python -m tests.faults.entry run``: the real daemon with the production pipelines.

Configured only by the environment (SOKRATOS_LLM_BACKENDS, SOKRATOS_EMBEDDING_*), exactly as
a deployment is; the scenarios point it at ScriptedLLM servers.
"""

from __future__ import annotations

import sys

from sokratos_worker.cli import main as cli_main

if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
