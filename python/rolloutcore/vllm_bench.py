#!/usr/bin/env python3
"""Hot update vs restart of a real vLLM 0.26 or 0.33 through rolloutcore's worker extension (GPU machine).

    rolloutcore bench cycle --engine vllm --shape tiny|0.6b|8b [--cycles 5] [--controller] ...
    python3 -m rolloutcore.vllm_bench --shape ...          (the same; what the subcommand runs)

Needs a GPU, torch, vLLM 0.26 or 0.33 importable from $VLLM_SITE (default: the kit $VLLM_KIT's folder,
/tmp/vb/site for 0.26, /tmp/v33/site for 0.33; see docs/vllm.md) and the CUDA build of rolloutcore's
package ($RC_PYTHONPATH, default: this package's folder).

Per shape: a torch CUDA trainer publishes fsdp:2-style shards over cuda_ipc; vLLM (started with
`--load-format dummy` for the 0.6b/8b shapes: their weights arrive by refit) takes `--cycles` hot
updates, each: stage while serving -> pause(wait) -> install (one fused copy+digest launch; its
reply carries the label and the live digest) -> [0.33: POST /update_weight_version, vLLM's own
label, set while paused as the controller does] -> reset_prefix_cache -> resume -> first token. The
pause is vLLM's /pause (which sleeps 20 ms before answering) or /sleep?level=0 + /wake_up?tags=
scheduling (`--pause-call`; `both`, the default, alternates them cycle by cycle). Nothing is sent
to vLLM while it is paused (0.33 answers a request that arrives during /pause in wait mode with 503
instead of queueing it), and no reply body of /pause, /sleep, /wake_up or /resume is parsed (0.33
answers /sleep and /wake_up with JSON, 0.26 with an empty 200): only their status. Then vLLM is
restarted on the same checkpoint: process start -> /health -> first token. Prints the split of a
hot cycle (medians), the pause window, the restart / hot-cycle ratio, and the GPU digest against a
plain read of the same bytes (rc_bench_digest), and writes them to $OUT/bench_vllm_<shape>.json.

The calls inside the pause window go over a persistent HTTP/1.1 connection opened before it (as the
controller's adapter keeps its connections alive; until 2026-12-05 the bench opened one per call).
--window runs rolloutcore's pause window other ways, cycle by cycle in turn (docs/vllm.md "Closing
the pause window"): the prefix reset beside the install (overlap), one rc_install(atomic=True)
without a pause (atomic), the install by exchange instead of the copy, and its proof from the stage
(verify staged); WINDOW lines print the medians per variant.

With --controller the cycles go through `rolloutcore controller serve --engine vllm+http://...`
(POST /v1/updates, phase times from GET /v1/updates/{id}) instead of being driven from here.

The restart is a best case for vLLM: the same process environment, a warm page cache, a warm Triton
cache, and for the dummy-loaded shapes no weight bytes read from disk at all, so the ratio is a
lower bound of what a real restart costs.

With --versus native (vLLM 0.33 only: 0.26 cannot load its ipc backend, its ipc_engine.py imports
ray, which the kit does not bundle) the same vLLM server also runs vLLM's own `ipc` weight transfer
(`--weight-transfer-config '{"backend":"ipc"}'`, VLLM_ALLOW_INSECURE_SERIALIZATION=1, the extension
still loaded) and the bench alternates, `--cycles` times each, a rolloutcore hot cycle (as above;
trainer.publish counted too) and vLLM's own update of another version made by the same trainer:
pause -> /start_weight_update -> CUDA IPC handles of the trainer's tensors (reduce_tensor, pickled,
base64: what vLLM's IPCTrainerWeightTransferEngine and HTTPVLLMWeightSyncClient send) ->
/update_weights -> /finish_weight_update {weight_version} -> reset_prefix_cache -> resume -> first
token. Per cycle: the pause window, "weights ready -> first token on the new version", every call,
the vLLM processes' GPU memory (nvidia-smi by pid); what rolloutcore proved (digest == manifest,
label, cache reset); for vLLM's path, which proves nothing, the bench checks afterwards, outside the
timed window, that the live weights are the trainer's (the extension's fresh rc_digest against the
manifest digest of the same tensors, published only for that check): native_weights_correct. Prints
a side-by-side table of medians (the first cycle of each path is a warm-up, left out) and writes it
under "versus_native" in $OUT/bench_vllm_<shape>.json.

With --quantization (vLLM 0.33 only: the extension's FP8 layout is checked against 0.33 alone)
vLLM serves FP8 quantized from the trainer's bf16. Both refusals are checked before vLLM starts
(the release in $VLLM_SITE, else $VLLM_KIT) and again on the release the server reports.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

if __package__ in (None, ""):  # run as a file: import the package it lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RC_PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rolloutcore.vllm_harness import (OUT, VLLM_KIT, VLLM_SITE, Trainer, Vllm, http,  # noqa: E402
                                      manifest_digests, site_version)

MAKE_TINY = os.environ.get("MAKE_TINY") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_models.py")


def shapes_trainer(cfg_dir: str, durl: str, model: str, transport: str = "cuda_ipc", delta: bool = False):
    """A Trainer whose base tensors are random bf16, named and shaped like HF's Qwen3. The base is
    made on the GPU and stays there when the GPU has room for it beside what the bench adds later
    (two versions the trainer keeps, the engine's staging image, one f32 temporary); otherwise (an
    8B shape on an 80 GB GPU, with vLLM's share taken) it is kept in host memory and each version is
    made on the GPU from it (outside every timed window): the same values either way."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = list(meta.named_parameters())
    version_bytes = sum(p.numel() * 2 for _, p in params)
    largest_f32 = max(p.numel() * 4 for _, p in params)
    free, _ = torch.cuda.mem_get_info(0)
    on_device_needs = 4 * version_bytes + largest_f32 + (2 << 30)  # base, 2 versions, staging, f32, margin
    host_base = free < on_device_needs
    print(f"trainer: base tensors ({version_bytes / 2**30:.1f} GiB) kept on the "
          + (f"host (the GPU has {free / 2**30:.1f} GiB free, {on_device_needs / 2**30:.1f} GiB needed to keep them "
             "there beside two versions and the engine's staging)" if host_base else "GPU"), flush=True)
    t = Trainer.__new__(Trainer)
    t.torch, t.base_dir, t.model, t.device, t.world = torch, cfg_dir, model, 0, 2
    t.base_on = "host" if host_base else "device"
    g = torch.Generator(device="cuda:0").manual_seed(0)
    t.base = {}
    for name, p in params:
        x = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda:0")
        if p.dim() >= 2:
            x.normal_(0.0, 0.02, generator=g)
        else:
            x.fill_(1.0)
        t.base[name] = x.cpu() if host_base else x
        del x
    from rolloutcore import Publisher

    t.transport = transport
    t.pubs = [Publisher(durl, model, rank=r, world_size=2, transport=transport, delta=delta) for r in range(2)]
    t.versions = {}
    t.fp8 = []  # no FP8 parts: the bench measures the update path, not the trainer's FP8 digests
    return t


def first_token_ms(v: Vllm) -> float:
    t0 = time.perf_counter()
    v.complete([1, 2, 3, 4], max_tokens=1)
    return (time.perf_counter() - t0) * 1e3


def median(xs):
    return round(statistics.median(xs), 3) if xs else None


def reset_and_resume(v: Vllm, via_sleep: bool, own_label: bool, ver: str) -> Tuple[float, float, Optional[str]]:
    """The end of a cycle on either path, inside the pause: /reset_prefix_cache (must succeed),
    then resume (/wake_up?tags=scheduling after /sleep, else /resume); then, outside it, vLLM is
    serving again and (with vLLM's own label) labelled ``ver``. Returns (reset done, resume
    answered: perf_counter times) and vLLM's label (None without own_label)."""
    st, body = v.post("/reset_prefix_cache")
    assert body == {"success": True}, body
    reset_done = time.perf_counter()
    st, body = v.post("/wake_up?tags=scheduling" if via_sleep else "/resume")
    assert st == 200, body
    resumed = time.perf_counter()
    st, paused = http("GET", v.base + "/is_paused")
    assert paused == {"is_paused": False}, paused
    vllm_label = v.weight_info() if own_label else None
    assert vllm_label in (None, ver), vllm_label
    return reset_done, resumed, vllm_label


# ---- --window: how the pause window is run (issue 39 item 2; docs/vllm.md "Closing the pause window") ----
#
# A variant is SEQUENCE:INSTALL[:VERIFY]:
#   serial   pause -> rc_install -> [0.33: label] -> reset_prefix_cache -> resume (one call after another)
#   overlap  pause -> rc_install beside reset_prefix_cache (two connections: the reset commutes with the
#            install inside the pause) -> [label] -> resume
#   atomic   one call, no pause: rc_install(atomic=True) installs, resets vLLM's caches and sets its label
#            on the engine core's thread between two steps (refused unless the engine is idle)
#   INSTALL  copy (one fused copy + digest launch) | exchange (the live parameters take the staged slabs)
#   VERIFY   reread (the live weights digested inside the window) | staged (exchange only: the digest the
#            stage proved for those very bytes)
# Every call inside the window goes over a persistent HTTP/1.1 connection opened before the window.

WINDOW_SEQUENCES = ("serial", "overlap", "atomic")


def parse_windows(spec: str) -> List[Tuple[str, str, str]]:
    """--window's comma list -> [(sequence, install, verify)]; ValueError naming the bad item."""
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        ok = (2 <= len(parts) <= 3 and parts[0] in WINDOW_SEQUENCES and parts[1] in ("copy", "exchange")
              and (len(parts) == 2 or parts[2] in ("reread", "staged")))
        if not ok:
            raise ValueError(f"--window: {item.strip()!r} is not SEQUENCE:INSTALL[:VERIFY] (sequence "
                             f"{'|'.join(WINDOW_SEQUENCES)}, install copy|exchange, verify reread|staged)")
        if len(parts) == 3 and parts[2] == "staged" and parts[1] != "exchange":
            raise ValueError(f"--window: {item.strip()!r}: verify=staged is for an exchange only (a copy "
                             "digests what it writes)")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else "reread"))
    return out


def find_key(obj: Any, key: str) -> Any:
    """The first value of ``key`` in nested dicts and lists (depth first), or None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for x in obj:
            v = find_key(x, key)
            if v is not None:
                return v
    return None


def window_of(a, k: int) -> Tuple[str, str, str]:
    """The --window variant of cycle ``k`` (1-based; the variants are taken in turn)."""
    ws = getattr(a, "windows", None) or [("serial", "copy", "reread")]
    return ws[(k - 1) % len(ws)]


def window_name(w: Tuple[str, str, str]) -> str:
    return ":".join(w) if w[2] != "reread" else f"{w[0]}:{w[1]}"


class KeepAlive:
    """One persistent HTTP/1.1 connection to vLLM, opened (and used once) before the pause window so
    that no call inside it pays a connect."""

    def __init__(self, base: str) -> None:
        import http.client
        import urllib.parse

        u = urllib.parse.urlsplit(base)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        st, _ = self.request("GET", "/health")
        assert st == 200, f"GET /health answered {st}"

    def request(self, method: str, path: str, body: Any = None) -> Tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = self.conn.getresponse()
        raw = r.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return r.status, parsed

    def post(self, path: str, body: Any = None) -> Tuple[int, Any]:
        return self.request("POST", path, body)

    def rpc1(self, method: str, **kwargs: Any) -> Dict[str, Any]:
        st, body = self.post("/collective_rpc", {"method": method, "args": [], "kwargs": kwargs})
        assert st == 200, f"collective_rpc {method} answered {st}: {body}"
        (r,) = body["results"]
        return r

    def close(self) -> None:
        self.conn.close()


def connect(v: Vllm) -> KeepAlive:
    """A persistent connection to ``v`` for the calls inside a pause window."""
    return KeepAlive(v.base)


def rolloutcore_cycle(v: Vllm, a, model: str, durl: str, ver: str, via_sleep: bool, own_label: bool,
                      t_ready: Optional[float] = None, delta_policy: Optional[str] = None,
                      window: Tuple[str, str, str] = ("serial", "copy", "reread")) -> Dict[str, Any]:
    """One hot cycle driven from here: stage while serving -> the pause window as ``window`` says
    (see above; serial: pause -> rc_install -> [label] -> reset_prefix_cache -> resume) -> first
    token; ``ver`` is published. With ``t_ready`` (when the trainer's tensors were ready, before its
    publish) the row also has ready_to_serving_ms. With ``delta_policy`` the stage is asked for that
    full-or-delta policy (rc_stage's delta_policy)."""
    from concurrent.futures import ThreadPoolExecutor

    sequence, install, verify = window
    row: Dict[str, Any] = {"version": ver, "window": window_name(window), "sequence": sequence}
    c0 = time.perf_counter()
    kw = {} if delta_policy is None else {"delta_policy": delta_policy}
    ev = v.rpc1("rc_stage", model=model, version=ver, directory=durl, timeout_ms=120000, install=install, **kw)
    assert ev["ok"], ev
    c_staged = time.perf_counter()
    conn = connect(v)
    side = connect(v) if sequence == "overlap" else None
    pool = ThreadPoolExecutor(1) if side is not None else None
    ikw = {"version": ver, "install": install}
    if install == "exchange":
        ikw["verify"] = verify
    label_ms = reset_ms = pause_ms = resume_ms = None
    try:
        c1 = time.perf_counter()
        if sequence == "atomic":
            inst = conn.rpc1("rc_install", atomic=True, **ikw)
            c_installed = c5 = time.perf_counter()
        else:
            st, body = conn.post("/sleep?level=0&mode=wait" if via_sleep else "/pause?mode=wait&clear_cache=false")
            assert st == 200, body
            c2 = time.perf_counter()
            pause_ms = (c2 - c1) * 1e3
            reset = None
            if side is not None:
                # The reset commutes with the install inside the pause: nothing runs a step to refill it.
                def timed_reset() -> Tuple[int, Any, float]:
                    t = time.perf_counter()
                    r = side.post("/reset_prefix_cache")
                    return r[0], r[1], (time.perf_counter() - t) * 1e3
                reset = pool.submit(timed_reset)
            inst = conn.rpc1("rc_install", **ikw)
            c_installed = time.perf_counter()
            if reset is not None:
                st, body, reset_ms = reset.result()
                assert body == {"success": True}, body
            if own_label:
                st, body = conn.post("/update_weight_version", {"new_version": ver})
                assert st == 200 and body == {"success": True, "new_version": ver}, f"update_weight_version: {st} {body}"
            c3 = time.perf_counter()
            label_ms = (c3 - c_installed) * 1e3 if own_label else None
            if reset is None:
                st, body = conn.post("/reset_prefix_cache")
                assert body == {"success": True}, body
                reset_ms = (time.perf_counter() - c3) * 1e3
            c4 = time.perf_counter()
            st, body = conn.post("/wake_up?tags=scheduling" if via_sleep else "/resume")
            assert st == 200, body
            c5 = time.perf_counter()
            resume_ms = (c5 - c4) * 1e3
    finally:
        conn.close()
        if side is not None:
            side.close()
            pool.shutdown()
    assert inst["ok"] and inst["verified"], inst
    # The install's reply is what rc_label would answer (the label rc_install set) and what
    # rc_digest(fresh=false) would: no further round trip inside the pause.
    assert inst["label"] == ver and inst["content_digest"], inst
    if sequence == "atomic":
        eng = inst.get("atomic") or {}
        assert eng.get("prefix_cache_reset") is True, inst
        assert eng.get("vllm_label") == (ver if own_label else None), inst
    # Outside the window: vLLM serves, labelled ver (0.33).
    st, paused = http("GET", v.base + "/is_paused")
    assert paused == {"is_paused": False}, paused
    vllm_label = v.weight_info() if own_label else None
    assert vllm_label in (None, ver), vllm_label
    # stage_ms is the rc_stage call's wall time (vLLM's collective_rpc and the extension
    # around it); stage_engine_ms the receiver's own total, stage_parts_ms its steps.
    row.update(stage_ms=(c_staged - c0) * 1e3, stage_engine_ms=ev["stage_ms"].get("total"),
               stage_parts_ms=ev["stage_ms"], stage_wire_ms=ev["stage_ms"].get("wire"),
               stage_digest_ms=ev["stage_ms"].get("digest"),
               pause_via=None if sequence == "atomic" else ("sleep" if via_sleep else "pause"),
               pause_call_ms=pause_ms, install_call_ms=(c_installed - (c1 if sequence == "atomic" else c2)) * 1e3,
               install_ms=inst["install_ms"], install_path=inst.get("install_path"), install_mode=install,
               exchange_verify=inst.get("exchange_verify"), exchange_refused=inst.get("exchange_refused"),
               digest_source=inst.get("digest_source"), label_ms=label_ms,
               install_kernel_ms=inst.get("kernel_ms"), live_digest_ms=inst.get("digest_ms"),
               worker_call_ms=inst.get("call_ms"), worker_split_ms=inst.get("worker_split_ms"), atomic=inst.get("atomic"),
               reset_ms=reset_ms, resume_ms=resume_ms, pause_window_ms=(c5 - c1) * 1e3,
               bytes_pulled=ev["bytes_pulled"], prepare=ev.get("install_prepared"),
               exchange_prepared=ev.get("exchange_prepared"),
               digest_equals_manifest=inst["content_digest"] == ev.get("manifest_digest"),
               label=inst["label"], vllm_label=vllm_label, cache_reset=True,
               mode=ev.get("mode"), delta_choice=ev.get("delta_choice"), delta_ineligible=ev.get("delta_ineligible"),
               changed=ev.get("changed"), bytes_uploaded=ev.get("bytes_uploaded"),
               stage_install_verify_ms=(c_staged - c0 + c_installed - (c1 if sequence == "atomic" else c2)) * 1e3)
    if a.quantization:
        f = inst.get("fp8") or {}
        assert f.get("match") is True, f  # the FP8 image is the quantization of the proven bf16
        row.update(fp8_quantize_ms=f.get("quantize_ms"), fp8_proof_ms=f.get("ms"), fp8_match=f.get("match"),
                   fp8_parameters=f.get("parameters") and len(f["parameters"]))
    row["first_token_ms"] = first_token_ms(v)
    end = time.perf_counter()
    row["hot_cycle_ms"] = (end - c0) * 1e3
    if t_ready is not None:
        row["ready_to_serving_ms"] = (end - t_ready) * 1e3
    return row


WINDOW_COLUMNS: Tuple[Tuple[str, str], ...] = (
    ("pause_window_ms", "window"), ("pause_call_ms", "pause"), ("install_call_ms", "install call"),
    ("worker_call_ms", "worker"), ("install_kernel_ms", "kernel"), ("label_ms", "label"), ("reset_ms", "reset"),
    ("resume_ms", "resume"), ("stage_ms", "stage"), ("hot_cycle_ms", "hot cycle"))


def window_summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians per --window variant, each variant's first cycle left out (its warm-up)."""
    out: Dict[str, Any] = {}
    seen: Dict[str, int] = {}
    for r in rows:
        w = r.get("window")
        if w is None:
            continue
        seen[w] = seen.get(w, 0) + 1
        if seen[w] == 1:
            continue
        out.setdefault(w, []).append(r)
    summary = {}
    for w, rs in out.items():
        s: Dict[str, Any] = {"n": len(rs), "install_path": sorted({str(r.get("install_path")) for r in rs}),
                             "exchange_refused": sorted({r["exchange_refused"] for r in rs if r.get("exchange_refused")}),
                             "digest_equals_manifest": all(r.get("digest_equals_manifest") for r in rs)}
        for key, _ in WINDOW_COLUMNS:
            vals = [r[key] for r in rs if r.get(key) is not None]
            s[key] = median(vals) if vals else None
        # The worker's own time, part by part (rc_install's worker_split_ms).
        parts = sorted({k for r in rs for k in (r.get("worker_split_ms") or {})})
        s["worker_split_ms"] = {k: median([r["worker_split_ms"][k] for r in rs if k in (r.get("worker_split_ms") or {})])
                                for k in parts}
        summary[w] = s
    return summary


def window_table(ws: Dict[str, Any]) -> List[str]:
    head = "| variant | n | " + " | ".join(c for _, c in WINDOW_COLUMNS) + " | path | digest = manifest |"
    lines = ["WINDOW medians in ms (each variant's first cycle left out)", head,
             "|" + "---|" * (len(WINDOW_COLUMNS) + 4)]
    for w, s in ws.items():
        cells = [_fmt(s.get(k), 2) for k, _ in WINDOW_COLUMNS]
        lines.append(f"| {w} | {s['n']} | " + " | ".join(cells) + f" | {','.join(s['install_path'])} | "
                     f"{str(s['digest_equals_manifest']).lower()} |")
        if s.get("worker_split_ms"):
            lines.append("|   in the worker: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in s["worker_split_ms"].items())
                         + " |")
        for why in s["exchange_refused"]:
            lines.append(f"|   exchange refused: {why} |")
    return lines


# ---- --versus native: vLLM's own ipc weight transfer, alternating with rolloutcore's cycle -------
#
# vLLM 0.33's ipc backend (vllm/distributed/weight_transfer/ipc_engine.py), driven over HTTP the way
# its own trainer half does it: IPCTrainerWeightTransferEngine.trainer_init posts
# /init_weight_transfer_engine {"init_info": {"packed": false}} once (:315); send_weights (:318) is
# /start_weight_update, then _send_unpacked (:388) makes one CUDA IPC handle per tensor
# (reduce_tensor(t.detach().contiguous())[1], keyed by the GPU's UUID, :281 and :411) and posts
# them in one /update_weights, then /finish_weight_update, then torch.cuda.ipc_collect() (:386).
# Over HTTP the handles travel pickled and base64-encoded as `ipc_handles_pickled`
# (clients.py:26-47, HTTPVLLMWeightSyncClient), which the worker unpickles only with
# VLLM_ALLOW_INSECURE_SERIALIZATION=1 (ipc_engine.py:86). The worker rebuilds each tensor on its own
# device (:223-237) and feeds vLLM's load_weights inside the layerwise reload that
# /start_weight_update began; finish copies each processed layer back into the parameters'
# original storage (model_loader/reload/layerwise.py:398), so the extension's capture of those
# parameters stays valid and both paths can run in one server.

IPC_TRANSFER_CONFIG = '{"backend":"ipc"}'

# The medians the side-by-side table shows: (row key, what it is). A path that has no such step
# leaves it out of its rows.
VERSUS_METRICS: Tuple[Tuple[str, str], ...] = (
    ("ready_to_serving_ms", "weights ready -> first token on the new version"),
    ("pause_window_ms", "pause window (pause sent -> resume answered)"),
    ("publish_ms", "publish: shard tables + digests (serving)"),
    ("stage_ms", "rc_stage: pull + check (serving)"),
    ("pause_call_ms", "pause call"),
    ("install_call_ms", "rc_install: copy + digest of the live weights"),
    ("label_ms", "/update_weight_version"),
    ("start_ms", "/start_weight_update"),
    ("handles_ms", "IPC handles: reduce_tensor + pickle"),
    ("update_ms", "/update_weights"),
    ("finish_ms", "/finish_weight_update {weight_version}"),
    ("ipc_collect_ms", "torch.cuda.ipc_collect (trainer)"),
    ("reset_ms", "/reset_prefix_cache"),
    ("resume_ms", "resume call"),
    ("first_token_ms", "first token"),
)


def native_unavailable(release: str) -> Optional[str]:
    """Why --versus native cannot run against vLLM ``release`` ("0.26.0", "0.33", ...), or None."""
    if release.startswith("0.26"):
        return (f"--versus native: vLLM {release} cannot select the ipc weight-transfer backend: vLLM 0.26's "
                "distributed/weight_transfer/ipc_engine.py imports ray at module level and the kit does not "
                "bundle ray (../shared/vllm/README.md), so --weight-transfer-config "
                f"'{IPC_TRANSFER_CONFIG}' fails at start-up with ModuleNotFoundError. Run it against vLLM 0.33 "
                "(VLLM_KIT=0.33), whose ipc_engine.py imports neither ray nor requests.")
    return None


def quantization_unavailable(release: str) -> Optional[str]:
    """Why --quantization cannot run against vLLM ``release`` ("0.26.0", "0.33", ...), or None: the
    worker extension's FP8 layout (_rc_fp8_target, rc_fp8_image) is checked against vLLM 0.33 only."""
    if release.startswith("0.33"):
        return None
    return (f"--quantization: vLLM {release or '(release unknown)'} is not checked for the worker extension's "
            "FP8 install: the layout it reads from vLLM's FP8 layers (_rc_fp8_target, rc_fp8_image; "
            "docs/fp8.md) is checked against vLLM 0.33 only, and the GPU tests tests/vllm/test_fp8_vllm_*.py "
            "skip any other release. Run it against vLLM 0.33 (VLLM_KIT=0.33).")


def release_refusal(a, release: str) -> Optional[str]:
    """Why this bench's arguments ``a`` cannot run against vLLM ``release`` (--versus native, then
    --quantization), or None. Checked before vLLM starts (the site's release, else $VLLM_KIT) and
    again on the release the started server reports (GET /version)."""
    why = native_unavailable(release) if getattr(a, "versus", None) == "native" else None
    if why is None and getattr(a, "quantization", None):
        why = quantization_unavailable(release)
    return why


def ipc_update_info(items: Iterable[Tuple[str, Any]], handle_of: Callable[[Any], Any], gpu_uuid: str) -> Dict[str, Any]:
    """The ``update_info`` of vLLM 0.33's ``POST /update_weights`` for the ipc backend, unpacked, as
    its trainer builds it (IPCTrainerWeightTransferEngine._send_unpacked) and its HTTP client sends
    it (clients.py _json_safe_update_info): {names, dtype_names ("bfloat16"), shapes,
    ipc_handles_pickled: base64(pickle([{gpu_uuid: handle_of(t)}, ...])), tensor_sizes: None}.
    ``items`` are (HF name, tensor) pairs the caller keeps alive until vLLM has finished the update
    (the handles do not hold the storage); ``handle_of`` is reduce_tensor(t)[1] on the GPU."""
    names: List[str] = []
    dtype_names: List[str] = []
    shapes: List[List[int]] = []
    handles: List[Dict[str, Any]] = []
    for name, t in items:
        names.append(str(name))
        dtype_names.append(str(t.dtype).split(".")[-1])
        shapes.append([int(x) for x in t.shape])
        handles.append({gpu_uuid: handle_of(t)})
    if not names:
        raise ValueError("ipc_update_info: no tensors")
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("utf-8"), "tensor_sizes": None}


def parse_compute_apps(text: str) -> Dict[int, float]:
    """MiB per pid from ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``
    (a pid on several GPUs is summed; "[N/A]" and malformed lines are skipped)."""
    out: Dict[int, float] = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            pid, mib = int(parts[0]), float(parts[1])
        except ValueError:
            continue
        out[pid] = out.get(pid, 0.0) + mib
    return out


def _session_of(pid: int) -> Optional[int]:
    try:
        return os.getsid(pid)
    except OSError:  # not in this PID namespace, or gone
        return None


def gpu_memory(session: int) -> Dict[str, Any]:
    """The GPU memory the vLLM server holds, two ways: ``vllm_mib``, nvidia-smi's used_memory of the
    processes of its session (the harness starts vLLM as a session leader; its engine core and
    workers stay in that session), None when nvidia-smi shows none of them (e.g. another PID
    namespace); and the device-wide ``device_used_mib`` with this process's own
    ``bench_reserved_mib`` (the trainer's torch allocations), whose difference moves only with
    what the other processes on the GPU (vLLM) hold."""
    out: Dict[str, Any] = {"vllm_mib": None, "vllm_pids": [], "device_used_mib": None, "bench_reserved_mib": None}
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            mine = {p: m for p, m in parse_compute_apps(r.stdout).items() if _session_of(p) == session}
            if mine:
                out["vllm_mib"], out["vllm_pids"] = sum(mine.values()), sorted(mine)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        out["device_used_mib"] = round((total - free) / 2**20, 1)
        out["bench_reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    except Exception:  # noqa: BLE001 - no torch or no GPU: nvidia-smi's figure alone
        pass
    return out


def growth_mib(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """How much more GPU memory vLLM holds in ``after`` than in ``before`` (gpu_memory samples): by
    nvidia-smi per pid when both have it, else device used minus the bench's own reserved."""
    if before.get("vllm_mib") is not None and after.get("vllm_mib") is not None:
        return {"mib": round(after["vllm_mib"] - before["vllm_mib"], 1), "ruler": "nvidia-smi per pid"}
    keys = ("device_used_mib", "bench_reserved_mib")
    if all(x.get(k) is not None for x in (before, after) for k in keys):
        others = [x["device_used_mib"] - x["bench_reserved_mib"] for x in (before, after)]
        return {"mib": round(others[1] - others[0], 1), "ruler": "device used - bench reserved"}
    return {"mib": None, "ruler": None}


def native_cycle(v: Vllm, tensors: Dict[str, Any], ver: str, via_sleep: bool, own_label: bool, gpu_uuid: str,
                 t_ready: float) -> Dict[str, Any]:
    """One update through vLLM's own ipc transfer (module comment above), timed call by call: pause
    -> start -> handles -> update -> finish {weight_version} -> ipc_collect -> reset_prefix_cache ->
    resume -> first token. ``tensors`` (HF name -> CUDA tensor, the trainer's) stay alive meanwhile."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    row: Dict[str, Any] = {"version": ver, "path": "native", "pause_via": "sleep" if via_sleep else "pause"}
    replies: Dict[str, Any] = {}
    c1 = time.perf_counter()
    st, body = v.post("/sleep?level=0&mode=wait" if via_sleep else "/pause?mode=wait&clear_cache=false")
    assert st == 200, body
    c2 = time.perf_counter()
    st, replies["start"] = v.post("/start_weight_update")
    assert st == 200, f"/start_weight_update answered {st}: {replies['start']}"
    c3 = time.perf_counter()
    # As _send_unpacked: inside the session; the contiguous copies (none for the trainer's tensors,
    # which are contiguous) must outlive the finish.
    weights = [(n, t.detach().contiguous()) for n, t in tensors.items()]
    info = ipc_update_info(weights, lambda t: reduce_tensor(t)[1], gpu_uuid)
    c4 = time.perf_counter()
    st, replies["update"] = v.post("/update_weights", {"update_info": info})
    assert st == 200, f"/update_weights answered {st}: {replies['update']}"
    c5 = time.perf_counter()
    # 0.33's finish takes the label (HTTPVLLMWeightSyncClient.finish_weight_update(weight_version)).
    st, replies["finish"] = v.post("/finish_weight_update", {"weight_version": ver} if own_label else None)
    assert st == 200, f"/finish_weight_update answered {st}: {replies['finish']}"
    c6 = time.perf_counter()
    torch.cuda.ipc_collect()
    del weights
    c7 = time.perf_counter()
    c8, c9, vllm_label = reset_and_resume(v, via_sleep, own_label, ver)
    cache_reset = True
    row["first_token_ms"] = first_token_ms(v)
    end = time.perf_counter()
    row.update(pause_call_ms=(c2 - c1) * 1e3, start_ms=(c3 - c2) * 1e3, handles_ms=(c4 - c3) * 1e3,
               update_ms=(c5 - c4) * 1e3, finish_ms=(c6 - c5) * 1e3, ipc_collect_ms=(c7 - c6) * 1e3,
               reset_ms=(c8 - c7) * 1e3, resume_ms=(c9 - c8) * 1e3, pause_window_ms=(c9 - c1) * 1e3,
               hot_cycle_ms=(end - c1) * 1e3, ready_to_serving_ms=(end - t_ready) * 1e3,
               tensors=len(info["names"]), update_body_bytes=len(json.dumps({"update_info": info})),
               vllm_label=vllm_label, cache_reset=cache_reset, vllm_replies=replies)
    return row


def native_check(v: Vllm, trainer: Trainer, durl: str, model: str, ver: str) -> Dict[str, Any]:
    """After a native cycle, outside its timed window: are vLLM's live weights the trainer's ``ver``?
    The trainer publishes the same tensors (only to get the manifest's content digest, rolloutcore's
    definition) and the extension digests the live parameters afresh (rc_digest fresh=true, through
    the capture the rolloutcore cycles made); rc_native_state says whether any layer is still inside
    vLLM's layerwise reload."""
    c0 = time.perf_counter()
    trainer.publish(ver)
    want = manifest_digests(durl, model, ver)[0]
    live = v.rpc1("rc_digest", fresh=True)
    assert live["ok"], live
    state = v.rpc1("rc_native_state")
    return {"native_weights_correct": live["content_digest"] == want,
            "native_check": {"manifest_digest": want, "live_digest": live["content_digest"],
                             "not_loaded": live.get("not_loaded"), "fallback_tensors": live.get("fallback_tensors"),
                             "reload_state": state.get("after"), "check_ms": (time.perf_counter() - c0) * 1e3}}


def publish_parts(trainer: Any, reports: Any) -> Optional[Dict[str, Any]]:
    """Where a trainer.publish went, ms summed over its ranks (they publish one after the other in
    the trainer's process): add_shard calls, the shards' registration with the transport, their
    digests (one GPU launch per device for CUDA shards), and the directory's publish; None when the
    trainer reports nothing."""
    if not isinstance(reports, list) or not all(isinstance(r, dict) for r in reports):
        return None
    parts: Dict[str, Any] = {"add_shards": getattr(trainer, "add_shards_ms", None)}
    for key, name in (("register_ms", "register"), ("digest_ms", "digest"), ("publish_ms", "directory")):
        vals = [r.get(key) for r in reports]
        parts[name] = round(sum(vals), 3) if vals and all(x is not None for x in vals) else None
    return parts


def versus_cycles(a, v: Vllm, trainer: Trainer, model: str, durl: str,
                  own_label: bool) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """``a.cycles`` pairs, each a rolloutcore hot cycle of version rc<k> and then vLLM's own ipc
    update of version ipc<k>, both made by the same trainer the same way (another seed), one server.
    Returns the rolloutcore rows (the bench's usual rows) and the versus record (its own rows
    under "rows"; versus_finish adds the summary). A failure of vLLM's path is recorded, vLLM is
    left serving and the alternation stops."""
    import torch

    c0 = time.perf_counter()
    st, body = v.post("/init_weight_transfer_engine", {"init_info": {"packed": False}})
    if st != 200:
        raise RuntimeError(f"--versus native: /init_weight_transfer_engine answered {st}: {body}")
    init_ms = (time.perf_counter() - c0) * 1e3
    gpu_uuid = str(torch.cuda.get_device_properties(trainer.device).uuid)
    session = v.proc.pid
    rc_rows: List[Dict[str, Any]] = []
    native_rows: List[Dict[str, Any]] = []
    made: List[str] = []
    error = None
    for k in range(1, a.cycles + 1):
        via_sleep = a.pause_call == "sleep" or (a.pause_call == "both" and k % 2 == 0)
        for path, ver, seed in (("rolloutcore", f"rc{k}", 2 * k - 1), ("native", f"ipc{k}", 2 * k)):
            # The trainer keeps the version vLLM serves and the new one (an 8B version is 16 GB).
            while len(made) > 1:
                trainer.release(made.pop(0))
            before = gpu_memory(session)
            tensors = trainer.make(ver, seed=seed, scale=0.01)
            made.append(ver)
            torch.cuda.synchronize()
            t_ready = time.perf_counter()
            if path == "rolloutcore":
                reports = trainer.publish(ver)
                publish_ms = (time.perf_counter() - t_ready) * 1e3
                row = rolloutcore_cycle(v, a, model, durl, ver, via_sleep, own_label, t_ready=t_ready,
                                        window=window_of(a, k))
                row.update(path=path, publish_ms=publish_ms, publish_parts_ms=publish_parts(trainer, reports))
            else:
                try:
                    row = native_cycle(v, tensors, ver, via_sleep, own_label, gpu_uuid, t_ready)
                    row.update(native_check(v, trainer, durl, model, ver))
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on without this path
                    error = f"{ver}: {type(e).__name__}: {e}"
                    print("NATIVE FAILED " + error + "\nvLLM log tail:\n" + v.tail(40), flush=True)
                    for call in ("/finish_weight_update", "/wake_up?tags=scheduling" if via_sleep else "/resume"):
                        try:
                            v.post(call, timeout=60)
                        except OSError:
                            pass
                    try:
                        print("rc_native_state(restore) " + json.dumps(v.rpc1("rc_native_state", restore=True)))
                    except (AssertionError, OSError) as e2:
                        print(f"rc_native_state(restore): {e2}")
                    break
            row["gpu_mib_before"], row["gpu_mib_after"] = before, gpu_memory(session)
            (rc_rows if path == "rolloutcore" else native_rows).append(row)
            print(json.dumps(row), flush=True)
        if error is not None:
            break
    total = sum(x.numel() * x.element_size() for x in trainer.base.values())
    vs = {"backend": "ipc", "weight_transfer_config": IPC_TRANSFER_CONFIG, "packed": False, "init_ms": init_ms,
          "one_server": True, "pause_call": a.pause_call, "shape": a.shape, "tensors": len(trainer.base),
          "bytes": total, "error": error, "rows": {"rolloutcore": rc_rows, "native": native_rows}}
    return rc_rows, vs


def versus_summary(rc_rows: List[Dict[str, Any]], native_rows: List[Dict[str, Any]], warmup: int = 1) -> Dict[str, Any]:
    """Medians per path (the first ``warmup`` cycles of each left out, as the bench's other medians),
    the ratio rolloutcore / native per metric both have, what each proved and the GPU memory
    growth of vLLM over each path's cycles."""
    med: Dict[str, Dict[str, float]] = {}
    for path, rows in (("rolloutcore", rc_rows), ("native", native_rows)):
        kept = rows[warmup:] or rows
        med[path] = {}
        for key, _ in VERSUS_METRICS:
            vals = [r[key] for r in kept if r.get(key) is not None]
            if vals:
                med[path][key] = median(vals)
    ratio = {k: round(x / med["native"][k], 3) for k, x in med["rolloutcore"].items() if med["native"].get(k)}
    checks = [r.get("native_weights_correct") for r in native_rows]
    memory: Dict[str, Any] = {}
    for path, rows in (("rolloutcore", rc_rows), ("native", native_rows)):
        g = [growth_mib(r.get("gpu_mib_before") or {}, r.get("gpu_mib_after") or {}) for r in rows]
        later = [x["mib"] for x in g[1:] if x["mib"] is not None]
        memory[path] = {"first_update_growth_mib": g[0]["mib"] if g else None,
                        "later_updates_growth_mib_max": max(later) if later else None,
                        "ruler": next((x["ruler"] for x in g if x["ruler"]), None)}
    # Several --window variants taken in turn: each against vLLM's path on its own (each variant's
    # first cycle left out, as window_summary does); "median_ms" mixes them.
    by_window: Dict[str, Any] = {}
    variants = list(dict.fromkeys(r["window"] for r in rc_rows if r.get("window")))
    if len(variants) > 1:
        for w in variants:
            kept = [r for r in rc_rows if r.get("window") == w][warmup:]
            m = {key: median([r[key] for r in kept if r.get(key) is not None])
                 for key, _ in VERSUS_METRICS if any(r.get(key) is not None for r in kept)}
            by_window[w] = {"n": len(kept), "median_ms": m,
                            "rolloutcore_over_native": {k: round(x / med["native"][k], 3) for k, x in m.items()
                                                        if med["native"].get(k)}}
    # Where rolloutcore's "serving" part of ready -> serving goes: the trainer's publish and the
    # receiver's stage, step by step (medians over the measured cycles).
    parts: Dict[str, Dict[str, float]] = {}
    for name, key in (("publish", "publish_parts_ms"), ("stage", "stage_parts_ms")):
        kept = [r.get(key) or {} for r in (rc_rows[warmup:] or rc_rows)]
        steps = list(dict.fromkeys(k for p in kept for k in p))
        parts[name] = {k: median([p[k] for p in kept if p.get(k) is not None]) for k in steps
                       if any(p.get(k) is not None for p in kept)}
    return {
        "warmup_cycles_left_out": warmup,
        "measured_cycles": {"rolloutcore": len(rc_rows[warmup:]), "native": len(native_rows[warmup:])},
        "median_ms": med,
        "rolloutcore_parts_ms": parts,
        "rolloutcore_over_native": ratio,
        "rolloutcore_by_window": by_window,
        "rolloutcore_proved": {
            "cycles": len(rc_rows),
            "live_digest_equals_manifest": sum(1 for r in rc_rows if r.get("digest_equals_manifest") is True),
            "label_equals_version": sum(1 for r in rc_rows if r.get("label") == r.get("version")),
            "cache_reset": sum(1 for r in rc_rows if r.get("cache_reset") is True)},
        # vLLM's replies carry no evidence ({"message": ...}); the bench's own check, outside the window:
        "native_proved": None,
        "native_weights_correct": bool(checks) and all(c is True for c in checks),
        "native_weights_correct_per_cycle": checks,
        "gpu_memory": memory,
    }


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def versus_table(vs: Dict[str, Any]) -> List[str]:
    """The side-by-side table of a finished versus record (versus_cycles + versus_finish), as text."""
    med, ratio = vs["median_ms"], vs["rolloutcore_over_native"]
    n = vs["measured_cycles"]
    gb = vs.get("bytes")
    lines = [f"VERSUS rolloutcore vs vLLM's own ipc update: shape {vs.get('shape')}, "
             f"{_fmt(gb and gb / 1e9, 2)} GB in {vs.get('tensors')} tensors, vLLM {vs.get('vllm_version')}, "
             f"pause via {vs.get('pause_call')}, one server; medians of {n['rolloutcore']} / {n['native']} cycles "
             f"(first {vs['warmup_cycles_left_out']} of each left out)"]
    w = max(len(label) for _, label in VERSUS_METRICS) + 6
    lines.append(f"{'ms':<{w}} {'rolloutcore':>12} {'vLLM ipc':>12} {'rc/native':>10}")
    for key, label in VERSUS_METRICS:
        a, b = med["rolloutcore"].get(key), med["native"].get(key)
        if a is None and b is None:
            continue
        lines.append(f"{label:<{w}} {_fmt(a, 2):>12} {_fmt(b, 2):>12} {_fmt(ratio.get(key), 3):>10}")
    by_window = vs.get("rolloutcore_by_window") or {}
    if by_window:
        lines[0] += f"; rolloutcore ran {len(by_window)} --window variants in turn, mixed in the column above"
        lines.append("per --window variant (each one's first cycle left out): pause window / weights ready -> first "
                     "token, ms, and rc/native")
        for variant, x in by_window.items():
            m, r = x["median_ms"], x["rolloutcore_over_native"]
            lines.append(f"  {variant:<28} n={x['n']:<3} window {_fmt(m.get('pause_window_ms'), 2):>8} "
                         f"({_fmt(r.get('pause_window_ms'), 3)})  ready->serving "
                         f"{_fmt(m.get('ready_to_serving_ms'), 2):>8} ({_fmt(r.get('ready_to_serving_ms'), 3)})")
    for name, steps in (vs.get("rolloutcore_parts_ms") or {}).items():
        if steps:
            lines.append(f"rolloutcore {name}, ms (medians): " +
                         ", ".join(f"{k} {_fmt(x, 2)}" for k, x in steps.items()))
    mem = vs["gpu_memory"]
    staging = vs.get("rolloutcore_staging_bytes")
    lines.append(f"{'GPU MiB: staging kept between updates':<{w}} {_fmt(staging and staging / 2**20):>12} {'-':>12}")
    lines.append(f"{'GPU MiB: vLLM growth over the first update':<{w}} "
                 f"{_fmt(mem['rolloutcore']['first_update_growth_mib']):>12} "
                 f"{_fmt(mem['native']['first_update_growth_mib']):>12}")
    lines.append(f"{'GPU MiB: vLLM growth, later updates (max)':<{w}} "
                 f"{_fmt(mem['rolloutcore']['later_updates_growth_mib_max']):>12} "
                 f"{_fmt(mem['native']['later_updates_growth_mib_max']):>12}")
    lines.append(f"  (memory ruler: {mem['rolloutcore']['ruler'] or mem['native']['ruler']}; staging: the extension's "
                 "rc_bench_digest staging_alloc_bytes)")
    p = vs["rolloutcore_proved"]
    checks = vs["native_weights_correct_per_cycle"]
    lines.append(f"proved by rolloutcore: live digest == manifest {p['live_digest_equals_manifest']}/{p['cycles']}, "
                 f"label == version {p['label_equals_version']}/{p['cycles']}, "
                 f"cache reset {p['cache_reset']}/{p['cycles']}")
    lines.append(f"proved by vLLM's ipc path: nothing; the bench's check afterwards (fresh live digest == manifest): "
                 f"{sum(1 for c in checks if c is True)}/{len(checks)}, native_weights_correct: "
                 f"{str(vs['native_weights_correct']).lower()}")
    if vs.get("data_ptrs_stable") is not None:
        lines.append(f"live parameters at their first addresses after both paths (rc_describe): "
                     f"{str(vs['data_ptrs_stable']).lower()}")
    if vs.get("error"):
        lines.append(f"vLLM's ipc path FAILED, alternation stopped: {vs['error']}")
    return lines


def versus_finish(v: Vllm, vs: Dict[str, Any], digest_bench: Optional[Dict[str, Any]]) -> None:
    """Completes a versus record while vLLM still runs: the rolloutcore staging size, whether the
    live parameters kept their addresses through both paths, and the summary."""
    staging = (digest_bench or {}).get("staging_alloc_bytes")
    if staging is None:
        b = v.rpc1("rc_bench_digest", repeats=1)
        staging = b.get("staging_alloc_bytes") if b.get("ok") else None
    desc = v.rpc1("rc_describe")
    vs.update(vllm_version=v.version(), rolloutcore_staging_bytes=staging,
              data_ptrs_stable=desc.get("data_ptrs_stable"))
    vs.update(versus_summary(vs["rows"]["rolloutcore"], vs["rows"]["native"]))


# ---- --delta F: full and delta stages of the same trainer's versions, alternated --------------------

DELTA_METRICS: Tuple[Tuple[str, str], ...] = (
    ("bytes_pulled", "bytes on the wire (the stage's pull)"),
    ("stage_ms", "rc_stage: pull + apply + proof (serving)"),
    ("stage_install_verify_ms", "stage + install + verify (rc_stage + rc_install calls)"),
    ("pause_window_ms", "pause window"),
    ("ready_to_serving_ms", "weights ready -> first token on the new version"),
)


def delta_cycles(a, v: Vllm, trainer: Trainer, model: str, durl: str, own_label: bool
                 ) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """v1 staged in full (the base, a warm-up), then ``--cycles`` pairs of versions that change
    about ``--delta`` of the elements, staged as a delta (policy always) and in full (never) in
    turn, each installed and proven like any cycle, with one under policy auto right after the
    first pair (the receiver has measured both modes by then; a run cut short by its time limit
    has still shown the choice). The trainer publishes every version with its delta on the last
    (over ``--delta-transport``). After every update a ``DELTA_SO_FAR`` line holds the summary of
    the updates so far."""
    via_sleep = a.pause_call == "sleep"
    trainer.make("v1", seed=1, scale=0.01)
    trainer.publish("v1")
    rows = [dict(rolloutcore_cycle(v, a, model, durl, "v1", via_sleep, own_label, delta_policy="never"),
                 policy="never", warmup=True)]
    print(json.dumps(rows[-1]), flush=True)
    policies = ["always", "never", "auto"] + ["always", "never"] * (a.cycles - 1)
    for k, policy in enumerate(policies, start=2):
        ver = f"v{k}"
        if k > 2:
            trainer.release(f"v{k - 2}")  # installed and superseded: only the base v{k-1} is kept
        trainer.make_changed(ver, f"v{k - 1}", a.delta, seed=k)
        t_ready = time.perf_counter()
        pub = trainer.publish(ver)
        publish_ms = (time.perf_counter() - t_ready) * 1e3
        row = rolloutcore_cycle(v, a, model, durl, ver, via_sleep, own_label, t_ready=t_ready, delta_policy=policy)
        row.update(policy=policy, publish_ms=publish_ms, publish_parts_ms=publish_parts(trainer, pub),
                   delta_published=sum(r.get("delta_changed", 0) for r in pub),
                   delta_bytes_published=sum(r.get("delta_bytes", 0) for r in pub))
        assert row["digest_equals_manifest"], row
        rows.append(row)
        print(json.dumps(row), flush=True)
        print("DELTA_SO_FAR " + json.dumps(delta_summary(a, rows)), flush=True)
    return rows, delta_summary(a, rows)


def delta_summary(a, rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians per mode of the policy-pinned rows (not the warm-up, not auto), their ratios
    delta / full, and what auto took."""
    out: Dict[str, Any] = {"change_fraction": a.delta, "transport": a.delta_transport}
    for mode in ("delta", "full"):
        sel = [r for r in rows if not r.get("warmup") and r.get("policy") != "auto" and r.get("mode") == mode]
        out[mode] = {k: median([r[k] for r in sel if r.get(k) is not None]) for k, _ in DELTA_METRICS}
        out[mode]["n"] = len(sel)
    for k, _ in DELTA_METRICS:
        d, f = out["delta"].get(k), out["full"].get(k)
        out[k + "_delta_over_full"] = round(d / f, 4) if d is not None and f else None
    auto = [r for r in rows if r.get("policy") == "auto"]
    if auto:
        out["auto"] = {"mode": auto[-1].get("mode"), "delta_choice": auto[-1].get("delta_choice"),
                       "delta_ineligible": auto[-1].get("delta_ineligible")}
    return out


def delta_table(ds: Dict[str, Any]) -> List[str]:
    lines = [f"DELTA {ds['transport']}, change fraction {ds['change_fraction']}: medians "
             f"(delta n={ds['delta']['n']}, full n={ds['full']['n']})"]
    for k, what in DELTA_METRICS:
        d, f, r = ds["delta"].get(k), ds["full"].get(k), ds.get(k + "_delta_over_full")
        lines.append(f"  {what:<58} delta {_fmt(d):>14}  full {_fmt(f):>14}  delta/full {_fmt(r, 4)}")
    if "auto" in ds:
        lines.append(f"  auto took: {ds['auto']['mode']} {json.dumps(ds['auto']['delta_choice'])}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rolloutcore bench cycle --engine vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.6b", "8b"], default="tiny")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--gpu-util", type=float, default=None)
    ap.add_argument("--controller", action="store_true", help="drive the cycles through rolloutcore's controller")
    ap.add_argument("--pause-call", choices=["pause", "sleep", "both"], default=None,
                    help="pause: /pause?mode=wait&clear_cache=false + /resume; sleep: /sleep?level=0&mode=wait + "
                         "/wake_up?tags=scheduling; both: alternate (odd cycles pause, even sleep). Default both, "
                         "with --versus pause (both paths of a pair always use the same call). With "
                         "--controller: sleep passes --vllm-pause-call sleep")
    ap.add_argument("--versus", choices=["native"], default=None,
                    help="native: in the same run and vLLM server, alternate a rolloutcore hot cycle and an update "
                         "through vLLM's own ipc weight transfer (--weight-transfer-config '{\"backend\":\"ipc\"}', "
                         "CUDA IPC handles of the same trainer's tensors), --cycles of each; print them side by side "
                         "(VERSUS lines) and add \"versus_native\" to $OUT/bench_vllm_<shape>.json. vLLM 0.33 only "
                         "(0.26 cannot load its ipc backend); not with --controller or --quantization")
    ap.add_argument("--quantization", choices=["fp8_per_tensor", "fp8_per_channel", "fp8_per_block"], default=None,
                    help="vLLM serves FP8 weights quantized from the trainer's bf16 (vLLM 0.33's --quantization; "
                         "docs/fp8.md): each install stages bf16, quantizes on the GPU and proves the FP8 image. "
                         "vLLM 0.33 only (the extension's FP8 layout is checked against 0.33 alone)")
    ap.add_argument("--compare-bf16", action="store_true",
                    help="with --quantization: run the same cycles on bf16 vLLM first, then on FP8, in this one "
                         "call, and print the two side by side (COMPARE line, $OUT/bench_vllm_<shape>_fp8_vs_bf16.json)")
    ap.add_argument("--delta", type=float, default=None, metavar="F",
                    help="full and delta stages side by side (docs/refit.md \"Delta on the GPU\"): the trainer "
                         "publishes with deltas, each version changing about F of the elements; v1 full, then "
                         "--cycles pairs staged as a delta and in full in turn (rc_stage delta_policy always / "
                         "never), then one under auto; DELTA lines and \"delta\" in $OUT/bench_vllm_<shape>.json")
    ap.add_argument("--delta-transport", choices=["cuda_ipc", "shm"], default="cuda_ipc",
                    help="with --delta: the trainer's transport: cuda_ipc (same GPU, from its memory) or shm "
                         "(copied to host memory at publish: the cross-process, wire-bound path)")
    ap.add_argument("--window", default="serial:copy", metavar="VARIANTS",
                    help="how rolloutcore's pause window runs, a comma list of SEQUENCE:INSTALL[:VERIFY] taken "
                         "in turn cycle by cycle (docs/vllm.md \"Closing the pause window\"): sequence serial "
                         "(pause, install, [label], reset, resume), overlap (the reset beside the install) or "
                         "atomic (one rc_install(atomic=True), no pause); install copy or exchange (vLLM then "
                         "starts with ROLLOUTCORE_VLLM_INSTALL=exchange); verify reread or staged (exchange "
                         "only). WINDOW lines and \"windows\" in the JSON. Default serial:copy. With --versus, "
                         "rolloutcore's side runs them; with --controller, serial:exchange starts vLLM with the "
                         "exchange layout and the controller installs by exchange")
    ap.add_argument("--fold-engine-calls", action="store_true",
                    help="with --controller: controller serve --vllm-fold-engine-calls (the cache resets and vLLM's "
                         "label inside rc_install's call, within the controller's pause; docs/vllm.md)")
    ap.add_argument("--no-restart", action="store_true", help="skip the restart measurement")
    ap.add_argument("--no-digest-bench", action="store_true", help="skip rc_bench_digest")
    ap.add_argument("--dry-run", action="store_true", help="print the configuration as JSON and exit")
    a = ap.parse_args(argv)
    if a.compare_bf16 and not a.quantization:
        ap.error("--compare-bf16 needs --quantization (the FP8 method to compare with bf16)")
    if a.versus and a.controller:
        ap.error("--versus native drives both paths from here, call by call: not with --controller")
    if a.versus and a.quantization:
        ap.error("--versus native compares bf16 updates: not with --quantization")
    if a.cycles < 1:
        ap.error(f"--cycles must be at least 1, got {a.cycles}")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port must be in [0, 65535], got {a.port}")
    if a.gpu_util is not None and not 0 < a.gpu_util <= 1:
        ap.error(f"--gpu-util is vLLM's --gpu-memory-utilization, in (0, 1], got {a.gpu_util}")
    if a.delta is not None and not 0 < a.delta < 1:
        ap.error(f"--delta is a change fraction in (0, 1), got {a.delta}")
    if a.delta is not None and (a.versus or a.controller or a.quantization):
        ap.error("--delta drives its own cycles from here: not with --versus, --controller or --quantization")
    try:
        a.windows = parse_windows(a.window)
    except ValueError as e:
        ap.error(str(e))
    if a.fold_engine_calls and not a.controller:
        ap.error("--fold-engine-calls is a controller flag: with --controller only (--window atomic:... is the "
                 "bench's own folded install)")
    if a.controller and a.window not in ("serial:copy", "serial:exchange"):
        ap.error("with --controller the controller drives the pause window: --window serial:copy or "
                 "serial:exchange only (an exchange comes from vLLM's ROLLOUTCORE_VLLM_INSTALL=exchange)")
    if a.quantization and any(w[1] == "exchange" for w in a.windows):
        ap.error("--window ...:exchange: vLLM serving FP8 installs by quantizing into its parameters, not by exchange")
    if a.pause_call is None:
        a.pause_call = ("pause" if (a.versus or a.delta is not None) else
                        "sleep" if a.window != "serial:copy" else "both")
    why = release_refusal(a, site_version(VLLM_SITE) or VLLM_KIT)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if a.dry_run:
        print(json.dumps({**vars(a), "make_tiny": MAKE_TINY, "out": str(OUT),
                          "rolloutcore_bin": os.environ.get("ROLLOUTCORE_BIN")}, sort_keys=True))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    if not a.compare_bf16:
        summary = run(a)
        return 1 if (summary.get("versus_native") or {}).get("error") else 0
    # bf16 then FP8, the same shape, cycles and seeds, one after the other in this call.
    runs = {}
    for q in (None, a.quantization):
        b = argparse.Namespace(**vars(a))
        b.quantization = q
        runs[q or "bf16"] = run(b)
    keys = ("pause_window_ms_median", "hot_cycle_ms_median", "install_ms_median", "install_call_ms_median",
            "fp8_quantize_ms_median", "fp8_proof_ms_median", "stage_ms_median", "first_token_ms_median",
            "cold_healthy_s")
    cmp = {"shape": a.shape, "cycles": a.cycles, "quantization": a.quantization,
           "bf16": {k: runs["bf16"].get(k) for k in keys}, a.quantization: {k: runs[a.quantization].get(k) for k in keys}}
    for k in ("pause_window_ms_median", "hot_cycle_ms_median"):
        lo, hi = runs["bf16"].get(k), runs[a.quantization].get(k)
        if lo and hi:
            cmp[k.replace("_median", "_fp8_over_bf16")] = round(hi / lo, 3)
    print("COMPARE " + json.dumps(cmp), flush=True)
    (OUT / f"bench_vllm_{a.shape}_fp8_vs_bf16.json").write_text(json.dumps(cmp, indent=1))
    return 0


def run(a) -> dict:
    """One bench run (a shape, bf16 or one FP8 method); returns its summary."""
    from rolloutcore.cluster import Server, find_binary

    tag = (a.shape + (f"_{a.quantization}" if a.quantization else "")
           + (f"_delta_{a.delta_transport}" if getattr(a, "delta", None) is not None else ""))
    work = OUT / f"bench_{tag}"
    work.mkdir(exist_ok=True)
    cfg = str(work / "model")
    dummy = a.shape != "tiny"
    cmd = [sys.executable, MAKE_TINY, cfg, "--shape", a.shape] + (["--no-weights"] if dummy else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
               OUT / f"bench_directory_{tag}.log", find_binary())
    durl = d.wait_url(30)
    model = f"bench-{a.shape}"
    util = a.gpu_util or (0.3 if a.shape == "8b" else 0.25)
    extra = (["--load-format", "dummy"] if dummy else []) + (["--quantization", a.quantization] if a.quantization else [])
    env_extra = None
    if any(w[1] == "exchange" for w in getattr(a, "windows", ())):
        # The staging image laid out in slabs (one per live parameter), so an install can exchange them.
        env_extra = {"ROLLOUTCORE_VLLM_INSTALL": "exchange"}
    if a.versus == "native":
        # vLLM's own ipc transfer in the same server as the extension (both are loaded per worker,
        # neither redefines the other's names); the pickled IPC handles need the opt-in.
        extra += ["--weight-transfer-config", IPC_TRANSFER_CONFIG]
        env_extra = {**(env_extra or {}), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    t0 = time.time()
    v = Vllm(cfg, a.port, f"bench_{tag}", extra=extra, gpu_util=util, max_len=1024, env_extra=env_extra)
    try:
        cold_healthy = v.wait_healthy(600)
    except RuntimeError as e:
        if a.versus == "native":
            raise RuntimeError(f"--versus native: vLLM did not start with --weight-transfer-config "
                               f"{IPC_TRANSFER_CONFIG}: {e}") from e
        raise
    vllm_version = v.version()
    why = release_refusal(a, vllm_version)
    if why is not None:
        v.stop()
        d.stop()
        raise SystemExit(why)
    # 0.33 has its own weight label (GET /weight_info, POST /update_weight_version); a control plane
    # sets it inside the pause after every install (the controller does), so the cycle does too.
    own_label = v.is_033()
    cold_first = first_token_ms(v)
    cold_total = time.time() - t0
    tkw = {"transport": a.delta_transport, "delta": True} if a.delta is not None else {}
    trainer = shapes_trainer(cfg, durl, model, **tkw) if dummy else Trainer(cfg, durl, model, **tkw)
    total_bytes = sum(x.numel() * x.element_size() for x in trainer.base.values())
    ctl = None
    if a.controller:
        ctl_args = ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                    "--model", model, "--state-dir", str(work / "controller"), "--port", "0"]
        if a.pause_call == "sleep":
            ctl_args += ["--vllm-pause-call", "sleep"]
        if getattr(a, "fold_engine_calls", False):
            ctl_args += ["--vllm-fold-engine-calls"]
        ctl = Server("controller", ctl_args,
                     OUT / f"bench_controller_{tag}.log", find_binary())
        curl = ctl.wait_url(60)
    versus: Optional[Dict[str, Any]] = None
    delta: Optional[Dict[str, Any]] = None
    if a.versus == "native":
        rows, versus = versus_cycles(a, v, trainer, model, durl, own_label)
    elif a.delta is not None:
        rows, delta = delta_cycles(a, v, trainer, model, durl, own_label)
    else:
        rows = []
        for k in range(1, a.cycles + 1):
            ver = f"v{k}"
            trainer.make(ver, seed=k, scale=0.01)
            trainer.publish(ver)
            if k > 2:
                trainer.release(f"v{k - 2}")
            if ctl is None:
                via_sleep = a.pause_call == "sleep" or (a.pause_call == "both" and k % 2 == 0)
                row = rolloutcore_cycle(v, a, model, durl, ver, via_sleep, own_label,
                                        window=window_of(a, k))
            else:
                row = {"version": ver}
                c0 = time.perf_counter()
                st, body = http("POST", curl + "/v1/updates", {"model": model, "version": ver})
                assert st == 202, body
                st, upd = http("GET", f"{curl}/v1/updates/{body['id']}?wait_ms=120000", timeout=180)
                eng = upd["engines"][0]
                assert eng["outcome"] == "committed", upd
                row.update(phases_ms=eng.get("phases_ms"), controller_cycle_ms=(time.perf_counter() - c0) * 1e3,
                           install_path=find_key(eng.get("evidence"), "install_path"),
                           exchange_refused=find_key(eng.get("evidence"), "exchange_refused"))
                row["first_token_ms"] = first_token_ms(v)
                row["hot_cycle_ms"] = (time.perf_counter() - c0) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    digest_bench = None
    if not a.no_digest_bench:
        digest_bench = v.rpc1("rc_bench_digest", repeats=5)
        print("DIGEST " + json.dumps(digest_bench), flush=True)
    if versus is not None:
        versus_finish(v, versus, digest_bench)
    # Restart on the same checkpoint: process start -> healthy -> first token.
    v.stop()
    restart_s = healthy = restart_first = None
    if not a.no_restart:
        r0 = time.time()
        v2 = Vllm(cfg, a.port, f"bench_{tag}_restart", extra=extra, gpu_util=util, max_len=1024,
                  env_extra=env_extra)
        healthy = v2.wait_healthy(600)
        restart_first = first_token_ms(v2)
        restart_s = time.time() - r0
        v2.stop()
    hot = [r["hot_cycle_ms"] for r in rows[1:]] or [r["hot_cycle_ms"] for r in rows]
    summary = {
        "shape": a.shape, "quantization": a.quantization, "bytes": total_bytes,
        "trainer_base": getattr(trainer, "base_on", "device"), "cycles": a.cycles, "controller": bool(ctl),
        "vllm_version": vllm_version,
        "cold_start_s": round(cold_total, 2), "cold_healthy_s": round(cold_healthy, 2),
        "cold_first_token_ms": round(cold_first, 2),
        "restart_s": restart_s and round(restart_s, 2), "restart_healthy_s": healthy and round(healthy, 2),
        "restart_first_token_ms": restart_first and round(restart_first, 2),
        "hot_cycle_ms_median": median(hot),
        "restart_over_hot": restart_s and round(restart_s * 1e3 / statistics.median(hot), 1),
        "digest_bench": digest_bench,
        "rows": rows,
    }
    if versus is not None:
        summary["versus_native"] = versus
    if delta is not None:
        summary["delta"] = delta
    windows = window_summary(rows)
    if windows:
        summary["windows"] = windows
    for key in ("stage_ms", "stage_engine_ms", "stage_wire_ms", "stage_digest_ms", "pause_call_ms", "install_call_ms", "install_ms",
                "install_kernel_ms", "label_ms", "reset_ms", "resume_ms", "pause_window_ms", "first_token_ms",
                "fp8_quantize_ms", "fp8_proof_ms"):
        vals = [r[key] for r in rows[1:] if r.get(key) is not None]
        if vals:
            summary[key + "_median"] = median(vals)
        for via in ("pause", "sleep"):
            vals = [r[key] for r in rows[1:] if r.get(key) is not None and r.get("pause_via") == via]
            if vals and a.pause_call == "both":
                summary[f"{key}_median_via_{via}"] = median(vals)
    print("SUMMARY " + json.dumps({k: v for k, v in summary.items()
                                   if k not in ("rows", "versus_native", "delta", "windows")}), flush=True)
    if windows:
        print("\n".join(window_table(windows)), flush=True)
        print("WINDOWS " + json.dumps(windows), flush=True)
    if delta is not None:
        print("\n".join(delta_table(delta)), flush=True)
        print("DELTA " + json.dumps(delta), flush=True)
    if versus is not None:
        print("\n".join(versus_table(versus)), flush=True)
        print("VERSUS " + json.dumps({k: x for k, x in versus.items() if k != "rows"}), flush=True)
    (OUT / f"bench_vllm_{tag}.json").write_text(json.dumps(summary, indent=1))
    if ctl is not None:
        ctl.stop()
    trainer.close()
    d.stop()
    return summary


if __name__ == "__main__":
    sys.exit(main())
