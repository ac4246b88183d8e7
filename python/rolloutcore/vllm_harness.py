"""Harness for the GPU tests against a real vLLM 0.26 or 0.33 (tests/vllm/test_vllm*.py).

Everything here runs on the GPU machine: vLLM from the stripped bundle of the kit $VLLM_KIT
(0.26 or 0.33, default 0.33; ../shared/vllm/, unpacked at $VLLM_SITE, by default /tmp/vb/site for
0.26 and /tmp/v33/site for 0.33: scripts/gpu/vllm_env.sh sets both), the CUDA build of
rolloutcore's Python package ($RC_PYTHONPATH), the `rolloutcore` binary ($ROLLOUTCORE_BIN). A trainer stand-in holds the model in torch CUDA tensors, makes new
versions by perturbing them, exports each version to disk (safetensors + config + tokenizer, so a
fresh vLLM can be started on it) and publishes it as fsdp:2-style row shards from the same GPU
over cuda_ipc (no host copy).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# The kit the tests run against (scripts/gpu/vllm_env.sh exports it) and where it is unpacked. The
# tests read the running server's release from GET /version (Vllm.release()); VLLM_KIT only says
# which one was asked for.
VLLM_KIT = os.environ.get("VLLM_KIT", "0.33")
KIT_SITES = {"0.26": "/tmp/vb/site", "0.33": "/tmp/v33/site"}
VLLM_SITE = os.environ.get("VLLM_SITE") or KIT_SITES.get(VLLM_KIT, KIT_SITES["0.33"])
# The other kit's site/, when it is unpacked too (the restart-on-another-release test); "" if not.
VLLM_OTHER_SITE = os.environ.get("VLLM_OTHER_SITE", "")


def site_version(site: str) -> str:
    """The vLLM release unpacked in `site` (its generated vllm/_version.py: `__version__ = version =
    '0.33.0'`), without importing it; "" when there is none."""
    try:
        with open(os.path.join(site, "vllm", "_version.py")) as f:
            for line in f:
                if line.startswith("__version__ =") or line.startswith("__version__="):
                    return line.split("=")[-1].strip().strip("'\"")
    except OSError:
        pass
    return ""
RC_PYTHONPATH = os.environ.get("RC_PYTHONPATH", "")
OUT = Path(os.environ.get("OUT", "/tmp/rc_vllm_out"))


def http(method: str, url: str, body: Any = None, timeout: float = 120.0,
         headers: Optional[Dict[str, str]] = None) -> Tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw.strip() else None)
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw


class Vllm:
    """One `vllm serve` process with rolloutcore's worker extension."""

    def __init__(self, model_dir: str, port: int, name: str, extra: Optional[List[str]] = None,
                 gpu_util: float = 0.25, max_len: int = 1024, site: Optional[str] = None,
                 env_extra: Optional[Dict[str, str]] = None) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = OUT / f"vllm_{name}.log"
        self.site = site or VLLM_SITE  # another kit's site/ starts that release
        self._version: Optional[str] = None
        env = dict(os.environ)
        env.update(
            PYTHONPATH=":".join(p for p in (RC_PYTHONPATH, self.site, env.get("PYTHONPATH", "")) if p),
            VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", GLOO_SOCKET_IFNAME="lo",
            NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0",
            VLLM_ENGINE_READY_TIMEOUT_S="300", ROLLOUTCORE_VLLM_FAULT_INJECTION="1")
        env.update(env_extra or {})
        args = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--served-model-name", "m",
                "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "TRITON_ATTN", "--enforce-eager",
                "--gpu-memory-utilization", str(gpu_util), "--max-model-len", str(max_len), "--max-num-seqs", "16",
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--worker-extension-cls", "rolloutcore.vllm.Extension", *(extra or [])]
        self.log = open(self.log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.healthy_s: Optional[float] = None

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:
                st, _ = http("GET", self.base + "/health", timeout=2)
                if st == 200:
                    self.healthy_s = time.time() - self.started
                    return self.healthy_s
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy within {timeout_s} s; log tail:\n{self.tail()}")

    def version(self) -> str:
        """The release this server runs: GET /version answers {"version": "0.33.0"} (0.26 and 0.33
        alike, entrypoints/serve/instrumentator/basic.py:53)."""
        if self._version is None:
            st, body = http("GET", self.base + "/version", timeout=10)
            assert st == 200 and isinstance(body, dict) and body.get("version"), f"GET /version: {st} {body}"
            self._version = str(body["version"])
        return self._version

    def release(self) -> str:
        """"0.26" or "0.33" (major.minor of version())."""
        return ".".join(self.version().split(".")[:2])

    def is_033(self) -> bool:
        return self.release() == "0.33"

    def weight_info(self) -> str:
        """vLLM 0.33's own label (GET /weight_info {"weight_version": s}; "default" until set)."""
        st, body = http("GET", self.base + "/weight_info", timeout=10)
        assert st == 200 and isinstance(body, dict), f"GET /weight_info: {st} {body}"
        return str(body["weight_version"])

    def set_weight_version(self, label: str) -> None:
        """vLLM 0.33's POST /update_weight_version {"new_version": s} (labels, touches no weight)."""
        st, body = self.post("/update_weight_version", {"new_version": label})
        assert st == 200 and body == {"success": True, "new_version": label}, f"update_weight_version: {st} {body}"

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def rpc(self, method: str, timeout: float = 300.0, **kwargs: Any) -> List[Dict[str, Any]]:
        st, body = http("POST", self.base + "/collective_rpc", {"method": method, "args": [], "kwargs": kwargs},
                        timeout=timeout)
        assert st == 200, f"collective_rpc {method} answered {st}: {body}"
        return body["results"]

    def rpc1(self, method: str, **kwargs: Any) -> Dict[str, Any]:
        (r,) = self.rpc(method, **kwargs)
        return r

    def complete(self, prompt: Any, max_tokens: int = 16, **extra: Any) -> Dict[str, Any]:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(extra)
        st, out = http("POST", self.base + "/v1/completions", body, timeout=300)
        assert st == 200, f"completion answered {st}: {out}"
        return out

    def post(self, path: str, body: Any = None, timeout: float = 300.0) -> Tuple[int, Any]:
        return http("POST", self.base + path, body, timeout=timeout)

    def metric(self, name: str) -> float:
        req = urllib.request.Request(self.base + "/metrics")
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name) and (len(line) > len(name) and line[len(name)] in "{ "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def cached_tokens(resp: Dict[str, Any]) -> int:
    d = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(d.get("cached_tokens") or 0)


def tokens_of(resp: Dict[str, Any]) -> str:
    return resp["choices"][0]["text"]


class Trainer:
    """Torch CUDA trainer stand-in: versions by perturbation, fsdp:2 row shards over cuda_ipc."""

    def __init__(self, base_dir: str, directory_url: str, model: str, device: int = 0, world: int = 2,
                 fp8: Optional[List[str]] = None, transport: str = "cuda_ipc", delta: bool = False) -> None:
        import torch
        from safetensors.torch import load_file

        self.torch = torch
        self.base_dir = base_dir
        self.model = model
        self.device = device
        self.world = world
        self.base = {}
        for fn in sorted(os.listdir(base_dir)):
            if fn.endswith(".safetensors"):
                self.base.update(load_file(os.path.join(base_dir, fn), device=f"cuda:{device}"))
        from rolloutcore import Publisher

        # cuda_ipc: the shards are published from the trainer's GPU memory (zero copy); a host
        # transport (shm) copies each shard to shared host memory at publish. delta: every version
        # after the first also carries its changes on the last (docs/refit.md "Delta refit").
        self.transport = transport
        self.pubs = [Publisher(directory_url, model, rank=r, world_size=world, transport=transport, delta=delta)
                     for r in range(world)]
        self.versions: Dict[str, Dict[str, Any]] = {}
        # Quantizations whose FP8 parts every rank publishes (docs/fp8.md, "The expected image, from
        # the trainer"); the ranks are in this process, so their amaxes are merged here.
        self.fp8 = list(fp8 or [])

    def make(self, version: str, seed: int, scale: float = 0.05) -> Dict[str, Any]:
        torch = self.torch
        g = torch.Generator(device=f"cuda:{self.device}").manual_seed(seed)
        out = {}
        for name, t in sorted(self.base.items()):
            t = t.to(f"cuda:{self.device}")  # a base kept in host memory (vllm_bench.shapes_trainer)
            noise = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32) * scale
            out[name] = (t.float() + noise).to(t.dtype).contiguous()
        self.versions[version] = out
        return out

    def make_changed(self, version: str, previous: str, fraction: float, seed: int) -> Dict[str, Any]:
        """``previous`` with about ``fraction`` of the elements of every tensor changed in their
        lowest bit (the sparse steps of RL fine-tuning: docs/refit.md "Delta refit")."""
        torch = self.torch
        g = torch.Generator(device=f"cuda:{self.device}").manual_seed(seed)
        out = {}
        for name, t in sorted(self.versions[previous].items()):
            u = t.clone()
            bits = u.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[u.element_size()])
            mask = torch.rand(bits.shape, generator=g, device=u.device) < fraction
            bits ^= mask.to(bits.dtype)
            out[name] = u
        self.versions[version] = out
        return out

    def export(self, version: str, out_dir: str) -> str:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        for fn in os.listdir(self.base_dir):
            if not fn.endswith(".safetensors"):
                shutil.copy(os.path.join(self.base_dir, fn), os.path.join(out_dir, fn))
        save_file({k: v.cpu() for k, v in self.versions[version].items()}, os.path.join(out_dir, "model.safetensors"))
        return out_dir

    def publish(self, version: str) -> List[Dict[str, Any]]:
        """Every rank's shards of ``version`` added and published (the ranks in turn); returns their
        publish reports. ``add_shards_ms`` is then the time the add_shard calls took."""
        tensors = self.versions[version]
        t0 = time.perf_counter()
        for r, pub in enumerate(self.pubs):
            for name, t in tensors.items():
                rows = t.shape[0]
                per = -(-rows // self.world)
                lo, hi = min(rows, r * per), min(rows, (r + 1) * per)
                if hi <= lo:
                    continue
                shard = t[lo:hi]  # rows of a contiguous tensor: contiguous, zero copy
                pub.add_shard(version, name, shard, offset=[lo] + [0] * (t.dim() - 1), global_shape=list(t.shape),
                              copy=self.transport != "cuda_ipc")
        self.add_shards_ms = (time.perf_counter() - t0) * 1e3
        for q in self.fp8:
            import numpy as np

            merged: Dict[str, Any] = {}
            for pub in self.pubs:
                for k, v in pub.fp8_amax(version, q)[0].items():
                    merged[k] = v if k not in merged else np.maximum(merged[k], v)
            for pub in self.pubs:
                pub.attach_fp8(version, q, merged)
        return [pub.publish(version) for pub in self.pubs]

    def release(self, version: str) -> None:
        for pub in self.pubs:
            if version in pub.versions():
                pub.release(version)
        self.versions.pop(version, None)

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()


def manifest_digests(directory_url: str, model: str, version: str) -> Tuple[str, Dict[str, str]]:
    """(content digest, per-tensor digests) of a committed version, from the directory."""
    st, body = http("GET", f"{directory_url}/v1/models/{model}/versions/{version}")
    assert st == 200, body
    m = body["manifest"]
    per = {}
    for t in m["tensors"]:
        seen, total = set(), 0
        for s in t["shards"]:
            key = (tuple(s["offset"]), tuple(s["shape"]))
            if key in seen:
                continue
            seen.add(key)
            total = (total + int(s["digest"], 16)) % (1 << 64)
        per[t["name"]] = f"{total:016x}"
    return m["content_digest"], per


def tiny_env(work: Path, port: int, vllm_name: str, directory_log: str, model: str = "tiny",
             env_extra: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, Any], Any]:
    """A GPU test module's setup in ``work``: a random tiny Qwen3 (seed 0, $MAKE_TINY), a directory,
    the torch trainer and vLLM with rolloutcore's extension on ``port`` (``env_extra`` in its
    environment), started, not yet healthy. Returns (env, stop); stop stops whatever env["vllm"] is
    then (a test may have restarted it), the trainer and the directory."""
    import sys

    from .cluster import Server, find_binary

    OUT.mkdir(parents=True, exist_ok=True)
    tiny = str(work / "tiny")
    subprocess.run([sys.executable, os.environ["MAKE_TINY"], tiny, "--seed", "0"], check=True,
                   stdout=subprocess.DEVNULL)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"], OUT / directory_log,
               find_binary())
    durl = d.wait_url(30)
    trainer = Trainer(tiny, durl, model)
    v = Vllm(tiny, port, vllm_name, env_extra=env_extra)
    e = {"work": work, "tiny": tiny, "directory": durl, "trainer": trainer, "vllm": v, "port": port}

    def stop() -> None:
        e["vllm"].stop()
        trainer.close()
        d.stop()

    return e, stop


def require_gpu_vllm() -> Any:
    """The module-level skips of a GPU test module of tests/vllm: without torch, a CUDA device, vLLM
    (importable, or the kit at VLLM_SITE) or the CUDA build of rolloutcore._core, the module is
    skipped, named. Returns torch."""
    import importlib.util

    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    if importlib.util.find_spec("vllm") is None and not os.path.isdir(VLLM_SITE):
        pytest.skip("vLLM is not available (VLLM_SITE)", allow_module_level=True)
    try:
        from rolloutcore import _core
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"rolloutcore not importable: {e}", allow_module_level=True)
    if not getattr(_core, "cuda_built", False):
        pytest.skip("rolloutcore._core is not the CUDA build", allow_module_level=True)
    return torch


class Background:
    """Runs fn in a thread and keeps its result or exception."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self.result: Any = None
        self.error: Optional[BaseException] = None

        def run() -> None:
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 300) -> Any:
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result
