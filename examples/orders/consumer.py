"""The consumer of the order service: applies each order fact to ``customer_totals`` and commits
its reader group *in the same transaction* (``reader.commit(fact, conn=session)``), so that a
consumer killed at any point has applied a fact and moved past it, or neither: restarted, it
resumes at the group's position, and every fact counts once.

``python examples/orders/consumer.py [--setup] [--slow SECONDS] [--idle SECONDS]``:
``--setup`` creates the stream and the service's tables first; ``--slow`` waits between a fact's
writes and its commit (the example's test kills it at random moments); it stops after ``--idle``
seconds without a new fact (default: follows for ever).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator

from models import STREAM, AppliedFact, Base, CustomerTotal, sqlalchemy_url
from sqlalchemy import Engine, create_engine, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

import streams

GROUP = "customer-totals"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setup", action="store_true")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--idle", type=float, default=None)
    args = parser.parse_args()
    url = os.environ["STREAMS_DATABASE_URL"]
    engine = create_engine(sqlalchemy_url(url))
    with streams.connect(url) as client:
        if args.setup:
            client.create_stream(STREAM)
            Base.metadata.create_all(engine)
            return
        with client.reader(STREAM, group=GROUP) as reader:
            facts: Iterator[streams.Fact]
            if args.idle is None:  # follow for ever
                facts = (fact for epoch in reader for fact in epoch.facts)
            else:
                facts = reader.facts(idle_timeout=args.idle)
            for fact in facts:
                apply(engine, reader, fact, args.slow)
    engine.dispose()


def apply(engine: Engine, reader: streams.Reader, fact: streams.Fact, slow: float) -> None:
    """One fact, one transaction: its effects and the group's position commit together."""
    order = fact.payload
    with Session(engine) as session, session.begin():
        session.execute(
            insert(CustomerTotal)
            .values(customer=order["customer"], orders=0, amount=0)
            .on_conflict_do_nothing()
        )
        session.execute(
            update(CustomerTotal)
            .where(CustomerTotal.customer == order["customer"])
            .values(orders=CustomerTotal.orders + 1, amount=CustomerTotal.amount + order["amount"])
        )
        session.add(AppliedFact(stream_id=fact.stream_id))
        session.flush()
        time.sleep(slow)  # a kill here: nothing of this fact is committed
        reader.commit(fact, conn=session)


if __name__ == "__main__":
    main()
