"""Every per-client share (anonymous pace, connection caps, quotas) counts a client by one key:
an IPv6 host's /64, an IPv4-mapped address's IPv4, loopback nobody's."""

from stragglers.serving_quota import client_key, quota_client


def test_one_ipv6_host_is_one_client_whatever_address_of_its_64_it_picks():
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9")
    assert quota_client("2001:db8:1:2::1") == quota_client("2001:db8:1:2:abcd::1")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")


def test_ipv4_and_mapped_ipv4_are_the_same_client_and_loopback_has_no_quota():
    assert client_key("::ffff:192.0.2.7") == client_key("192.0.2.7") == "192.0.2.7"
    assert client_key("192.0.2.7") != client_key("192.0.2.8")
    assert quota_client("127.0.0.5") is None and quota_client("::1") is None
