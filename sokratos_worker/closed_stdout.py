"""A stdout whose reader went away (``status | head -1``): telling it from other broken pipes,
and writing on into nothing."""

from __future__ import annotations

import os
import select
import sys


def reader_gone() -> bool:
    """True when stdout's reader has gone, so the BrokenPipeError was stdout's."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (tests)
        return False
    if not hasattr(select, "poll"):
        return True  # no poll to ask (Windows): the error is taken at its word
    poller = select.poll()
    poller.register(descriptor, 0)
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))


def discard_stdout() -> None:
    """Point fd 1 at /dev/null, the Python docs' recipe: what is still buffered, and what is
    printed later, goes nowhere instead of raising again (at interpreter shutdown too)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def print_on(text: str) -> None:
    """``print``, for a command that must finish what it changes even when the reader has
    gone (``failed retry --all | head -1``): the rest of its output is discarded."""
    try:
        print(text)
    except BrokenPipeError:
        if not reader_gone():
            raise
        discard_stdout()
