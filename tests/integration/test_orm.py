"""``writer.fact`` and ``reader.commit(conn=...)`` in the transactions of the ORMs services use
(`streams.orm`): SQLAlchemy sync and asyncio (``Session``, ``Connection``, ``AsyncSession``;
dialect ``postgresql+psycopg``) and Django (``django.db.connection`` with its psycopg 3 backend,
inside ``transaction.atomic()``), on real PostgreSQL. Each joins the ORM's transaction: what the
ORM commits, the fact and the group's position commit with; what it rolls back, they roll back
with; an error of ours leaves the transaction unable to commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import sqlalchemy as sa
from helpers import fact_rows, wait_until
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import streams
from streams import Client


def sa_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture
def table(streams_url: str, unique_name: str) -> Iterator[str]:
    name = f"effects_{unique_name}"
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {name} (stream_id bigint, item text)")
    yield name
    with psycopg.connect(streams_url, autocommit=True) as admin:
        admin.execute(f"DROP TABLE {name}")


def items(url: str, table: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT stream_id, item FROM {table} ORDER BY 1, 2").fetchall()


def test_sqlalchemy_session_and_connection(
    client: Client, stream: str, streams_url: str, table: str
) -> None:
    engine = sa.create_engine(sa_url(streams_url))
    insert = sa.text(f"INSERT INTO {table} VALUES (:id, :item)")
    try:
        with client.writer(stream) as writer:
            with Session(engine) as session:
                with writer.fact(session, key="order-1") as fact:
                    session.execute(insert, {"id": fact.stream_id, "item": "committed"})
                    fact.add({"order": 1})
                assert writer.core.tracker.pending_count == 1  # until the session commits
                session.commit()
                wait_until(lambda: writer.core.tracker.pending_count == 0, what="resolved")
                with writer.fact(session, key="order-2") as lost:
                    session.execute(insert, {"id": lost.stream_id, "item": "rolled back"})
                session.rollback()
                with writer.fact(session, key="order-1") as again:
                    assert again.duplicate and again.ack == fact.ack
                session.commit()
            with engine.connect() as conn:  # a Connection, "commit as you go"
                with writer.fact(conn, key="order-2") as second:
                    conn.execute(insert, {"id": second.stream_id, "item": "via connection"})
                conn.commit()
            # An error of ours in the session's transaction: it can only roll back.
            with Session(engine) as session:
                session.execute(insert, {"id": 0, "item": "never"})
                with pytest.raises(streams.InvalidFact), writer.fact(session) as bad:
                    bad.add({"bad": float("nan")})
                with contextlib.suppress(sa.exc.DBAPIError):
                    session.commit()  # PostgreSQL answers with a rollback
            wait_until(lambda: writer.core.tracker.pending_count == 0, what="all resolved")
    finally:
        engine.dispose()
    assert items(streams_url, table) == [
        (fact.stream_id, "committed"),
        (second.stream_id, "via connection"),
    ]
    assert [r[4] for r in fact_rows(streams_url, stream)] == [{"order": 1}]


def test_sqlalchemy_session_commits_a_group_with_its_effects(
    client: Client, stream: str, streams_url: str, table: str
) -> None:
    engine = sa.create_engine(sa_url(streams_url))
    insert = sa.text(f"INSERT INTO {table} VALUES (:id, 'applied')")
    try:
        with client.writer(stream) as writer:
            writer.append_batch([{"n": n} for n in range(4)])
        with client.reader(stream, group="g") as reader, Session(engine) as session:
            facts = list(reader.facts())
            for fact in facts:
                session.execute(insert, {"id": fact.stream_id})
            reader.commit(conn=session)
            session.commit()
    finally:
        engine.dispose()
    assert [p for p, _ in items(streams_url, table)] == [f.stream_id for f in facts]
    assert {g.group: g.position for g in client.groups(stream)} == {"g": facts[-1].stream_id}


def test_sqlalchemy_asyncio_session(streams_url: str, unique_name: str, table: str) -> None:
    asyncio.run(_sqlalchemy_asyncio(streams_url, unique_name, table))


async def _sqlalchemy_asyncio(streams_url: str, stream: str, table: str) -> None:
    engine = create_async_engine(sa_url(streams_url))
    insert = sa.text(f"INSERT INTO {table} VALUES (:id, :item)")
    try:
        async with await streams.aconnect(streams_url, lease_seconds=2.0) as client:
            await client.create_stream(stream)
            async with await client.writer(stream) as writer:
                async with AsyncSession(engine) as session:
                    async with writer.fact(session, key="k") as fact:
                        await session.execute(insert, {"id": fact.stream_id, "item": "async"})
                        await fact.add({"async": True})
                    await session.commit()
                    async with writer.fact(session, key="k") as again:
                        assert again.duplicate and again.ack == fact.ack
                    async with writer.fact(session) as lost:
                        await session.execute(insert, {"id": lost.stream_id, "item": "lost"})
                    await session.rollback()
                async with engine.connect() as conn:
                    async with writer.fact(conn) as other:
                        await other.add({"via": "connection"})
                    await conn.commit()
            async with await client.reader(stream, group="g") as reader:
                got = [f async for f in reader.facts()]
                async with AsyncSession(engine) as session:
                    await reader.commit(conn=session)
                    await session.commit()
            assert [f.payload for f in got] == [{"async": True}, {"via": "connection"}]
            groups = {g.group: g.position for g in await client.groups(stream)}
            assert groups == {"g": got[-1].stream_id}
    finally:
        await engine.dispose()
    assert items(streams_url, table) == [(fact.stream_id, "async")]


def test_the_wrong_kind_of_connection_is_refused(client: Client, stream: str) -> None:
    engine = create_async_engine(sa_url(client.settings.database_url))
    with client.writer(stream) as writer:
        with pytest.raises(streams.UsageError, match="asyncio"), writer.fact(AsyncSession(engine)):
            pass
        with pytest.raises(streams.UsageError, match="expected"), writer.fact(object()):
            pass
    asyncio.run(engine.dispose())


@pytest.fixture(scope="module")
def django_connection(streams_url: str) -> Any:
    """Django configured on the session's database (its psycopg 3 backend)."""
    import django
    from django.conf import settings

    parts = urlsplit(streams_url)
    if not settings.configured:
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": parts.path.lstrip("/"),
                    "USER": parts.username or "postgres",
                    "PASSWORD": parts.password or "",
                    "HOST": parts.hostname or "127.0.0.1",
                    "PORT": str(parts.port or 5432),
                }
            },
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
        django.setup()
    from django.db import connection

    yield connection
    connection.close()


def test_django_atomic(
    client: Client, stream: str, streams_url: str, table: str, django_connection: Any
) -> None:
    from django.db import transaction

    connection = django_connection
    insert = f"INSERT INTO {table} VALUES (%s, %s)"
    with client.writer(stream) as writer:
        with pytest.raises(streams.UsageError, match="atomic"), writer.fact(connection):
            pass
        with transaction.atomic(), writer.fact(connection, key="d1") as fact:
            with connection.cursor() as cur:
                cur.execute(insert, (fact.stream_id, "django"))
            fact.add({"django": 1})
        with pytest.raises(RuntimeError), transaction.atomic():
            with writer.fact(connection, key="d2") as lost, connection.cursor() as cur:
                cur.execute(insert, (lost.stream_id, "rolled back"))
            raise RuntimeError("the view failed")
        with transaction.atomic(), writer.fact(connection, key="d1") as again:
            assert again.duplicate and again.ack == fact.ack
        wait_until(lambda: writer.core.tracker.pending_count == 0, what="resolved")
    with client.reader(stream, group="dj") as reader:
        got = list(reader.facts())
        with transaction.atomic():
            reader.commit(conn=connection)
    assert [f.payload for f in got] == [{"django": 1}]
    assert items(streams_url, table) == [(fact.stream_id, "django")]
    assert {g.group: g.position for g in client.groups(stream)} == {"dj": lost.stream_id}
