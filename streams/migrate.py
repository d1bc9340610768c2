"""Upgrade the database schema to this library's head, programmatically (`streams migrate`).

The Alembic scripts ship inside the package as `streams._migrations` (the repository's
top-level ``migrations/`` folder), so an installed wheel can migrate without a checkout.

SQLAlchemy never sees the database URL: its URL parser raises with the whole URL (password
included) in the message when the password holds an unencoded ``@`` and ``:``. The engine gets
connections from `streams.store.sessions.connect` instead, which checks the URL with libpq's parser
and reports failures redacted.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, pool

from .config import redact_url, scrub_secrets
from .errors import StoreError
from .store import sessions

__all__ = ["current_revision", "upgrade"]


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("streams._migrations")))
    config.set_main_option("version_table", "streams_alembic_version")
    return config


def _engine(database_url: str) -> Engine:
    """An engine whose every connection comes from `sessions.connect` (no URL parsing)."""
    sessions.parse_database_url(database_url)  # ConfigurationError before any engine work

    def creator() -> Any:
        return sessions.connect(database_url, autocommit=False, purpose="migration")

    return create_engine("postgresql+psycopg://", creator=creator, poolclass=pool.NullPool)


def _failure(database_url: str, action: str, exc: Exception) -> StoreError:
    """One line: what failed, the driver's first line (password scrubbed), never the SQL."""
    cause = getattr(exc, "orig", None) or exc
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    reason = scrub_secrets(first, sessions.secrets_of(database_url))
    return StoreError(
        f"{action} of {redact_url(database_url)} failed: {type(cause).__name__}"
        + (f": {reason}" if reason else "")
    )


def _is_driver_error(exc: Exception) -> bool:
    return exc.__class__.__module__.startswith(("sqlalchemy", "psycopg"))


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply every migration up to `revision` (idempotent; concurrent callers queue)."""
    engine = _engine(database_url)
    config = _config()
    failure: StoreError | None = None
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    except Exception as exc:
        if not _is_driver_error(exc):
            raise
        failure = _failure(database_url, "migration", exc)
    finally:
        engine.dispose()
    if failure is not None:  # raised outside the handler: no chained driver message
        raise failure


def current_revision(database_url: str) -> str | None:
    """The schema revision stamped in the database (None before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    engine = _engine(database_url)
    failure: StoreError | None = None
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"version_table": "streams_alembic_version"}
            )
            return context.get_current_revision()
    except Exception as exc:
        if not _is_driver_error(exc):
            raise
        failure = _failure(database_url, "reading the schema revision", exc)
    finally:
        engine.dispose()
    raise failure
