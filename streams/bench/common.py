"""What the benchmarks share: their payload, percentiles, the raw catch-up loop, and the
bookkeeping that removes whatever a benchmark created.

* `PAYLOAD`: what every benchmark appends (197 bytes as JSONB).
* `percentile`, `percentiles_ms`: linear interpolation between closest ranks.
* `raw_catchup`: the raw baseline of a catch-up: a plain psycopg loop paging a stream's rows.
* `scratch_streams`: a context that hands out new streams (and names of raw baseline tables
  and sequences), watches the child processes a benchmark starts, and at its end, whether the
  benchmark returned, failed or was interrupted (Ctrl-C), ends those children and drops it all:
  each stream with `drop_streams` (its registry row, which takes its writer rows, reader groups
  and proof record with it through their foreign keys, its partition of ``streams_facts`` and
  its sequence), then the raw tables and sequences.
* `ignore_interrupts`: the first thing a benchmark's child process does (its parent ends it).
* `progress_report`: how a command prints a benchmark's lines (with a spinner on a terminal).
"""

from __future__ import annotations

import contextlib
import math
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType
from typing import Any, TypeVar

import click
import psycopg
from psycopg import sql

from ..cli_params import failure_line
from ..core.fact_columns import KEY_ORDER, ROW_INDEX, ROW_SELECT
from ..core.payloads import decode_payloads
from ..errors import StoreError, StreamsError
from ..store import sessions
from ..store.driver import run
from ..store.registry import create_stream, drop_stream
from ..types import StreamInfo

__all__ = [
    "CHILD_GRACE_SECONDS",
    "PAYLOAD",
    "Scratch",
    "drop_streams",
    "end_children",
    "ignore_interrupts",
    "percentile",
    "percentiles_ms",
    "progress_report",
    "raw_catchup",
    "scratch_streams",
]

_PAYLOAD = ROW_INDEX["payload"]

#: The payload every benchmark appends: 197 bytes as JSONB.
PAYLOAD = {"kind": "bench", "text": "x" * 160}
#: Seconds a child process has to exit after SIGTERM before it is killed.
CHILD_GRACE_SECONDS = 5.0

#: A child process of a benchmark: started with `subprocess` or `multiprocessing`.
Child = subprocess.Popen[Any] | BaseProcess
C = TypeVar("C", bound=Child)


# ------------------------------------------------------------------------------ figures


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of sorted values (NaN if none)."""
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def percentiles_ms(seconds: Iterable[float]) -> dict[str, float]:
    """``{"p50_ms": ..., "p99_ms": ...}`` of durations in seconds."""
    ordered = sorted(seconds)
    return {"p50_ms": 1000 * percentile(ordered, 0.5), "p99_ms": 1000 * percentile(ordered, 0.99)}


def raw_catchup(
    database_url: str, stream_key: int, page_size: int, limit: int | None = None
) -> tuple[int, float]:
    """Page through the rows of stream ``stream_key`` (all of them, or pages until at least
    ``limit``) as plainly and as fast as psycopg can: (rows read, seconds).

    The work a reader does to get them, without the reader: autocommit, the stream and the
    bounds inlined as integer literals (so the planner knows the partition), the payload read
    as JSON text and a page's payloads decoded in one call with the reader's own decoder
    (`streams.core.payloads.decode_payloads`; psycopg's loader per value is slower). Analyze a
    freshly filled partition first: without statistics the planner sorts the whole rest of the
    stream for every page (several times slower), where a reader's queries are planned well.
    """
    key, size = int(stream_key), int(page_size)
    with psycopg.connect(database_url, autocommit=True) as conn:
        count = after = 0
        start = time.perf_counter()
        while limit is None or count < limit:
            rows = conn.execute(
                f"SELECT {ROW_SELECT} FROM streams_facts "
                f"WHERE stream = {key} AND stream_id > {int(after)} "
                f"ORDER BY {KEY_ORDER} LIMIT {size}"
            ).fetchall()
            decode_payloads([row[_PAYLOAD] for row in rows])
            count += len(rows)
            if len(rows) < size:
                break
            after = rows[-1][0]
        return count, time.perf_counter() - start


# ------------------------------------------------------------------------------ reporting


def progress_report() -> Callable[[str], None]:
    """Print a benchmark's lines; on a terminal, also keep a spinner on stderr showing the
    last one and the time spent, so a long run shows it is alive (plain when piped)."""
    if not sys.stderr.isatty():
        return click.echo
    import atexit

    from rich.console import Console

    status = Console(stderr=True).status("starting...")
    status.start()
    started = time.monotonic()

    def report(line: str) -> None:
        status.stop()
        click.echo(line)
        status.update(f"{time.monotonic() - started:.0f}s: {line.strip()[:80]}")
        status.start()

    atexit.register(status.stop)
    return report


# ------------------------------------------------------------------------------ cleanup


def drop_streams(database_url: str, names: Iterable[str]) -> None:
    """Drop each stream (`streams.store.registry.drop_stream`: registry row, partition,
    sequence; writer rows, reader groups and the proof record go with the registry row). One
    that fails does not stop the others; `StoreError` names those left, afterwards."""
    with contextlib.closing(
        sessions.connect(database_url, autocommit=False, purpose="bench cleanup")
    ) as conn:
        left = _drop_each(conn, database_url, names)
    if left:
        raise StoreError(f"could not drop stream(s) {', '.join(left)}: {next(iter(left.values()))}")


def _drop_each(
    conn: psycopg.Connection[Any], database_url: str, names: Iterable[str]
) -> dict[str, str]:
    """Drop each stream on ``conn``: what could not be dropped, and why."""
    left: dict[str, str] = {}
    for name in names:
        try:
            run(conn, drop_stream(name))
        except Exception as exc:
            left[name] = _why(exc, database_url)
    return left


def _why(exc: Exception, database_url: str) -> str:
    """One line for a failed removal, every form of a password out."""
    return str(exc) if isinstance(exc, StreamsError) else failure_line(exc, database_url, None)


def _alive(child: Child) -> bool:
    if isinstance(child, subprocess.Popen):
        return child.poll() is None
    return child.pid is not None and child.is_alive()


def _wait(child: Child, timeout: float) -> bool:
    """Whether ``child`` exited within ``timeout`` seconds."""
    if isinstance(child, subprocess.Popen):
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    child.join(timeout=timeout)
    return not child.is_alive()


def end_children(children: Iterable[Child], grace: float = CHILD_GRACE_SECONDS) -> None:
    """SIGTERM every child still running, SIGKILL those still there after ``grace`` seconds,
    and reap them all (closing the pipes of `subprocess` ones)."""
    children = list(children)
    alive = [child for child in children if _alive(child)]
    for child in alive:
        with contextlib.suppress(ProcessLookupError):
            child.terminate()
    deadline = time.monotonic() + grace
    for child in alive:
        if not _wait(child, max(0.0, deadline - time.monotonic())):
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            _wait(child, grace)
    for child in children:
        if isinstance(child, subprocess.Popen):
            for pipe in (child.stdin, child.stdout, child.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


def ignore_interrupts() -> None:
    """In a benchmark's child process: leave Ctrl-C to the parent. A terminal sends SIGINT to
    the whole process group; the parent's `Scratch` then ends its children (SIGTERM) before it
    drops their streams, and no child prints a traceback on the way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM during a benchmark run: stop it as Ctrl-C would (`Scratch.__enter__`)."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """While cleaning up: a first Ctrl-C says what is going on, a second one gives up."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (
        None,
        signal.SIG_IGN,
    ):
        yield
        return
    pressed: list[int] = []

    def interrupted(signum: int, frame: FrameType | None) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)
        click.echo(
            "bench: removing the streams and processes the benchmark created "
            "(Ctrl-C again to leave them)",
            err=True,
        )

    signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Scratch:
    """What one benchmark run creates, removed when the run ends (see `scratch_streams`).

    Streams are named ``bench-<kind>-<unix time>-<4 hex>[-<role>]``; raw tables and sequences
    ``streams_bench_<stem>_<8 hex>``.
    """

    def __init__(self, database_url: str, kind: str) -> None:
        self.database_url = database_url
        self.kind = kind
        self.tag = f"{int(time.time())}-{secrets.token_hex(2)}"
        self._streams: list[str] = []
        self._handed_out: set[str] = set()
        self._kept: set[str] = set()
        self._tables: list[str] = []
        self._sequences: list[str] = []
        self._children: list[Child] = []
        #: The SIGTERM handler to restore when the run ends (None: none was installed).
        self._term_handler: Any = None

    # -------------------------------------------------------------------------- handing out

    def create(self, role: str = "") -> StreamInfo:
        """Create a new stream (default settings) named after the run and ``role``."""
        base = f"bench-{self.kind}-{self.tag}" + (f"-{role}" if role else "")
        name, n = base, 1
        while name in self._handed_out:
            n += 1
            name = f"{base}-{n}"
        self._handed_out.add(name)
        with contextlib.closing(
            sessions.connect(self.database_url, autocommit=False, purpose="bench")
        ) as conn:
            self._streams.append(name)  # before: an interrupted create may have committed
            try:
                return run(conn, create_stream(name, exist_ok=False))
            except Exception:
                self._streams.remove(name)  # one transaction that failed: nothing to drop
                raise

    def table(self, stem: str) -> str:
        """A name for a raw baseline table the caller creates; dropped at the end."""
        name = f"streams_bench_{stem}_{secrets.token_hex(4)}"
        self._tables.append(name)
        return name

    def sequence(self, stem: str) -> str:
        """A name for a raw baseline sequence the caller creates; dropped at the end."""
        name = f"streams_bench_{stem}_seq_{secrets.token_hex(4)}"
        self._sequences.append(name)
        return name

    def watch(self, child: C) -> C:
        """A child process of the benchmark: ended (if still running) before anything is
        dropped."""
        self._children.append(child)
        return child

    # -------------------------------------------------------------------------- early ends

    def keep(self, name: str) -> None:
        """Leave stream ``name`` in place at the end (``streams bench history --keep``)."""
        self._kept.add(name)

    def drop(self, name: str) -> None:
        """Drop stream ``name`` now (its processes must have ended)."""
        drop_streams(self.database_url, [name])
        self._streams.remove(name)

    # -------------------------------------------------------------------------- the end

    def __enter__(self) -> Scratch:
        # A SIGTERM (a job's timeout, `kill`) ends the run as a Ctrl-C does, through the
        # removal below, rather than leaving the streams and children behind.
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            self._term_handler = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with _interrupts_deferred():
            try:
                problems = self._remove()
            finally:
                if self._term_handler is not None:
                    signal.signal(signal.SIGTERM, self._term_handler)
        if problems and exc is None:
            raise StoreError("; ".join(problems))
        for problem in problems:  # the benchmark's own failure is what the caller sees
            click.echo(f"bench: {problem}", err=True)

    def _remove(self) -> list[str]:
        """End the children, then drop the streams, tables and sequences: what failed."""
        problems: list[str] = []
        try:
            end_children(self._children)
        except Exception as exc:
            problems.append(f"could not end a child process: {type(exc).__name__}")
        self._children.clear()
        streams = [name for name in self._streams if name not in self._kept]
        relations = [
            *((sql.SQL("DROP TABLE IF EXISTS {}"), name) for name in self._tables),
            *((sql.SQL("DROP SEQUENCE IF EXISTS {}"), name) for name in self._sequences),
        ]
        self._streams.clear()
        self._tables.clear()
        self._sequences.clear()
        if not streams and not relations:
            return problems
        try:
            conn = sessions.connect(self.database_url, autocommit=False, purpose="bench cleanup")
        except Exception as exc:
            what = ", ".join([*streams, *(name for _, name in relations)])
            return [*problems, f"could not remove {what}: {_why(exc, self.database_url)}"]
        with contextlib.closing(conn):
            left = _drop_each(conn, self.database_url, streams)
            problems.extend(f"could not drop stream {name}: {why}" for name, why in left.items())
            conn.autocommit = True
            for statement, name in relations:
                try:
                    conn.execute(statement.format(sql.Identifier(name)))
                except Exception as exc:
                    problems.append(f"could not drop {name}: {_why(exc, self.database_url)}")
        return problems


def scratch_streams(database_url: str, kind: str) -> Scratch:
    """``with scratch_streams(url, "write") as scratch:``: the streams, raw tables and child
    processes of one benchmark run, all removed when the block ends, however it ends (see
    `Scratch`). A Ctrl-C during the removal says so; a second one abandons it. A failure to
    remove is an error of its own (`StoreError`) after a run that succeeded, a line on stderr
    after one that failed."""
    return Scratch(database_url, kind)
