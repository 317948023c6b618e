"""A collective sweep's table on the terminal: launcher.nccl.render's rows (data) drawn as a
rich Table, wrong results in red. About 110 columns wide; rich wraps its cells on a narrower
console."""

from __future__ import annotations

from rich.table import Table

from gpufleet.contracts import SweepRow
from launcher.nccl.render import TABLE_COLUMNS, table_rows

__all__ = ["rich_table"]


def rich_table(rows: list[SweepRow]) -> Table:
    """The rows as a rich table, one line per row, wrong results in red."""
    t = Table(title="collective sweep")
    for name, right in TABLE_COLUMNS:
        t.add_column(name, justify="right" if right else "left")
    for cells, wrong in table_rows(rows):
        t.add_row(*cells, style="red" if wrong else None)
    return t
