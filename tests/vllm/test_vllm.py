"""rolloutcore's vLLM worker extension against a real vLLM 0.26 or 0.33 (labels gpu, vllm).

Run on the GPU machine with scripts/gpu/run_vllm.sh (VLLM_KIT=0.26|0.33; it sets VLLM_SITE,
RC_PYTHONPATH, ROLLOUTCORE_BIN, MAKE_TINY, OUT). Skips cleanly without a GPU, vLLM or the CUDA build.
Every test passes on both releases; where they differ (a request sent while /pause holds the
engine, the replies of /sleep and /wake_up) the test reads the running server's release (GET
/version) and asserts that release's behaviour, so the difference itself is tested both ways.
The tests that only 0.33 can run (its own label, weight_versions, keep and recompute through the
controller) are in test_vllm_033.py.

Figures (stage/install/digest times, start-up times) are printed and written to
$OUT/vllm_figures.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

try:
    from vllm_harness import require_gpu_vllm
except ImportError as e:  # pragma: no cover
    pytest.skip(f"rolloutcore not importable: {e}", allow_module_level=True)
torch = require_gpu_vllm()

from vllm_harness import (  # noqa: E402
    OUT, VLLM_KIT, Background, Vllm, cached_tokens, http, manifest_digests, tiny_env, tokens_of)

from rolloutcore.cluster import Server, find_binary  # noqa: E402

MODEL = "tiny"
FIG: dict = {}
PROMPTS = [list(range(100, 180)), list(range(300, 364)), [7, 8, 9, 10, 11, 12, 13, 14] * 6]


def figure(name: str, value) -> None:
    FIG[name] = value
    print(f"FIGURE {name} = {value}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vllm_figures.json").write_text(json.dumps(FIG, indent=1, sort_keys=True))


def start_env(tmp_path_factory, name: str, port: int, vllm_name: str, directory_log: str):
    """A module's setup (vllm_harness.tiny_env): a random tiny Qwen3 (seed 0), a directory, the torch
    trainer and vLLM with rolloutcore's extension on `port`. Returns (env, stop, seconds to healthy);
    stop stops whatever env["vllm"] is then (a test may have restarted it)."""
    e, stop = tiny_env(tmp_path_factory.mktemp(name), port, vllm_name, directory_log, model=MODEL)
    healthy = e["vllm"].wait_healthy()
    figure(f"{vllm_name}_vllm_version", e["vllm"].version())
    return e, stop, healthy


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e, stop, healthy = start_env(tmp_path_factory, "vllm", 8100, "main", "directory.log")
    figure("vllm_start_to_healthy_s", round(healthy, 1))
    yield e
    stop()


def stage_install(env, version: str, reset: bool = True):
    v, durl = env["vllm"], env["directory"]
    ev = v.rpc1("rc_stage", model=MODEL, version=version, directory=durl, timeout_ms=60000)
    assert ev["ok"], ev
    st, body = v.post("/pause?mode=wait&clear_cache=false")
    assert st == 200, body
    inst = v.rpc1("rc_install", version=version)
    assert inst["ok"] and inst["outcome"] == "installed", inst
    if reset:
        st, body = v.post("/reset_prefix_cache")
        assert st == 200 and body == {"success": True}, body
    st, body = v.post("/resume")
    assert st == 200, body
    return ev, inst


def test_describe_reports_the_live_parameters(env):
    v = env["vllm"]
    d = v.rpc1("rc_describe")
    assert d["ok"], d
    # The release the workers import is the one the server reports, and the kit asked for.
    assert d["vllm_version"] == v.version(), (d["vllm_version"], v.version())
    if "VLLM_KIT" in os.environ:
        assert v.release() == VLLM_KIT, f"VLLM_KIT={VLLM_KIT} but the server runs vLLM {v.version()}"
    assert d["tp_size"] == 1 and d["tp_rank"] == 0
    names = {p["name"] for p in d["parameters"]}
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names), sorted(names)[:8]
    assert d["label"] == "v0" and d["generation"] == 0
    assert len(d["boot_id"]) == 32


def test_initial_digest_equals_the_checkpoint(env):
    """Before any stage the extension captures against the checkpoint vLLM loaded and proves it."""
    v, trainer = env["vllm"], env["trainer"]
    trainer.versions["v0"] = {k: t.contiguous() for k, t in trainer.base.items()}
    trainer.publish("v0")
    want, per = manifest_digests(env["directory"], MODEL, "v0")
    d = v.rpc1("rc_digest", per_tensor=True, fresh=True)
    assert d["ok"], d
    assert d["fallback_tensors"] == [], d
    loaded = {n: h for n, h in per.items() if n not in d["not_loaded"]}
    assert d["tensors"] == loaded
    if not d["not_loaded"]:
        assert d["content_digest"] == want
    figure("tiny_not_loaded", d["not_loaded"])


def test_stage_install_and_prove_v1_from_fsdp2_cuda_shards(env):
    v, trainer = env["vllm"], env["trainer"]
    trainer.make("v1", seed=1)
    reports = trainer.publish("v1")
    assert reports[-1]["state"] == "COMMITTED", reports
    want, per = manifest_digests(env["directory"], MODEL, "v1")
    ev, inst = stage_install(env, "v1")
    assert ev["transport"] == "cuda_ipc"
    assert ev["bytes_needed"] == ev["bytes_planned"] == ev["bytes_pulled"], ev
    assert ev["fallback_tensors"] == [], ev["fallback_reasons"]
    assert inst["verified"], inst
    # One fused launch copied staging into the live parameters and digested what it wrote; the
    # fresh digest below re-reads the live memory and must agree tensor by tensor.
    assert ev["install_prepared"]["ok"], ev["install_prepared"]
    assert inst["install_path"] == "fused" and inst["digest_source"] == "fused", inst
    figure("tiny_fused_install_kernel_ms", inst["kernel_ms"])
    d = v.rpc1("rc_digest", per_tensor=True, fresh=True)
    assert d["digest_source"] == "reread"
    assert d["label"] == "v1" and d["generation"] == 1
    loaded = {n: h for n, h in per.items() if n not in d["not_loaded"]}
    assert d["tensors"] == loaded, "live digest != manifest for some tensor"
    # The device digest (kernels.cu) against the CPU's definition, on the trainer's own bytes: the
    # smallest, the largest and a fused (qkv) source tensor.
    import rolloutcore

    full = trainer.versions["v1"]
    names = sorted(full, key=lambda n: full[n].numel())
    picks = {names[0], names[-1]} | {n for n in names if n.endswith("k_proj.weight")}
    for n in sorted(picks)[:4]:
        if n in d["tensors"]:
            assert rolloutcore.tensor_digest(full[n].detach().cpu().contiguous()) == d["tensors"][n], n
    if not d["not_loaded"]:
        assert d["content_digest"] == want == inst["content_digest"]
    lab = v.rpc1("rc_label")
    assert lab["label"] == "v1" and lab["generation"] == 1 and lab["content_digest"] == inst["content_digest"]
    figure("tiny_stage_ms", ev["stage_ms"])
    figure("tiny_install_ms", round(inst["install_ms"], 3))
    figure("tiny_live_digest_ms", round(inst["digest_ms"], 3))
    figure("tiny_bytes_pulled", ev["bytes_pulled"])
    figure("tiny_captured_copies", ev["captured_copies"])
    # A second stage of another version reuses the capture and staging; plans are rebuilt only when
    # the source topology changes (new handles here: new buffers).
    assert v.rpc1("rc_describe")["data_ptrs_stable"] is True


def test_greedy_tokens_equal_a_fresh_vllm_on_the_exported_checkpoint(env):
    v, trainer = env["vllm"], env["trainer"]
    assert v.rpc1("rc_label")["label"] == "v1"
    out = trainer.export("v1", str(env["work"] / "export_v1"))
    fresh = Vllm(out, 8101, "fresh_v1")
    try:
        figure("fresh_vllm_start_to_healthy_s", round(fresh.wait_healthy(), 1))
        for p in PROMPTS:
            a = v.complete(p, max_tokens=24, cache_salt="greedy-check")
            b = fresh.complete(p, max_tokens=24)
            assert tokens_of(a) == tokens_of(b), (p, tokens_of(a), tokens_of(b))
    finally:
        fresh.stop()


def test_stale_cache_negative_control_and_reset(env):
    """Skipping the reset after an update yields stale hits and other output; the reset fixes it."""
    v, trainer = env["vllm"], env["trainer"]
    p = PROMPTS[0]
    v.complete(p, max_tokens=1)
    hit = v.complete(p, max_tokens=16)
    assert cached_tokens(hit) > 0, hit["usage"]
    hits_before = v.metric("vllm:prefix_cache_hits_total")
    assert hits_before > 0
    trainer.make("v2", seed=2)
    trainer.publish("v2")
    stage_install(env, "v2", reset=False)  # the negative control: no prefix-cache reset
    stale = v.complete(p, max_tokens=16)
    assert cached_tokens(stale) > 0, "expected stale prefix-cache hits without a reset"
    st, body = v.post("/pause?mode=wait&clear_cache=false")
    st, body = v.post("/reset_prefix_cache")
    assert body == {"success": True}, body
    v.post("/resume")
    fresh1 = v.complete(p, max_tokens=16)
    assert cached_tokens(fresh1) == 0
    fresh2 = v.complete(p, max_tokens=16)
    assert cached_tokens(fresh2) > 0
    assert tokens_of(fresh1) == tokens_of(fresh2)
    figure("stale_cached_tokens", cached_tokens(stale))
    figure("stale_output_differs", tokens_of(stale) != tokens_of(fresh1))
    assert tokens_of(stale) != tokens_of(fresh1), "stale KV gave the same tokens (weak perturbation?)"


def test_reset_prefix_cache_answers_false_while_a_request_is_frozen(env):
    """A request frozen by /pause?mode=keep holds its blocks: the prefix reset is refused. Meanwhile
    the extension's rc_frozen names it by vLLM's internal id (cmpl-R-0-<8 hex> for the body's
    request_id R, in 0.26 and 0.33 alike) with its output length so far, which does not move while
    the engine is paused (nothing steps). test_vllm_033.py checks the count against vLLM's own
    weight_versions boundary."""
    v = env["vllm"]
    bg = Background(v.complete, list(range(500, 540)), max_tokens=600, ignore_eos=True, request_id="frozen-probe")
    deadline = time.time() + 30
    while time.time() < deadline and v.metric("vllm:num_requests_running") < 1:
        time.sleep(0.05)
    time.sleep(0.05)  # a few tokens
    st, body = v.post("/pause?mode=keep&clear_cache=false")
    assert st == 200, body
    try:
        st, body = v.post("/reset_prefix_cache")
        figure("reset_while_frozen", body)
        assert st == 200 and body == {"success": False}, body
        f1 = v.rpc1("rc_frozen")
        time.sleep(0.3)
        f2 = v.rpc1("rc_frozen")
        figure("rc_frozen_while_kept", f1)
        assert f1["ok"], f1
        assert f1["runner"] in ("v1", "v2"), f1
        (req,) = f1["requests"]
        assert re.fullmatch(r"cmpl-frozen-probe-0-[0-9a-f]{8}", req["request_id"]), req
        assert 0 < req["output_tokens"] < 600, req
        assert f2["requests"] == f1["requests"], ("the count moved while paused", f1, f2)
    finally:
        v.post("/resume")
    out = bg.join(120)
    assert out["usage"]["completion_tokens"] == 600
    deadline = time.time() + 5  # the step after the last one removes the finished request
    while (after := v.rpc1("rc_frozen"))["requests"] and time.time() < deadline:
        time.sleep(0.05)
    assert after["ok"] and after["requests"] == [], after


def test_sleep_level0_pauses_the_scheduler_and_wake_up_scheduling_resumes_it(env):
    """--vllm-pause-call sleep: /sleep?level=0&mode=wait is the scheduler pause without /pause's
    trailing 20 ms sleep; requests sent meanwhile wait until /wake_up?tags=scheduling, in both
    releases: 0.33's rejection of new requests (503) is set only by /pause (pause_generation,
    v1/engine/core.py:2226-2233), while /sleep reaches EngineCore.sleep, which calls pause_scheduler
    (core.py:1007) and leaves the queueing policy alone. The replies differ: 0.26 answers both
    calls with an empty 200 (entrypoints/serve/dev/sleep/api_router.py:21-42), 0.33 with JSON
    (the same file, :26-55)."""
    v = env["vllm"]
    t0 = time.perf_counter()
    st, body = v.post("/sleep?level=0&mode=wait")
    sleep_ms = (time.perf_counter() - t0) * 1e3
    assert st == 200, body
    assert body == ({"status": "sleeping", "level": 0} if v.is_033() else None), (v.version(), body)
    assert http("GET", v.base + "/is_paused")[1] == {"is_paused": True}
    bg = Background(http, "POST", v.base + "/v1/completions",
                    {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0.0}, timeout=60)
    bg.thread.join(0.5)
    assert bg.thread.is_alive(), f"a request was answered while asleep (level 0) on {v.version()}: {bg.result}"
    t1 = time.perf_counter()
    st, body = v.post("/wake_up?tags=scheduling")
    wake_ms = (time.perf_counter() - t1) * 1e3
    assert st == 200, body
    assert body == ({"status": "awake", "tags": ["scheduling"]} if v.is_033() else None), (v.version(), body)
    assert http("GET", v.base + "/is_paused")[1] == {"is_paused": False}
    st, out = bg.join(60)
    assert st == 200 and out["usage"]["completion_tokens"] == 2, (st, out)
    t2 = time.perf_counter()
    st, body = v.post("/pause?mode=wait&clear_cache=false")
    pause_ms = (time.perf_counter() - t2) * 1e3
    v.post("/resume")
    figure("idle_sleep0_call_ms", round(sleep_ms, 2))
    figure("idle_pause_call_ms", round(pause_ms, 2))
    figure("idle_wake_up_call_ms", round(wake_ms, 2))


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_a_request_sent_while_paused_waits_on_026_and_gets_503_on_033_unless_keep(env, mode):
    """/pause?mode=M: vLLM 0.26 queues a request that arrives while paused, in every mode, and
    serves it after /resume. 0.33 rejects it at once in wait and abort mode (HTTP 503
    ServiceUnavailableError "Generation is paused...", retryable: EngineCoreProc.pause_generation
    sets reject_new_requests for mode != keep, v1/engine/core.py:2226-2233; the add is finished
    with error code engine_paused, core.py:1796-1816; RetryableRequestError is 503,
    exceptions.py:139-144) and queues it in keep mode, as 0.26 does; /resume clears the flag
    (core.py:2235-2237)."""
    v = env["vllm"]
    rejects = v.is_033() and mode != "keep"
    st, body = v.post(f"/pause?mode={mode}&clear_cache=false")
    assert st == 200 and body == {"status": "paused"}, body
    try:
        bg = Background(http, "POST", v.base + "/v1/completions",
                        {"model": "m", "prompt": [9, 10, 11, 12], "max_tokens": 2, "temperature": 0.0}, timeout=60)
        bg.thread.join(3.0)
        if rejects:
            assert not bg.thread.is_alive(), f"0.33, /pause?mode={mode}: the request was not answered at once"
            st, out = bg.join(1)
            figure(f"request_while_paused_{mode}_033", [st, out])
            assert st == 503, (st, out)
            assert "paused" in json.dumps(out).lower(), out
        else:
            assert bg.thread.is_alive(), f"{v.version()}, /pause?mode={mode}: answered while paused: {bg.result}"
    finally:
        st, body = v.post("/resume")
        assert st == 200 and body == {"status": "resumed"}, body
    if not rejects:
        st, out = bg.join(60)
        assert st == 200 and out["usage"]["completion_tokens"] == 2, (st, out)
    # After the resume a new request is served (0.33 cleared its reject flag).
    assert v.complete([9, 10, 11, 12], max_tokens=2)["usage"]["completion_tokens"] == 2


def test_install_without_stage_is_refused_untouched(env):
    v = env["vllm"]
    before = v.rpc1("rc_label")
    r = v.rpc1("rc_install", version="v-never-staged")
    assert not r["ok"] and r["outcome"] == "refused_untouched", r
    after = v.rpc1("rc_digest", fresh=True)
    assert after["label"] == before["label"] and after["content_digest"] == before["content_digest"]


def test_stage_of_an_unknown_version_is_not_found(env):
    r = env["vllm"].rpc1("rc_stage", model=MODEL, version="v404", directory=env["directory"], timeout_ms=5000)
    assert not r["ok"] and r["code"] == "NotFound", r


# ---- replay validation (issue 18): the bf16 bound, measured ----------------------------------------


def f32_probes(env, weights, prompts, steps: int, top_k: int):
    """The torch trainer's probes: a Transformers Qwen3 in f32 on exactly these (bf16) weights."""
    import torch
    from transformers import Qwen3ForCausalLM

    from rolloutcore.probes import make_probes

    ref = Qwen3ForCausalLM.from_pretrained(env["tiny"], dtype=torch.float32).to("cuda").eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    probes = make_probes(ref, prompts, steps=steps, top_k=top_k)
    del ref
    torch.cuda.empty_cache()
    return probes


def replay_paused(v, probes):
    """rc_replay of every probe with the engine paused (wait) and drained, as VALIDATING does."""
    st, body = v.post("/pause?mode=wait&clear_cache=false")
    assert st == 200, body
    try:
        out = []
        for p in probes:
            r = v.rpc1("rc_replay", prompt=p["prompt"], steps=len(p["steps"]), top_k=p["top_k"], probe=p["name"])
            assert r["ok"], r
            out.append(r)
        return out
    finally:
        v.post("/resume")


def compare(probes, replays):
    """Per probe and step, as CompareReplay does: the first step where the greedy tokens differ
    ends that probe; before it, |logprob diff| of the chosen token and of every trainer top-k token
    the engine also lists."""
    diffs, first_diverged = [], []
    for p, r in zip(probes, replays):
        for s, (t, e) in enumerate(zip(p["steps"], r["steps"])):
            if t["token"] != e["token"]:
                etop = dict((int(i), float(x)) for i, x in e["top"])
                first_diverged.append({"probe": p["name"], "step": s, "trainer": [t["token"], t["logprob"]],
                                       "engine": [e["token"], e["logprob"]],
                                       "engine_lp_of_trainer_token": etop.get(t["token"])})
                break
            diffs.append(abs(t["logprob"] - e["logprob"]))
            etop = dict((int(i), float(x)) for i, x in e["top"])
            diffs.extend(abs(x - etop[int(i)]) for i, x in t["top"] if int(i) in etop)
    return diffs, first_diverged


def test_replay_bf16_bound_measured_and_wrong_weights_caught(env):
    """The vLLM flavour's default replay tolerance comes from this measurement: for 3 versions ×
    4 prompts × 16 greedy steps (top-5), the torch trainer's f32 logprobs on the published bf16
    weights against vLLM's bf16 kernels replaying them through rc_replay (paused). Negative
    control: the probes of one version replayed on another version's weights (a wrong install the
    digest would not see if the mapping were wrong) differ far beyond the bound."""
    import random

    v, trainer = env["vllm"], env["trainer"]
    rng = random.Random(5)
    prompts = [[rng.randrange(16, 2000) for _ in range(n)] for n in (8, 24, 40, 64)]
    worst, all_diffs, diverged, engine_ms, probes_of = [], [], [], [], {}
    for i, seed in enumerate((21, 22, 23)):
        ver = f"v-bound{i}"
        w = trainer.make(ver, seed=seed)
        trainer.publish(ver)
        stage_install(env, ver)
        probes = f32_probes(env, w, prompts, steps=16, top_k=5)
        probes_of[ver] = probes
        reps = replay_paused(v, probes)
        engine_ms.extend(r["engine_ms"] for r in reps)
        d, div = compare(probes, reps)
        all_diffs.extend(d)
        diverged.extend(div)
        worst.append(max(d))
    all_diffs.sort()
    figure("vllm_replay_bound", {
        "worst_per_version": [round(x, 6) for x in worst], "worst": round(max(worst), 6),
        "p99": round(all_diffs[int(0.99 * (len(all_diffs) - 1))], 6), "median": round(all_diffs[len(all_diffs) // 2], 6),
        "compared_logprobs": len(all_diffs), "greedy_divergences": diverged,
        "engine_ms_per_probe_16_steps": [round(x, 2) for x in engine_ms]})
    # Negative control: v-bound0's probes on v-bound2's weights (live now).
    reps = replay_paused(v, probes_of["v-bound0"])
    d, div = compare(probes_of["v-bound0"], reps)
    wrong = max(d) if d else float("inf")
    figure("vllm_replay_wrong_weights", {"worst_diff_before_divergence": round(wrong, 4),
                                         "divergences": len(div), "first_steps": [x["step"] for x in div]})
    # Probes from other weights must fail: a token differs at step 0 in some probe, or the diffs
    # are far beyond the bound the right weights give.
    assert div and min(x["step"] for x in div) == 0 or wrong > 10 * max(worst), (wrong, div, worst)
    assert max(worst) < 1.0, worst
    for ver in probes_of:
        trainer.release(ver)


# ---- through the controller: `rolloutcore controller serve --engine vllm+http://...` -------------


class Controller:
    """`rolloutcore controller serve --engine vllm+http://...` on one state dir; restartable with other flags
    (a restart re-checks the journal's claim against the engine before admitting anything). `state`
    names the state dir (and the logs): a test that must not inherit another's journal takes its own."""

    def __init__(self, env, state: str = "controller") -> None:
        self.env = env
        self.state = state
        self.server = None
        self.url = ""
        self.starts = 0

    def start(self, *extra: str) -> str:
        env = self.env
        self.starts += 1
        self.server = Server("controller", ["controller", "serve", "--engine", "vllm+" + env["vllm"].base,
                                            "--directory", env["directory"], "--model", MODEL,
                                            "--state-dir", str(env["work"] / self.state), "--port", "0",
                                            "--install-deadline-ms", "3000", "--stage-deadline-ms", "20000", *extra],
                             OUT / f"{self.state}_{self.starts}.log", find_binary())
        self.url = self.server.wait_url(120)
        deadline = time.time() + 60
        while time.time() < deadline and status(self.url)["state"] != "READY":
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def ctl(env):
    c = Controller(env)
    c.start()
    yield c
    c.stop()


def update(ctl_url: str, version: str, wait_ms: int = 120000, **extra):
    """POST /v1/updates (extra: e.g. mode="keep") and wait for its end; the first engine's result."""
    st, body = http("POST", ctl_url + "/v1/updates", {"model": MODEL, "version": version, **extra})
    assert st == 202, body
    st, out = http("GET", f"{ctl_url}/v1/updates/{body['id']}?wait_ms={wait_ms}", timeout=wait_ms / 1e3 + 30)
    assert st == 200, out
    return out["engines"][0]


def rollout(ctl_url: str, prompt, max_tokens: int, rollout_id: str, **extra):
    body = {"prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 0.0, "rollout_id": rollout_id}
    body.update(extra)
    return http("POST", ctl_url + "/v1/rollouts", body, timeout=300)


def journal(ctl_url: str, since: int = 0):
    """The journal's records after seq `since` (all by default)."""
    st, body = http("GET", ctl_url + "/v1/journal" + (f"?since={since}" if since else ""))
    assert st == 200, body
    return body["records"] if isinstance(body, dict) else body


def trajectories(ctl_url: str):
    """Every stored trajectory row (GET /v1/trajectories, JSON)."""
    st, body = http("GET", ctl_url + "/v1/trajectories?format=json&limit=100000")
    assert st == 200, body
    return body["trajectories"] if isinstance(body, dict) else body


def find(records, event, rollout=None):
    for r in records:
        if r.get("event") == event and (rollout is None or r.get("rollout") == rollout):
            return r
    return None


def status(ctl_url: str):
    st, body = http("GET", ctl_url + "/v1/status")
    assert st == 200, body
    return body["engines"][0]


def test_controller_update_commits_with_the_digest_proven(env, ctl):
    trainer = env["trainer"]
    trainer.make("v3", seed=3)
    trainer.publish("v3")
    want, per = manifest_digests(env["directory"], MODEL, "v3")
    eng = update(ctl.url, "v3")
    assert eng["outcome"] == "committed", eng
    s = status(ctl.url)
    assert s["state"] == "READY" and s["label"] == "v3", s
    d = env["vllm"].rpc1("rc_digest", per_tensor=True, fresh=True)
    assert {n: h for n, h in per.items() if n not in d["not_loaded"]} == d["tensors"]
    figure("controller_update_v3_phases_ms", eng.get("phases_ms"))
    figure("controller_update_v3_evidence", eng.get("evidence"))


@pytest.mark.skipif(os.environ.get("ROLLOUTCORE_VLLM_REPLAY") == "0",
                    reason="ROLLOUTCORE_VLLM_REPLAY=0: the extension does not offer rc_replay")
def test_probes_from_the_torch_trainer_replay_in_vllm_within_the_bound(env, ctl):
    """Replay validation on vLLM (docs/lifecycle.md): the trainer computes probes with a
    Transformers model in f32 on exactly the weights it publishes; in VALIDATING, still paused,
    the extension's rc_replay runs them through vLLM's own model runner (bf16 kernels); the update
    commits with the worst difference as evidence."""
    import torch
    from transformers import Qwen3ForCausalLM

    from rolloutcore.probes import make_probes

    trainer = env["trainer"]
    w = trainer.make("v-probe", seed=11)
    ref = Qwen3ForCausalLM.from_pretrained(env["tiny"], dtype=torch.float32).to("cuda").eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in w.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    probes = make_probes(ref, [PROMPTS[0][:24], PROMPTS[1][:16]], steps=8, top_k=5)
    del ref
    torch.cuda.empty_cache()
    trainer.pubs[0].attach_probes("v-probe", probes)
    trainer.publish("v-probe")
    eng = update(ctl.url, "v-probe")
    assert eng["outcome"] == "committed", json.dumps({"reason": eng.get("reason"),
                                                      "validated": eng.get("evidence", {}).get("validated")})
    replay = eng["evidence"]["validated"]["replay"]
    figure("vllm_replay_evidence", replay)
    assert replay["skipped"] is False, replay
    assert replay["match"] is True, replay
    assert replay["probes"] == 2 and replay["tokens"] == 16, replay
    assert replay["worst_logprob_diff"] <= replay["tolerance"], replay
    figure("vllm_replay_worst_logprob_diff", replay["worst_logprob_diff"])
    figure("vllm_replay_ties", replay.get("ties"))
    figure("vllm_replay_engine_ms", replay["engine_ms"])
    # The replay ran while paused and left nothing behind: the engine serves v-probe afterwards.
    st, body = rollout(ctl.url, PROMPTS[2], 4, "after-replay")
    assert st == 200 and body["binding"]["label"] == "v-probe", body


def test_live_256_token_rollout_drains_before_the_install(env, ctl):
    """Experiment 1: a rollout admitted under v3 is mid-generation when v4 is requested."""
    v, trainer = env["vllm"], env["trainer"]
    # vLLM's kernels are not batch-invariant: the canary warm-up and the stage that prefetch runs while
    # the rollout generates would change its greedy tokens without any weight change (seen on the H200).
    # Without prefetch nothing else runs beside it until it finished (stage and canary come after the
    # drain), so its tokens must equal the v3-only run exactly.
    ctl.stop()
    ctl.start("--no-prefetch")
    served = status(ctl.url)["label"]  # v3, or v-probe when the replay test ran before
    prompt = list(range(40, 72))
    st, ref = rollout(ctl.url, prompt, 256, "ref-v3", ignore_eos=True)
    assert st == 200, ref
    trainer.make("v4", seed=4)
    trainer.publish("v4")
    gen0 = v.metric("vllm:generation_tokens_total")
    bg = Background(rollout, ctl.url, prompt, 256, "long-1", ignore_eos=True)
    deadline = time.time() + 30
    while time.time() < deadline and v.metric("vllm:generation_tokens_total") < gen0 + 8:
        time.sleep(0.002)
    mid = v.metric("vllm:generation_tokens_total") - gen0
    eng = Background(update, ctl.url, "v4")
    st, long = bg.join(120)
    eng = eng.join(180)
    assert 8 <= mid < 256, mid
    figure("live_rollout_tokens_at_update_request", mid)
    assert st == 200, long
    assert eng["outcome"] == "committed", eng
    assert long["binding"]["label"] == served
    assert long["choices"][0]["text"] == ref["choices"][0]["text"], "tokens equal the v3-only run"
    j = journal(ctl.url)
    fin, inst = find(j, "finish", "long-1"), find(j, "begin_install")
    ins = [r for r in j if r.get("event") == "begin_install"]
    assert fin is not None and ins, j[-10:]
    assert fin["seq"] < ins[-1]["seq"], "its finish is journaled before the install began"
    st, after = rollout(ctl.url, prompt, 16, "after-1")
    assert st == 200 and after["binding"]["label"] == "v4", after
    ctl.stop()
    ctl.start()  # back to prefetch; the restarted controller checks its journal (v4) against the engine
    assert status(ctl.url)["label"] == "v4"


def test_first_request_after_an_update_is_fresh_and_the_second_hits(env, ctl):
    """Experiment 2 through the controller (the negative control is test_stale_cache_...)."""
    v, trainer = env["vllm"], env["trainer"]
    p = PROMPTS[1]
    rollout(ctl.url, p, 1, "warm-1")
    st, hit = rollout(ctl.url, p, 1, "warm-2")
    assert cached_tokens(hit) > 0, hit.get("usage")
    trainer.make("v5", seed=5)
    trainer.publish("v5")
    eng = update(ctl.url, "v5")
    assert eng["outcome"] == "committed", json.dumps({"result": {k: x for k, x in eng.items() if k != "evidence"},
                                                      "journal": journal(ctl.url)[-8:]})[:6000]
    st, first = rollout(ctl.url, p, 16, "fresh-1")
    st2, second = rollout(ctl.url, p, 16, "fresh-2")
    assert cached_tokens(first) == 0 and cached_tokens(second) > 0
    out = trainer.export("v5", str(env["work"] / "export_v5"))
    fresh = Vllm(out, 8102, "fresh_v5")
    try:
        fresh.wait_healthy()
        ref = fresh.complete(p, max_tokens=16)
        assert tokens_of(first) == tokens_of(ref) == tokens_of(second)
    finally:
        fresh.stop()


def test_two_versions_same_shapes_each_trajectory_carries_its_own_digest(env, ctl):
    """Experiment 3."""
    v5_digest, _ = manifest_digests(env["directory"], MODEL, "v5")
    v4_digest, _ = manifest_digests(env["directory"], MODEL, "v4")
    assert v5_digest != v4_digest
    rows = trajectories(ctl.url)
    seen = {}
    for t in rows:
        b = t["binding"]
        seen.setdefault(b["label"], set()).add(b["identity"]["content_digest"])
    assert seen.get("v5") == {v5_digest} and seen.get("v4") == {v4_digest}, seen


TRAINER_CHILD = r'''
import os, sys, time
sys.path.insert(0, os.environ["HARNESS_DIR"])
from vllm_harness import Trainer
t = Trainer(sys.argv[1], sys.argv[2], sys.argv[3])
t.make(sys.argv[4], seed=int(sys.argv[5]))
t.publish(sys.argv[4])
print("published", flush=True)
time.sleep(600)
'''


def test_trainer_dead_before_the_pull_leaves_the_engine_on_the_old_version(env, ctl):
    """Experiment 4b: the sources of a committed version die; the stage fails, nothing live changes."""
    v = env["vllm"]
    before = v.rpc1("rc_digest", fresh=True)
    child = subprocess.Popen([sys.executable, "-c", TRAINER_CHILD, env["tiny"], env["directory"], MODEL, "v7", "7"],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, HARNESS_DIR=os.path.dirname(__file__)))
    assert child.stdout.readline().strip() == "published"
    child.kill()
    child.wait()
    t0 = time.time()
    env_ctl = ctl.url
    eng = update(env_ctl, "v7")
    figure("dead_trainer_update_s", round(time.time() - t0, 3))
    assert eng["outcome"] != "committed", eng
    s = status(env_ctl)
    assert s["state"] == "READY" and s["label"] == before["label"], s
    after = v.rpc1("rc_digest", fresh=True)
    assert after["content_digest"] == before["content_digest"] and after["label"] == before["label"]


def test_trainer_killed_mid_pull_leaves_the_engine_ready_on_the_old_version(env, ctl):
    """Experiment 4b, mid-pull: the controller's stage has imported the trainer's CUDA memory and is
    held (fault stage_pull_delay_ms) before its reads when the trainer is SIGKILLed. The pull fails
    (cuda_ipc sees the owner gone), nothing live is touched: READY on the old version, the live
    digest unchanged, within the stage deadline (--stage-deadline-ms 20000)."""
    v = env["vllm"]
    ctl.stop()
    ctl.start()  # prefetch on (the default): the stage runs while vLLM serves, under the stage deadline
    before = v.rpc1("rc_digest", fresh=True)
    st0 = status(ctl.url)
    child = subprocess.Popen([sys.executable, "-c", TRAINER_CHILD, env["tiny"], env["directory"], MODEL, "v11", "11"],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, HARNESS_DIR=os.path.dirname(__file__)))
    try:
        assert child.stdout.readline().strip() == "published"
        f = v.rpc1("rc_fault", stage_pull_delay_ms=5000)
        assert f["ok"], f
        t0 = time.time()
        bg = Background(update, ctl.url, "v11")
        time.sleep(2.0)  # the stage's manifest, plan and imports take milliseconds; it now waits in the delay
        assert bg.thread.is_alive(), "the update finished before the kill"
        t_kill = time.time()
        child.kill()
        child.wait()
        eng = bg.join(60)
        t_end = time.time()
    finally:
        if child.poll() is None:
            child.kill()
        v.rpc1("rc_fault")
    figure("trainer_killed_mid_pull", {"update_s": round(t_end - t0, 3), "after_kill_s": round(t_end - t_kill, 3),
                                       "outcome": eng["outcome"], "reason": str(eng.get("reason"))[:400]})
    assert eng["outcome"] != "committed", eng
    # The reads were posted after the kill: the transfer (not the import) saw the owner gone.
    assert "cuda_ipc transfer" in json.dumps(eng) and "is gone" in json.dumps(eng), eng.get("reason")
    assert t_end - t0 < 20.0, "beyond the stage deadline"
    s = status(ctl.url)
    assert s["state"] == "READY" and s["label"] == before["label"] == st0["label"], s
    after = v.rpc1("rc_digest", fresh=True)
    assert after["content_digest"] == before["content_digest"] and after["label"] == before["label"]


def test_vllm_killed_mid_install_taints_in_bounded_time_and_recovery_proves_the_digest(env, ctl):
    """Experiment 4a and recovery."""
    v, trainer = env["vllm"], env["trainer"]
    trainer.make("v8", seed=8)
    trainer.publish("v8")
    assert v.rpc1("rc_fault", install_sleep_ms=10000)["ok"]
    st, body = http("POST", ctl.url + "/v1/updates", {"model": MODEL, "version": "v8"})
    assert st == 202, body
    deadline = time.time() + 60
    while time.time() < deadline and status(ctl.url)["state"] != "UPDATING":
        time.sleep(0.005)
    assert status(ctl.url)["state"] == "UPDATING"
    time.sleep(0.3)  # inside the install: its first copy is done, the extension sleeps
    t_kill = time.time()
    v.kill9()
    while time.time() < t_kill + 10 and status(ctl.url)["state"] != "TAINTED":
        time.sleep(0.005)
    taint_ms = (time.time() - t_kill) * 1e3
    figure("killed_mid_install_to_tainted_ms", round(taint_ms, 1))
    assert status(ctl.url)["state"] == "TAINTED"
    assert taint_ms <= 3000 + 100
    # Restart vLLM on its checkpoint (v0 weights, label v0) at the same address, then recover.
    v2 = Vllm(env["tiny"], v.port, "main_restarted")
    env["vllm"] = v2
    v2.wait_healthy()
    st, body = http("POST", ctl.url + "/v1/recover", {"model": MODEL, "version": "v8"})
    assert st == 202, body
    deadline = time.time() + 120
    while time.time() < deadline and status(ctl.url)["state"] != "READY":
        time.sleep(0.1)
    s = status(ctl.url)
    assert s["state"] == "READY" and s["label"] == "v8", s
    want, per = manifest_digests(env["directory"], MODEL, "v8")
    d = v2.rpc1("rc_digest", per_tensor=True, fresh=True)
    assert d["label"] == "v8" and {n: h for n, h in per.items() if n not in d["not_loaded"]} == d["tensors"]


def test_controller_with_pause_via_sleep_commits(env, ctl):
    """`controller serve` against the real vLLM pauses through /sleep?level=0 by default (and with
    `--vllm-pause-call sleep`); `--vllm-pause-call pause` stays selectable: both updates commit, the
    journal shows each pause call, the engine is unpaused afterwards."""
    trainer = env["trainer"]
    for ver, seed, flags, call in (("v9", 9, (), "/sleep?level=0&mode=wait"),
                                   ("v10", 10, ("--vllm-pause-call", "pause"), "/pause?mode=wait&clear_cache=false")):
        trainer.make(ver, seed=seed)
        trainer.publish(ver)
        want, per = manifest_digests(env["directory"], MODEL, ver)
        ctl.stop()
        ctl.start(*flags)
        eng = update(ctl.url, ver)
        assert eng["outcome"] == "committed", eng
        figure(f"controller_{'default_sleep' if not flags else 'pause'}_phases_ms", eng.get("phases_ms"))
        ins = [r for r in journal(ctl.url) if r.get("event") == "begin_install"]
        assert ins and call in json.dumps(ins[-1]), (call, ins[-1:])
        assert http("GET", env["vllm"].base + "/is_paused")[1] == {"is_paused": False}
        d = env["vllm"].rpc1("rc_digest", per_tensor=True, fresh=True)
        assert d["label"] == ver and {n: h for n, h in per.items() if n not in d["not_loaded"]} == d["tensors"]
