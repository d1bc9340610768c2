"""Alembic environment for the `streams` schema.

The URL comes from, in order: a connection handed over by `streams migrate`
(``config.attributes["connection"]``), ``-x database_url=...``, ``sqlalchemy.url`` in the
config, then ``STREAMS_DATABASE_URL``. The version table is ``streams_alembic_version`` so that
`streams` can share a database with an application that uses Alembic itself.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

VERSION_TABLE = "streams_alembic_version"
config = context.config


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("database_url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("STREAMS_DATABASE_URL")
    )
    if not url:
        raise SystemExit("set STREAMS_DATABASE_URL or pass -x database_url=postgresql://...")
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg{sep}{rest}"
    return url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, version_table=VERSION_TABLE, target_metadata=None)
    with context.begin_transaction():
        # Two processes migrating at once (e.g. several services starting) queue up here
        # instead of failing half-way on "relation already exists".
        connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7314229876012345)")
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), version_table=VERSION_TABLE, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
