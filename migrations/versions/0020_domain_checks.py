"""The checks of a fact's ID and timestamp move from table constraints to domains: creating a
stream no longer costs more with every stream (issue 40).

``streams_facts`` had two CHECK constraints (``stream_id > 0``, ``ts >= 0``), and a
partitioned table's CHECKs are copied to every partition: two rows of ``pg_constraint`` per
stream. Creating a stream's partition and attaching it under its bucket cost more as those
rows grew (``CREATE SEQUENCE`` + ``CREATE TABLE`` + ``ATTACH`` in one statement: 3.3 ms at 10
streams, 10.9 ms at 10,000; without the two CHECKs, 3.7-4.1 ms at 10,000; measured by timing
each statement of ``create_stream``). The same checks as domains (``streams_stream_id``,
``streams_timestamp``) are one row each, whatever the number of streams, and PostgreSQL
enforces them on every insert and update as before.

How the upgrade avoids rewriting the facts: a column changed to a domain *without*
constraints needs no rewrite of the table (PostgreSQL checks a domain's constraints by
rewriting, so it has none yet at that point); the constraints are then added ``NOT VALID``,
which enforces them on every new value without a scan. The existing rows satisfy them: the
table's CHECKs held until this same transaction dropped them. PostgreSQL does rebuild the two
indexes of every partition (measured: new files for both, the heap's unchanged): plan the
upgrade of a large database as a ``REINDEX`` of ``streams_facts``.

What it costs: the ``ALTER TABLE`` locks every partition of ``streams_facts`` (and their
indexes) in one transaction. PostgreSQL's lock table holds about
``max_locks_per_transaction * (max_connections + max_prepared_transactions)`` locks (6,400
at the defaults, and a little more before "out of shared memory"): a database of more than
about 1,000 streams must raise ``max_locks_per_transaction`` (a restart) for this upgrade, which
says so before it starts, nothing changed. The downgrade turns the columns back to ``bigint``
and the checks back into table constraints (validated: a scan).

Revision ID: 0020_domain_checks
Revises: 0019_stream_fences
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0020_domain_checks"
down_revision = "0019_stream_fences"
branch_labels = None
depends_on = None

#: Locks the ALTER takes per partition, about: the table, its two indexes, its TOAST table
#: and that table's index.
LOCKS_PER_PARTITION = 5

_PARTITIONS_SQL = """
WITH RECURSIVE tree(relid) AS (
    SELECT 'streams_facts'::regclass::oid
    UNION ALL
    SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree t ON i.inhparent = t.relid
)
SELECT count(*) FROM tree
"""

_LOCK_TABLE_SQL = """
SELECT current_setting('max_locks_per_transaction')::int,
       current_setting('max_connections')::int
       + current_setting('max_prepared_transactions')::int
"""


def needed_locks_setting(relations: int, per_transaction: int, backends: int) -> int | None:
    """The ``max_locks_per_transaction`` this upgrade needs with ``relations`` tables in
    ``streams_facts``'s tree, or None if the current one will do (the ALTER may take at most
    half of the lock table: other sessions hold locks too)."""
    needed = relations * LOCKS_PER_PARTITION
    if 2 * needed <= per_transaction * backends:
        return None
    return -(-2 * needed // backends)


def _check_lock_table() -> None:
    bind = op.get_bind()
    relations = int(bind.execute(text(_PARTITIONS_SQL)).scalar_one())
    per_transaction, backends = bind.execute(text(_LOCK_TABLE_SQL)).one()
    enough = needed_locks_setting(relations, int(per_transaction), int(backends))
    if enough is not None:
        raise RuntimeError(
            f"revision 0020 alters all {relations} tables of streams_facts in one transaction "
            f"(about {relations * LOCKS_PER_PARTITION} locks), more than PostgreSQL's lock "
            f"table can spare: set max_locks_per_transaction to at least {enough} "
            "(postgresql.conf, then a restart) for the upgrade, and run it again; nothing was "
            "changed"
        )


def upgrade() -> None:
    _check_lock_table()
    op.execute("CREATE DOMAIN streams_stream_id AS bigint")
    op.execute("CREATE DOMAIN streams_timestamp AS bigint")
    op.execute(
        "ALTER TABLE streams_facts "
        "DROP CONSTRAINT streams_facts_stream_id_check, "
        "DROP CONSTRAINT streams_facts_ts_check, "
        "ALTER COLUMN stream_id TYPE streams_stream_id, "
        "ALTER COLUMN ts TYPE streams_timestamp"
    )
    op.execute(
        "ALTER DOMAIN streams_stream_id ADD CONSTRAINT streams_stream_id_check "
        "CHECK (VALUE > 0) NOT VALID"
    )
    op.execute(
        "ALTER DOMAIN streams_timestamp ADD CONSTRAINT streams_timestamp_check "
        "CHECK (VALUE >= 0) NOT VALID"
    )


def downgrade() -> None:
    _check_lock_table()
    op.execute(
        "ALTER TABLE streams_facts "
        "ALTER COLUMN stream_id TYPE bigint, "
        "ALTER COLUMN ts TYPE bigint, "
        "ADD CONSTRAINT streams_facts_stream_id_check CHECK (stream_id > 0), "
        "ADD CONSTRAINT streams_facts_ts_check CHECK (ts >= 0)"
    )
    op.execute("DROP DOMAIN streams_stream_id")
    op.execute("DROP DOMAIN streams_timestamp")
