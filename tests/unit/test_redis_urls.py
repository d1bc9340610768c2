"""Parsing ``redis+sentinel://`` and ``redis+cluster://`` URLs (`streams.redis_urls`), their
validation in `streams.config`, and their redaction. No servers."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.config import redact_url, validate_redis_url
from streams.errors import ConfigurationError
from streams.redis_urls import RedisTopology, is_topology_url, parse_redis_url


def test_sentinel_url_parts() -> None:
    topology = parse_redis_url(
        "redis+sentinel://:s%40cret@10.0.0.1:26379,sentinel-b,[::1]:26380/mymaster/3"
        "?sentinel_password=spw&socket_timeout=2"
    )
    assert topology.kind == "sentinel"
    assert topology.follows_master and not topology.sharded and topology.fixed_url is None
    assert topology.reconnect_cap == 1.0
    assert topology.nodes == (("10.0.0.1", 26379), ("sentinel-b", 26379), ("::1", 26380))
    assert topology.service == "mymaster"
    assert topology.db == 3
    assert topology.password == "s@cret" and topology.username is None
    assert topology.sentinel_password == "spw"
    assert topology.options == (("socket_timeout", "2"),)
    assert topology.node_url("10.0.0.9", 6380) == (
        "redis://:s%40cret@10.0.0.9:6380/3?socket_timeout=2"
    )
    assert "s@cret" not in repr(topology) and "spw" not in repr(topology)


def test_cluster_url_parts() -> None:
    topology = parse_redis_url("redis+cluster://u:p@h1:7000,h2")
    assert topology.kind == "cluster"
    assert topology.sharded and not topology.follows_master and topology.fixed_url is None
    assert topology.nodes == (("h1", 7000), ("h2", 6379))
    assert (topology.username, topology.password) == ("u", "p")
    assert topology.node_url("h3", 7001) == "redis://u:p@h3:7001/0"


def test_tls_topology_urls() -> None:
    topology = parse_redis_url(
        "rediss+sentinel://:pw@s1:26379,s2/svc?sentinel_password=spw&ssl_ca_certs=/ca.pem"
        "&ssl_cert_reqs=required&socket_timeout=2"
    )
    assert topology.kind == "sentinel" and topology.tls
    assert topology.node_url("m", 6380) == (
        "rediss://:pw@m:6380/0?ssl_ca_certs=%2Fca.pem&ssl_cert_reqs=required&socket_timeout=2"
    )
    assert topology.sentinel_url("s2", 26379) == (
        "rediss://:spw@s2:26379/0?ssl_ca_certs=%2Fca.pem&ssl_cert_reqs=required"
    )
    assert parse_redis_url("redis+sentinel://s1/svc").sentinel_url("s1", 1) == "redis://s1:1/0"
    cluster = parse_redis_url("rediss+cluster://h1:7000?ssl_cert_reqs=none")
    assert cluster.kind == "cluster" and cluster.tls
    assert cluster.node_url("h2", 7001) == "rediss://h2:7001/0?ssl_cert_reqs=none"
    for url in ("rediss+sentinel://s1/svc", "rediss+cluster://h1"):
        assert is_topology_url(url) and validate_redis_url(url) == url
    assert redact_url("rediss+cluster://u:secret@h1") == "rediss+cluster://u:***@h1"


def test_plain_urls_are_single() -> None:
    for url in ("redis://localhost:6379/0", "rediss://h", "unix:///tmp/r.sock"):
        assert parse_redis_url(url) == RedisTopology("single", url)
        single = parse_redis_url(url)
        assert single.fixed_url == url and single.reconnect_cap == 5.0
        assert not single.follows_master and not single.sharded
        assert not is_topology_url(url)
    assert is_topology_url("REDIS+SENTINEL://h/s")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h:26379", "service name"),
        ("redis+sentinel://h:26379/", "service name"),
        ("redis+sentinel://h/svc/x", "database must be a number"),
        ("redis+sentinel://h/svc/0/extra", "service name"),
        ("redis+sentinel://h/bad name", "white space"),
        ("redis+sentinel://h/b%21d", "invalid service name"),
        ("redis+sentinel://h:0/svc", "bad port"),
        ("redis+sentinel://h:99999/svc", "bad port"),
        ("redis+sentinel://h:x/svc", "bad port"),
        ("redis+sentinel://h,,g/svc", "empty host"),
        ("redis+sentinel://[zz]:1/svc", "IPv6"),
        ("redis+cluster://h:7000/1", "only database 0"),
        ("redis+cluster://:pa/ss@h:7000", "does not parse as it reads"),
        ("redis+cluster://:pa#ss@h:7000", "does not parse as it reads"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_redis_url(url)
    with pytest.raises(ConfigurationError):
        validate_redis_url(url)


def test_errors_never_quote_the_password() -> None:
    for url in (
        "redis+sentinel://:hunter22@h:x/svc",
        "redis+cluster://:hunter22@h:7000/5",
        "redis+sentinel://:hunter22@h/svc/nodb",
    ):
        with pytest.raises(ConfigurationError) as info:
            validate_redis_url(url)
        assert "hunter22" not in str(info.value)


def test_config_accepts_the_new_schemes() -> None:
    assert (
        validate_redis_url("redis+sentinel://h1,h2/mymaster") == "redis+sentinel://h1,h2/mymaster"
    )
    assert validate_redis_url("redis+cluster://h1:7000") == "redis+cluster://h1:7000"
    with pytest.raises(ConfigurationError, match="redis\\+cluster://"):
        validate_redis_url("memcached://h")


def test_redaction_covers_the_new_schemes() -> None:
    assert (
        redact_url("redis+sentinel://:pw@h1:1,h2:2/svc/0")
        == "redis+sentinel://:***@h1:1,h2:2/svc/0"
    )
    assert (
        redact_url("redis+cluster://u:pw@h1:7000,h2:7001")
        == "redis+cluster://u:***@h1:7000,h2:7001"
    )
    redacted = redact_url("redis+sentinel://h1/svc?sentinel_password=spw")
    assert "spw" not in redacted


_hosts = st.lists(
    st.tuples(
        st.from_regex(r"[a-z][a-z0-9\-]{0,10}", fullmatch=True),
        st.integers(min_value=1, max_value=65535),
    ),
    min_size=1,
    max_size=4,
)
_secret = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)


@given(
    hosts=_hosts,
    service=st.from_regex(r"[A-Za-z0-9_.:\-]{1,20}", fullmatch=True),
    db=st.integers(min_value=0, max_value=15),
    password=_secret,
)
def test_sentinel_round_trip(
    hosts: list[tuple[str, int]], service: str, db: int, password: str
) -> None:
    url = (
        f"redis+sentinel://:{quote(password, safe='')}@"
        + ",".join(f"{h}:{p}" for h, p in hosts)
        + f"/{quote(service, safe='')}/{db}"
    )
    topology = parse_redis_url(url)
    assert topology.nodes == tuple(hosts)
    assert (topology.service, topology.db, topology.password) == (service, db, password)
    assert validate_redis_url(url) == url
    # The master's URL carries the same password, as redis-py will read it.
    host, port = hosts[0]
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(topology.node_url(host, port))
    assert unquote(parts.password or "") == password
    assert (parts.hostname, parts.port, parts.path) == (host, port, f"/{db}")


@given(text=st.text(max_size=60))
def test_any_text_parses_or_raises_configuration_error(text: str) -> None:
    for url in (f"redis+sentinel://{text}", f"redis+cluster://{text}"):
        try:
            topology = parse_redis_url(url)
        except ConfigurationError:
            continue
        assert topology.kind in ("sentinel", "cluster")
        assert topology.nodes
