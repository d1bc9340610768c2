"""Every name `streams` uses outside its own tables: Redis channels and PostgreSQL lock keys.

Kept in one place so an operator sees what a deployment touches on shared servers and two
modules never disagree on a name. `streams` keeps no Redis keys (pub/sub only). The channels
and why: docs/protocol.md; the advisory locks and why: docs/schema.md ("Names outside the
tables").
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUCKET_WIDTH",
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
    "facts_bucket",
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

#: First key of a writer's own lock (shared, transaction-scoped; second key ``hashtext(<stream
#: id> || '/' || instance)``): finds an expired writer's sessions (docs/design/liveness.md).
WRITER_LOCK: Final = 7316

#: First key of the lock that serialises key rotations (transaction-scoped).
KEY_ROTATION_LOCK: Final = 7317

#: The instance of the hint a ``KEYS`` line becomes: no writer's (those start with a letter or
#: digit) nor a prober's.
KEYS_INSTANCE: Final = "_keys"

#: Instance names of the lines that announce a shared proof (never a writer's, as above).
PROOF_INSTANCE_PREFIX: Final = "_proof:"

#: Reservation locks carry ``L mod 2**32``: readers recover ``L`` within 2**31 of max allocated
#: (docs/design/probe.md, "The reservation lock").
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
    """Whether ``channel`` is one stream's (data or proof): a Redis Cluster shards it
    (``SPUBLISH``/``SSUBSCRIBE``); control traffic goes to every node (``PUBLISH``)."""
    return channel.startswith((f"{prefix}:data:", f"{prefix}:proof:"))


def instance_channel(prefix: str, instance: str) -> str:
    """The channel for messages meant for one instance."""
    return f"{prefix}/{instance}"


def facts_partition(stream_key: int) -> str:
    """The name of a stream's partition of ``streams_facts`` (revision ``0006_partitions``)."""
    return f"streams_facts_{int(stream_key)}"


#: Consecutive stream IDs whose partitions hang under one partition of ``streams_facts``, a
#: "bucket" (see `streams.store.registry`, "Layout"): attaching a partition costs in proportion
#: to its parent's partitions, so a bucket keeps that cost flat at 10^4 streams and more.
BUCKET_WIDTH = 256


def facts_bucket(stream_key: int) -> str:
    """The name of the bucket (a partition of ``streams_facts``, itself partitioned) that a
    stream created since revision ``0018_bucketed_partitions`` hangs its partition under."""
    return f"streams_facts_b{int(stream_key) // BUCKET_WIDTH}"


def reservation_lock_class(stream_key: int) -> int:
    """First (int4) key of a stream's reservation locks: minus the stream's registry id."""
    return -stream_key


#: A record older than this (ms, server clock) counts as no proof: followers probe themselves.
STALE_AFTER = 3000
#: Seconds a follower waits after a writer's hint for a proof covering it before it looks for
#: itself: what a prober that cannot announce costs followers, not a poll interval.
PROOF_GRACE = 0.05
