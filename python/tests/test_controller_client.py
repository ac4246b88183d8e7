"""ControllerClient.wait_update against a fake controller: a long-poll answered 503 (every
long-poll slot taken, docs/controller.md "HTTP limits") is not an error; the client asks without
waiting and long-polls again (issue 36)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Iterator, List

import pytest

import rolloutcore


class _FakeController(http.server.BaseHTTPRequestHandler):
    seen: List[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _FakeController.seen.append(self.path)
        waits = sum("wait_ms" in p for p in _FakeController.seen)
        if "wait_ms" in self.path and waits == 1:
            status, body = 503, {"error": "controller: 64 long-polls are waiting already", "code": "Unavailable"}
        else:
            status, body = 200, {"id": "u-1", "done": waits >= 2, "outcome": "committed" if waits >= 2 else ""}
        data = json.dumps(body).encode()
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_controller() -> Iterator[str]:
    _FakeController.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeController)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_wait_update_rides_out_a_full_long_poll_pool(fake_controller: str) -> None:
    client = rolloutcore.ControllerClient(fake_controller, api_key="")
    rec = client.wait_update("u-1", timeout_s=10)
    assert rec["done"] and rec["outcome"] == "committed"
    assert [("wait_ms" in p) for p in _FakeController.seen] == [True, False, True]


@pytest.mark.parametrize("make", [rolloutcore.ControllerClient, rolloutcore.DirectoryClient, rolloutcore.EngineClient])
def test_clients_refuse_a_url_without_a_scheme_and_a_bad_timeout_when_made(make) -> None:
    for url in ("127.0.0.1:8300", "localhost", "ftp://x", "http://", ""):
        with pytest.raises(ValueError, match="is not an http:// or https:// URL"):
            make(url)
    for timeout in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            make("http://127.0.0.1:8300", timeout_s=timeout)
    assert make("https://controller.example:8443/").url.endswith(":8443")
