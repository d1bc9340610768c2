"""A reader's other sessions, on ADBC: pages of rows read as Arrow tables.

`streams.arrow` delivers a reader's facts as Arrow record batches. Its proofs are the reader's
own (step 2 of the read sequence, `streams.store.reads`, on the reader's psycopg session:
`ReaderCore.step` without rows); the rows of what they proved are read here, on an ADBC
connection (ADBC's PostgreSQL driver reads the binary COPY format straight into Arrow columns,
with no Python object per value), by the store's plan `streams.store.reads.read_proven_range`
(steps 3-4: the rows, then the retention check). Why another session may read what the first
proved is written there. Step 1 runs on this session when it connects (`ArrowSession`), as it
does on the shells' psycopg sessions: a session on another database history never reads.

Terms: an **ADBC session** is one ``adbc_driver_postgresql`` connection in autocommit with the
readers' session settings (`streams.store.probe.READER_SESSION_SETUP`). A **transient** failure
is one another try on a fresh session may mend (the connection or server failed, or PostgreSQL
said so by its SQLSTATE: `streams.store.driver.transient_sqlstate`); `ArrowSession.read` tries
again on a fresh session with back-off for `RETRY_SECONDS`, then raises `ConnectionLost`. A
read moves no position (the shell does, after it), so trying it again delivers nothing twice.

pyarrow and ADBC are optional (the ``arrow`` extra): `require_arrow` says so in a `UsageError`.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.replication import backoff_delay
from ..errors import ConnectionLost, StoreError, UsageError
from .driver import Commit, Query, transient_sqlstate
from .identity import check_history
from .probe import READER_SESSION_SETUP
from .reads import RangeGen, StreamRows, read_proven_range
from .sessions import with_client_tcp_settings

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "BATCH_BYTES",
    "RETRY_SECONDS",
    "SESSIONS",
    "ArrowSession",
    "ArrowSessions",
    "require_arrow",
    "run_on_adbc",
    "transient",
]

T = TypeVar("T")
R = TypeVar("R")

#: ADBC sessions of one reader (`ArrowSessions`): reads of consecutive ranges run on them at
#: once. Two ran 1.4-1.55x one on the 2-core development machine (1,000,000 rows; three: no
#: better than two): the server's output of the rows is most of a read's cost, and two
#: backends share it.
SESSIONS = 2
#: What an ADBC session sets besides the readers' settings: its reads are spans of stream IDs
#: (`streams.arrow`) whose upper bound is below the stream's end, and for a span of a few
#: percent of a stream the planner chose a (parallel) sequential scan of the whole partition
#: and a sort over the primary key's range scan: 0.4x the speed (measured, 65,535 IDs of
#: 1,000,000). Set after step 1 (the incarnation's catalog join took 120-190 ms with it, 2 ms
#: without): every later statement reads a key range of the facts or the registry's row by
#: its primary key.
ARROW_SESSION_SETUP = ("SET enable_seqscan = off",)
#: Seconds a page read keeps being tried while it fails transiently.
RETRY_SECONDS = 60.0
#: ADBC's record batch size hint (bytes; its default is 16 MiB): large enough that a page of
#: the default size usually arrives as one batch, which `streams.arrow` then hands on without
#: concatenating (a copy).
BATCH_BYTES = 64 << 20
#: ADBC's PostgreSQL statement option for `BATCH_BYTES`.
_BATCH_SIZE_OPTION = "adbc.postgresql.batch_size_hint_bytes"


def require_arrow(what: str) -> None:
    """`UsageError` naming the extra to install when pyarrow or the ADBC driver is missing."""
    try:
        import adbc_driver_postgresql.dbapi  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"{what} needs pyarrow and adbc-driver-postgresql ({exc.name} is not installed): "
            "pip install 'streams[arrow]'"
        ) from None


def transient(exc: BaseException) -> bool:
    """Is this failure of a read worth another try on a fresh session: the connection or the
    server failed (an ``OperationalError``, a socket error, no connection), or PostgreSQL said
    so by its SQLSTATE (a cancelled statement, a timeout, a restart)? A statement error, such
    as a missing table, is not: no retry mends it."""
    import adbc_driver_manager

    if isinstance(exc, ConnectionLost | OSError | adbc_driver_manager.OperationalError):
        return True
    if isinstance(exc, adbc_driver_manager.Error):
        return transient_sqlstate(getattr(exc, "sqlstate", None))
    return False


def run_on_adbc(
    cur: Any,
    plan: Any,
    rows: Callable[[Any], Iterator[R]],
    *,
    batch_bytes: int,
    statement_errors: bool = False,
) -> Generator[R, None, Any]:
    """Drive a plain-statement plan of the store (`Query` without parameters, `Commit`,
    `StreamRows`: `streams.store.reads.read_range`, `read_proven_range`, `check_history`) on
    the ADBC cursor ``cur``, the one Arrow read path of `ArrowSession` and the Spark executor:
    each `Query` run and its rows sent back, a `Commit` nothing (autocommit), the `StreamRows`
    statement run with ADBC's record batch size hint ``batch_bytes`` and what ``rows(cur)``
    makes of its result yielded (closed when done or left). Returns the plan's result.

    With ``statement_errors``, a statement's ADBC error that is not `transient` is thrown into
    the plan as a `StoreError`; otherwise every error is raised as it is."""
    answer: list[Any] | None = None
    error: StoreError | None = None
    while True:
        try:
            if error is not None:
                op = plan.throw(error)
            else:
                op = next(plan) if answer is None else plan.send(answer)
        except StopIteration as stop:
            return stop.value
        answer, error = [], None
        try:
            if isinstance(op, StreamRows):
                cur.adbc_statement.set_options(**{_BATCH_SIZE_OPTION: str(batch_bytes)})
                cur.execute(op.statement)
                produced = rows(cur)
                try:
                    yield from produced
                finally:
                    close = getattr(produced, "close", None)
                    if close is not None:
                        close()  # e.g. stops and joins a prefetch thread
            elif isinstance(op, Query):
                assert op.params is None, "a plan for any driver has no parameters"
                text = op.statement
                cur.execute(text.decode() if isinstance(text, bytes) else text)
                answer = list(cur.fetchall()) if cur.description else []
            elif not isinstance(op, Commit):  # a Commit: autocommit, nothing to do
                raise TypeError(f"not a plain-statement operation: {op!r}")
        except Exception as exc:
            if not statement_errors or transient(exc):
                raise
            import adbc_driver_manager

            if not isinstance(exc, adbc_driver_manager.Error):
                raise
            error = _store_error(exc)


def _store_error(exc: BaseException) -> StoreError:
    """An ADBC error as the library's error tree has it (first line, SQLSTATE kept)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    error = StoreError(f"ADBC: {text}")
    error.sqlstate = getattr(exc, "sqlstate", None)
    return error


def _whole_table(cur: Any) -> Iterator[pa.Table]:
    """A rows statement's result as one Arrow table (`run_on_adbc`'s ``rows``)."""
    yield cur.fetch_arrow_table()


class ArrowSession:
    """One reader's ADBC session to ``url``, opened on first use and again after a transient
    failure; ``history()`` gives the reader's database incarnation token and the WAL position
    of its last proof, which every new session is checked against (step 1)."""

    def __init__(self, url: str, who: str, history: Callable[[], tuple[str | None, int]]) -> None:
        self._url = url
        self._who = who
        self._history = history
        self._conn: Any = None
        # A read (in a prefetch thread) and `close` never overlap: ADBC must not close a
        # connection under a running statement.
        self._lock = threading.Lock()
        #: Sessions opened (for tests and metrics).
        self.sessions = 0

    def _session(self) -> Any:
        if self._conn is not None:
            return self._conn
        import adbc_driver_postgresql.dbapi as adbc

        try:
            conn = adbc.connect(with_client_tcp_settings(self._url), autocommit=True)
        except Exception as exc:
            raise ConnectionLost(f"cannot connect with ADBC: {type(exc).__name__}") from None
        try:
            with conn.cursor() as cur:
                for statement in READER_SESSION_SETUP:
                    cur.execute(statement)
                token, proof_lsn = self._history()
                if token is not None:  # step 1, before this session reads anything
                    self._drive(cur, check_history(token, self._who, proof_lsn or None))
                for statement in ARROW_SESSION_SETUP:  # after step 1, which it slows 100x
                    cur.execute(statement)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        self._conn = conn
        self.sessions += 1
        return conn

    def _drive(self, cur: Any, plan: RangeGen[T] | Any) -> tuple[T, pa.Table | None]:
        """Run a plain-statement plan on ``cur`` (`run_on_adbc`, its statements' errors thrown
        into it; a transient one is raised as it is: the caller tries again on a fresh
        session): its result, and the Arrow table of its `StreamRows` (None: it had none)."""
        tables: list[pa.Table] = []
        run = run_on_adbc(cur, plan, _whole_table, batch_bytes=BATCH_BYTES, statement_errors=True)
        while True:
            try:
                tables.append(next(run))
            except StopIteration as stop:
                result: T = stop.value
                return result, tables[-1] if tables else None

    def read(
        self, stream: str, stream_key: int, after: int, through: int, limit: int | None
    ) -> pa.Table:
        """Steps 3-4 for ``(after, through]`` (proven by the reader's probe), at most ``limit``
        rows: the rows as an Arrow table (``stream_id, row_no, instance, ts, payload``, the
        payload as ADBC hands jsonb over: Arrow's JSON extension type over UTF-8 strings);
        `FactsPruned` if retention removed facts after ``after``. Transient failures are tried
        again on a fresh session (see the module doc)."""
        with self._lock:
            return self._read(stream, stream_key, after, through, limit)

    def _read(
        self, stream: str, stream_key: int, after: int, through: int, limit: int | None
    ) -> pa.Table:
        failures = 0
        since = time.monotonic()
        while True:
            try:
                cur = self._session().cursor()
                try:
                    _, table = self._drive(
                        cur,
                        read_proven_range(stream, stream_key, after, through, limit, jsonb=True),
                    )
                finally:
                    with contextlib.suppress(Exception):
                        cur.close()
                assert table is not None
                return table
            except Exception as exc:
                if not transient(exc):
                    raise
                self._close()
                if time.monotonic() - since >= RETRY_SECONDS:
                    raise ConnectionLost(
                        f"{self._who}: reading {stream!r} ({after}, {through}] with ADBC failed "
                        f"for {RETRY_SECONDS:g}s: {type(exc).__name__}"
                    ) from None
                if failures:  # the first retry at once: a session the server ended is common
                    time.sleep(backoff_delay(failures - 1, jitter=random.random()))
                failures += 1

    def close(self) -> None:
        """Close the session (after a read in progress, if any)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class ArrowSessions:
    """`SESSIONS` ADBC sessions of one reader (`ArrowSession`: each opened at its first read)
    and the threads that read on them at once (`read_many`)."""

    def __init__(
        self,
        url: str,
        who: str,
        history: Callable[[], tuple[str | None, int]],
        count: int = SESSIONS,
    ) -> None:
        self.sessions = [ArrowSession(url, who, history) for _ in range(count)]
        self._pool: Any = None

    def read(
        self, stream: str, stream_key: int, after: int, through: int, limit: int | None
    ) -> pa.Table:
        """`ArrowSession.read` on the first session."""
        return self.sessions[0].read(stream, stream_key, after, through, limit)

    def read_many(
        self, stream: str, stream_key: int, ranges: list[tuple[int, int]], limit: int
    ) -> list[pa.Table | Exception]:
        """`ArrowSession.read` of each ``(after, through]`` of ``ranges`` (at most as many as
        there are sessions), at once, one per session: each read's table, or its error."""
        from concurrent.futures import ThreadPoolExecutor

        if len(ranges) > len(self.sessions):
            raise ValueError(f"{len(ranges)} ranges for {len(self.sessions)} sessions")
        if len(ranges) == 1:
            after, through = ranges[0]
            try:
                return [self.read(stream, stream_key, after, through, limit)]
            except Exception as exc:
                return [exc]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.sessions), "streams-arrow-read")
        futures = [
            self._pool.submit(session.read, stream, stream_key, after, through, limit)
            for session, (after, through) in zip(self.sessions, ranges, strict=False)
        ]
        results: list[pa.Table | Exception] = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:
                results.append(exc)
        return results

    def close(self) -> None:
        """Close every session (after the reads in progress, if any)."""
        for session in self.sessions:
            session.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
