"""JSON over HTTP with the standard library only (urllib), shared by the pure-Python clients."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Mapping, Optional

from .errors import DeadlineExceededError, InternalError, InvalidArgumentError, UnavailableError, from_http


def _json_default(value: Any) -> Any:
    """numpy scalars and arrays (a seed from np.int64, token ids from an array) as JSON."""
    item = getattr(value, "item", None)
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and getattr(value, "ndim", 0) > 0:
        return tolist()
    if callable(item):
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


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
        try:
            parts.port  # noqa: B018 - urllib checks the port's range only when asked
        except ValueError as e:
            raise ValueError(f"{base_url!r}: {e}") from None
        if any(c.isspace() for c in base_url) or parts.path.strip("/") or parts.query or parts.fragment:
            raise ValueError(f"{base_url!r} is not the base URL of a service: http:// or https://, a host and port, "
                             "no path (e.g. http://127.0.0.1:8300)")
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
        if body is not None:
            try:
                # allow_nan=False: NaN / Infinity are not JSON, and the server would refuse the body
                # as unparsable far from the argument that held it.
                payload = json.dumps(body, allow_nan=False, default=_json_default).encode()
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"{method} {path}: the request body cannot be sent as JSON: {e}") from None
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if body is not None:
            data = payload
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
        except (ConnectionError, http.client.HTTPException) as e:
            # A connection reset, or an answer cut short or garbled (IncompleteRead, BadStatusLine,
            # RemoteDisconnected): the server went away mid-call.
            raise UnavailableError(f"{method} {url}: the answer was lost: {type(e).__name__}: {e}") from e
        if raw:
            return text
        if not text.strip():
            return {}
        try:
            answer = json.loads(text)
        except ValueError as e:
            raise InternalError(f"{method} {url}: the answer is not JSON ({e}): {text[:200]!r}") from None
        if not isinstance(answer, dict):
            # Every rolloutcore (and vLLM) JSON answer is an object; anything else (a list, a bare
            # string) is not the service asked for, and would fail at the caller as a TypeError.
            raise InternalError(f"{method} {url}: the answer is a JSON {type(answer).__name__}, not an object: "
                                f"{text[:200]!r}")
        return answer
