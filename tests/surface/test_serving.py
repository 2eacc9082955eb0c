"""What the HTTP services and their clients share (stragglers.serving): URLs checked alike."""

from __future__ import annotations

import pytest

from stragglers.errors import InputError
from stragglers.serving import check_url


@pytest.mark.parametrize("url", ["notaurl", "http://[::1", "http://127.0.0.1:99999", "ftp://h:1",
                                 "http://:80", "", None, "http://h:port"])
def test_a_bad_service_url_is_one_line_naming_the_field(url):
    with pytest.raises(InputError) as err:
        check_url(url, "shard service")
    assert err.value.field == "url" and "expected http://host:port" in str(err.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8151", "https://monitor.example/base/",
                                 "http://[::1]:8150", "http://host"])
def test_good_service_urls_pass(url):
    assert check_url(url, "x").hostname


def test_every_client_checks_its_url_before_connecting():
    # the shard client took 'http://[::1' to an internal error and retried 'notaurl' for 2 s
    from stragglers.adapt.client import ShardClient
    from stragglers.advice.live import MonitorWindows
    from stragglers.record.upload import PartUploader

    for make, source in ((lambda: ShardClient("http://[::1", "d", "w"), "shard service"),
                         (lambda: MonitorWindows("notaurl", "job"), "MonitorWindows"),
                         (lambda: PartUploader("http://h:x", None, "job", 0), "monitor URL")):
        with pytest.raises(InputError) as err:
            make()
        assert err.value.source == source and err.value.field == "url"
    with pytest.raises(InputError) as err:
        ShardClient("http://127.0.0.1:1", "", "w")
    assert err.value.field == "dataset"


@pytest.mark.parametrize("text", ["00", "01", "+0", "-0", " 1", "1 ", "\uff11", "\u00b2", "1_0",
                                  "0x1", "", "1e3", "1.0", "11", "9" * 40])
def test_only_canonical_decimal_names_a_number(text):
    # int() takes '+0', ' 1', '1_0' and '\uff11': one number written several ways in a path
    from stragglers.serving import canonical_decimal
    assert canonical_decimal(text, 10) is None


@pytest.mark.parametrize("text, value", [("0", 0), ("7", 7), ("10", 10)])
def test_canonical_decimal_reads_its_number(text, value):
    from stragglers.serving import canonical_decimal
    assert canonical_decimal(text, 10) == value
