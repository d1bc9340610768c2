"""The operator's commands of the `streams` command line (`ops`): `streams.command` composes
them with the benchmarks (``streams bench``) into the ``streams`` command.

Every command takes ``--database-url``, ``--redis-url`` and ``--prefix`` (defaulting to
``STREAMS_DATABASE_URL``, ``STREAMS_REDIS_URL``, ``STREAMS_PREFIX``). Listing commands take
``--json`` and print one JSON document (``read`` prints JSON lines), so scripts can rely on
them. Errors print one line on stderr and exit 1; URLs are always shown redacted.

The commands live in modules by group, each registered here on `ops`:

* `stream_commands`: ``create``, ``drop``, ``key-window``, ``tables``, ``retention``,
  ``prune``, ``list``;
* `key_commands`: ``keys``;
* `io_commands`: ``append``, ``read``;
* `position_commands`: ``positions``, ``writers prune``;
* `database_commands`: ``migrate``, ``doctor``, ``metrics serve``;
* `group_commands`, `incarnation_commands`, `failover_commands`, `role_commands`,
  `schema_commands`: ``groups``, ``incarnation``, ``failover``, ``roles``, ``schema``;
* `demo_commands`: ``demo``;
* `server_commands`: ``up``, ``down``, ``status`` (embedded servers kept running).

What several of them share is `shared` (settings, the client, ``--json`` output) and `render`
(tables).
"""

from __future__ import annotations

import click

from .database_commands import doctor, metrics, migrate
from .demo_commands import demo
from .failover_commands import failover
from .group_commands import groups
from .incarnation_commands import incarnation
from .io_commands import append, read
from .key_commands import keys
from .position_commands import positions, writers
from .role_commands import roles
from .schema_commands import schema
from .server_commands import down, status, up
from .stream_commands import create, drop, key_window, list_, prune_, retention, tables

__all__ = ["ops"]

#: Every command of ``streams`` but ``bench``, gathered for `streams.command`.
ops = click.Group("ops")
ops.add_command(migrate)
ops.add_command(create)
ops.add_command(drop)
ops.add_command(key_window)
ops.add_command(tables)
ops.add_command(keys)
ops.add_command(retention)
ops.add_command(prune_)
ops.add_command(list_)
ops.add_command(append)
ops.add_command(read)
ops.add_command(positions)
ops.add_command(writers)
ops.add_command(doctor)
ops.add_command(metrics)
ops.add_command(groups)
ops.add_command(incarnation)
ops.add_command(failover)
ops.add_command(roles)
ops.add_command(schema)
ops.add_command(demo)
ops.add_command(up)
ops.add_command(down)
ops.add_command(status)
