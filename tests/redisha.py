"""Private Redis topologies for tests: a Sentinel set and a Cluster, from installed binaries.

* `SentinelSet`: a master, one replica and three Sentinels (``redis-server --sentinel`` with a
  generated config; quorum 2, ``down-after-milliseconds`` 1000), on free ports in a work
  directory. `url` is the ``redis+sentinel://`` URL; `kill_master` SIGKILLs the master;
  `wait_failover` waits until the Sentinels name another master and it says ``ROLE`` master.
* `RedisCluster`: three masters (``--cluster-enabled yes``), slots assigned with ``redis-cli
  --cluster create --cluster-replicas 0``. `url` is the ``redis+cluster://`` URL; `kill` and
  `restart` a node on the same port with its ``nodes.conf`` (its slots come back with it).
* `make_tls` writes a throwaway CA and a server certificate for 127.0.0.1 (``openssl``);
  ``SentinelSet(workdir, tls=...)`` then serves TLS only (``rediss+sentinel://``): every data
  node and Sentinel listens on a TLS port alone, replication and Sentinels' links use TLS.

Every server is a child that dies with the test process (``PR_SET_PDEATHSIG``), leads no
daemon, and is stopped by PID when the set closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from servers import free_port

LOCALHOST = "127.0.0.1"

__all__ = ["TLS", "RedisCluster", "SentinelSet", "make_tls", "redis_cluster", "sentinel_set"]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"the Redis HA tests need {name} on PATH", pytrace=False)
    return path


def _wait(condition: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


class _Server:
    """One ``redis-server`` process (a data node or a Sentinel) on a fixed port."""

    def __init__(
        self, workdir: Path, name: str, port: int, args: list[str], tls: TLS | None = None
    ) -> None:
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = port
        self.args = args
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [_binary("redis-server"), *self.args]
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads start before exec)
            )
        _wait(self.ping, 10, f"{self.name} on port {self.port}")

    def ping(self) -> bool:
        client = self.client(timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def client(self, timeout: float = 2) -> redis.Redis:
        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}
        return redis.Redis(
            LOCALHOST, self.port, socket_timeout=timeout, socket_connect_timeout=timeout, **tls
        )

    def kill(self) -> None:
        """SIGKILL, and wait until the port is free."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _data_args(port: int, *extra: str, tls: TLS | None = None) -> list[str]:
    ports = ["--port", str(port)]
    if tls is not None:
        ports = ["--port", "0", "--tls-port", str(port), *tls.server_args()]
    return [
        *ports, "--bind", LOCALHOST, "--save", "", "--appendonly", "no",
        "--daemonize", "no", "--protected-mode", "no", *extra,
    ]  # fmt: skip


class TLS:
    """A throwaway CA (``ca``) and a server certificate for 127.0.0.1 (`make_tls`)."""

    def __init__(self, directory: Path) -> None:
        self.ca = directory / "ca.crt"
        self.cert = directory / "server.crt"
        self.key = directory / "server.key"

    def server_args(self) -> list[str]:
        return [
            "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no",
            "--tls-replication", "yes",
        ]  # fmt: skip

    def sentinel_config(self, port: int) -> str:
        return (
            f"port 0\ntls-port {port}\ntls-cert-file {self.cert}\ntls-key-file {self.key}\n"
            f"tls-ca-cert-file {self.ca}\ntls-auth-clients no\ntls-replication yes\n"
        )


def make_tls(directory: Path) -> TLS:
    """Write a CA and a server certificate for 127.0.0.1 into ``directory`` (``openssl``)."""
    directory.mkdir(parents=True, exist_ok=True)
    tls = TLS(directory)
    openssl = _binary("openssl")
    run = functools.partial(subprocess.run, check=True, capture_output=True, timeout=30)
    run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=streams-test-ca", "-keyout", str(directory / "ca.key"),
         "-out", str(tls.ca)])  # fmt: skip
    run([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", str(tls.key), "-out", str(directory / "server.csr")])  # fmt: skip
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n", encoding="utf-8")
    run([openssl, "x509", "-req", "-in", str(directory / "server.csr"), "-CA", str(tls.ca),
         "-CAkey", str(directory / "ca.key"), "-CAcreateserial", "-days", "2",
         "-extfile", str(ext), "-out", str(tls.cert)])  # fmt: skip
    return tls


class SentinelSet:
    """A master, a replica and three Sentinels (see the module docstring)."""

    SERVICE = "streamsmaster"

    def __init__(self, workdir: Path, *, down_after_ms: int = 1000, tls: TLS | None = None) -> None:
        self.down_after_ms = down_after_ms
        self.tls = tls
        master_port, replica_port = free_port(), free_port()
        self.data = [
            _Server(workdir, "master", master_port, _data_args(master_port, tls=tls), tls),
            _Server(
                workdir,
                "replica",
                replica_port,
                _data_args(replica_port, "--replicaof", LOCALHOST, str(master_port), tls=tls),
                tls,
            ),
        ]
        self.sentinels = []
        for i in range(3):
            port = free_port()
            config = workdir / f"sentinel{i}" / "sentinel.conf"
            config.parent.mkdir(parents=True, exist_ok=True)
            listen = f"port {port}\n" if tls is None else tls.sentinel_config(port)
            config.write_text(
                f"{listen}bind {LOCALHOST}\ndaemonize no\nprotected-mode no\n"
                f"sentinel monitor {self.SERVICE} {LOCALHOST} {master_port} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} {down_after_ms}\n"
                f"sentinel failover-timeout {self.SERVICE} 5000\n"
                f"sentinel parallel-syncs {self.SERVICE} 1\n",
                encoding="utf-8",
            )
            self.sentinels.append(
                _Server(workdir, f"sentinel{i}", port, [str(config), "--sentinel"], tls)
            )

    @property
    def url(self) -> str:
        hosts = ",".join(f"{LOCALHOST}:{s.port}" for s in self.sentinels)
        if self.tls is not None:
            return f"rediss+sentinel://{hosts}/{self.SERVICE}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def start(self) -> None:
        for server in [*self.data, *self.sentinels]:
            server.start()
        _wait(self._replica_synced, 10, "the replica to sync")
        # Every Sentinel knows the replica and the other Sentinels (hello messages, ~2 s).
        _wait(self._sentinels_ready, 15, "the Sentinels to discover each other", step=0.1)

    def _replica_synced(self) -> bool:
        info: Any = self.data[1].client().info("replication")
        return bool(info.get("master_link_status") == "up")

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            fields: Any = sentinel.client().sentinel_master(self.SERVICE)
            if int(fields["num-other-sentinels"]) < 2 or int(fields["num-slaves"]) < 1:
                return False
        return True

    def master_port(self) -> int:
        """The master's port as the first Sentinel that answers says."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError):
                reply: Any = sentinel.client().execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE
                )
                return int(reply[1])
        raise AssertionError("no Sentinel answers")

    def server(self, port: int) -> _Server:
        return next(s for s in self.data if s.port == port)

    def kill_master(self) -> int:
        """SIGKILL the current master; returns its port."""
        port = self.master_port()
        self.server(port).kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 30) -> int:
        """Wait until the Sentinels name a master other than ``old_port`` that says it is one;
        returns its port."""

        def promoted() -> bool:
            port = self.master_port()
            if port == old_port:
                return False
            role: Any = self.server(port).client().execute_command("ROLE")  # type: ignore[no-untyped-call]
            return bool(role[0] == b"master")

        _wait(promoted, timeout, "the Sentinels to promote the replica", step=0.05)
        return self.master_port()

    def close(self) -> None:
        for server in [*self.sentinels, *self.data]:
            server.kill()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a free port too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536 and port_free(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


class RedisCluster:
    """Three cluster masters on free ports, slots assigned by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = []
        for i in range(masters):
            port = _cluster_port()
            self.nodes.append(
                _Server(
                    workdir,
                    f"node{i}",
                    port,
                    _data_args(
                        port,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-require-full-coverage",
                        "no",
                    ),
                )
            )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOCALHOST}:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                _binary("redis-cli"),
                "--cluster",
                "create",
                *(f"{LOCALHOST}:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait(self.healthy, 15, "the cluster to be ok")

    def healthy(self) -> bool:
        for node in self.nodes:
            if not node.alive():
                return False
            info = node.client().execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or "cluster_slots_ok:16384" not in text:
                return False
        return True

    def node_of(self, channel: str) -> _Server:
        """The node owning ``channel``'s slot (asked of the cluster)."""
        slot = int(self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", channel))  # type: ignore[no-untyped-call]
        for node in self.nodes:
            if not node.alive():
                continue
            slots: Any = node.client().execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            for start, end, master, *_ in slots:
                if int(start) <= slot <= int(end):
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise AssertionError(f"no node owns slot {slot}")

    def kill(self, node: _Server) -> None:
        node.kill()

    def restart(self, node: _Server) -> None:
        """Start ``node`` again on its port, with its ``nodes.conf``: it takes its slots back."""
        node.start()
        _wait(self.healthy, 20, "the cluster to be ok again", step=0.1)

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def sentinel_set(workdir: Path, **kwargs: Any) -> Iterator[SentinelSet]:
    ha = SentinelSet(workdir, **kwargs)
    try:
        ha.start()
        yield ha
    finally:
        ha.close()


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[RedisCluster]:
    cluster = RedisCluster(workdir, masters)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
