"""An order service: FastAPI, SQLAlchemy's asyncio ORM, and `streams`.

``POST /orders`` with an ``Idempotency-Key`` header stores the order and appends the fact that
announces it *in one ORM transaction*: the request's key is the fact's key, so a client that
retries (its request timed out, its connection dropped) gets the same order back, however many
times and to however many processes of the service it sends it, and the order and its fact are
written once, or not at all.

Run: ``STREAMS_DATABASE_URL=postgresql://... uvicorn app:app --app-dir examples/orders``
(``pip install -e '.[examples]'``; ``python examples/orders/consumer.py --setup`` creates the
stream and the tables).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header, HTTPException
from models import STREAM, Order, sqlalchemy_url
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import streams

DATABASE_URL = os.environ["STREAMS_DATABASE_URL"]


class NewOrder(BaseModel):
    customer: str
    amount: int


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(sqlalchemy_url(DATABASE_URL))
    async with (
        await streams.aconnect(DATABASE_URL) as client,
        await client.writer(STREAM) as writer,
    ):
        app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
        app.state.writer = writer
        yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


@app.post("/orders")
async def create_order(
    order: NewOrder, idempotency_key: str = Header(min_length=1, max_length=200)
) -> dict[str, Any]:
    writer: streams.AsyncWriter = app.state.writer
    session: AsyncSession
    # The fact joins the session's transaction: it commits with the order row, or not at all
    # (session.begin() commits when the block ends, after the fact's block). A retried request
    # finds its key written: the original fact, and nothing new is written.
    async with (
        app.state.sessions() as session,
        session.begin(),
        writer.fact(session, key=idempotency_key) as fact,
    ):
        if not fact.duplicate:
            session.add(Order(stream_id=fact.stream_id, **order.model_dump()))
            await fact.add({"order": fact.stream_id, **order.model_dump()})
    if fact.duplicate:
        async with app.state.sessions() as session:
            stored = await session.get(Order, fact.stream_id)
        if stored is None:  # the key named another kind of request: not ours to answer
            raise HTTPException(409, "this idempotency key was used for something else")
        order = NewOrder(customer=stored.customer, amount=stored.amount)
    return {"order": fact.stream_id, "duplicate": fact.duplicate, **order.model_dump()}
