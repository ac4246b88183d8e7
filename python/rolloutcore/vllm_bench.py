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

With --controller the cycles go through `rolloutcore controller serve --engine vllm+http://...`
(POST /v1/updates, phase times from GET /v1/updates/{id}) instead of being driven from here.

The restart is a best case for vLLM: the same process environment, a warm page cache, a warm Triton
cache, and for the dummy-loaded shapes no weight bytes read from disk at all, so the ratio is a
lower bound of what a real restart costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a file: import the package it lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RC_PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rolloutcore.vllm_harness import OUT, Trainer, Vllm, http  # noqa: E402

MAKE_TINY = os.environ.get("MAKE_TINY") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_models.py")


def shapes_trainer(cfg_dir: str, durl: str, model: str):
    """A Trainer whose base tensors are random bf16 on the GPU, named and shaped like HF's Qwen3."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    t = Trainer.__new__(Trainer)
    t.torch, t.base_dir, t.model, t.device, t.world = torch, cfg_dir, model, 0, 2
    g = torch.Generator(device="cuda:0").manual_seed(0)
    t.base = {}
    for name, p in meta.named_parameters():
        x = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda:0")
        if p.dim() >= 2:
            x.normal_(0.0, 0.02, generator=g)
        else:
            x.fill_(1.0)
        t.base[name] = x
    from rolloutcore import Publisher

    t.pubs = [Publisher(durl, model, rank=r, world_size=2, transport="cuda_ipc") for r in range(2)]
    t.versions = {}
    t.fp8 = []  # no FP8 parts: the bench measures the update path, not the trainer's FP8 digests
    return t


def first_token_ms(v: Vllm) -> float:
    t0 = time.perf_counter()
    v.complete([1, 2, 3, 4], max_tokens=1)
    return (time.perf_counter() - t0) * 1e3


def median(xs):
    return round(statistics.median(xs), 3) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rolloutcore bench cycle --engine vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.6b", "8b"], default="tiny")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--gpu-util", type=float, default=None)
    ap.add_argument("--controller", action="store_true", help="drive the cycles through rolloutcore's controller")
    ap.add_argument("--pause-call", choices=["pause", "sleep", "both"], default="both",
                    help="pause: /pause?mode=wait&clear_cache=false + /resume; sleep: /sleep?level=0&mode=wait + "
                         "/wake_up?tags=scheduling; both: alternate (odd cycles pause, even sleep). With "
                         "--controller: sleep passes --vllm-pause-call sleep")
    ap.add_argument("--quantization", choices=["fp8_per_tensor", "fp8_per_channel", "fp8_per_block"], default=None,
                    help="vLLM serves FP8 weights quantized from the trainer's bf16 (vLLM 0.33's --quantization; "
                         "docs/fp8.md): each install stages bf16, quantizes on the GPU and proves the FP8 image")
    ap.add_argument("--compare-bf16", action="store_true",
                    help="with --quantization: run the same cycles on bf16 vLLM first, then on FP8, in this one "
                         "call, and print the two side by side (COMPARE line, $OUT/bench_vllm_<shape>_fp8_vs_bf16.json)")
    ap.add_argument("--no-restart", action="store_true", help="skip the restart measurement")
    ap.add_argument("--no-digest-bench", action="store_true", help="skip rc_bench_digest")
    ap.add_argument("--dry-run", action="store_true", help="print the configuration as JSON and exit")
    a = ap.parse_args(argv)
    if a.compare_bf16 and not a.quantization:
        ap.error("--compare-bf16 needs --quantization (the FP8 method to compare with bf16)")
    if a.dry_run:
        print(json.dumps({**vars(a), "make_tiny": MAKE_TINY, "out": str(OUT),
                          "rolloutcore_bin": os.environ.get("ROLLOUTCORE_BIN")}, sort_keys=True))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    if not a.compare_bf16:
        run(a)
        return 0
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

    tag = a.shape + (f"_{a.quantization}" if a.quantization else "")
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
    t0 = time.time()
    v = Vllm(cfg, a.port, f"bench_{tag}", extra=extra, gpu_util=util, max_len=1024)
    cold_healthy = v.wait_healthy(600)
    vllm_version = v.version()
    # 0.33 has its own weight label (GET /weight_info, POST /update_weight_version); a control plane
    # sets it inside the pause after every install (the controller does), so the cycle does too.
    own_label = v.is_033()
    cold_first = first_token_ms(v)
    cold_total = time.time() - t0
    trainer = shapes_trainer(cfg, durl, model) if dummy else Trainer(cfg, durl, model)
    total_bytes = sum(x.numel() * x.element_size() for x in trainer.base.values())
    ctl = None
    if a.controller:
        ctl_args = ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                    "--model", model, "--state-dir", str(work / "controller"), "--port", "0"]
        if a.pause_call == "sleep":
            ctl_args += ["--vllm-pause-call", "sleep"]
        ctl = Server("controller", ctl_args,
                     OUT / f"bench_controller_{tag}.log", find_binary())
        curl = ctl.wait_url(60)
    rows = []
    for k in range(1, a.cycles + 1):
        ver = f"v{k}"
        trainer.make(ver, seed=k, scale=0.01)
        trainer.publish(ver)
        if k > 2:
            trainer.release(f"v{k - 2}")
        row = {"version": ver}
        c0 = time.perf_counter()
        if ctl is None:
            ev = v.rpc1("rc_stage", model=model, version=ver, directory=durl, timeout_ms=120000)
            assert ev["ok"], ev
            c1 = time.perf_counter()
            via_sleep = a.pause_call == "sleep" or (a.pause_call == "both" and k % 2 == 0)
            st, body = v.post("/sleep?level=0&mode=wait" if via_sleep else "/pause?mode=wait&clear_cache=false")
            assert st == 200, body
            c2 = time.perf_counter()
            inst = v.rpc1("rc_install", version=ver)
            assert inst["ok"] and inst["verified"], inst
            # The install's reply is what rc_label would answer (the label rc_install set) and what
            # rc_digest(fresh=false) would: no further round trip inside the pause.
            assert inst["label"] == ver and inst["content_digest"], inst
            c_installed = time.perf_counter()
            label_ms = None
            if own_label:
                v.set_weight_version(ver)
                label_ms = (time.perf_counter() - c_installed) * 1e3
            c3 = time.perf_counter()
            st, body = v.post("/reset_prefix_cache")
            assert body == {"success": True}, body
            c4 = time.perf_counter()
            st, body = v.post("/wake_up?tags=scheduling" if via_sleep else "/resume")
            assert st == 200, body
            c5 = time.perf_counter()
            st, paused = http("GET", v.base + "/is_paused")
            assert paused == {"is_paused": False}, paused
            if own_label:
                assert v.weight_info() == ver
            # stage_ms is the rc_stage call's wall time (vLLM's collective_rpc and the extension
            # around it); stage_engine_ms the receiver's own total, stage_parts_ms its steps.
            row.update(stage_ms=(c1 - c0) * 1e3, stage_engine_ms=ev["stage_ms"].get("total"),
                       stage_parts_ms=ev["stage_ms"], stage_wire_ms=ev["stage_ms"].get("wire"),
                       stage_digest_ms=ev["stage_ms"].get("digest"), pause_via=("sleep" if via_sleep else "pause"),
                       pause_call_ms=(c2 - c1) * 1e3, install_call_ms=(c_installed - c2) * 1e3,
                       install_ms=inst["install_ms"], install_path=inst.get("install_path"), label_ms=label_ms,
                       install_kernel_ms=inst.get("kernel_ms"), live_digest_ms=inst.get("digest_ms"),
                       reset_ms=(c4 - c3) * 1e3, resume_ms=(c5 - c4) * 1e3, pause_window_ms=(c5 - c1) * 1e3,
                       bytes_pulled=ev["bytes_pulled"], prepare=ev.get("install_prepared"),
                       digest_equals_manifest=inst["content_digest"] == ev.get("manifest_digest"))
            if a.quantization:
                f = inst.get("fp8") or {}
                assert f.get("match") is True, f  # the FP8 image is the quantization of the proven bf16
                row.update(fp8_quantize_ms=f.get("quantize_ms"), fp8_proof_ms=f.get("ms"), fp8_match=f.get("match"),
                           fp8_parameters=f.get("parameters") and len(f["parameters"]))
        else:
            st, body = http("POST", curl + "/v1/updates", {"model": model, "version": ver})
            assert st == 202, body
            st, upd = http("GET", f"{curl}/v1/updates/{body['id']}?wait_ms=120000", timeout=180)
            eng = upd["engines"][0]
            assert eng["outcome"] == "committed", upd
            row.update(phases_ms=eng.get("phases_ms"), controller_cycle_ms=(time.perf_counter() - c0) * 1e3)
        row["first_token_ms"] = first_token_ms(v)
        row["hot_cycle_ms"] = (time.perf_counter() - c0) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    digest_bench = None
    if not a.no_digest_bench:
        digest_bench = v.rpc1("rc_bench_digest", repeats=5)
        print("DIGEST " + json.dumps(digest_bench), flush=True)
    # Restart on the same checkpoint: process start -> healthy -> first token.
    v.stop()
    restart_s = healthy = restart_first = None
    if not a.no_restart:
        r0 = time.time()
        v2 = Vllm(cfg, a.port, f"bench_{tag}_restart", extra=extra, gpu_util=util, max_len=1024)
        healthy = v2.wait_healthy(600)
        restart_first = first_token_ms(v2)
        restart_s = time.time() - r0
        v2.stop()
    hot = [r["hot_cycle_ms"] for r in rows[1:]] or [r["hot_cycle_ms"] for r in rows]
    summary = {
        "shape": a.shape, "quantization": a.quantization, "bytes": total_bytes, "cycles": a.cycles, "controller": bool(ctl),
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
    print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "rows"}), flush=True)
    (OUT / f"bench_vllm_{tag}.json").write_text(json.dumps(summary, indent=1))
    if ctl is not None:
        ctl.stop()
    trainer.close()
    d.stop()
    return summary


if __name__ == "__main__":
    sys.exit(main())
