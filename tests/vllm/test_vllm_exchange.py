"""Install by exchange and the atomic install against a real vLLM 0.26 or 0.33 (labels gpu, vllm;
docs/vllm.md "Closing the pause window").

vLLM starts with ROLLOUTCORE_VLLM_INSTALL=exchange (the staging image in slabs, one per live
parameter) and --enforce-eager (the harness's; no CUDA graph holds a parameter's address). Checked:
the live parameters take the staged slabs and give theirs back (the addresses alternate and return
after two updates), the live weights are proven by a fresh re-read against the manifest, greedy
tokens equal a fresh vLLM started on the exported checkpoint; the atomic install resets the prefix
cache and sets vLLM's own label (0.33) in one call without a pause, and is refused untouched while a
request runs. Run with scripts/gpu/run_vllm.sh -k exchange.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

try:
    from vllm_harness import require_gpu_vllm
except ImportError as e:  # pragma: no cover
    pytest.skip(f"rolloutcore not importable: {e}", allow_module_level=True)
torch = require_gpu_vllm()

from vllm_harness import Background, Vllm, cached_tokens, http, manifest_digests, tiny_env, tokens_of  # noqa: E402

MODEL = "tiny"
PROMPT = list(range(100, 180))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e, stop = tiny_env(tmp_path_factory.mktemp("exchange"), 8140, "exchange", "directory_exchange.log", model=MODEL,
                       env_extra={"ROLLOUTCORE_VLLM_INSTALL": "exchange"})
    try:
        e["vllm"].wait_healthy()
        yield e
    finally:
        stop()


def publish(env, version: str, seed: int) -> str:
    env["trainer"].make(version, seed=seed)
    env["trainer"].publish(version)
    want, _ = manifest_digests(env["directory"], MODEL, version)
    return want


def stage(env, version: str, install: str = "exchange"):
    ev = env["vllm"].rpc1("rc_stage", model=MODEL, version=version, directory=env["directory"], timeout_ms=60000,
                          install=install)
    assert ev["ok"], ev
    return ev


def paused_install(env, version: str, **kw):
    v = env["vllm"]
    st, body = v.post("/pause?mode=wait&clear_cache=false")
    assert st == 200, body
    inst = v.rpc1("rc_install", version=version, **kw)
    st, body = v.post("/reset_prefix_cache")
    assert body == {"success": True}, body
    if v.is_033() and inst.get("ok"):
        v.set_weight_version(version)
    st, body = v.post("/resume")
    assert st == 200, body
    return inst


def live_ptrs(v) -> dict:
    d = v.rpc1("rc_describe")
    assert d["ok"], d
    return d


def test_describe_reports_the_slab_layout_and_the_atomic_path(env):
    v = env["vllm"]
    publish(env, "v1", 1)
    stage(env, "v1")
    d = live_ptrs(v)
    assert d["install"]["mode"] == "exchange" and d["install"]["staging_layout"] == "slabs", d["install"]
    assert d["install"]["exchange_issue"] is None, d["install"]
    # vllm serve with TP=1 runs the worker inside the engine core (the uniproc executor).
    assert d["install"]["atomic"] == {"available": True, "reason": None}, d["install"]


def test_exchange_installs_proves_and_alternates_the_storages(env):
    v = env["vllm"]
    want1 = manifest_digests(env["directory"], MODEL, "v1")[0]
    ev = stage(env, "v1")
    assert ev["exchange_prepared"]["ok"], ev["exchange_prepared"]
    inst = paused_install(env, "v1", install="exchange")
    assert inst["ok"] and inst["verified"] and inst["install_path"] == "exchange", inst
    assert inst["bytes_copied"] == 0 and inst["digest_source"] == "reread", inst
    d = v.rpc1("rc_digest", per_tensor=True, fresh=True)
    assert d["ok"] and d["label"] == "v1", d
    if not d["not_loaded"]:
        assert d["content_digest"] == want1 == inst["content_digest"]
    assert live_ptrs(v)["data_ptrs_stable"] is False  # the live parameters are the slabs now
    # v2 stages into the storages v0 lived in, proven by the stage's own digest this time; after it
    # every parameter is back at its first address.
    want2 = publish(env, "v2", 2)
    ev = stage(env, "v2")
    assert ev["exchange_prepared"]["ok"], ev["exchange_prepared"]
    inst = paused_install(env, "v2", install="exchange", verify="staged")
    assert inst["ok"] and inst["verified"] and inst["install_path"] == "exchange", inst
    assert inst["digest_source"] == "staged", inst
    d = v.rpc1("rc_digest", fresh=True)
    if not d["not_loaded"]:
        assert d["content_digest"] == want2 == inst["content_digest"]
    assert live_ptrs(v)["data_ptrs_stable"] is True


def test_greedy_tokens_after_two_exchanges_equal_a_fresh_vllm(env):
    v, trainer = env["vllm"], env["trainer"]
    assert v.rpc1("rc_label")["label"] == "v2"
    out = trainer.export("v2", str(env["work"] / "export_v2"))
    fresh = Vllm(out, 8141, "exchange_fresh_v2")
    try:
        fresh.wait_healthy()
        for p in (PROMPT, [7, 8, 9, 10, 11, 12, 13, 14] * 6):
            a = v.complete(p, max_tokens=24, cache_salt="exchange-greedy")
            b = fresh.complete(p, max_tokens=24)
            assert tokens_of(a) == tokens_of(b), (p, tokens_of(a), tokens_of(b))
    finally:
        fresh.stop()


def test_atomic_install_resets_the_cache_and_labels_without_a_pause(env):
    v = env["vllm"]
    want3 = publish(env, "v3", 3)
    v.complete(PROMPT, max_tokens=1)
    assert cached_tokens(v.complete(PROMPT, max_tokens=1)) > 0  # the old weights' prefix is cached
    stage(env, "v3")
    inst = v.rpc1("rc_install", version="v3", install="exchange", atomic=True)
    assert inst["ok"] and inst["verified"] and inst["install_path"] == "exchange", inst
    a = inst["atomic"]
    assert a["prefix_cache_reset"] is True, a
    assert a["vllm_label"] == ("v3" if v.is_033() else None), a
    if v.is_033():
        assert v.weight_info() == "v3"
    st, paused = http("GET", v.base + "/is_paused")
    assert paused == {"is_paused": False}, paused
    first = v.complete(PROMPT, max_tokens=8)
    assert cached_tokens(first) == 0, first["usage"]  # nothing computed under v2 is served
    assert cached_tokens(v.complete(PROMPT, max_tokens=8)) > 0
    d = v.rpc1("rc_digest", fresh=True)
    if not d["not_loaded"]:
        assert d["content_digest"] == want3
    # A copy install can be atomic too.
    want4 = publish(env, "v4", 4)
    stage(env, "v4", install="copy")
    inst = v.rpc1("rc_install", version="v4", install="copy", atomic=True)
    assert inst["ok"] and inst["install_path"] == "fused" and inst["atomic"]["prefix_cache_reset"], inst
    d = v.rpc1("rc_digest", fresh=True)
    if not d["not_loaded"]:
        assert d["content_digest"] == want4


def test_atomic_install_is_refused_untouched_while_a_request_runs(env):
    v = env["vllm"]
    publish(env, "v5", 5)
    stage(env, "v5")
    before = v.rpc1("rc_digest", fresh=True)
    long = Background(v.complete, PROMPT, max_tokens=400, ignore_eos=True)
    deadline = time.time() + 30
    while v.metric("vllm:num_requests_running") < 1:
        assert time.time() < deadline, "the long request never ran"
        time.sleep(0.05)
    refused = v.rpc1("rc_install", version="v5", atomic=True)
    assert not refused["ok"] and refused["outcome"] == "refused_untouched", refused
    assert "in flight" in refused["error"] or "batch queue" in refused["error"], refused
    out = long.join(120)
    assert len(out["choices"][0]["text"]) > 0
    after = v.rpc1("rc_digest", fresh=True)
    assert after["label"] == before["label"] and after["content_digest"] == before["content_digest"]
    # Once idle, the same staged version installs.
    inst = v.rpc1("rc_install", version="v5", atomic=True)
    assert inst["ok"] and inst["verified"], inst
