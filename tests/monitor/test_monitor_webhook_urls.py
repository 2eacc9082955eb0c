"""Webhook URLs are checked at the start as the sender (urllib) reads them: one that can never
be posted to is one line naming `webhooks[i]`; the URLs it can post to are taken as written."""

from __future__ import annotations

import pytest

from stragglers.errors import InputError
from stragglers.monitor.alerts import parse_webhooks

REFUSED = {
    "http://x\r\nX-Injected: 1/": "'\\r'",        # a header injected through the request line
    "http://h/\x00": "'\\x00'",
    "http://h/ü": "'ü'",                          # http.client sends the request line as ASCII
    "https://:80/": "no host",
    "http://user@/": "no host",
    "http:h": "no host",
    "http://user:pw@h/": "credentials",           # urllib looks 'user:pw@h' up as a host
    "http://h:0/": "port",
    "http://h:x/": "port",
    "ftp://h/": "http://",
}


@pytest.mark.parametrize("url", list(REFUSED))
def test_a_webhook_url_that_cannot_be_posted_to_is_one_line_naming_it(url):
    with pytest.raises(InputError) as caught:
        parse_webhooks(["http://127.0.0.1:9093/api/v2/alerts", url], "monitor.yaml")
    text = str(caught.value)
    assert "\n" not in text and "field 'webhooks[1]'" in text and REFUSED[url] in text, text


def test_webhook_urls_the_sender_can_post_to_are_taken_as_written():
    urls = ["http://127.0.0.1:9093/api/v2/alerts", "https://[::1]:65535/hook?x=1",
            "HTTP://Alerts.example/", "http://alerts:/a%20b"]
    assert parse_webhooks(urls, "monitor.yaml") == urls
    assert parse_webhooks(None, "monitor.yaml") == []
