"""`streams bench probe` (issue 10, item 3): a small run measures every situation."""

from __future__ import annotations

import json

import psycopg
from click.testing import CliRunner

from streams.bench.probe_cost import bench_probe_command, run_probe_bench


def test_probe_bench_small_run(streams_url: str) -> None:
    lines: list[str] = []
    result = run_probe_bench(
        streams_url, lock_counts=(50,), idle_sessions=3, iterations=5, report=lines.append
    )
    names = [s.name for s in result.scenarios]
    assert names == ["idle", "locks-50", "idle-in-tx-3", "writing", "idle-again"]
    assert result.scenarios[1].held == 50
    assert result.scenarios[2].held == 3
    for scenario in result.scenarios:
        assert scenario.select1_ms > 0
        assert set(scenario.probe_ms) == {1, 3}
        assert scenario.follow_ms > 0  # a shared-proof follower's look, measured beside it
    idle = (result.scenarios[0].probe_ms[1] + result.scenarios[4].probe_ms[1]) / 2
    assert abs(result.ratio(result.scenarios[1], 1) * idle - result.scenarios[1].probe_ms[1]) < 1e-9
    assert any(line.startswith("target (issue 10)") for line in lines)
    assert any(line.startswith("with shared proofs, a reader's look") for line in lines)
    assert any(line.startswith("while another session writes: probe 1") for line in lines)
    # Nothing is left behind: the bench streams are dropped, the locks released.
    with psycopg.connect(streams_url) as conn:
        (streams,) = conn.execute(
            "SELECT count(*) FROM streams_registry WHERE name LIKE 'bench-probe-%'"
        ).fetchone()  # type: ignore[misc]
        (proofs,) = conn.execute(
            "SELECT count(*) FROM streams_proofs p WHERE NOT EXISTS "
            "(SELECT 1 FROM streams_registry r WHERE r.id = p.stream)"
        ).fetchone()  # type: ignore[misc]
        (locks,) = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s",
            (0x5B0BE,),
        ).fetchone()  # type: ignore[misc]
        (tables,) = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'streams_bench_probe_writes'"
        ).fetchone()  # type: ignore[misc]
    assert (streams, proofs, locks, tables) == (0, 0, 0, 0)


def test_probe_bench_command_json(streams_url: str) -> None:
    out = CliRunner().invoke(
        bench_probe_command,
        [
            "--database-url",
            streams_url,
            "--iterations",
            "3",
            "--locks",
            "20",
            "--idle-sessions",
            "2",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output.strip().splitlines()[-1])
    assert data["target_ratio"] == 2.0
    names = [s["name"] for s in data["scenarios"]]
    assert names == ["idle", "locks-20", "idle-in-tx-2", "writing", "idle-again"]
