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
        self._http = JsonHttp(url, timeout_s, api_key)  # ValueError naming a URL that is none
        self.url = self._http.base_url  # api_key None: $ROLLOUTCORE_API_KEY

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
        """Prometheus text, or one series' value when ``name`` is given.

        ``name`` is a metric name (``"vllm:generation_tokens_total"``: the sum of its samples over
        their labels, e.g. the engine's ``model_name``), optionally with labels that the samples
        must carry (``'vllm:request_success_total{finished_reason="stop"}'``). None when no sample
        matches.
        """
        text = self._http.request("GET", "/metrics", raw=True)
        if name is None:
            return text
        want_name, _, want_labels = name.partition("{")
        want = _labels(want_labels.rstrip("}"))
        total, found = 0.0, False
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            metric, _, labels = series.partition("{")
            if metric != want_name:
                continue
            have = _labels(labels.rstrip("}"))
            if all(have.get(k) == v for k, v in want.items()):
                total += float(value)
                found = True
        return total if found else None


def _labels(text: str) -> Dict[str, str]:
    """``a="x",b="y"`` -> {"a": "x", "b": "y"} (label values without commas or escaped quotes)."""
    out: Dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out
