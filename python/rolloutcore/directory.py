"""DirectoryClient: read the version directory (``rolloutcore directory serve``) from Python.

Pure Python over the directory's HTTP API (docs/directory.md), so it works without the compiled
core. Publishing is the Publisher's job (it registers memory and publishes through the C++
DirectoryClient); this class lists, reads, waits for and releases versions. Digests are the
directory's 16-hex-digit strings.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any, Dict, List, Optional

from ._http import JsonHttp
from .errors import DeadlineExceededError, FailedPreconditionError, NotFoundError


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


class DirectoryClient:
    """A client of one directory, e.g. ``DirectoryClient("http://127.0.0.1:8200")``.

    Thread safety: methods may be called from any thread (each call is its own request).
    """

    def __init__(self, url: str, timeout_s: float = 30.0, api_key: Optional[str] = None) -> None:
        self._http = JsonHttp(url, timeout_s, api_key)  # ValueError naming a URL that is none
        self.url = self._http.base_url  # api_key None: $ROLLOUTCORE_API_KEY

    def health(self) -> Dict[str, Any]:
        """``{"status": "ok", "store": ...}``; raises UnavailableError when unreachable."""
        return self._http.request("GET", "/health")

    def list(self, model: str, state: str = "committed") -> List[Dict[str, Any]]:
        """Versions of ``model`` in ``state`` (committed | staging | abandoned | all).

        Committed versions come first in commit order. Each entry is a VersionInfo dict:
        ``{model, version, state, expected_ranks, published_ranks, commit_seq, content_digest}``.
        """
        return self._http.request("GET", f"/v1/models/{_q(model)}/versions", query={"state": state})["versions"]

    def info(self, model: str, version: str) -> Dict[str, Any]:
        """The VersionInfo of a version in any state (NotFoundError when unknown or released)."""
        return self._http.request("GET", f"/v1/models/{_q(model)}/versions/{_q(version)}/status")

    def get(self, model: str, version: str) -> Dict[str, Any]:
        """The committed manifest: ``{model, version, expected_ranks, content_digest, tensors: [...]}``.

        Each tensor is ``{name, dtype, shape, shards: [{rank, offset, shape, handle, digest}]}``.
        FailedPreconditionError while the version is STAGING or ABANDONED.
        """
        answer = self._http.request("GET", f"/v1/models/{_q(model)}/versions/{_q(version)}")
        manifest = dict(answer["manifest"])
        manifest["commit_seq"] = answer.get("commit_seq", 0)
        return manifest

    def commits(self, model: str, after: int = 0, timeout_ms: int = 0) -> Dict[str, Any]:
        """Commits with seq > ``after``, waiting up to ``timeout_ms`` for the first one.

        ``{"model", "commits": [{model, version, seq, content_digest}], "last_seq"}``.
        """
        return self._http.request(
            "GET",
            f"/v1/models/{_q(model)}/commits",
            query={"after": after, "timeout_ms": timeout_ms},
            timeout_s=self._http.timeout_s + timeout_ms / 1000.0,
        )

    def wait_committed(self, model: str, version: str, timeout_s: float = 60.0) -> Dict[str, Any]:
        """Blocks until ``version`` is COMMITTED and returns its VersionInfo.

        FailedPreconditionError when it is ABANDONED or UNAVAILABLE; DeadlineExceededError after
        ``timeout_s``.
        A version not published yet is waited for.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = self.info(model, version)
                if info["state"] == "COMMITTED":
                    return info
                if info["state"] in ("ABANDONED", "UNAVAILABLE"):
                    raise FailedPreconditionError(
                        f"version {version} of model {model} is {info['state']}: {info.get('reason', '')}"
                    )
            except NotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"version {version} of model {model} not committed within {timeout_s} s")
            time.sleep(0.02)

    def mark_unavailable(self, model: str, version: str, reason: str) -> Dict[str, Any]:
        """Records that the memory ``version`` names is gone (docs/directory.md): COMMITTED becomes
        UNAVAILABLE, STAGING becomes ABANDONED. Returns the VersionInfo after the mark."""
        return self._http.request(
            "POST", f"/v1/models/{_q(model)}/versions/{_q(version)}/unavailable", body={"reason": reason}
        )

    def release(self, model: str, version: str) -> Dict[str, Any]:
        """Drops a version in any state (NotFoundError when unknown or already released)."""
        return self._http.request("DELETE", f"/v1/models/{_q(model)}/versions/{_q(version)}")
