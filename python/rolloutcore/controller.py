"""ControllerClient: the controller service (``rolloutcore controller serve``) from Python.

Pure Python over the controller's HTTP API (docs/controller.md). Why not bound from C++: the
controller is a network service whose API is JSON over HTTP, so a binding would only wrap an HTTP
client; urllib keeps this client free of the compiled core, so it runs on any Python 3.8+ where
the extension was not built for that interpreter (a GPU machine with another Python, say) and
cannot crash the trainer process. Every rollout answer carries the controller's ``binding``
(``{rollout_id, label, generation, identity, admitted_at_ms, engine}``).
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any, Dict, List, Optional, Sequence

from ._http import JsonHttp
from .errors import DeadlineExceededError, RolloutcoreError, UnavailableError


class ControllerClient:
    """A client of one controller, e.g. ``ControllerClient("http://127.0.0.1:8300")``.

    Thread safety: methods may be called from any thread concurrently (each call is its own
    request), which is how rollouts of one group are usually sent.
    """

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: Optional[str] = None) -> None:
        self._http = JsonHttp(url, timeout_s, api_key)  # ValueError naming a URL that is none
        self.url = self._http.base_url  # api_key None: $ROLLOUTCORE_API_KEY

    # ---- rollouts ------------------------------------------------------------------------

    def rollout(
        self,
        prompt_token_ids: Optional[Sequence[int]] = None,
        *,
        prompt: Optional[str] = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        seed: Optional[int] = None,
        logprobs: Optional[int] = None,
        rollout_id: Optional[str] = None,
        retry_s: float = 60.0,
        **fields: Any,
    ) -> Dict[str, Any]:
        """Generates one rollout through a READY engine and returns the completion plus ``binding``.

        Give ``prompt_token_ids`` (the embedded engine's tokenizer is byte-level; send ids) or
        ``prompt``. Other ``/v1/completions`` fields pass through ``fields`` (``return_token_ids``,
        ``ignore_eos``, ``top_p``, ...). While no engine is READY (an update is draining or
        installing) the controller answers 503; this retries for up to ``retry_s`` seconds.
        """
        body: Dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
        if prompt is not None:
            body["prompt"] = prompt
        if seed is not None:
            body["seed"] = seed
        if logprobs is not None:
            body["logprobs"] = logprobs
        if rollout_id is not None:
            body["rollout_id"] = rollout_id
        body.update(fields)
        return self._retry(lambda: self._http.request("POST", "/v1/rollouts", body), retry_s)

    def admit(self, rollout_id: Optional[str] = None, retry_s: float = 60.0) -> Dict[str, Any]:
        """Admits a rollout that the client generates itself (lease mode); returns its binding."""
        body = {"rollout_id": rollout_id} if rollout_id else {}
        return self._retry(lambda: self._http.request("POST", "/v1/rollouts:admit", body), retry_s)

    def finish(self, rollout_id: str, **record: Any) -> Dict[str, Any]:
        """Finishes an admitted rollout: ``token_ids``, ``prompt_token_ids``, ``logprobs``,
        ``finish_reason``, ``cached_tokens``, ``extra``."""
        path = f"/v1/rollouts/{urllib.parse.quote(rollout_id, safe='')}:finish"
        return self._http.request("POST", path, record)

    # ---- updates -------------------------------------------------------------------------

    def request_update(self, model: str, version: str, mode: Optional[str] = None) -> str:
        """Queues an update of every engine to a committed directory version; returns its id.
        ``mode``: the policy mode of this update (strict, keep, recompute, abort; None: the
        controller's ``--update-mode``)."""
        body: Dict[str, Any] = {"model": model, "version": version}
        if mode:
            body["mode"] = mode
        return self._http.request("POST", "/v1/updates", body)["id"]

    def update(self, update_id: str, wait_ms: int = 0) -> Dict[str, Any]:
        """The update's record: ``{id, model, version, done, outcome, engines: [...]}``.

        With ``wait_ms`` the controller holds the answer until the update ends or the time passes.
        """
        path = f"/v1/updates/{urllib.parse.quote(update_id, safe='')}"
        return self._http.request(
            "GET", path, query={"wait_ms": wait_ms or None}, timeout_s=self._http.timeout_s + wait_ms / 1000.0
        )

    def wait_update(self, update_id: str, timeout_s: float = 120.0) -> Dict[str, Any]:
        """Blocks until the update is done and returns its record (``outcome`` says how it ended:
        ``committed``, or the first engine's other outcome). DeadlineExceededError after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            try:
                rec = self.update(update_id, wait_ms=min(max(left_ms, 1), 10_000))
            except DeadlineExceededError:
                rec = self.update(update_id)  # the controller's own wait timed out: ask once more
            except UnavailableError as e:
                if e.http_status != 503:
                    raise
                # Every long-poll slot of the controller is taken (docs/controller.md, "HTTP
                # limits"): ask without waiting, and wait here before the next long-poll.
                rec = self.update(update_id)
                if not rec.get("done"):
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if rec.get("done"):
                return rec
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"update {update_id} not done within {timeout_s} s: {rec}")

    def update_to(self, model: str, version: str, timeout_s: float = 120.0) -> Dict[str, Any]:
        """request_update + wait_update; raises RolloutcoreError unless the outcome is ``committed``."""
        rec = self.wait_update(self.request_update(model, version), timeout_s)
        if rec.get("outcome") != "committed":
            raise RolloutcoreError(f"update of model {model} to {version} ended {rec.get('outcome')}: {rec}")
        return rec

    def recover(self, model: str, version: str) -> str:
        """Asks TAINTED engines to re-install and prove ``version``; returns the operation id."""
        return self._http.request("POST", "/v1/recover", {"model": model, "version": version})["id"]

    # ---- state and records ---------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """Per engine: state, label, generation, identity, active rollouts, counters."""
        return self._http.request("GET", "/v1/status")

    def journal(self, since: int = 0, engine: Optional[int] = None) -> Any:
        """Journal records after sequence number ``since`` (of one engine, or all)."""
        return self._http.request("GET", "/v1/journal", query={"since": since, "engine": engine})

    def trajectories(self, label: Optional[str] = None, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """Recorded trajectories (binding, prompt and output ids, logprobs, finish reason, ...)."""
        answer = self._http.request(
            "GET", "/v1/trajectories", query={"label": label, "limit": limit, "format": "json"}
        )
        if isinstance(answer, dict):
            return answer.get("trajectories", [])
        return answer

    def health(self) -> Dict[str, Any]:
        return self._http.request("GET", "/health")

    def metrics(self) -> str:
        """Prometheus text."""
        return self._http.request("GET", "/metrics", raw=True)

    @staticmethod
    def _retry(call: Any, retry_s: float) -> Dict[str, Any]:
        deadline = time.monotonic() + retry_s
        delay = 0.01
        while True:
            try:
                return call()
            except UnavailableError as e:
                # 503: no engine READY (an update is under way). Connection refused is final.
                if e.http_status != 503 or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
