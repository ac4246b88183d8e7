"""vLLM's own weight transfer (`controller serve --vllm-transfer native-nccl`) against a real
vLLM 0.26 or 0.33 on ONE GPU (labels gpu, vllm; run by scripts/gpu/run_vllm.sh, e.g. `-k native`).

NCCL puts one rank per GPU, so on one GPU the trainer-side sender (rolloutcore.vllm_native) and
the vLLM worker cannot form a working NCCL communicator. What one GPU allows, against the real
vLLM started with `--weight-transfer-config '{"backend":"nccl"}'`:

* the session endpoints directly: start → (start again refused) → update_weights without a
  formed group refused → vLLM has reset its session but left the model inside its layerwise
  reload (layers on meta tensors) → finish refused → rc_native_state(restore) finalizes → the
  live digest and greedy output equal those before the session; rc_adopt refuses a digest that
  does not match and adopts one that does;
* through the controller, the sender unreachable → refused before start_weight_update, READY on
  the old version, nothing touched;
* through the controller with both processes' pynccl disabled (VLLM_DISABLE_PYNCCL=1: the
  group's TCP rendezvous is real, the broadcasts are no-ops, so vLLM loads uninitialised
  receive buffers): the whole order init → start → send ‖ update → finish → rc_adopt runs
  against the real vLLM, and rc_adopt refuses to label weights whose digest is not the
  manifest's → TAINTED, no session left, label "unknown". The two-GPU run (real bytes, commit)
  is the two-GPU issue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    import importlib.util

    from vllm_harness import VLLM_SITE, site_version  # the kit's site/ (VLLM_KIT, VLLM_SITE)

    if site_version(VLLM_SITE).startswith("0.33."):
        # vLLM 0.33 replaced the trainer API rolloutcore.vllm_native.NativeSender calls
        # (NCCLWeightTransferEngine.trainer_init / trainer_send_weights, static in 0.26:
        # distributed/weight_transfer/nccl_engine.py:208, :267) by NCCLTrainerWeightTransferEngine with a
        # client and a WeightSource (0.33 nccl_engine.py:248-330), and moved `packed` from the
        # per-round update_info to the init info (:54-116): the sender and the controller's
        # native-nccl session speak 0.26's protocol only.
        pytest.skip("--vllm-transfer native-nccl is implemented for vLLM 0.26's weight-transfer API only; "
                    f"{VLLM_SITE} holds {site_version(VLLM_SITE)}", allow_module_level=True)

    if importlib.util.find_spec("vllm") is None:
        if not os.path.isdir(VLLM_SITE):
            pytest.skip("vLLM is not available (VLLM_SITE)", allow_module_level=True)
        sys.path.append(VLLM_SITE)  # the sender imports vLLM's trainer API in this process
    from rolloutcore import _core

    if not getattr(_core, "cuda_built", False):
        pytest.skip("rolloutcore._core is not the CUDA build", allow_module_level=True)
except ImportError as e:  # pragma: no cover
    pytest.skip(f"rolloutcore not importable: {e}", allow_module_level=True)

# One GPU: both sides' pynccl off (read by vLLM at communicator creation, so vLLM inherits it).
os.environ["VLLM_DISABLE_PYNCCL"] = "1"

from vllm_harness import OUT, Trainer, Vllm, http, manifest_digests  # noqa: E402

from rolloutcore.cluster import Server, find_binary  # noqa: E402
from rolloutcore.vllm_native import NativeSender  # noqa: E402

MODEL = "tiny"
FIG: dict = {}
PROMPT = list(range(100, 164))


def figure(name: str, value) -> None:
    FIG[name] = value
    print(f"FIGURE {name} = {value}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vllm_native_figures.json").write_text(json.dumps(FIG, indent=1, sort_keys=True, default=str))


@pytest.fixture(scope="module")
def nenv(tmp_path_factory):
    OUT.mkdir(parents=True, exist_ok=True)
    work = tmp_path_factory.mktemp("vllm_native")
    tiny = str(work / "tiny")
    subprocess.run([sys.executable, os.environ["MAKE_TINY"], tiny, "--seed", "0"], check=True,
                   stdout=subprocess.DEVNULL)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"], OUT / "native_directory.log",
               find_binary())
    durl = d.wait_url(30)
    trainer = Trainer(tiny, durl, MODEL)
    v = Vllm(tiny, 8110, "native", extra=["--weight-transfer-config", '{"backend":"nccl"}'])
    sender = NativeSender(device=0)
    figure("native_vllm_start_to_healthy_s", round(v.wait_healthy(), 1))
    yield {"work": work, "tiny": tiny, "directory": durl, "trainer": trainer, "vllm": v, "sender": sender}
    sender.close()
    v.stop()
    trainer.close()
    d.stop()


def text_of(v, prompt):
    return v.complete(prompt, max_tokens=12)["choices"][0]["text"]


def test_native_session_error_after_start_and_restore(nenv):
    v, sender, trainer = nenv["vllm"], nenv["sender"], nenv["trainer"]
    d0 = v.rpc1("rc_digest", fresh=True)
    assert d0["ok"], d0
    out0 = text_of(v, PROMPT)
    trainer.make("v1", seed=1)
    sender.offer("v1", sorted(trainer.versions["v1"].items()))
    info = sender.update_info("v1")["update_info"]

    st, body = v.post("/start_weight_update")
    figure("native_start", [st, body])
    assert st == 200, body
    during = v.rpc1("rc_native_state")
    figure("native_state_during_session", during)
    assert during["before"]["session_active"] is True
    assert during["before"]["layers_in_reload"] > 0 and during["before"]["meta_parameters"] > 0, during
    st, body = v.post("/start_weight_update")
    figure("native_second_start", [st, body])
    assert st == 500, body  # "start_weight_update called while a weight update is already active"

    st, body = v.post("/update_weights", {"update_info": info})
    figure("native_update_without_group", [st, body])
    assert st == 500, body  # "NCCL weight transfer not initialized"
    left = v.rpc1("rc_native_state")
    figure("native_state_after_failed_update", left)
    assert left["before"]["session_active"] is False, "vLLM resets its session when update_weights raises"
    assert left["before"]["layers_in_reload"] > 0, "... but leaves the layers inside the layerwise reload"
    st, body = v.post("/finish_weight_update")
    figure("native_finish_after_failed_update", [st, body])
    assert st == 500, body  # "finish_weight_update called without a matching start_weight_update"

    restored = v.rpc1("rc_native_state", restore=True)
    figure("native_restore", restored)
    assert restored["ok"] and restored["restored"], restored
    assert restored["after"] == {"session_active": False, "layers_in_reload": 0, "meta_parameters": 0}, restored
    d1 = v.rpc1("rc_digest", fresh=True)
    assert d1["content_digest"] == d0["content_digest"], "nothing was received: the old weights are back"
    assert text_of(v, PROMPT) == out0

    bad = v.rpc1("rc_adopt", version="v-bogus", content_digest="0123456789abcdef")
    figure("native_adopt_mismatch", {k: bad.get(k) for k in ("ok", "code", "error", "label", "label_kept")})
    assert not bad["ok"] and bad["code"] == "DataLoss" and bad["outcome"] == "failed_after_mutation", bad
    assert bad["label_kept"] is True and bad["label"] == d0["label"], bad
    good = v.rpc1("rc_adopt", version="v0-adopted", content_digest=d0["content_digest"])
    assert good["ok"] and good["label"] == "v0-adopted" and good["content_digest"] == d0["content_digest"], good
    assert good["generation"] == d0["generation"] + 1, good


class Controller:
    # The install deadline is 60 s (the native group's deadline is half of it): forming the NCCL group
    # with a sender whose CUDA/NCCL start is cold took 12.9 and 17.5 s on a fresh H200 machine
    # (session 10), past the 10 s a 20 s deadline gave it; warm, 8 s.
    def __init__(self, nenv, name: str, *extra: str) -> None:
        self.server = Server("controller", ["controller", "serve", "--engine", "vllm+" + nenv["vllm"].base,
                                            "--directory", nenv["directory"], "--model", MODEL,
                                            "--state-dir", str(nenv["work"] / f"controller_{name}"), "--port", "0",
                                            "--vllm-transfer", "native-nccl", "--install-deadline-ms", "60000",
                                            *extra],
                             OUT / f"native_controller_{name}.log", find_binary())
        self.url = self.server.wait_url(120)
        deadline = time.time() + 60
        while time.time() < deadline and self.status()["state"] != "READY":
            time.sleep(0.05)

    def status(self):
        st, body = http("GET", self.url + "/v1/status")
        assert st == 200, body
        return body["engines"][0]

    def update(self, version: str):
        st, body = http("POST", self.url + "/v1/updates", {"model": MODEL, "version": version})
        assert st == 202, body
        st, out = http("GET", f"{self.url}/v1/updates/{body['id']}?wait_ms=120000", timeout=150)
        assert st == 200, out
        return out["engines"][0]

    def journal(self):
        st, body = http("GET", self.url + "/v1/journal")
        assert st == 200, body
        return body["records"] if isinstance(body, dict) else body

    def stop(self):
        self.server.stop()


def test_native_controller_refuses_untouched_when_the_sender_is_unreachable(nenv):
    v, trainer = nenv["vllm"], nenv["trainer"]
    trainer.publish("v1")
    before = v.rpc1("rc_digest", fresh=True)
    c = Controller(nenv, "dead", "--vllm-native-trainer", "http://127.0.0.1:9", "--no-prefetch")
    try:
        assert c.status()["state"] == "READY"
        t0 = time.time()
        eng = c.update("v1")
        figure("native_dead_sender_update_s", round(time.time() - t0, 3))
        figure("native_dead_sender_outcome", eng)
        assert eng["outcome"] != "committed", eng
        s = c.status()
        assert s["state"] == "READY" and s["label"] == before["label"], s
        ns = v.rpc1("rc_native_state")
        assert ns["before"] == {"session_active": False, "layers_in_reload": 0, "meta_parameters": 0}, ns
        after = v.rpc1("rc_digest", fresh=True)
        assert after["content_digest"] == before["content_digest"] and after["label"] == before["label"]
        text = json.dumps(c.journal()) + json.dumps(eng)
        assert "refused before start_weight_update" in text, text[-2000:]
    finally:
        c.stop()


def test_native_controller_drives_the_session_in_order_and_adopt_refuses_unproven_weights(nenv):
    v, sender = nenv["vllm"], nenv["sender"]
    want, _ = manifest_digests(nenv["directory"], MODEL, "v1")
    before = v.rpc1("rc_digest", fresh=True)
    c = Controller(nenv, "live", "--vllm-native-trainer", sender.url)
    try:
        t0 = time.time()
        eng = c.update("v1")
        figure("native_update_s", round(time.time() - t0, 3))
        figure("native_update_outcome", eng)
        s = c.status()
        figure("native_status_after", s)
        assert eng["outcome"] != "committed", eng
        assert s["state"] == "TAINTED", s
        text = json.dumps(c.journal()) + json.dumps(eng)
        i = [text.find(k) for k in ("POST /init_weight_transfer_engine ok", "sender init ok",
                                    "POST /start_weight_update ok", "POST /update_weights ok", "sender send ok",
                                    "POST /finish_weight_update ok", "collective_rpc rc_adopt ok")]
        figure("native_trail_positions", i)
        assert all(x >= 0 for x in i) and i == sorted(i), text[-3000:]
        assert "rc_adopt" in text and want in text, "the refusal names the manifest digest"
        # The cleanup after the failure reached vLLM: rc_native_state(restore) answered (one object
        # per worker, not an error string). vLLM closes a connection after a 500
        # (finish_weight_update's), so a client that reused it would fail this call unanswered.
        assert '"native_state":[{' in eng["reason"], eng["reason"]
        st = sender.state()
        figure("native_sender_state", st)
        assert st["joined"] is True
        ns = v.rpc1("rc_native_state")
        assert ns["before"] == {"session_active": False, "layers_in_reload": 0, "meta_parameters": 0}, ns
        lab = v.rpc1("rc_label")
        figure("native_label_after", lab)
        assert lab["label"].startswith("<unknown"), lab
        d = v.rpc1("rc_digest", fresh=True)
        assert d["content_digest"] not in (want, before["content_digest"]), "no-op broadcasts: unreceived buffers"
        # No session is left: a new one starts (and is finished at once).
        st_, body = v.post("/start_weight_update")
        assert st_ == 200, body
        st_, body = v.post("/finish_weight_update")
        assert st_ == 200, body
    finally:
        c.stop()
