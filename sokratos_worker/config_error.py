"""The one error a bad configuration raises, kept apart so every config module can raise it.

:class:`ConfigError` names the variable to fix and says why; the CLI prints it as one line
and exits 78. It lives in its own module so that :mod:`sokratos_worker.config` and the
modules it builds on (:mod:`~sokratos_worker.config_sources`,
:mod:`~sokratos_worker.config_validators`) can all raise it without importing one another in a
cycle; :mod:`sokratos_worker.config` re-exports it, and that is where callers import it from.
"""

from __future__ import annotations


class ConfigError(Exception):
    """Invalid configuration: ``variable`` names what to fix, ``message`` says why."""

    heading = "invalid configuration"  # what the CLI's line calls it (before the message)

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message
