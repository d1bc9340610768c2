"""The example service's own tables (SQLAlchemy), beside the `streams` schema.

* ``orders``: one row per order the service accepted, keyed by the stream ID of the fact that
  announced it (written in the request's transaction, with the fact);
* ``customer_totals``: what the consumer derives from the facts (orders and amount per
  customer), in the consumer's transaction, with the group's position;
* ``applied_facts``: every fact the consumer applied, once each (what the example's test checks).
"""

from __future__ import annotations

import os

from sqlalchemy import BigInteger, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: The stream the service appends to and the consumer follows.
STREAM = os.environ.get("ORDERS_STREAM", "orders")


def sqlalchemy_url(database_url: str) -> str:
    """``postgresql://...`` as SQLAlchemy's psycopg 3 dialect (``postgresql+psycopg://``)."""
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    stream_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    amount: Mapped[int] = mapped_column(BigInteger)


class CustomerTotal(Base):
    __tablename__ = "customer_totals"

    customer: Mapped[str] = mapped_column(String(100), primary_key=True)
    orders: Mapped[int] = mapped_column(BigInteger, default=0)
    amount: Mapped[int] = mapped_column(BigInteger, default=0)


class AppliedFact(Base):
    __tablename__ = "applied_facts"

    # No primary key on purpose in spirit: an effect applied twice would show as two rows, so
    # the example's test can see it. (SQLAlchemy's ORM needs one: a surrogate.)
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    stream_id: Mapped[int] = mapped_column(BigInteger, index=True)
