"""JSON over HTTP with the standard library only (urllib), shared by the pure-Python clients."""

from __future__ import annotations

import json
import os
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Mapping, Optional

from .errors import DeadlineExceededError, UnavailableError, from_http


def _error_message(body: Any, raw: str) -> tuple:
    """(code, message) from the error shapes the servers use.

    Controller: ``{"error": msg, "code": Name}``; trainer: ``{"error": {"code": Name, "message"}}``;
    engine (vLLM's shape): ``{"error": {"message", "type", "param", "code": HTTP status}}``.
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            return (code if isinstance(code, str) else None), str(err.get("message", raw))
        if err is not None:
            code = body.get("code")  # the engine sends its HTTP status here, the controller a name
            return (code if isinstance(code, str) else None), str(err)
    return None, raw.strip() or "(empty body)"


API_KEY_ENV = "ROLLOUTCORE_API_KEY"
TLS_CA_FILE_ENV = "ROLLOUTCORE_TLS_CA_FILE"


class JsonHttp:
    """A base URL plus a timeout; every call is one request on a fresh connection.

    ``api_key`` (default: the ``ROLLOUTCORE_API_KEY`` environment variable) is sent as
    ``Authorization: Bearer <key>`` on every request, as servers started with a key
    (``--api-key-file`` or ``$ROLLOUTCORE_API_KEY``) expect.
    For ``https://`` URLs the server certificate is verified against ``ROLLOUTCORE_TLS_CA_FILE``
    when set, else the system's CAs.
    """

    def __init__(self, base_url: str, timeout_s: float = 30.0, api_key: Optional[str] = None) -> None:
        parts = urllib.parse.urlsplit(base_url) if isinstance(base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            # Without a scheme urllib would fail at the first call ("unknown url type"), far from the cause.
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8300)")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        ca = os.environ.get(TLS_CA_FILE_ENV)
        self._ssl = ssl.create_default_context(cafile=ca) if ca and self.base_url.startswith("https") else None

    def request(
        self,
        method: str,
        path: str,
        body: Optional[Any] = None,
        query: Optional[Mapping[str, Any]] = None,
        timeout_s: Optional[float] = None,
        raw: bool = False,
    ) -> Any:
        """Sends one request; returns the decoded JSON (or text with ``raw``).

        Raises the rolloutcore.errors class for the server's error code / HTTP status, and
        UnavailableError / DeadlineExceededError when the server cannot be reached in time.
        """
        url = self.base_url + path
        if query:
            q = {k: v for k, v in query.items() if v is not None}
            if q:
                url += "?" + urllib.parse.urlencode(q)
        data = None
        headers: Dict[str, str] = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif method in ("POST", "PUT"):
            data = b""
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s, context=self._ssl) as resp:
                text = resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            code, message = _error_message(parsed, text)
            raise from_http(e.code, code, f"{method} {url}: {message}") from None
        except (socket.timeout, TimeoutError) as e:
            raise DeadlineExceededError(f"{method} {url}: no answer within {timeout_s or self.timeout_s} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise DeadlineExceededError(f"{method} {url}: no answer within {timeout_s or self.timeout_s} s") from e
            raise UnavailableError(f"{method} {url}: {e.reason}") from e
        except ConnectionError as e:
            raise UnavailableError(f"{method} {url}: {e}") from e
        if raw:
            return text
        return json.loads(text) if text.strip() else {}
