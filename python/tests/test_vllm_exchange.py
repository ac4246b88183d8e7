"""The vLLM extension's install by exchange and atomic install (docs/vllm.md "Install by exchange",
"Atomic install"), on CPU PyTorch tensors.

What runs for real: the extension's Python (rc_stage's preparation, rc_install, the storage exchange
on real nn.Parameters, the alias check on PyTorch's storage reference counts, the undo, the call
stack walk to the engine core). What stands in: the C++ DeviceStager (CUDA-only) is played by
HostStager below, which reads and writes the host addresses the extension's own buffer callbacks
give it (ctypes), and checks the exchange geometry from those addresses as receiver/exchange.h
does (that check itself is tested in C++, src/receiver/exchange_test.cc); and vLLM's engine core is
a class that runs the call the way vLLM's uniproc executor does (EngineCore.collective_rpc ->
driver_worker.worker.<method>). The real pair runs on the GPU machine (tests/vllm).

Runs where PyTorch is installed (build/trl-venv: CTest python_trl_tests); skipped elsewhere.
"""

from __future__ import annotations

import ctypes
import hashlib
import types
from typing import Any, Dict, List

import pytest

torch = pytest.importorskip("torch")

import rolloutcore.vllm as ext  # noqa: E402
from rolloutcore.vllm import Extension  # noqa: E402


def _digest(chunks: List[bytes]) -> str:
    return hashlib.sha256(b"".join(chunks)).hexdigest()[:16]


class HostStager:
    """The DeviceStager's contract on host memory: digests are per source tensor over the bytes its
    copies hold, read at the addresses the extension's callbacks answer."""

    def __init__(self, copies: List[Dict[str, Any]], staging_buffers, live_buffers) -> None:
        self.copies = copies
        self.staging_buffers = staging_buffers
        self.live_buffers = live_buffers
        self.prepared = None
        self.proven = None
        self.calls: List[str] = []
        self.fail_complete = None
        self.sources: Dict[str, torch.Tensor] = {}
        self.mode = "full"

    def _read(self, ptr: int, n: int) -> bytes:
        return ctypes.string_at(ptr, n)

    def _digests(self, where) -> Dict[str, str]:
        parts: Dict[str, List[bytes]] = {}
        for i, c in enumerate(self.copies):
            ptr, n = where(i, c)
            parts.setdefault(c["source"], []).append(self._read(ptr, n))
        return {k: _digest(v) for k, v in parts.items()}

    def _staging_at(self, i, c):
        return self.staging_buffers()[f"rc.staging.{i}"]

    def _live_at(self, i, c):
        base, _ = self.live_buffers()[c["param_name"]]
        n = c["nbytes"]
        return base + c["dest_offset"] * c["esize"], n

    def stage(self, directory, model, version, timeout_ms, pull_delay_ms=0, delta_policy="never") -> Dict[str, Any]:
        """Writes each copy's box of its source (``self.sources``, the trainer's version) into the
        staging buffer the extension names."""
        self.calls.append("stage")
        sources = self.sources
        bufs = self.staging_buffers()
        for i, c in enumerate(self.copies):
            ptr, n = bufs[f"rc.staging.{i}"]
            src = sources[c["source"]].contiguous()
            assert src.numel() * src.element_size() == n
            ctypes.memmove(ptr, src.data_ptr(), n)
        self.proven = self._digests(self._staging_at)
        self.prepared = None
        return {"stage_ms": {}, "mode": self.mode, "published": dict(self.proven), "bytes_pulled": 0}

    def prepare_exchange(self, live_after: Dict[str, Any]) -> Dict[str, Any]:
        self.calls.append("prepare_exchange")
        bufs = self.staging_buffers()
        for i, c in enumerate(self.copies):
            base, _ = live_after[c["param_name"]]
            if bufs[f"rc.staging.{i}"][0] != base + c["dest_offset"] * c["esize"]:
                return {"ok": False, "reason": f"copy {i} off its live offset"}
        self.prepared = dict(live_after)
        return {"ok": True, "bytes": sum(n for _, n in live_after.values()), "parameters": len(live_after)}

    def complete_exchange(self, reread: bool = True) -> Dict[str, Any]:
        self.calls.append("complete_exchange")
        if self.fail_complete:
            raise RuntimeError(self.fail_complete)
        live = self.live_buffers()
        if self.prepared is None or any(live[n][0] != self.prepared[n][0] for n in self.prepared):
            raise RuntimeError("complete_exchange: the live parameters are not the prepared slabs")
        self.prepared = None
        tensors = self._digests(self._live_at) if reread else dict(self.proven)
        self.proven = None
        return {"tensors": tensors, "content_digest": _digest([v.encode() for _, v in sorted(tensors.items())]),
                "kernel_ms": 0.0, "digest_ms": 0.0, "source": "reread" if reread else "staged"}

    def prepare_install(self) -> Dict[str, Any]:
        self.calls.append("prepare_install")
        return {"ok": True}

    def install(self) -> Dict[str, Any]:
        """The fused copy: staging bytes into the live boxes, digesting what was written."""
        self.calls.append("install")
        for i, c in enumerate(self.copies):
            sptr, n = self._staging_at(i, c)
            lptr, _ = self._live_at(i, c)
            ctypes.memmove(lptr, sptr, n)
        tensors = self._digests(self._live_at)
        return {"ok": True, "bytes": sum(c["nbytes"] for c in self.copies), "tensors": tensors,
                "content_digest": _digest([v.encode() for _, v in sorted(tensors.items())]), "kernel_ms": 0.0,
                "digest_ms": 0.0, "source": "fused"}

    def live_digest(self) -> Dict[str, Any]:
        self.calls.append("live_digest")
        tensors = self._digests(self._live_at)
        return {"tensors": tensors, "content_digest": _digest([v.encode() for _, v in sorted(tensors.items())]),
                "kernel_ms": 0.0, "digest_ms": 0.0, "source": "reread"}


class Model(torch.nn.Module):
    """vLLM's shapes in miniature: a fused qkv_proj tiled by q, k, v and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 6, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.qkv_proj.weight.requires_grad_(False)


def _copy(source, param, offset, shape, esize):
    n = 1
    for x in shape:
        n *= x
    strides, acc = [], 1
    for x in reversed(shape):
        strides.append(acc)
        acc *= x
    return {"source": source, "param_name": param, "dest_offset": offset, "dest_shape": list(shape),
            "dest_strides": list(reversed(strides)), "nbytes": n * esize, "esize": esize}


def sources(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(2, 4, generator=g).to(torch.bfloat16),
            "k": torch.randn(2, 4, generator=g).to(torch.bfloat16),
            "v": torch.randn(2, 4, generator=g).to(torch.bfloat16),
            "norm": torch.randn(4, generator=g)}


class Worker(Extension):
    pass


@pytest.fixture
def rig(monkeypatch):
    """A worker in the exchange layout, its capture and the host stager, as _rc_ensure_capture leaves
    them (the capture of vLLM's loader itself is tested on the GPU machine)."""
    monkeypatch.setenv("ROLLOUTCORE_VLLM_INSTALL", "exchange")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    model = Model()
    w = Worker()
    w.model_runner = types.SimpleNamespace(model=model)
    none = types.SimpleNamespace(name="NONE")
    w.vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=none, mode=none))
    params = dict(model.named_parameters())
    cap = types.SimpleNamespace(params=params, unsupported={}, suppressed_writes={}, copies=[
        _copy("q", "qkv_proj.weight", 0, [2, 4], 2), _copy("k", "qkv_proj.weight", 8, [2, 4], 2),
        _copy("v", "qkv_proj.weight", 16, [2, 4], 2), _copy("norm", "norm", 0, [4], 4)])
    st = w._rc_state()
    st.capture, st.fallback, st.not_loaded = cap, [], []
    assert w._rc_exchange_static_issue(cap, None, []) is None
    # What rc_stage's capture step leaves for this manifest (the loader's capture runs on the GPU).
    monkeypatch.setattr(ext, "_http_get_json", lambda url, timeout, key: {"manifest": {"tensors": MANIFEST_TENSORS}})
    st.sources_key = tuple((t["name"], t["dtype"], tuple(t["shape"])) for t in MANIFEST_TENSORS)
    st.slabs = {n: torch.empty_like(params[n]) for n in ("norm", "qkv_proj.weight")}
    st.staging_views = Extension._rc_slab_views(cap, st.slabs)
    st.stager = HostStager(cap.copies, lambda: Extension._rc_staging_buffers(st),
                           lambda: Extension._rc_live_buffers(st))
    return types.SimpleNamespace(w=w, st=st, model=model, params=params)


MANIFEST_TENSORS = [{"name": "k", "dtype": "bf16", "shape": [2, 4]}, {"name": "norm", "dtype": "f32", "shape": [4]},
                    {"name": "q", "dtype": "bf16", "shape": [2, 4]}, {"name": "v", "dtype": "bf16", "shape": [2, 4]}]


def stage(rig, version: str, seed: int, install: str = "exchange", delta_policy: str = "never") -> Dict[str, Any]:
    """rc_stage itself, the directory's answer and the stager's pull standing in."""
    src = sources(seed)
    rig.st.stager.sources = src
    ev = rig.w.rc_stage("m", version, "http://dir", install=install, delta_policy=delta_policy)
    assert ev["ok"], ev
    return src


def expect_live(rig, src) -> None:
    w = rig.model.qkv_proj.weight
    assert torch.equal(w[0:2], src["q"]) and torch.equal(w[2:4], src["k"]) and torch.equal(w[4:6], src["v"])
    assert torch.equal(rig.model.norm, src["norm"])


def test_tiling_rule_names_strided_gapped_and_overlapping_copies():
    c = lambda o, shape, strides=None: {"source": "s", "dest_offset": o, "dest_shape": shape,  # noqa: E731
                                        "dest_strides": strides or [shape[-1], 1][-len(shape):]}
    assert ext._tiling_issue("p", 8, [c(4, [1, 4]), c(0, [1, 4])]) is None
    assert "strided box" in ext._tiling_issue("p", 8, [c(0, [2, 2], [4, 1]), c(2, [2, 2], [4, 1])])
    assert "leaves elements 4..5 unwritten" in ext._tiling_issue("p", 9, [c(0, [1, 4]), c(5, [1, 4])])
    assert "overlaps" in ext._tiling_issue("p", 8, [c(0, [1, 4]), c(2, [1, 4])])
    assert "write 4 of its 8" in ext._tiling_issue("p", 8, [c(0, [1, 4])])
    assert ext._dense([3, 1, 4], [4, 99, 1]) and not ext._dense([3, 4], [1, 3])


def test_alias_rule_sees_a_view_kept_elsewhere_and_a_shared_storage():
    m = Model()
    params = dict(m.named_parameters())
    assert ext._alias_issue(torch, params, params) is None
    kept = m.qkv_proj.weight.data[1:]  # a layer keeping a view of its weight
    assert "qkv_proj.weight: 2 other reference(s) to its storage" in ext._alias_issue(torch, params, params)
    del kept
    assert ext._alias_issue(torch, params, params) is None
    part = {"p": torch.nn.Parameter(torch.zeros(8)[2:], requires_grad=False)}
    assert "not the whole of its own contiguous storage" in ext._alias_issue(torch, part, part)


def test_exchange_installs_the_staged_bytes_without_copying_and_alternates_storages(rig):
    before = {n: p.data_ptr() for n, p in rig.params.items()}
    slabs = {n: t.data_ptr() for n, t in rig.st.slabs.items()}
    src = stage(rig, "v1", 1)
    r = rig.w.rc_install("v1")
    assert r["ok"] and r["install_path"] == "exchange" and r["verified"], r
    assert r["bytes_copied"] == 0 and r["bytes_installed"] == 6 * 4 * 2 + 4 * 4 and r["exchange_verify"] == "reread"
    assert "install" not in rig.st.stager.calls  # no copy ran
    expect_live(rig, src)
    # The live parameters are the slabs; the old storages are the next slabs.
    assert {n: p.data_ptr() for n, p in rig.params.items()} == slabs
    assert {n: t.data_ptr() for n, t in rig.st.slabs.items()} == before
    assert r["label"] == "v1" and r["generation"] == 1 and r["content_digest"]
    assert set(r["worker_split_ms"]) == {"checks", "synchronize", "exchange_swaps", "exchange_proof", "fp8_and_label",
                                        "reply"}
    # The next version stages into the old storages while v1 serves, and exchanges back.
    src2 = stage(rig, "v2", 2)
    expect_live(rig, src)  # staging v2 did not touch the live v1
    r2 = rig.w.rc_install("v2", verify="staged")
    assert r2["ok"] and r2["install_path"] == "exchange" and r2["verified"] and r2["digest_source"] == "staged", r2
    expect_live(rig, src2)
    assert {n: p.data_ptr() for n, p in rig.params.items()} == before


def test_an_alias_or_a_failed_proof_installs_by_copy_instead_with_the_reason(rig):
    src = stage(rig, "v1", 3)
    kept = rig.model.norm.data[:2]  # someone keeps a view: exchanging would leave it on the old bytes
    r = rig.w.rc_install("v1")
    assert r["ok"] and r["install_path"] == "fused" and r["verified"], r
    assert "norm: 2 other reference(s) to its storage" in r["exchange_refused"]
    expect_live(rig, src)
    assert torch.equal(kept, src["norm"][:2])  # the view sees the install: it was a copy
    del kept
    # The stager fails its proof after the storages were exchanged: every one is given back.
    src2 = stage(rig, "v2", 4)
    before = {n: p.data_ptr() for n, p in rig.params.items()}
    rig.st.stager.fail_complete = "kernel launch failed"
    r = rig.w.rc_install("v2")
    assert r["ok"] and r["install_path"] == "fused" and "kernel launch failed" in r["exchange_refused"], r
    assert {n: p.data_ptr() for n, p in rig.params.items()} == before
    expect_live(rig, src2)


class CountingParameter(torch.nn.Parameter):
    """vLLM's BasevLLMParameter in miniature: a ``__torch_function__`` that only forwards (and here
    counts what it forwards)."""

    calls: List[str] = []

    def __new__(cls, data):
        return super().__new__(cls, data=data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("install", ["exchange", "copy"])
def test_installs_walk_vllms_parameters_without_their_torch_function(rig, install):
    """The install's walks over the parameters (addresses, sizes, storage checks, swaps) skip the
    subclass's __torch_function__: a forwarding one costs ~10 us per call, milliseconds of the pause
    window over 291 parameters (docs/vllm.md). The parameters stay vLLM's class and hold the new
    version."""
    rig.model.qkv_proj.weight = CountingParameter(rig.model.qkv_proj.weight.data)
    rig.model.norm = CountingParameter(rig.model.norm.data)
    rig.params.update(dict(rig.model.named_parameters()))
    src = stage(rig, "v1", 11, install=install)
    CountingParameter.calls.clear()
    r = rig.w.rc_install("v1", install=install)
    calls = list(CountingParameter.calls)
    assert r["ok"] and r["install_path"] == ("exchange" if install == "exchange" else "fused") and r["verified"], r
    assert calls == [], calls
    assert all(type(p) is CountingParameter for p in rig.params.values())
    expect_live(rig, src)
    # Without the context the same walk does call it (the test would see a regression).
    rig.params["norm"].data_ptr()
    assert CountingParameter.calls


def test_a_delta_stage_or_a_copy_request_installs_by_copy(rig):
    src = stage(rig, "v1", 5, install="copy")
    r = rig.w.rc_install("v1", install="copy")
    assert r["ok"] and r["install_path"] == "fused" and r["exchange_refused"] is None, r
    expect_live(rig, src)
    rig.st.stager.mode = "delta"
    src = stage(rig, "v2", 6)
    r = rig.w.rc_install("v2")
    assert r["install_path"] == "fused" and "staged as a delta" in r["exchange_refused"], r
    expect_live(rig, src)
    rig.st.stager.mode = "full"
    src = stage(rig, "v3", 7, delta_policy="auto")  # a full stage that may be followed by deltas
    r = rig.w.rc_install("v3")
    assert r["install_path"] == "fused" and "under delta policy auto" in r["exchange_refused"], r
    expect_live(rig, src)


def test_bad_modes_are_refused_untouched_and_named(rig):
    stage(rig, "v1", 7)
    before = {n: p.detach().clone() for n, p in rig.params.items()}
    r = rig.w.rc_install("v1", install="swap")
    assert not r["ok"] and r["outcome"] == "refused_untouched" and "'swap'" in r["error"], r
    r = rig.w.rc_install("v1", verify="trust")
    assert not r["ok"] and "verify must be one of reread, staged" in r["error"], r
    assert all(torch.equal(p, before[n]) for n, p in rig.params.items())


def test_static_refusals_name_graphs_fp8_and_fallbacks(rig):
    cap = rig.st.capture
    rig.w.vllm_config.compilation_config.cudagraph_mode = types.SimpleNamespace(name="FULL_AND_PIECEWISE")
    assert "--enforce-eager" in rig.w._rc_exchange_static_issue(cap, None, [])
    assert "FP8" in rig.w._rc_exchange_static_issue(cap, {"scheme": "block"}, [])
    assert "fallback tensors" in rig.w._rc_exchange_static_issue(cap, None, ["lm_head.weight"])


# ---- the atomic install -----------------------------------------------------------------------


class EngineCore:
    """vLLM's engine core as the uniproc executor runs a utility call: collective_rpc ->
    driver_worker.worker.<method>(**kwargs), on one thread, between two steps."""

    __module__ = "vllm.v1.engine.core"

    def __init__(self, worker, unfinished: int = 0, reset_ok: bool = True) -> None:
        self.model_executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))
        # vLLM's scheduler queues: requests running, and waiting (never started, or preempted with
        # computed tokens).
        self.scheduler = types.SimpleNamespace(
            running=[types.SimpleNamespace(num_computed_tokens=5) for _ in range(unfinished)],
            waiting=[], kv_holding_waiting=[])
        self.batch_queue = None
        self.reset_ok = reset_ok
        self.events: List[str] = []
        self.version = "default"

    def collective_rpc(self, method: str, kwargs: Dict[str, Any]):
        return [getattr(self.model_executor.driver_worker.worker, method)(**kwargs)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.events.append("reset_prefix_cache")
        return self.reset_ok

    def reset_mm_cache(self) -> None:
        self.events.append("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        self.events.append("reset_encoder_cache")

    def set_weight_version(self, v: str) -> None:
        self.events.append("set_weight_version " + v)
        self.version = v


def test_atomic_install_resets_the_engine_and_labels_it_in_the_same_call(rig):
    core = EngineCore(rig.w)
    # A request queued and never started (it arrived during the call, or while paused) runs after
    # the install, on the new weights: it does not block it.
    core.scheduler.waiting.append(types.SimpleNamespace(num_computed_tokens=0))
    src = stage(rig, "v1", 8)
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert r["ok"] and r["verified"] and r["install_path"] == "exchange", r
    a = r["atomic"]
    assert a["engine"] == "EngineCore" and a["prefix_cache_reset"] and a["reset_mm_cache"] and a["vllm_label"] == "v1"
    assert core.events == ["reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache", "set_weight_version v1"]
    assert core.version == "v1"
    assert "reply_and_engine_side" in r["worker_split_ms"], r["worker_split_ms"]
    expect_live(rig, src)
    # What rc_describe reports as install.atomic, asked through the engine core and from outside it.
    assert core.collective_rpc("_rc_atomic_available", {}) == [(True, None)]
    assert rig.w._rc_atomic_available()[0] is False


def test_atomic_install_is_refused_untouched_when_busy_or_out_of_reach(rig):
    stage(rig, "v1", 9)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in rig.params.items()}
    core = EngineCore(rig.w, unfinished=2)
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and r["outcome"] == "refused_untouched" and "2 request(s) in flight" in r["error"], r
    core.scheduler.running.clear()
    core.scheduler.waiting.append(types.SimpleNamespace(num_computed_tokens=40))  # preempted: old KV
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and "preempted" in r["error"], r
    core.scheduler.waiting.clear()
    core.batch_queue = [object()]
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and "batch queue" in r["error"], r
    r = rig.w.rc_install("v1", atomic=True)  # called from no engine core at all
    assert not r["ok"] and "not on this call's stack" in r["error"], r
    assert core.events == [] and rig.st.label != "v1"
    assert all(p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) for n, p in rig.params.items())
    # Reached, but the engine core runs another worker.
    foreign = EngineCore(Worker())
    foreign.model_executor.driver_worker.worker = object()

    def call_from(core_obj):
        self = core_obj  # noqa: F841 - the frame the walk looks for
        return rig.w.rc_install("v1", atomic=True)

    r = call_from(foreign)
    assert not r["ok"] and "does not run this worker" in r["error"], r


class Request:
    """vLLM's v1 Request as the idle check reads it (0.26 and 0.33 v1/request.py alike): computed
    tokens, output tokens behind the num_output_tokens property, and the preemption count."""

    def __init__(self, num_computed_tokens: int = 0, outputs: int = 0, num_preemptions: int = 0) -> None:
        self.num_computed_tokens = num_computed_tokens
        self._output_token_ids = list(range(outputs))
        self.output_token_ids = tuple(self._output_token_ids)
        self.num_preemptions = num_preemptions

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)


def preempt(sched, r: Request) -> None:
    """vLLM's Scheduler._preempt_request (0.26 scheduler.py:1212-1234, 0.33 :1822-1842): computed
    tokens back to 0, one more preemption, back to the head of ``waiting``; the output stays."""
    r.num_computed_tokens = 0
    r.num_preemptions += 1
    sched.waiting.insert(0, r)


def untouched(rig, before) -> bool:
    return all(p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) for n, p in rig.params.items())


def test_atomic_install_reads_026s_skipped_waiting_queue(rig):
    """0.26 has no kv_holding_waiting: a request blocked while waiting (grammar, remote KV, streamed
    input) or skipped by the scan sits in skipped_waiting (0.26 scheduler.py:185, :1962-1974)."""
    stage(rig, "v1", 12)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in rig.params.items()}
    core = EngineCore(rig.w)
    core.scheduler = types.SimpleNamespace(running=[], waiting=[], skipped_waiting=[Request(num_computed_tokens=16)])
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and r["outcome"] == "refused_untouched", r
    assert "1 request(s) in flight" in r["error"] and "skipped_waiting" in r["error"], r
    assert core.events == [] and untouched(rig, before)
    # Never started, in either queue: runs after the install, on the new weights.
    core.scheduler.skipped_waiting = [Request()]
    core.scheduler.waiting.append(Request())
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert r["ok"] and r["verified"], r
    assert core.version == "v1"


@pytest.mark.parametrize("shape", ["0.26", "0.33"])
def test_atomic_install_counts_a_preempted_request_as_started(rig, shape):
    """Preemption sets num_computed_tokens back to 0 and requeues the request in waiting, where it
    looks fresh by that count alone; its output tokens and preemption count still say it ran on the
    old weights (/pause?mode=keep with clear_cache=true preempts frozen requests on 0.26)."""
    stage(rig, "v1", 13)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in rig.params.items()}
    core = EngineCore(rig.w)
    queues = {"skipped_waiting": []} if shape == "0.26" else {"kv_holding_waiting": []}
    core.scheduler = types.SimpleNamespace(running=[], waiting=[], **queues)
    r0 = Request(num_computed_tokens=40, outputs=3)
    preempt(core.scheduler, r0)
    assert r0.num_computed_tokens == 0 and r0.num_output_tokens == 3 and r0.num_preemptions == 1
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and "preempted" in r["error"] and "in waiting" in r["error"], r
    # Each sign alone: output tokens (the property, or only output_token_ids), or a preemption
    # before any output (preempted during its prefill).
    for started in (Request(outputs=2), types.SimpleNamespace(num_computed_tokens=0, output_token_ids=[7]),
                    Request(num_preemptions=1)):
        core.scheduler.waiting[:] = [Request(), started]
        (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
        assert not r["ok"] and "1 request(s) in flight" in r["error"], (started, r)
    assert core.events == [] and untouched(rig, before)
    core.scheduler.waiting[:] = [Request(), types.SimpleNamespace(num_computed_tokens=0)]  # never started
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert r["ok"] and r["verified"], r


def test_atomic_install_refuses_a_scheduler_without_a_known_waiting_queue(rig):
    """A scheduler with running but none of waiting / skipped_waiting / kv_holding_waiting (a release
    whose layout the check does not know): its waiting requests cannot be read, so it is refused."""
    stage(rig, "v1", 14)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in rig.params.items()}
    core = EngineCore(rig.w)
    core.scheduler = types.SimpleNamespace(running=[], pending_queue=[Request(num_computed_tokens=9)])
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and r["outcome"] == "refused_untouched", r
    assert "none of the waiting queues waiting, skipped_waiting, kv_holding_waiting" in r["error"], r
    assert core.events == [] and untouched(rig, before)
    assert "cannot tell" in ext._engine_busy(types.SimpleNamespace(scheduler=core.scheduler, batch_queue=None))


def test_atomic_install_whose_cache_reset_fails_is_failed_after_mutation(rig):
    core = EngineCore(rig.w, reset_ok=False)
    stage(rig, "v1", 10)
    (r,) = core.collective_rpc("rc_install", {"version": "v1", "atomic": True})
    assert not r["ok"] and r["outcome"] == "failed_after_mutation" and "reset_prefix_cache answered false" in r["error"]
    assert r["label"].startswith("<unknown after a failed install of v1")


def test_the_stage_collects_garbage_views_and_names_a_view_that_lives_on(rig):
    import gc

    gc.disable()  # the cycle below stays until a collection
    try:
        class Holder:
            pass

        h = Holder()
        h.me, h.view = h, rig.model.qkv_proj.weight.data[:1]  # garbage with a view, in a cycle
        del h
        src = stage(rig, "v1", 11)
        ev = rig.st.exchange
        assert ev["ok"], ev  # collected at the stage, while serving
        r = rig.w.rc_install("v1")
        assert r["install_path"] == "exchange", r
        expect_live(rig, src)
        kept = rig.model.norm.data[1:]  # a view that lives on
        stage(rig, "v2", 12)
        assert not rig.st.exchange["ok"] and "norm: 2 other reference(s)" in rig.st.exchange["reason"]
        r = rig.w.rc_install("v2")
        assert r["install_path"] == "fused" and "norm" in r["exchange_refused"], r
        del kept
    finally:
        gc.enable()


class LoaderModel(Model):
    """A vLLM-style loader: q, k, v narrowed into the fused qkv_proj, the norm copied whole."""

    def load_weights(self, weights):
        for name, t in weights:
            if name in ("q", "k", "v"):
                self.qkv_proj.weight.data.narrow(0, {"q": 0, "k": 2, "v": 4}[name], 2).copy_(t)
            else:
                self.norm.data.copy_(t)


def test_rc_stage_captures_the_loader_into_slabs_and_exchanges(monkeypatch):
    """The first stage of a source set: vLLM's own loader captured (rolloutcore.vllm's capture on
    meta tensors), the staging image laid out in slabs at the captured offsets, prepared, exchanged."""
    from rolloutcore import _core

    monkeypatch.setenv("ROLLOUTCORE_VLLM_INSTALL", "exchange")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    made = []
    trainer: Dict[str, Any] = {}

    class CaptureStager(HostStager):
        def __init__(self, device, staging_buffers, live_buffers):
            super().__init__([], staging_buffers, live_buffers)
            made.append(self)

        def stage(self, *a, **kw):
            self.sources = trainer["version"]  # what the trainer published
            return super().stage(*a, **kw)

        def set_captures(self, staging_params, staging_copies, live_params, live_copies):
            esize = {"bf16": 2, "f32": 4}
            dtype = {n: d for n, d, _ in live_params}
            names = [n for n, _, _ in live_params]
            self.copies = []
            for c in live_copies:
                n = 1
                for x in c["dest_shape"]:
                    n *= x
                e = esize[dtype[names[c["param"]]]]
                self.copies.append({**c, "param_name": names[c["param"]], "esize": e, "nbytes": n * e})

    monkeypatch.setattr(_core, "cuda_built", True, raising=False)
    monkeypatch.setattr(_core, "DeviceStager", CaptureStager, raising=False)
    monkeypatch.setattr(ext, "_http_get_json", lambda url, timeout, key: {"manifest": {"tensors": MANIFEST_TENSORS}})
    model = LoaderModel()
    w = Worker()
    w.model_runner = types.SimpleNamespace(model=model)
    w.device = torch.device("cpu", 0)
    none = types.SimpleNamespace(name="NONE")
    w.vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=none, mode=none))
    src = sources(21)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}

    def stage_version(version, s):
        trainer["version"] = s
        ev = w.rc_stage("m", version, "http://dir")
        assert ev["ok"], ev
        return ev

    ev = stage_version("v1", src)
    st = w._rc_state()
    assert st.slabs is not None and set(st.slabs) == {"qkv_proj.weight", "norm"} and st.staging is None
    assert ev["captured_copies"] == 4 and ev["fallback_tensors"] == [], ev
    assert ev["exchange_prepared"]["ok"], ev["exchange_prepared"]
    # Each copy's staging buffer lies at its live offset inside its parameter's slab.
    base = st.slabs["qkv_proj.weight"].data_ptr()
    offsets = sorted(v.data_ptr() - base for v, c in zip(st.staging_views, st.capture.copies)
                     if c["param_name"] == "qkv_proj.weight")
    assert offsets == [0, 16, 32]
    r = w.rc_install("v1")
    assert r["ok"] and r["install_path"] == "exchange" and r["verified"], r
    w_ = model.qkv_proj.weight
    assert torch.equal(w_[0:2], src["q"]) and torch.equal(w_[2:4], src["k"]) and torch.equal(w_[4:6], src["v"])
    assert torch.equal(model.norm, src["norm"])
    assert all(p.data_ptr() != before[n] for n, p in model.named_parameters())
    src2 = sources(22)
    stage_version("v2", src2)
    r = w.rc_install("v2")
    assert r["ok"] and r["install_path"] == "exchange", r
    assert torch.equal(model.qkv_proj.weight[2:4], src2["k"])
    assert all(p.data_ptr() == before[n] for n, p in model.named_parameters())
    assert len(made) == 1  # one capture for the source set
