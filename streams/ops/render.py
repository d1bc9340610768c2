"""Tables for the command line: rich on a terminal, plain aligned text when piped.

A `Table` has a title, column names and rows of already-formatted cells. Column names are the
keys of the same figures in the commands' ``--json`` output, in capitals, so a script and a
person read the same names. Formatting helpers turn milliseconds into human ages and
timestamps; they are pure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ..cli_params import LAST_DATE_MS

if TYPE_CHECKING:
    from ..types import GroupRow, StreamPositions

__all__ = [
    "Table",
    "age",
    "positions_tables",
    "print_tables",
    "render_plain",
    "sparkline",
    "timestamp",
]

_BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    #: Columns aligned to the right (numbers).
    numeric: frozenset[str] = frozenset()


def format_duration_ms(ms: int) -> str:
    """Milliseconds as a duration that ``--key-window`` and the like read back: ``24h``,
    ``1h30m``, ``250ms`` (hours at most, so a day reads ``24h``)."""
    parts = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0ms"


def age(ms: int | float | None) -> str:
    """``850ms``, ``12.5s``, ``3m20s``, ``2h05m``, ``3d04h``; ``-`` for None."""
    if ms is None:
        return "-"
    if ms < 0:
        return f"-{age(-ms)}"
    if ms < 1000:
        return f"{int(ms)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def timestamp(ms: int) -> str:
    """ms since the Unix epoch as ``2026-11-23 09:12:03.123Z`` (UTC); beyond the year 9999
    (an ``uncapped`` stream accepts any client timestamp), the number itself."""
    if not 0 <= ms <= LAST_DATE_MS:
        return f"{ms} ms"
    moment = dt.datetime.fromtimestamp(ms // 1000, dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}Z"


def sparkline(values: Sequence[float]) -> str:
    """One block character per value, scaled between 0 and the largest value."""
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return _BLOCKS[0] * len(values)
    return "".join(_BLOCKS[min(7, int(v / top * 7.999))] for v in values)


def render_plain(tables: Sequence[Table]) -> str:
    """Aligned text, one block per non-empty table, for pipes and logs."""
    blocks = []
    for table in tables:
        if not table.rows:
            continue
        widths = [
            max([len(c), *(len(str(r[i])) for r in table.rows)])
            for i, c in enumerate(table.columns)
        ]
        lines = []
        for cells in [table.columns, *table.rows]:
            parts = [
                str(cell).rjust(w) if col in table.numeric else str(cell).ljust(w)
                for cell, w, col in zip(cells, widths, table.columns, strict=True)
            ]
            lines.append("  ".join(parts).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def rich_renderable(tables: Sequence[Table]) -> Any:
    """The tables as one rich renderable (for a terminal, or `rich.live.Live`)."""
    from rich.console import Group
    from rich.table import Table as RichTable

    parts = []
    for table in tables:
        if not table.rows:
            continue
        rich_table = RichTable(title=table.title, title_justify="left", expand=False)
        for column in table.columns:
            rich_table.add_column(column, justify="right" if column in table.numeric else "left")
        for row in table.rows:
            rich_table.add_row(*(str(cell) for cell in row))
        parts.append(rich_table)
    return Group(*parts)


def print_tables(tables: Sequence[Table], out: IO[str], *, terminal: bool) -> None:
    """Print rich tables on a terminal, plain text otherwise."""
    if terminal:
        from rich.console import Console

        Console(file=out).print(rich_renderable(tables))
    else:
        text = render_plain(tables)
        if text:
            out.write(text + "\n")


def _group_state(group: GroupRow) -> str:
    """``stale`` (idle past the stale-after time, holding retention back: delete it if its
    reader is gone), ``holds retention`` (the same, but it committed recently), or empty."""
    if group.stale:
        return "stale"
    return "holds retention" if group.holds_retention else ""


def _consumer(group: GroupRow) -> list[str]:
    """GENERATION, TAKEN_AGE_MS (since the group last changed hands) and OWNER: ``-`` for a
    group no consumer opened since generations exist."""
    if group.generation is None:
        return ["-", "-", "-"]
    return [str(group.generation), age(group.taken_age_ms), group.owner or "-"]


def positions_tables(
    items: Sequence[StreamPositions],
    show_all: bool,
    rates: Mapping[str, Sequence[float]] | None = None,
) -> list[Table]:
    """The streams, writers and groups tables of `streams positions` (and the demo's view);
    ``rates`` (facts/s samples per stream) adds a RATE column with a sparkline."""
    streams_table = Table(
        "streams",
        [
            "STREAM",
            "LINEAR",
            "MAX_ALLOCATED",
            "SCRATCHPAD",
            "OLDEST_PENDING_MS",
            "PRUNED_THROUGH",
            "KEY_WINDOW",
        ]
        + (["RATE"] if rates is not None else []),
        numeric=frozenset(
            {"LINEAR", "MAX_ALLOCATED", "SCRATCHPAD", "OLDEST_PENDING_MS", "PRUNED_THROUGH"}
        ),
    )
    writers = Table(
        "writers",
        ["STREAM", "WRITER", "POSITION", "PENDING", "STATE", "HEARTBEAT_AGE_MS"],
        numeric=frozenset({"POSITION", "PENDING", "HEARTBEAT_AGE_MS"}),
    )
    groups = Table(
        "reader groups and Spark queries",
        ["STREAM", "GROUP", "POSITION", "LAG", "LAG_MS", "IDLE_MS", "GENERATION", "TAKEN_AGE_MS",
         "OWNER", "STATE"],
        numeric=frozenset({"POSITION", "LAG", "LAG_MS", "IDLE_MS", "GENERATION", "TAKEN_AGE_MS"}),
    )  # fmt: skip
    for p in items:
        row = [p.stream, str(p.linear), str(p.max_allocated), str(p.scratchpad)]
        row += [age(p.oldest_pending_ms), str(p.pruned_through)]
        row.append(format_duration_ms(p.key_window_ms))
        if rates is not None:
            history = rates.get(p.stream, [])
            now = f"{history[-1]:,.0f}/s" if history else "-"
            row.append(f"{now} {sparkline(history[-20:])}")
        streams_table.rows.append(row)
        for name, w in sorted(p.writers.items()):
            if w.retired and not show_all:
                continue
            writers.rows.append(
                [p.stream, name, str(w.position), str(w.pending), w.state, age(w.heartbeat_age_ms)]
            )
        for g in p.groups:
            lags = [str(g.lag), age(g.lag_ms), age(g.idle_ms)]
            groups.rows.append(
                [p.stream, g.group, str(g.position), *lags, *_consumer(g), _group_state(g)]
            )
    return [streams_table, writers, groups]
