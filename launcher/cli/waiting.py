"""`--wait`: a launch onto nodes another account's job holds (launcher.core.holds.HeldError) tries
again every WAIT_POLL_S instead of refusing, with a progress line on stderr (at once, then once a
minute) naming whose job it waits for. Each try is a whole check: nothing starts on any node
until every node is free."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from rich.markup import escape

from launcher.cli.render import err
from launcher.core.holds import HeldError

__all__ = ["WAIT_POLL_S", "waiting"]

T = TypeVar("T")

WAIT_POLL_S = 5.0  # one check of every node per try: a few SSH sessions riding open connections
PROGRESS_EVERY = 12  # tries between progress lines: one a minute


def waiting(call: Callable[[], T], wait: bool) -> T:
    """`call()`; with `wait`, again after each HeldError until it passes."""
    t0, tries = time.monotonic(), 0
    while True:
        try:
            return call()
        except HeldError as e:
            if not wait:
                raise
            whose = "; ".join(h.line(nodes) for h, nodes in e.holds.items())
            if tries % PROGRESS_EVERY == 0:  # a line, not a spinner: the caller's own may be on
                waited = time.monotonic() - t0
                err.print(f"[dim]waiting for the nodes ({waited:.0f} s so far): {escape(whose)}[/dim]")
            tries += 1
            time.sleep(WAIT_POLL_S)
