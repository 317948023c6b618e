"""`launch`, the click edge: the group and its command table (main), one module per command
(cmd_*), the options every command shares (options) and what the user sees (render). click and
rich live here only."""

from __future__ import annotations

from launcher.cli.main import main

__all__ = ["main"]
