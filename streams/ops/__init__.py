"""The operator's surface: the ``streams`` command and what only it uses.

* `cli`: the commands (click); `params`: their parameter types and error discipline.
* `doctor`: health checks and the safe repairs; `render`: tables for terminals and pipes.
* `channel`: a read-only look at a replication channel (who answers ``REPLICATE``).
* `demo`: the main job end to end, checking itself; `embedded`: private PostgreSQL and Redis
  servers in ``./.streams/``.

The library never imports this package; it may import anything below it.
"""
