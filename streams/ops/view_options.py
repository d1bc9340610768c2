"""``--like``, ``--limit`` and ``--sort``: the options of the listings a person reads (``streams
list``, ``positions``, ``groups list``), over `streams.store.overview` (issue 40).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..cli_params import MAX_ID
from ..store.overview import Overview

__all__ = ["LIKE_PATTERN", "TABLE_PAGE", "limited_note", "page", "truncation_note", "view_options"]

#: Rows a table shows when ``--limit`` is not given: a person reads a page (and at 10^4
#: streams a name-sorted page reads only its streams' sequences); ``--json`` lists all.
TABLE_PAGE = 100

F = TypeVar("F", bound=Callable[..., Any])


class LikePattern(click.ParamType[str]):
    """An SQL ``LIKE`` pattern (``%``, ``_``, ``\\`` escaping either): refused here when
    PostgreSQL would refuse it (a NUL, a trailing escape), so the error names the option."""

    name = "pattern"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text:
            self.fail("an empty pattern matches no stream (every stream: '%')", param, ctx)
        if "\x00" in text:
            self.fail("a pattern cannot hold a NUL character", param, ctx)
        if (len(text) - len(text.rstrip("\\"))) % 2:
            self.fail(f"{text!r} ends in an escape character (\\)", param, ctx)
        return text


LIKE_PATTERN = LikePattern()


def view_options(func: F) -> F:
    """Add ``--like PATTERN``, ``--limit N`` and ``--sort name|lag`` to a listing."""
    func = click.option(
        "--sort",
        type=click.Choice(["name", "lag"]),
        default="name",
        show_default=True,
        help="By stream name, or by lag (the largest reader-group lag first).",
    )(func)
    func = click.option(
        "--limit",
        type=click.IntRange(0, MAX_ID),
        help=f"Show the first N streams only (0: all). A table shows the first {TABLE_PAGE} "
        "unless given; --json lists all unless given.",
    )(func)
    func = click.option(
        "--like",
        type=LIKE_PATTERN,
        metavar="PATTERN",
        help="Only streams whose name matches this SQL LIKE pattern ('%' any text, '_' any "
        "one character; e.g. 'orders-%').",
    )(func)
    return func


def page(limit: int | None, as_json: bool) -> int | None:
    """The limit a listing applies (None: all): ``--limit`` as given (0: all), else a page of
    `TABLE_PAGE` for a table and everything for JSON."""
    if limit is None:
        return None if as_json else TABLE_PAGE
    return limit or None


def truncation_note(found: Overview, what: str = "streams") -> str | None:
    """The line a human table ends with when a limit cut it short (None: it did not)."""
    if not found.truncated:
        return None
    return limited_note(len(found.streams), found.matched, what)


def limited_note(shown: int, matched: int, what: str = "streams") -> str:
    """What a table cut short ends with, and how to see the rest."""
    return (
        f"(first {shown:,} of {matched:,} {what} shown: --limit N or --limit 0 for more, "
        "--like PATTERN to choose)"
    )
