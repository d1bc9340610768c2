"""The pure core: the model of streams, with no I/O (sans-IO, in h11's manner).

Nothing here opens a connection, a socket, a file or a thread's event loop: every module takes
its inputs as values and returns values (times are passed in, never read from a clock), so it
is tested on its own, with Hypothesis against brute-force models. The rule of the package: a
module here imports only other modules of this package and `streams.errors`
(``tests/unit/test_layout.py`` checks it).

* `constants`: every name and number the processes must agree on (Redis channels, advisory
  lock classes, partition names, proof timings).
* `positions`: per-writer and linear positions, pending IDs (Synapse's stream model).
* `frontier`: antichains, probes, the live-subscriber filter (Timely, Strymon).
* `epochs`: `Fact`, `Epoch`, and planning a page of rows into whole facts.
* `timestamps`: S2's timestamp rules (modes, capping, the running maximum).
* `protocol`: the wire protocol's commands, parsed and serialized (Synapse's byte format).
* `replication`: what a replication message means to a process (`LinkCore`, `Announcer`).
* `foreign`: another deployment on the channel: the verdict, and the link's quarantines.
* `stalls`: when a stream held back at one position is worth a look for an expired writer.
* `resp`: a RESP2 parser for the subscriber connection.
"""
