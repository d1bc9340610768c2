"""docs/cli.md says what the commands are: every command of ``streams --help`` (and of its
groups) has its row, and the claim about table headers holds for the listings."""

from __future__ import annotations

import json
import re

import click
from click.testing import CliRunner
from helpers import REPO_ROOT

from streams import Client
from streams.command import main

PAGE = (REPO_ROOT / "docs" / "cli.md").read_text()


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += _commands(command, (*path, name))
        else:
            found.append((*path, name))
    return found


def test_every_command_has_its_row_on_the_page() -> None:
    rows = re.findall(r"^\| `streams ([a-z -]+?)(?: [A-Z\[\-`(]|`)", PAGE, re.M)
    documented = {" ".join(row.split()) for row in rows}
    commands = {" ".join(path) for path in _commands(main) if path[0] != "bench"}
    assert commands - documented == set(), "commands docs/cli.md leaves out"
    benches = {" ".join(path) for path in _commands(main) if path[0] == "bench"}
    assert all(f"`streams {b}" in PAGE or f"`{b.split()[1]}`" in PAGE for b in benches), benches


def test_table_headers_name_the_json_keys(client: Client, stream: str, streams_url: str) -> None:
    """`list`'s table: each header is a JSON key in capitals, but the shortened `MAX ALLOC`
    (the page says so)."""
    assert "`MAX ALLOC` for `max_allocated`" in PAGE
    argv = ["list", "--like", stream, "--database-url", streams_url]
    keys = set(json.loads(CliRunner().invoke(main, [*argv, "--json"]).stdout)[0])
    header = CliRunner().invoke(main, argv).stdout.splitlines()[0]
    shown = {h.lower() for h in header.replace("MAX ALLOC", "MAX_ALLOCATED").split()}
    shown = {"name" if h == "stream" else h for h in shown}
    assert shown <= keys, (shown, keys)
