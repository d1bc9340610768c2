"""Redis URLs of the three topologies, parsed in one place (pure: no I/O, no driver).

* ``redis://``, ``rediss://``, ``unix://``: one server (``single``); redis-py reads the URL.
* ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]``:
  a master that Sentinels watch (``sentinel``). The hosts are *Sentinels* (port 26379 if left
  out); ``service_name`` is the name they monitor (``sentinel monitor <name> ...``). Every
  connection asks them for the current master, connects to it and checks that it is a master
  (``ROLE``), so after a failover processes follow the new master by themselves. The user and
  password are the *master's*; Sentinels are asked without a password unless the query says
  ``sentinel_password=`` (and ``sentinel_username=``). Other query options (``socket_timeout``,
  ...) are passed on to the master's connection, as redis-py reads them in a ``redis://`` URL.
* ``redis+cluster://[[user]:password@]host:port[,host:port...][?options]``: a Redis Cluster
  (``cluster``): the hosts are seed nodes (port 6379 if left out); the slot map is read from
  whichever answers. No database number (a cluster has only database 0).
* ``rediss+sentinel://`` and ``rediss+cluster://``: the same over TLS (``tls``): every server
  is reached with ``rediss://`` (the Sentinels too), and the ``ssl_*`` query options
  (``ssl_ca_certs``, ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``,
  ``ssl_check_hostname``...) go to every connection, the Sentinels' included.

A raw ``@ / ? #`` in the user name or password must be percent-encoded, as in any URL. Errors
raise `ConfigurationError` and never quote the user information (the password): they name the
scheme and the part that is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode

from .errors import ConfigurationError

__all__ = [
    "CLUSTER_SCHEME",
    "SENTINEL_SCHEME",
    "TOPOLOGY_SCHEMES",
    "RedisTopology",
    "is_topology_url",
    "parse_redis_url",
]

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
#: Every Sentinel and Cluster scheme, plain and TLS (``rediss+``).
TOPOLOGY_SCHEMES = (
    SENTINEL_SCHEME,
    CLUSTER_SCHEME,
    "rediss+sentinel",
    "rediss+cluster",
)
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_CLUSTER_PORT = 6379

_SERVICE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9_.\-]{1,253}")
#: Query options of a Sentinel URL that are for the Sentinels, not passed on to the master.
_SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")

Kind = Literal["single", "sentinel", "cluster"]


@dataclass(frozen=True, slots=True)
class RedisTopology:
    """What a Redis URL names. ``nodes``: the Sentinels or the cluster's seed nodes, as
    ``(host, port)`` (empty for ``single``). The repr hides the passwords."""

    kind: Kind
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    #: Query options passed on to each server's connection, in order.
    options: tuple[tuple[str, str], ...] = ()
    #: ``rediss+``: every server (the Sentinels too) is reached over TLS.
    tls: bool = False

    # What each kind means for a connection, named once: callers ask these, not the kind.

    @property
    def follows_master(self) -> bool:
        """Sentinel: the master is asked of the Sentinels, checked with ``ROLE``, and checked
        again on every keep-alive (it may be demoted while it stays reachable)."""
        return self.kind == "sentinel"

    @property
    def sharded(self) -> bool:
        """Cluster: channels live on shards found from the slot map."""
        return self.kind == "cluster"

    @property
    def fixed_url(self) -> str | None:
        """The one server to connect to, known without asking anyone (a single server)."""
        return self.url if self.kind == "single" else None

    @property
    def reconnect_cap(self) -> float:
        """Most seconds between two reconnection attempts: under Sentinel the next attempt asks
        for the master again, on a cluster another node, so they are tried at least once a
        second (live soon after a promotion or a shard's restart); one server is waited for."""
        return 5.0 if self.kind == "single" else 1.0

    def node_url(self, host: str, port: int, *, db: int | None = None) -> str:
        """A plain ``redis://`` URL of one server of this topology (a master, a cluster node),
        with the URL's user, password and options."""
        auth = ""
        if self.username is not None or self.password is not None:
            auth = quote(self.username or "", safe="")
            if self.password is not None:
                auth += ":" + quote(self.password, safe="")
            auth += "@"
        where = f"[{host}]" if ":" in host else host
        query = f"?{urlencode(self.options)}" if self.options else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}{where}:{port}/{self.db if db is None else db}{query}"

    def sentinel_url(self, host: str, port: int) -> str:
        """A ``redis(s)://`` URL of one Sentinel: the Sentinel credentials, the TLS options."""
        auth = ""
        if self.sentinel_username is not None or self.sentinel_password is not None:
            auth = quote(self.sentinel_username or "", safe="")
            if self.sentinel_password is not None:
                auth += ":" + quote(self.sentinel_password, safe="")
            auth += "@"
        where = f"[{host}]" if ":" in host else host
        tls = [(k, v) for k, v in self.options if k.startswith("ssl_")] if self.tls else []
        query = f"?{urlencode(tls)}" if tls else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{where}:{port}/0{query}"


def is_topology_url(url: str) -> bool:
    """Whether ``url`` is a Sentinel or Cluster URL (cheap: the scheme only)."""
    scheme = url.partition("://")[0].lower()
    return scheme in TOPOLOGY_SCHEMES


def parse_redis_url(url: str) -> RedisTopology:
    """The topology ``url`` names (see the module docstring); `ConfigurationError` if it is a
    Sentinel or Cluster URL that does not parse. A single server's URL is returned as is
    (``kind="single"``): `streams.config.validate_redis_url` checks those."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in TOPOLOGY_SCHEMES:
        return RedisTopology("single", url)
    tls = scheme.startswith("rediss+")
    scheme = scheme.replace("rediss+", "redis+")
    what = "Sentinel" if scheme == SENTINEL_SCHEME else "Cluster"
    if any(c.isspace() for c in rest):
        raise ConfigurationError(f"{what} URL contains white space; {_ENCODE}")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in tail.partition("?")[0] or "#" in tail:
        raise ConfigurationError(
            f"{what} URL does not parse as it reads (an '@', '/', '?' or '#' in the password?); "
            f"{_ENCODE}"
        )
    userinfo, at, hosts = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    default_port = DEFAULT_SENTINEL_PORT if scheme == SENTINEL_SCHEME else DEFAULT_CLUSTER_PORT
    nodes = tuple(_node(part, default_port, what) for part in hosts.split(","))
    path, _, query = tail.partition("?")
    options = parse_qsl(query, keep_blank_values=True)
    for key, _value in options:
        if not key or key != key.strip():
            raise ConfigurationError(f"{what} URL: a query option has no name")
    segments = [s for s in path.split("/") if s != ""] if path else []
    if scheme == CLUSTER_SCHEME:
        if segments not in ([], ["0"]):
            raise ConfigurationError(
                "Cluster URL: a cluster has only database 0; write "
                "redis+cluster://host:port[,host:port...] with no path"
            )
        return RedisTopology(
            "cluster", url, nodes, None, 0, username, password, options=tuple(options), tls=tls
        )
    if not segments or len(segments) > 2:
        raise ConfigurationError(
            "Sentinel URL needs the monitored service name: "
            "redis+sentinel://host:port[,host:port...]/service_name[/db]"
        )
    service = unquote(segments[0])
    if not _SERVICE.fullmatch(service):
        raise ConfigurationError(
            f"Sentinel URL: invalid service name {service!r} (1-128 characters from letters, "
            "digits, '_', '.', ':' or '-')"
        )
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit() or len(segments[1]) > 5:
            raise ConfigurationError(
                f"Sentinel URL: the database must be a number, not {segments[1]!r}"
            )
        db = int(segments[1])
    given = dict(options)
    return RedisTopology(
        "sentinel",
        url,
        nodes,
        service,
        db,
        username,
        password,
        given.get("sentinel_username") or None,
        given.get("sentinel_password") or None,
        tuple((k, v) for k, v in options if k not in _SENTINEL_OPTIONS),
        tls,
    )


_ENCODE = (
    "percent-encode special characters in the user name and password "
    "(/ as %2F, @ as %40, : as %3A, ? as %3F, # as %23, % as %25)"
)


def _node(text: str, default_port: int, what: str) -> tuple[str, int]:
    """One ``host[:port]`` (``[v6]:port`` for IPv6) of the host list."""
    if not text:
        raise ConfigurationError(f"{what} URL: empty host in the host list")
    if text.startswith("["):
        host, bracket, after = text[1:].partition("]")
        if not bracket or not host or not re.fullmatch(r"[0-9A-Fa-f:.]+", host):
            raise ConfigurationError(f"{what} URL: bad IPv6 host {text!r}")
        if after and not after.startswith(":"):
            raise ConfigurationError(f"{what} URL: bad host {text!r}")
        port_text = after[1:] if after else None
    else:
        host, colon, port_text_raw = text.partition(":")
        port_text = port_text_raw if colon else None
        if not _HOST.fullmatch(host):
            raise ConfigurationError(f"{what} URL: bad host {text!r}")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigurationError(f"{what} URL: bad port in {text!r} (1-65535)")
    return host, int(port_text)
