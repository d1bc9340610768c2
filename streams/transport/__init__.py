"""Redis: the fast path that tells processes when to look, never what is true.

* `link`: `RedisLink` and `AsyncRedisLink`, one process's link, each driving the plans of
* `link_plans`: the discipline both share (listen, keep alive, reconnect, publish).
* `faces`: what writers, readers and the prover need of a link, and a writer's handle.
* `connections`: the subscriber read in bulk and the fire-and-forget publisher.
* `discovery`: where a URL leads: a Sentinel set's master, a Cluster's slot map.
* `cluster`: the link on a Redis Cluster, as plans: sharded channels, routing.
* `cluster_io`: the cluster subscriber's connections and publishers, threads and asyncio.
* `redis_errors`: Redis failures as errors that say what failed, where and what to do.

What a message means is decided in `streams.core.replication`; here is only I/O. Nothing read
from Redis is trusted: readers ask PostgreSQL (`streams.store`) what is complete.
"""
