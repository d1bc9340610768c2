"""Every connection gets TCP keepalives and a send timeout unless its URL sets its own
(`streams.store.sessions.CLIENT_TCP_SETTINGS`): a partitioned server is noticed in about a
minute, not the operating system's two hours."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from streams.errors import ConfigurationError
from streams.store.sessions import CLIENT_TCP_SETTINGS, with_client_tcp_settings


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@db.example:5432/orders",
        "postgres://db.example/orders?sslmode=require",
        "host=db.example dbname=orders user=app",
    ],
)
def test_the_settings_are_added_to_every_form_of_url(url: str) -> None:
    params = conninfo_to_dict(with_client_tcp_settings(url))
    for key, value in CLIENT_TCP_SETTINGS.items():
        assert params[key] == value
    for key, own in conninfo_to_dict(url).items():
        assert params[key] == own  # nothing of the URL changes


def test_the_urls_own_settings_win() -> None:
    url = "postgresql://db.example/orders?keepalives_idle=5&tcp_user_timeout=1000"
    params = conninfo_to_dict(with_client_tcp_settings(url))
    assert (params["keepalives_idle"], params["tcp_user_timeout"]) == ("5", "1000")
    assert params["keepalives_count"] == CLIENT_TCP_SETTINGS["keepalives_count"]


def test_a_bad_url_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigurationError) as raised:
        with_client_tcp_settings("postgresql://app:pa@ss@db.example/orders")
    assert "pa@ss" not in str(raised.value)
