"""The exit codes every ``sokratos-worker`` command ends with, and nothing else.

The contract allows only these four: 0 success, 1 anything else (usage errors too), 75 the
database unreachable or read-only (a temporary failure: try again later), 78 bad configuration.
They live apart from ``cli.py`` so that the command modules it imports can use them without
an import cycle; ``cli.py`` re-exports them.
"""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_TEMPFAIL = 75
EXIT_CONFIG = 78
