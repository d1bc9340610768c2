"""Upgrade the database schema to this library's head, programmatically (`streams migrate`).

The Alembic scripts ship inside the package as `streams._migrations` (the repository's
top-level ``migrations/`` folder), so an installed wheel can migrate without a checkout.
"""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, pool

from .config import redact_url
from .errors import StoreError

__all__ = ["current_revision", "upgrade"]


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("streams._migrations")))
    config.set_main_option("version_table", "streams_alembic_version")
    return config


def _engine_url(database_url: str) -> str:
    scheme, sep, rest = database_url.partition("://")
    return (
        f"postgresql+psycopg{sep}{rest}" if scheme in ("postgresql", "postgres") else database_url
    )


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply every migration up to `revision` (idempotent; concurrent callers queue)."""
    engine = create_engine(_engine_url(database_url), poolclass=pool.NullPool)
    config = _config()
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    except Exception as exc:
        if exc.__class__.__module__.startswith(("sqlalchemy", "psycopg")):
            raise StoreError(
                f"migration of {redact_url(database_url)} failed: {type(exc).__name__}"
            ) from None
        raise
    finally:
        engine.dispose()


def current_revision(database_url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(_engine_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"version_table": "streams_alembic_version"}
            )
            return context.get_current_revision()
    finally:
        engine.dispose()
