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


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """Answers by path: /cut (a body cut short), /garbage (no HTTP status line), /text (200, not
    JSON), /list (200, a JSON list), /ok (200, JSON)."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/garbage":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
            return
        data = {"/cut": b'{"a": 1, "b": [1, 2, 3', "/text": b"<html>hello</html>", "/list": b"[1, 2]",
                "/ok": b'{"a": 1}'}[self.path]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data) + (100 if self.path == "/cut" else 0)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802
        _Misbehaving.posted = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


def test_answers_lost_or_garbled_mid_call_raise_the_documented_classes() -> None:
    """A server that dies mid-answer, or answers garbage, is UnavailableError (the answer was lost)
    or InternalError (not JSON), never http.client's or json's own exceptions, which would escape
    ``except UnavailableError`` and the retry loops built on it."""
    from rolloutcore._http import JsonHttp

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        h = JsonHttp(f"http://127.0.0.1:{server.server_address[1]}", 5.0, "")
        assert h.request("GET", "/ok") == {"a": 1}
        with pytest.raises(rolloutcore.errors.UnavailableError, match="the answer was lost"):
            h.request("GET", "/cut")
        with pytest.raises(rolloutcore.errors.UnavailableError, match="the answer was lost"):
            h.request("GET", "/garbage")
        with pytest.raises(rolloutcore.errors.InternalError, match="not JSON"):
            h.request("GET", "/text")
        # Every answer of the services is an object: a list would fail later at the caller's
        # subscript as a TypeError far from the cause.
        with pytest.raises(rolloutcore.errors.InternalError, match="the answer is a JSON list, not an object"):
            h.request("GET", "/list")
        # A body that is not JSON is refused before anything is sent, naming why.
        with pytest.raises(rolloutcore.errors.InvalidArgumentError, match="cannot be sent as JSON"):
            h.request("POST", "/ok", {"temperature": float("nan")})
        np = pytest.importorskip("numpy")
        assert h.request("POST", "/ok", {"seed": np.int64(3), "ids": np.array([1, 2])}) == {"a": 1}
        assert _Misbehaving.posted == {"seed": 3, "ids": [1, 2]}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("make", [rolloutcore.ControllerClient, rolloutcore.DirectoryClient, rolloutcore.EngineClient])
def test_clients_refuse_a_port_out_of_range_a_path_and_none_when_made(make) -> None:
    for url in ("http://127.0.0.1:99999", "http://127.0.0.1:1 x", "http://127.0.0.1:1/v1"):
        with pytest.raises(ValueError):
            make(url)
    with pytest.raises(ValueError, match="is not an http:// or https:// URL"):
        make(None)
