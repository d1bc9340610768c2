"""docker-compose.yml runs the whole system. There is no Docker engine (nor compose plugin) on
the development machines, so this checks what can be checked without one: the file parses,
every service the README names is there with a healthcheck where others wait on it, every
`depends_on` and mounted path exists, and the commands it runs are real CLI commands; the
Grafana service finds the Prometheus data source and the dashboard where its provisioning
files say (`docker compose config`, or the standalone `docker-compose config`, validates the
file too, with and without the `ha` profile, where either is installed: `.ci/run` installs it);
and the Spark image (deploy/spark/Dockerfile) has a Python that `requires-python` accepts, Java 17,
streams[spark] from pip and Spark's own spark-class from the pip PySpark, as the cluster test
(tests/spark/test_cluster.py) runs it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers import REPO_ROOT
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from streams.command import main

ROOT = REPO_ROOT
SPARK_SERVICES = ("spark-master", "spark-worker", "demo", "metrics")


def test_compose_file_runs_the_whole_system() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "spark-master", "spark-worker", "demo", "metrics",
            "prometheus", "grafana"} <= set(services)  # fmt: skip
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
    jobs = {
        job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
        for job in prometheus["scrape_configs"]
    }
    assert jobs == {"streams": ["metrics:9464"], "streams-clients": ["demo:9465"]}
    # The demo serves its client's metrics where Prometheus looks for them.
    demo = services["demo"]["command"]
    assert demo[demo.index("--metrics") + 1] == "0.0.0.0:9465"


def _substitute(value: str) -> str:
    """Compose's ``${VAR:-default}`` with VAR unset: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def image_python(dockerfile: str, build_args: dict[str, str]) -> Version:
    """The Python version of the image a Dockerfile builds: its ``FROM`` resolved through the
    ``ARG`` defaults and the build's args, which must name an official ``python:X.Y...`` image
    (any other base, such as an apache/spark image, has a Python this cannot know)."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    args.update(build_args)
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    found = re.fullmatch(r"(?:docker\.io/)?(?:library/)?python:(\d+\.\d+)(?:\.\d+)?(-\S+)?", image)
    assert found, f"the Spark image starts FROM {image}: not an official python image"
    return Version(found.group(1))


def _spark_build() -> tuple[str, dict[str, str], dict[str, Any]]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    builds = {name: compose["services"][name]["build"] for name in SPARK_SERVICES}
    build = builds["spark-master"]
    assert all(b == build for b in builds.values()), "the Spark services share one image"
    args = {k: _substitute(str(v)) for k, v in build.get("args", {}).items()}
    dockerfile = (ROOT / build["context"] / build["dockerfile"]).read_text()
    return dockerfile, args, compose


def test_the_spark_image_has_a_python_the_project_accepts() -> None:
    dockerfile, args, _ = _spark_build()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    python = image_python(dockerfile, args)
    assert python in SpecifierSet(requires), f"Python {python} in the image; needs {requires}"


@pytest.mark.parametrize(
    ("dockerfile", "args", "version"),
    [
        ("ARG PYTHON_IMAGE=python:3.12-slim-bookworm\nFROM ${PYTHON_IMAGE}\n", {}, "3.12"),
        ("ARG PYTHON_IMAGE=python:3.12\nFROM ${PYTHON_IMAGE}\n", {"PYTHON_IMAGE": "python:3.10"},
         "3.10"),
        ("FROM python:3.11.9-bookworm\n", {}, "3.11"),
    ],
)  # fmt: skip
def test_image_python_reads_the_base_image(
    dockerfile: str, args: dict[str, str], version: str
) -> None:
    assert image_python(dockerfile, args) == Version(version)


def test_image_python_refuses_a_base_whose_python_it_cannot_know() -> None:
    official = "FROM apache/spark:4.2.0-preview5-scala2.13-java17-python3-ubuntu\n"
    with pytest.raises(AssertionError, match="not an official python image"):
        image_python(official, {})


def test_the_spark_image_runs_spark_as_the_cluster_test_does() -> None:
    dockerfile, _, compose = _spark_build()
    assert "openjdk-17-jre-headless" in dockerfile  # Java 17
    # streams with the spark extra from pip (which brings PySpark, and with it Spark), and
    # /opt/spark is that PySpark's directory.
    assert re.search(r'pip install [^\n]*"/opt/streams\[spark[,\]]', dockerfile)
    assert re.search(r"ln -s .*pyspark.__file__.*\n\s*/opt/spark", dockerfile)
    assert "SPARK_HOME=/opt/spark" in dockerfile
    for path in re.findall(r"^COPY (.+) /opt/streams", dockerfile, re.M):
        for source in path.split():
            assert (ROOT / source).exists(), source
    cluster_test = (ROOT / "tests" / "sparkcluster.py").read_text()
    for service, cls in (("spark-master", "master.Master"), ("spark-worker", "worker.Worker")):
        command = compose["services"][service]["command"]
        assert command[:2] == ["/opt/spark/bin/spark-class", f"org.apache.spark.deploy.{cls}"]
        assert command[1] in cluster_test
    worker = compose["services"]["spark-worker"]["command"]
    assert worker[2] == "spark://spark-master:7077"
    assert (
        worker[worker.index("--cores") + 1] == "2" and worker[worker.index("--memory") + 1] == "2g"
    )
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # not sent as the build's context


def _compose_cli() -> list[str] | None:
    """``docker compose`` if the Docker CLI with its compose plugin is here, else the
    standalone ``docker-compose`` (Debian's package: ``apt-get install docker-compose``), else
    None. Neither needs an engine to validate a file."""
    docker = shutil.which("docker")
    if docker is not None:
        found = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30,
            check=False,
        )  # fmt: skip
        if found.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone is not None else None


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    compose_cli = _compose_cli()
    if compose_cli is not None:  # the real validation, where the plugin exists
        for profiles in ([], ["--profile", "ha"]):
            checked = subprocess.run(
                [*compose_cli, "-f", str(ROOT / "docker-compose.yml"), *profiles, "config",
                 "--quiet"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert checked.returncode == 0, checked.stderr
    # Always (there is no compose plugin on the development machines): what it would check of
    # the grafana service, and what it cannot (the mounted files are what Grafana expects).
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    grafana = services["grafana"]
    image, _, tag = grafana["image"].partition(":")
    assert image == "grafana/grafana" and re.fullmatch(r"\d+\.\d+\.\d+", tag), grafana["image"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert any(p.endswith(":3000") for p in grafana["ports"])
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == (
        "Viewer"
    )
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, *_ = volume.split(":")
        assert (ROOT / source).exists(), source
        mounts[target] = ROOT / source
    provisioning = Path("/etc/grafana/provisioning")
    datasources = mounts[str(provisioning / "datasources")]
    (source,) = yaml.safe_load((datasources / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090" in " ".join(services["prometheus"]["ports"])
    dashboards = mounts[str(provisioning / "dashboards")]
    (provider,) = yaml.safe_load((dashboards / "streams.yml").read_text())["providers"]
    assert provider["type"] == "file"
    dashboard = Path(provider["options"]["path"]) / "streams.json"
    assert mounts[str(dashboard)] == ROOT / "deploy" / "grafana" / "streams.json"
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == str(dashboard)
    # It loads as JSON (its own checks: tests/integration/test_dashboard.py).
    assert json.loads(mounts[str(dashboard)].read_text())["uid"]
