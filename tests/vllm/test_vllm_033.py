"""What only vLLM 0.33 offers, through rolloutcore's controller (labels gpu, vllm; scripts/gpu/run_vllm.sh
with VLLM_KIT=0.33). Skipped, with the reason, when the kit or the running server is not 0.33.

vLLM 0.33 has its own weight label (POST /update_weight_version {"new_version"}, GET /weight_info,
initially "default"; v1/engine/core.py:147, :1119-1124) and stamps it on every step's outputs; a
completion asked with return_weight_versions: true reports choices[i].weight_versions =
[{version, start, end}] over output-token indexes (outputs.py:49-55, output_processor.py:531-545).
The controller (`controller serve --engine vllm+http://...`) sets vLLM's label to the committed one
while still paused after each install, reads it back in VALIDATING (journaled as
vllm_weight_version next to the extension's label and the digest), builds the version spans of
every rollout from vLLM's own weight_versions (reported_by_engine: true), and runs the keep and
recompute policy modes: the frozen requests' output lengths come from the extension's rc_frozen
(the swap index), cross-checked against vLLM's spans. The tests below check exactly that contract,
plus the rc_frozen count against vLLM's own span boundary directly (no controller), a rollout sent
while an abort update pauses vLLM (0.33 answers 503 to new requests during /pause in abort and wait
mode, core.py:2226-2233) and a vLLM restarted on the other release under a running controller.

Each test sets up what it needs (its own versions, its own controller and state dir, vLLM healthy,
unpaused and with its own label equal to the extension's: ready_engine), so none depends on the
label another test left.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# test_vllm's module-level checks skip this module as well without a GPU, vLLM or the CUDA build.
from test_vllm import (  # noqa: E402
    MODEL, Controller, figure, journal, rollout, start_env, status, trajectories, update)
from vllm_harness import (  # noqa: E402
    VLLM_OTHER_SITE, VLLM_SITE, Background, Vllm, http, manifest_digests, site_version)


def _kit_version() -> str:
    """The release the tests will start: the kit's site/, else an installed vLLM's metadata."""
    got = site_version(VLLM_SITE)
    if not got:
        try:
            from importlib.metadata import version

            got = version("vllm")
        except Exception:  # noqa: BLE001 - not installed either
            got = ""
    return got


if not _kit_version().startswith("0.33."):
    pytest.skip(f"vLLM 0.33 only: {VLLM_SITE} holds vLLM {_kit_version() or '(unknown)'} "
                "(run with VLLM_KIT=0.33)", allow_module_level=True)

PORT = 8120
_restarts = [0]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e, stop, healthy = start_env(tmp_path_factory, "vllm033", PORT, "main033", "directory033.log")
    try:
        if not e["vllm"].is_033():
            pytest.skip(f"vLLM 0.33 only: the server at {e['vllm'].base} runs {e['vllm'].version()}")
        figure("vllm033_start_to_healthy_s", round(healthy, 1))
        yield e
    finally:
        stop()


# ---- helpers ------------------------------------------------------------------------------------


def ready_engine(env) -> Vllm:
    """Each test's starting point: the module's vLLM alive on this kit (started again if a test
    killed it or left another release on the port), not paused, and vLLM's own label equal to the
    extension's (a test that changed either does not leak into the next one)."""
    v = env["vllm"]
    healthy = v.proc.poll() is None
    if healthy:
        try:
            healthy = http("GET", v.base + "/health", timeout=5)[0] == 200
        except OSError:
            healthy = False
    if not healthy or v.site != VLLM_SITE:
        if v.proc.poll() is None:
            v.kill9()
        _restarts[0] += 1
        v = Vllm(env["tiny"], env["port"], f"main033_restart{_restarts[0]}")
        env["vllm"] = v
        v.wait_healthy()
    if http("GET", v.base + "/is_paused")[1] == {"is_paused": True}:
        v.post("/resume")
    lab = v.rpc1("rc_label")
    assert lab["ok"], lab
    if v.weight_info() != lab["label"]:
        v.set_weight_version(lab["label"])
    return v


def publish(env, version: str, seed: int) -> str:
    """A new committed version of the trainer's weights; its manifest content digest."""
    env["trainer"].make(version, seed=seed)
    reports = env["trainer"].publish(version)
    assert reports[-1]["state"] == "COMMITTED", reports
    return manifest_digests(env["directory"], MODEL, version)[0]


def new_controller(env, name: str, *flags: str) -> Controller:
    """A controller on a state dir of its own (c033_<name>), READY."""
    c = Controller(env, state=f"c033_{name}")
    c.start(*flags)
    s = status(c.url)
    assert s["state"] == "READY", s
    return c


def last_seq(ctl_url: str) -> int:
    return max([r["seq"] for r in journal(ctl_url)] or [0])


def objects_with(x, key: str):
    """Every dict, at any depth of x, that has `key`."""
    out = []
    if isinstance(x, dict):
        if key in x:
            out.append(x)
        for val in x.values():
            out.extend(objects_with(val, key))
    elif isinstance(x, list):
        for val in x:
            out.extend(objects_with(val, key))
    return out


def values_of(x, pred):
    """Every (key, value) pair at any depth of x whose key satisfies pred."""
    out = []
    if isinstance(x, dict):
        for k, val in x.items():
            if pred(k):
                out.append((k, val))
            out.extend(values_of(val, pred))
    elif isinstance(x, list):
        for val in x:
            out.extend(values_of(val, pred))
    return out


def wait_state(ctl_url: str, state: str, timeout_s: float) -> float:
    """Seconds until the engine's state is `state` (or the timeout passed)."""
    t0 = time.time()
    while time.time() < t0 + timeout_s and status(ctl_url)["state"] != state:
        time.sleep(0.02)
    return time.time() - t0


def wait_generated(v: Vllm, since: float, tokens: int, timeout_s: float = 30) -> float:
    deadline = time.time() + timeout_s
    while time.time() < deadline and v.metric("vllm:generation_tokens_total") < since + tokens:
        time.sleep(0.002)
    return v.metric("vllm:generation_tokens_total") - since


def output_len(resp) -> int:
    return int(resp["usage"]["completion_tokens"])


def assert_one_span(spans, n: int, label: str, what: str) -> None:
    """Exactly one span [0, n) of `label`, reported by vLLM (its own weight_versions). A request
    that produced no token (aborted at once) has no span in vLLM's weight_versions
    (output_processor.py:538-545 zips the span starts, of which there are none): [] is accepted
    for n == 0, and so is an empty span [0, 0) of the label that vLLM did not report."""
    if n == 0 and spans == []:
        return
    assert isinstance(spans, list) and len(spans) == 1, (what, spans)
    s = spans[0]
    assert (s["from_token"], s["to_token"], s["label"]) == (0, n, label), (what, n, label, spans)
    assert n == 0 or s.get("reported_by_engine") is True, (what, spans)


def spans_core(spans):
    return [(s["from_token"], s["to_token"], s["label"], s.get("kv"), s.get("swap_index_reported")) for s in spans]


# ---- the extension's frozen counts against vLLM's own boundary (no controller) -------------------


@pytest.mark.parametrize("runner", ["default", "v1"])
@pytest.mark.parametrize("call", ["pause", "sleep"])
def test_rc_frozen_counts_equal_vllms_own_weight_version_boundary(env, call, runner):
    """Greedy 256-token requests are frozen by a keep pause (/pause?mode=keep or
    /sleep?level=0&mode=keep); rc_frozen names each by vLLM's internal id (cmpl-R-0-<8 hex>) with
    its output length, which does not move while paused; vLLM's label is changed while paused and
    the requests resumed: each one's weight_versions is [old 0..K), [new K..256) with K exactly
    rc_frozen's count. `runner`: the default (V2) model runner of the module's vLLM, or the V1
    runner (VLLM_USE_V2_MODEL_RUNNER=0, a second vLLM: only with RC_VLLM_TEST_V1_RUNNER=1, it costs
    a start)."""
    v = ready_engine(env)
    second = None
    if runner == "v1":
        if os.environ.get("RC_VLLM_TEST_V1_RUNNER") != "1":
            pytest.skip("the V1-runner variant starts a second vLLM: set RC_VLLM_TEST_V1_RUNNER=1")
        second = v = Vllm(env["tiny"], PORT + 1, f"v1runner_{call}", env_extra={"VLLM_USE_V2_MODEL_RUNNER": "0"})
        v.wait_healthy()
    try:
        old = v.weight_info()
        probe = f"frozen-probe-{call}-{runner}"
        pause, resume = (("/pause?mode=keep&clear_cache=false", "/resume") if call == "pause"
                         else ("/sleep?level=0&mode=keep", "/wake_up?tags=scheduling"))
        rids = [f"frz-{call}-{runner}-{i}" for i in range(3)]
        gen0 = v.metric("vllm:generation_tokens_total")
        bgs = {rid: Background(http, "POST", v.base + "/v1/completions",
                               {"model": "m", "prompt": list(range(600 + 50 * i, 632 + 50 * i)), "max_tokens": 256,
                                "temperature": 0.0, "ignore_eos": True, "request_id": rid,
                                "return_weight_versions": True}, timeout=300)
               for i, rid in enumerate(rids)}
        wait_generated(v, gen0, 3 * 8)
        st, body = v.post(pause)
        assert st == 200, body
        try:
            f1 = v.rpc1("rc_frozen")
            time.sleep(0.2)
            f2 = v.rpc1("rc_frozen")
            v.set_weight_version(probe)
        finally:
            st, body = v.post(resume)
            assert st == 200, body
        outs = {rid: bg.join(300) for rid, bg in bgs.items()}
        v.set_weight_version(old)
        figure(f"rc_frozen_{call}_{runner}", f1)
        assert f1["ok"], f1
        assert f1["runner"] == ("v1" if runner == "v1" else "v2"), f1
        assert f2["requests"] == f1["requests"], ("the counts moved while paused", f1, f2)
        counts = {}
        for r in f1["requests"]:
            m = re.fullmatch(r"cmpl-(.+)-0-[0-9a-f]{8}", r["request_id"])
            assert m and m.group(1) in rids, r
            counts[m.group(1)] = r["output_tokens"]
        assert counts, ("no request was frozen: they all finished before the pause", f1)
        for rid, (st, out) in outs.items():
            assert st == 200, (rid, st, out)
            wv = out["choices"][0]["weight_versions"]
            if rid in counts:
                k = counts[rid]
                assert 0 <= k < 256, (rid, k)
                # vLLM opens a span at a request's first token step (output_processor.py:531-536):
                # a request frozen before its first token has no span of the old label.
                want = ([{"version": old, "start": 0, "end": k}] if k else []) + \
                    [{"version": probe, "start": k, "end": 256}]
                assert wv == want, (rid, k, wv)
            else:  # it finished before the pause: all of it under the old label
                assert wv == [{"version": old, "start": 0, "end": 256}], (rid, wv)
    finally:
        if second is not None:
            second.stop()


# ---- through the controller --------------------------------------------------------------------


def test_every_committed_update_sets_vllms_own_label_and_the_journal_records_both(env):
    """After every committed update GET /weight_info equals the committed label; the update's
    journal records carry vllm_weight_version = the label, in the same record as the extension's
    label and the content digest."""
    v = ready_engine(env)
    c = new_controller(env, "label")
    try:
        for i, ver in enumerate(("lab-1", "lab-2")):
            want = publish(env, ver, seed=301 + i)
            since = last_seq(c.url)
            eng = update(c.url, ver)
            assert eng["outcome"] == "committed", eng
            assert v.weight_info() == ver
            assert status(c.url)["label"] == ver
            assert v.rpc1("rc_label")["label"] == ver
            recs = journal(c.url, since)
            holders = [r for r in recs
                       if any(o["vllm_weight_version"] == ver for o in objects_with(r, "vllm_weight_version"))]
            assert holders, ("no journal record of the update has vllm_weight_version", ver, recs)
            ok = False
            for r in holders:
                labels = [val for k, val in values_of(r, lambda k: "label" in k and k != "vllm_weight_version")]
                if ver in labels and want in json.dumps(r):
                    ok = True
            assert ok, ("vllm_weight_version is not next to the extension's label and the digest", ver, want, holders)
            figure(f"vllm_weight_version_record_{ver}", holders[0])
    finally:
        c.stop()


def rollout_retrying(ctl_url: str, prompt, max_tokens: int, rid: str, timeout_s: float = 120, **extra):
    """A rollout through the controller, asked again (under a new id) while the controller answers
    503 "no engine is READY" (an update in progress: admissions are closed). (id, status, body)."""
    deadline = time.time() + timeout_s
    attempt = 0
    while True:
        this = rid if attempt == 0 else f"{rid}-t{attempt}"
        st, body = rollout(ctl_url, prompt, max_tokens, this, **extra)
        if st != 503 or time.time() > deadline:
            return this, st, body
        attempt += 1
        time.sleep(0.02)


def test_fifty_rollouts_across_three_strict_updates_are_each_one_span_reported_by_vllm(env):
    """50 rollouts (8..32 tokens, 4 concurrent clients) while three strict updates commit: every
    rollout and every stored trajectory has exactly one span [0, n) with its bound label, and the
    span says it comes from vLLM's own weight_versions (reported_by_engine)."""
    v = ready_engine(env)
    versions = ["sp-1", "sp-2", "sp-3"]
    for i, ver in enumerate(versions):
        publish(env, ver, seed=311 + i)
    c = new_controller(env, "spans")
    start_label = status(c.url)["label"]
    rng = random.Random(7)
    jobs = [(f"sp-r{i:02d}", [rng.randrange(16, 1984) for _ in range(rng.randrange(4, 40))], rng.randrange(8, 33))
            for i in range(50)]
    done, lock = [], threading.Lock()

    def client(k: int) -> None:
        while True:
            with lock:
                if not jobs:
                    return
                rid, prompt, mt = jobs.pop(0)
            got = rollout_retrying(c.url, prompt, mt, rid)
            with lock:
                done.append(got)

    def updater() -> list:
        out = []
        for k, ver in enumerate(versions):
            while True:
                with lock:
                    n = len(done)
                if n >= 12 * (k + 1) or not jobs:
                    break
                time.sleep(0.01)
            out.append(update(c.url, ver))
        return out

    try:
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        upd = Background(updater)
        for t in threads:
            t.join(300)
        engs = upd.join(300)
        assert [e["outcome"] for e in engs] == ["committed"] * 3, engs
        assert len(done) == 50, len(done)
        labels = {}
        for rid, st, body in done:
            assert st == 200, (rid, st, body)
            label = body["binding"]["label"]
            labels[label] = labels.get(label, 0) + 1
            assert_one_span(body["version_spans"], output_len(body), label, rid)
        assert set(labels) <= {start_label, *versions}, labels
        assert len(labels) >= 2, ("the rollouts did not run across the updates", labels)
        rows = trajectories(c.url)
        ours = {rid for rid, _, _ in done}
        assert ours <= {t["binding"]["rollout_id"] for t in rows}
        for t in rows:
            assert t["finish_reason"] not in ("error", "identity_mismatch"), t
            assert t["output_token_ids"], t  # at least one token: the span below cannot be empty
            assert_one_span(t["version_spans"], len(t["output_token_ids"]), t["binding"]["label"],
                            t["binding"]["rollout_id"])
        assert v.weight_info() == versions[-1]
        figure("fifty_rollouts_per_label", labels)
    finally:
        c.stop()


def test_vllm_label_changed_behind_the_controller_taints_and_recovery_restores_it(env):
    """The test itself relabels vLLM after a committed update (POST /update_weight_version
    "someone-else"); the controller's identity monitor (--verify-interval-ms 200) sees vLLM's own
    label disagree and taints the engine within seconds, journaling why; a recovery re-installs
    and READY comes back with GET /weight_info == the label."""
    v = ready_engine(env)
    ver = "mon-1"
    publish(env, ver, seed=321)
    c = new_controller(env, "monitor", "--verify-interval-ms", "200")
    try:
        eng = update(c.url, ver)
        assert eng["outcome"] == "committed", eng
        assert v.weight_info() == ver
        since = last_seq(c.url)
        v.set_weight_version("someone-else")
        taint_s = wait_state(c.url, "TAINTED", 5)
        figure("vllm_label_changed_to_tainted_s", round(taint_s, 3))
        s = status(c.url)
        assert s["state"] == "TAINTED", s
        recs = journal(c.url, since)
        taints = [r for r in recs if r.get("event") == "taint" or r.get("to") == "TAINTED"]
        text = json.dumps(taints)
        assert taints and "someone-else" in text, recs
        assert "weight_info" in text or "vLLM's own label" in text, text
        st, body = http("POST", c.url + "/v1/recover", {"model": MODEL, "version": ver})
        assert st == 202, body
        wait_state(c.url, "READY", 120)
        s = status(c.url)
        assert s["state"] == "READY" and s["label"] == ver, s
        assert v.weight_info() == ver
        assert v.rpc1("rc_label")["label"] == ver
    finally:
        c.stop()


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_inflight_update_splits_the_spans_at_the_frozen_output_length(env, mode):
    """keep / recompute: three greedy 256-token rollouts (ignore_eos) are running when an update
    in that mode is requested. Each rollout that lived through it has exactly two spans covering
    [0, 256): the old label [0, K), the new one [K, 256) with kv "stale" (keep) or "recomputed"
    (recompute) and swap_index_reported == K, and the update's pause evidence lists it under
    "frozen" with output_tokens == K (vLLM's internal id cmpl-<rollout>-0-<8 hex>).

    recompute also checks the tokens: those after K equal the greedy continuation that vLLM, now on
    the new weights, gives for prompt + the K pre-swap tokens sent alone as a plain completion. vLLM's
    kernels are not batch-invariant (docs/vllm.md, experiment 1): the recomputed rollouts run
    beside each other and beside the controller's post-resume canary, the reference runs alone, so
    a mismatch names its first differing index for telling a near-tie flip from a wrong swap."""
    v = ready_engine(env)
    base, target = f"{mode}-0", f"{mode}-1"
    publish(env, base, seed=331 if mode == "keep" else 341)
    publish(env, target, seed=332 if mode == "keep" else 342)
    c = new_controller(env, mode)
    try:
        eng = update(c.url, base)  # the rollouts run on a label this controller installed
        assert eng["outcome"] == "committed", eng
        # recompute compares tokens with a reference sent alone: one rollout, so the recomputed one
        # also runs alone after the resume (vLLM's kernels are not batch-invariant); keep runs three.
        prompts = {f"{mode}-r{i}": list(range(200 + 40 * i, 232 + 40 * i)) for i in range(3 if mode == "keep" else 1)}
        gen0 = v.metric("vllm:generation_tokens_total")
        bgs = {rid: Background(rollout, c.url, p, 256, rid, ignore_eos=True) for rid, p in prompts.items()}
        mid = wait_generated(v, gen0, len(prompts) * 8)
        since = last_seq(c.url)
        eng = update(c.url, target, mode=mode)
        outs = {rid: bg.join(300) for rid, bg in bgs.items()}
        figure(f"{mode}_tokens_at_update_request", mid)
        assert eng["outcome"] == "committed", eng
        assert v.weight_info() == target
        recs = journal(c.url, since)
        frozen = [f for o in objects_with(recs, "frozen") if isinstance(o["frozen"], list) for f in o["frozen"]]
        figure(f"{mode}_frozen", frozen)
        by_rollout = {f.get("rollout_id"): f for f in frozen}
        rows = {t["binding"]["rollout_id"]: t for t in trajectories(c.url)}
        spanned = {}
        for rid, (st, body) in outs.items():
            assert st == 200, (rid, st, body)
            assert output_len(body) == 256, body["usage"]
            assert body["binding"]["label"] == base, body["binding"]
            spans = body["version_spans"]
            assert spans_core(rows[rid]["version_spans"]) == spans_core(spans), (rows[rid]["version_spans"], spans)
            if len(spans) == 1:  # finished before the pause: all of it on the old weights
                assert_one_span(spans, 256, base, rid)
                assert rid not in by_rollout, (rid, by_rollout)
                continue
            assert len(spans) == 2, (rid, spans)
            a, b = spans
            k = a["to_token"]
            assert 0 < k < 256, (rid, spans)
            assert (a["from_token"], a["label"]) == (0, base), (rid, spans)
            assert (b["from_token"], b["to_token"], b["label"]) == (k, 256, target), (rid, spans)
            assert b["kv"] == ("stale" if mode == "keep" else "recomputed"), (rid, spans)
            assert b["swap_index_reported"] == k, (rid, spans)
            assert a.get("reported_by_engine") is True and b.get("reported_by_engine") is True, (rid, spans)
            assert rid in by_rollout, ("not in the pause evidence's frozen list", rid, frozen)
            assert by_rollout[rid]["output_tokens"] == k, (rid, by_rollout[rid], spans)
            assert re.fullmatch(rf"cmpl-{re.escape(rid)}-0-[0-9a-f]{{8}}", by_rollout[rid]["request_id"]), \
                by_rollout[rid]
            spanned[rid] = k
        figure(f"{mode}_swap_indexes", spanned)
        assert spanned, ("no rollout lived through the update (all finished before the pause)", outs)
        if mode == "recompute":
            for rid, k in sorted(spanned.items()):
                ids = [int(x) for x in rows[rid]["output_token_ids"]]
                assert len(ids) == 256, len(ids)
                ref = v.complete(prompts[rid] + ids[:k], max_tokens=256 - k, ignore_eos=True, return_token_ids=True,
                                 logprobs=5, return_tokens_as_token_ids=True)
                ref_ids = [int(x) for x in ref["choices"][0]["token_ids"]]
                first = next((i for i, (x, y) in enumerate(zip(ids[k:], ref_ids)) if x != y), None)
                figure(f"recompute_{rid}_first_difference_after_swap", first)
                if first is not None:
                    # vLLM's bf16 kernels are not batch-invariant (the recomputed request ran beside the
                    # post-resume canary): past a near-tie the two greedy paths may part. Accepted only
                    # as such a flip: at the first difference the rollout's token is among the
                    # reference's top 5, within the measured replay bound (0.15) of its best. A stale
                    # or wrong swap differs at once and by far (random weights per version).
                    top = ref["choices"][0]["logprobs"]["top_logprobs"][first]
                    best = max(top.values())
                    mine = ref["choices"][0]["logprobs"]["tokens"][first]
                    got = ids[k + first]
                    lp_got = top.get(f"token_id:{got}")
                    figure(f"recompute_{rid}_flip", {"index": first, "best": best, "rollout_token": got,
                                                     "rollout_token_lp": lp_got, "reference_token": mine})
                    assert first >= 1, (rid, k, "the first token after the swap differs: not a recompute")
                    assert lp_got is not None and best - lp_got <= 0.15, (rid, k, first, top, got)
    finally:
        c.stop()


@pytest.mark.parametrize("pause_call", ["pause", "sleep"])
def test_rollouts_sent_while_an_abort_update_pauses_vllm_are_never_lost_or_mislabelled(env, pause_call):
    """--update-mode abort, rollouts fired continuously by 4 clients while two updates run. On 0.33
    a request that reaches vLLM while /pause (abort or wait) holds it is answered 503 (core.py:
    2226-2233; `--vllm-pause-call pause`); with /sleep?level=0 (the default call) it is queued as in
    0.26 (EngineCore.sleep calls pause_scheduler, which leaves the reject flag alone). Either way
    every rollout is accounted for: a 200 has one span [0, n) bound to the label it reports (an
    aborted one with aborted_at_update); an error was either refused at admission (503/409: never
    admitted, nothing bound, counted `refused`) or admitted and then has a finish record and a
    trajectory row saying it ended at the update or failed with the engine's error; no stored
    trajectory's spans disagree with its binding; the controller's counters add up."""
    v = ready_engine(env)
    vers = [f"ab-{pause_call}-1", f"ab-{pause_call}-2"]
    for i, ver in enumerate(vers):
        publish(env, ver, seed=351 + i + (10 if pause_call == "sleep" else 0))
    c = new_controller(env, f"abort_{pause_call}", "--update-mode", "abort", "--vllm-pause-call", pause_call)
    stop, lock, results = threading.Event(), threading.Lock(), []

    def client(k: int) -> None:
        rng = random.Random(100 + k)
        i = 0
        while not stop.is_set():
            rid = f"ab{pause_call[0]}-{k}-{i}"
            i += 1
            prompt = [rng.randrange(16, 1984) for _ in range(rng.randrange(4, 40))]
            st, body = rollout(c.url, prompt, rng.randrange(16, 49), rid)
            with lock:
                results.append((rid, st, body))

    try:
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        for ver in vers:
            eng = update(c.url, ver)
            assert eng["outcome"] == "committed", eng
            time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(120)
        recs = journal(c.url)
        admitted = {r["rollout"] for r in recs if r.get("event") == "admit"}
        ended = {}
        for r in recs:
            if r.get("rollout") and r.get("event") in ("finish", "aborted_by_drain", "interrupted"):
                ended.setdefault(r["rollout"], []).append(r)
        rows = {t["binding"]["rollout_id"]: t for t in trajectories(c.url)}
        counts = {"ok": 0, "aborted_at_update": 0, "refused": 0, "failed": 0}
        for rid, st, body in results:
            if st == 200:
                counts["ok"] += 1
                label = body["binding"]["label"]
                assert_one_span(body["version_spans"], output_len(body), label, rid)
                if body.get("aborted_at_update"):
                    counts["aborted_at_update"] += 1
                    assert body["choices"][0]["finish_reason"] == "abort", (rid, body["choices"][0])
                assert rid in rows and spans_core(rows[rid]["version_spans"]) == spans_core(body["version_spans"]), rid
                assert rid in ended, ("answered but no finish record", rid)
            elif rid not in admitted:
                counts["refused"] += 1
                assert st in (503, 409), (rid, st, body)
                assert rid not in rows, ("a rollout refused at admission has a trajectory", rid, rows[rid])
            else:
                counts["failed"] += 1
                assert st in (503, 409, 500, 502), (rid, st, body)
                assert rid in ended and rid in rows, ("an admitted rollout that failed is not recorded", rid, st, body)
                row, text = rows[rid], json.dumps(ended[rid]) + json.dumps(rows[rid].get("extra"))
                assert row["aborted_at_update"] or row["finish_reason"] in ("abort", "error"), (rid, row)
                # Ended at the update, or failed with the engine's 503 while an update had it paused
                # (the finish record and the row name the update in progress).
                assert row["aborted_at_update"] or "update_in_progress" in text or "503" in text or \
                    "paused" in text.lower(), (rid, st, body, ended[rid], row.get("extra"))
        for rid, t in rows.items():
            assert t["finish_reason"] != "identity_mismatch", (rid, t)
            spans, label = t["version_spans"], t["binding"]["label"]
            if spans:
                assert_one_span(spans, len(t["output_token_ids"]), label, rid)
        st, full = http("GET", c.url + "/v1/status")
        assert st == 200, full
        figure(f"abort_rollouts_{pause_call}", {"counts": counts, "controller": full.get("rollouts")})
        ctr = full["rollouts"]
        assert (ctr["ok"], ctr["refused"], ctr["failed"]) == (counts["ok"], counts["refused"], counts["failed"]), \
            (ctr, counts)
        assert counts["ok"] > 0, counts
        assert v.weight_info() == vers[-1]
    finally:
        stop.set()
        c.stop()


@pytest.mark.skipif(not VLLM_OTHER_SITE or not os.path.isdir(VLLM_OTHER_SITE),
                    reason="the other vLLM kit is not unpacked (VLLM_OTHER_SITE, e.g. /tmp/vb/site)")
def test_vllm_restarted_on_the_other_release_under_a_running_controller_taints(env):
    """vLLM is killed under a running controller and the other release (0.26, VLLM_OTHER_SITE) is
    started on the same port with the same extension: another engine (new boot id, other
    version), so the controller taints it. The next test's ready_engine starts this kit again."""
    v = ready_engine(env)
    other_version = site_version(VLLM_OTHER_SITE)
    if not other_version or other_version.split(".")[:2] == v.version().split(".")[:2]:
        pytest.skip(f"VLLM_OTHER_SITE={VLLM_OTHER_SITE} holds {other_version or '(unknown)'}, not another release")
    ver = "rel-1"
    publish(env, ver, seed=361)
    c = new_controller(env, "release", "--verify-interval-ms", "200")
    try:
        eng = update(c.url, ver)
        assert eng["outcome"] == "committed", eng
        since = last_seq(c.url)
        v.kill9()
        other = Vllm(env["tiny"], env["port"], "other_release", site=VLLM_OTHER_SITE)
        env["vllm"] = other  # stopped by the module's teardown, replaced by the next ready_engine
        other.wait_healthy()
        assert other.version() == other_version, (other.version(), other_version)
        taint_s = wait_state(c.url, "TAINTED", 30)
        s = status(c.url)
        figure("other_release_to_tainted_s", round(taint_s, 3))
        assert s["state"] == "TAINTED", s
        text = json.dumps([r for r in journal(c.url, since) if r.get("event") == "taint" or r.get("to") == "TAINTED"])
        assert "boot" in text or other_version in text, text
        figure("other_release_taint", text[:2000])
    finally:
        c.stop()
