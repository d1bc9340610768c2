"""``writer.fact(session)`` and ``reader.commit(conn=session)`` with synchronous SQLAlchemy
objects where greenlet is not installed (SQLAlchemy 2.1 no longer installs it, and its asyncio
extension cannot be imported without it): `streams.orm` must not import that extension for a
synchronous object.

The environment without greenlet is a subprocess of this interpreter in which
``sys.modules["greenlet"] = None`` is set before anything is imported, so ``import greenlet``
raises ImportError exactly as when it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import streams

SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["greenlet"] = None  # as if not installed: `import greenlet` raises ImportError

    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    import streams

    url, stream = sys.argv[1], sys.argv[2]
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with streams.connect(url) as client:
            with client.writer(stream) as writer, Session(engine) as session:
                with writer.fact(session) as fact:
                    fact.add({"order": 1})
                session.commit()
                written = fact.stream_id
            with client.reader(stream, group="no-greenlet") as reader:
                epoch = reader.poll(timeout=10)
                assert epoch is not None and epoch.facts[-1].stream_id == written, epoch
                with Session(engine) as session:
                    reader.commit(conn=session)
                    session.commit()
            committed = {g.group: g.position for g in client.groups(stream)}
            assert committed == {"no-greenlet": written}, committed
    finally:
        engine.dispose()
    assert "sqlalchemy.ext.asyncio" not in sys.modules
    print("ok", written)
    """
)


def test_sync_sqlalchemy_objects_need_no_greenlet(
    client: streams.Client, stream: str, streams_url: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, streams_url, stream],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok "), done.stdout
