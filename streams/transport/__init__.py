"""Redis: the fast path that tells processes when to look, never what is true.

* `link`: `RedisLink` (threads) and `AsyncRedisLink` (asyncio) of one process: the subscriber,
  the publisher, the connection discipline (subscribe, then ``REPLICATE``; keep-alive;
  reconnect with backoff), written once as plans that both drive.
* `faces`: what writers, readers and the prover need of a link (`Link`, `ProverLink`), and
  `AttachedWriter`, through which a writer announces (the link owns its `Announcer`).
* `connections`: the subscriber read in bulk (threads and asyncio) and the fire-and-forget
  publisher, on connections redis-py opens.
* `connect`: Redis failures as errors that say what failed, where and what to do.

What a message means is decided in `streams.core.replication`; here is only I/O. Nothing read
from Redis is trusted: readers ask PostgreSQL (`streams.store`) what is complete.
"""
