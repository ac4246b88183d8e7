"""EngineClient: the rolloutcore engine's evidence endpoints (docs/engine.md), pure Python.

For checks and tools: the live weights' content digest, the engine state, and the
receiver-driven refit calls (``/rc/refit/stage``, ``/rc/refit/install``) that the controller
normally drives. Generation through the controller (ControllerClient.rollout) is what binds a
rollout to a version; completions sent here directly are not recorded.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ._http import JsonHttp


class EngineClient:
    """A client of one ``rolloutcore engine serve``. Methods may be called from any thread."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: Optional[str] = None) -> None:
        self.url = url.rstrip("/")
        self._http = JsonHttp(self.url, timeout_s, api_key)  # api_key None: $ROLLOUTCORE_API_KEY

    def health(self) -> bool:
        self._http.request("GET", "/health", raw=True)
        return True

    def weights_digest(self) -> Dict[str, Any]:
        """``{content_digest, weight_version, tensors: {name: digest}, digest_ms}`` of the live weights."""
        return self._http.request("GET", "/rc/weights/digest")

    def weight_info(self) -> Dict[str, Any]:
        return self._http.request("GET", "/weight_info")

    def state(self) -> Dict[str, Any]:
        """``{paused, num_running, num_waiting, blocks_in_use, ..., weight_version, boot_id, install_generation, content_digest}``."""
        return self._http.request("GET", "/rc/engine/state")

    def stage(self, model: str, version: str, directory: str) -> Dict[str, Any]:
        """Pulls a committed version into staging (allowed while serving); returns the evidence."""
        return self._http.request("POST", "/rc/refit/stage", {"model": model, "version": version, "directory": directory})

    def install(self, version: str) -> Dict[str, Any]:
        """Installs the staged version (only while paused); returns ``live_content_digest`` etc."""
        return self._http.request("POST", "/rc/refit/install", {"version": version})

    def pause(self, mode: str = "wait") -> Dict[str, Any]:
        return self._http.request("POST", "/pause", query={"mode": mode})

    def resume(self) -> Dict[str, Any]:
        return self._http.request("POST", "/resume")

    def completions(self, **body: Any) -> Dict[str, Any]:
        """``POST /v1/completions`` (not bound to a version by any controller)."""
        return self._http.request("POST", "/v1/completions", body)

    def metrics(self, name: Optional[str] = None) -> Any:
        """Prometheus text, or the value of one un-labelled series when ``name`` is given."""
        text = self._http.request("GET", "/metrics", raw=True)
        if name is None:
            return text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return None
