"""Every name `streams` uses outside its own tables: Redis channels and PostgreSQL lock keys.

Kept in one place (like arq's ``constants.py``) so an operator can see at a glance what a
deployment touches on shared Redis and PostgreSQL servers, and so two modules can never disagree
on a name.

Redis
-----
* ``<prefix>``: the replication channel. Every command (``REPLICATE``, ``POSITION``, ``RDATA``,
  ``PING``...) is published here, one command per message (see `streams.core.protocol`).
* ``<prefix>:data:<stream>``: a stream's *data channel*. Every ``RDATA`` and ``POSITION`` a
  writer publishes about ``<stream>`` goes here, not on ``<prefix>``, and only the processes
  that need writers' hints of ``<stream>`` subscribe to it (its prover, readers that probe for
  themselves): a writer-only process hears no other process's appends, so an append costs
  Redis a delivery per interested process, whatever the number of writer processes.
* ``<prefix>:proof:<stream>``: a stream's *proof channel*: what its elected prover publishes
  (signed ranges of facts and ``POSITION`` lines, `streams.core.signing`). Every process with a
  reader of ``<stream>`` subscribes to it; a reader that follows fresh proofs needs nothing
  else, so it hears one line per proof, not one per append.
* ``<prefix>`` keeps the control traffic: ``REPLICATE`` and its answers, what each link
  announces when it (re)connects, and whatever a foreign deployment says there
  (`streams.core.replication`).
* ``KEYS <id>`` on ``<prefix>``: the replication keys changed (``streams keys rotate``; `id` is
  the newest key): every reader and prover reads the key table again at once, so a retired key
  stops verifying without waiting for `streams.core.signing.KEY_REFRESH`. Only a hint: a forged
  one costs a read of the key table (at most one a second per reader).
* ``<prefix>/<instance>``: messages meant for one instance only. Every process subscribes to the
  channel of each of its instance names; nothing in `streams` needs to send there yet, but tools
  (and Synapse-style workers) may.

`streams` keeps no Redis keys: pub/sub only. Redis may be flushed or restarted at any time.

PostgreSQL advisory locks
-------------------------
Advisory locks live in a namespace shared with every other application of the database, so
ours are spelled out here:

* ``(REGISTRATION_LOCK, <stream id>)``, transaction-scoped, exclusive: serialises writer
  registration (sequence repair, seeding positions) per stream.
* ``(-<stream id>, <low 32 bits of L>)``, transaction-scoped, *shared*: the **reservation
  lock**. Every writing transaction takes it, in the same statement and *before* ``nextval``,
  with ``L`` = the stream's sequence value plus one as read just before; so every ID that
  transaction reserves is ``>= L``. Readers look at ``pg_locks`` for these locks to learn, from
  PostgreSQL alone, up to which ID every reserved ID has completed (see
  `streams.store.probe.probe`). Negative first keys keep them apart from the ``(7314, id)`` lock
  and from most applications' own keys; a foreign lock that happened to collide could only make
  readers more cautious, never make them skip a fact, and readers end the session holding it
  once it has held the stream back past the lease (`streams.store.holders`, "the holding
  argument"), as they do any session's: advisory locks have no privileges.
* ``(PROOF_LOCK, <stream id>)``, session-scoped, exclusive: held by the one process that proves
  a stream's complete position for every reader (see `streams.proofs`). A collision could only
  make the processes of a deployment stop electing a prober; readers then probe themselves.
* ``(KEY_ROTATION_LOCK, 0)``, transaction-scoped, exclusive: serialises the rotations of the
  replication keys (`streams.store.keys`), so that two provers renewing the key of a new
  database incarnation at once make one key, not two that retire each other.

PostgreSQL tables
-----------------
Besides the tables of the Alembic revisions, each stream has its own partition of
``streams_facts``, ``streams_facts_<stream id>`` (`facts_partition`), created by
`streams.store.registry.create_stream` and dropped by `drop_stream`.

Shared proofs on Redis
----------------------
The elected prober announces each proven position as a ``POSITION <stream> _proof:<link name>
<prev> <complete>`` line on the stream's proof channel. Writer instance names start with a letter
or digit, so ``_proof:`` can never be a writer's; like every command it is only a hint.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "KEYS_INSTANCE",
    "KEY_ROTATION_LOCK",
    "PROOF_GRACE",
    "PROOF_INSTANCE_PREFIX",
    "PROOF_LOCK",
    "REGISTRATION_LOCK",
    "RESERVATION_LOCK_SPAN",
    "STALE_AFTER",
    "WRITER_LOCK",
    "data_channel",
    "facts_partition",
    "instance_channel",
    "proof_channel",
    "replication_channel",
    "reservation_lock_class",
    "sharded_channel",
]

#: First key of the per-stream registration lock.
REGISTRATION_LOCK: Final = 7314

#: First key of the per-stream prober election lock (session-scoped).
PROOF_LOCK: Final = 7315

#: First key of a writer's own lock: every writing transaction of writer ``instance`` on a
#: stream holds it (shared, transaction-scoped) with the second key ``hashtext(<stream id> || '/'
#: || instance)`` (int4), so the sessions of a writer whose lease expired can be found in
#: ``pg_locks`` and ended (`streams.store.leases.end_expired_sessions`), whatever they are doing.
WRITER_LOCK: Final = 7316

#: First key of the lock that serialises key rotations (transaction-scoped).
KEY_ROTATION_LOCK: Final = 7317

#: The instance name of the hint a ``KEYS`` line becomes (`streams.core.replication`): no
#: writer's (writer names start with a letter or digit) nor a prober's.
KEYS_INSTANCE: Final = "_keys"

#: Instance names of the lines that announce a shared proof (never a writer's: see above).
PROOF_INSTANCE_PREFIX: Final = "_proof:"

#: Reservation locks carry ``L mod 2**32``; readers recover ``L`` as the unique value in
#: ``[max allocated + 1 - 2**31, max allocated + 1 + 2**31)``: no transaction stays open for
#: 2e9 IDs, and a lock taken after the reader read max allocated may be above it.
RESERVATION_LOCK_SPAN: Final = 2**32


def replication_channel(prefix: str) -> str:
    """The channel every replication command is published on."""
    return prefix


def data_channel(prefix: str, stream: str) -> str:
    """The channel of one stream's ``RDATA`` and ``POSITION`` lines (heard by its readers)."""
    return f"{prefix}:data:{stream}"


def proof_channel(prefix: str, stream: str) -> str:
    """The channel of what one stream's prover publishes (heard by every reader of it)."""
    return f"{prefix}:proof:{stream}"


def sharded_channel(prefix: str, channel: str) -> bool:
    """Whether ``channel`` is one stream's (its data or proof channel): on a Redis Cluster it
    is published with ``SPUBLISH`` and heard with ``SSUBSCRIBE`` on the shard that owns its
    slot; every other channel (``<prefix>``, instance channels) is control traffic, published
    with ``PUBLISH``, which a cluster delivers on every node."""
    return channel.startswith((f"{prefix}:data:", f"{prefix}:proof:"))


def instance_channel(prefix: str, instance: str) -> str:
    """The channel for messages meant for one instance."""
    return f"{prefix}/{instance}"


def facts_partition(stream_key: int) -> str:
    """The name of a stream's partition of ``streams_facts`` (revision ``0006_partitions``)."""
    return f"streams_facts_{int(stream_key)}"


def reservation_lock_class(stream_key: int) -> int:
    """First (int4) key of a stream's reservation locks: minus the stream's registry id."""
    return -stream_key


#: A record older than this (ms, server clock) counts as no proof: followers probe themselves.
STALE_AFTER = 3000
#: Seconds a follower waits, after a writer's hint, for a proof that covers it before it looks
#: (and, if the proof is still behind, probes) for itself: a prober that proves but cannot
#: announce (its Redis publish failing) or is stopped costs followers this, not a poll interval.
PROOF_GRACE = 0.05
