"""docker-compose.yml runs the whole system. There is no Docker engine (nor compose plugin) on
the development machines, so this checks what can be checked without one: the file parses,
every service the README names is there with a healthcheck where others wait on it, every
`depends_on` and mounted path exists, and the commands it runs are real CLI commands."""

from __future__ import annotations

import yaml
from click.testing import CliRunner
from helpers import REPO_ROOT

from streams.ops.cli import main

ROOT = REPO_ROOT


def test_compose_file_runs_the_whole_system() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "spark-master", "spark-worker", "demo", "metrics",
            "prometheus"} <= set(services)  # fmt: skip
    for name, service in services.items():
        depends = service.get("depends_on", {})
        for dep, condition in depends.items() if isinstance(depends, dict) else []:
            assert dep in services, (name, dep)
            if condition.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health"
        for volume in service.get("volumes", []):
            assert (ROOT / volume.split(":")[0]).exists(), volume
    for name in ("demo", "metrics"):
        command = services[name]["command"]
        assert command[:3] == ["python3", "-m", "streams"]
        args = [a for a in command[3:] if not a.startswith("-")][:2]
        help_result = CliRunner().invoke(main, [*args, "--help"])
        assert help_result.exit_code == 0, (name, help_result.output)
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (target,) = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "metrics:9464"
