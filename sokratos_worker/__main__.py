"""``python -m sokratos_worker`` is the same as the ``sokratos-worker`` command."""

from sokratos_worker.cli import main

raise SystemExit(main())
