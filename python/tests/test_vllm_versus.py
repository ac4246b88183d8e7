"""The pure half of `rolloutcore bench cycle --engine vllm --versus native` (rolloutcore.vllm_bench):
the update_info sent to vLLM 0.33's ipc weight transfer, the memory readings, the side-by-side
summary and table, and the refusal on vLLM 0.26. Runs without torch, vLLM or a GPU (duck-typed
tensors, a stand-in for reduce_tensor); the cycles themselves run on the GPU machine
(docs/vllm.md, "Against vLLM's own ipc update")."""

import ast
import base64
import json
import os
import pickle

import pytest

from rolloutcore import vllm_bench as vb
from rolloutcore.vllm_harness import site_version


class FakeTensor:
    def __init__(self, shape, dtype="torch.bfloat16"):
        self.shape = tuple(shape)
        self.dtype = dtype


def fake_handle(t):
    # What reduce_tensor(t)[1] stands for: a picklable tuple whose index 6 is the device.
    return ("rebuild-args", tuple(t.shape), 0, 0, "UntypedStorage", t.dtype, 0, b"\x01handle")


def test_update_info_is_what_vllms_trainer_and_http_client_send():
    items = [("model.embed_tokens.weight", FakeTensor([32, 8])),
             ("model.layers.0.self_attn.q_proj.weight", FakeTensor([8, 8])),
             ("model.norm.weight", FakeTensor([8], "torch.float32"))]
    info = vb.ipc_update_info(items, fake_handle, "GPU-1234")
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled", "tensor_sizes"}
    assert info["names"] == [n for n, _ in items]
    assert info["dtype_names"] == ["bfloat16", "bfloat16", "float32"]
    assert info["shapes"] == [[32, 8], [8, 8], [8]]
    assert info["tensor_sizes"] is None  # unpacked
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    # One {gpu uuid: rebuild args} per tensor, in the order of names (the worker zips the two).
    assert handles == [{"GPU-1234": fake_handle(t)} for _, t in items]
    assert isinstance(info["ipc_handles_pickled"], str)  # JSON-safe


def test_update_info_refuses_no_tensors():
    with pytest.raises(ValueError, match="no tensors"):
        vb.ipc_update_info([], fake_handle, "GPU-0")


def _vllm_033_site():
    for site in (os.environ.get("VLLM_SITE", ""), "/work/v33kit/site", "/tmp/v33/site"):
        if site and site_version(site).startswith("0.33"):
            return site
    return None


def _dataclass_fields(path, cls_name):
    """(all fields, fields without a default) of a dataclass in a source file, read with ast."""
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            every, required = [], []
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    every.append(st.target.id)
                    if st.value is None:
                        required.append(st.target.id)
            return every, required
    raise AssertionError(f"{cls_name} not in {path}")


def test_update_info_matches_vllm_033s_dataclass():
    """The worker builds IPCWeightTransferUpdateInfo(**update_info): an unknown key is a 400/500, a
    missing required one too. Checked against the real 0.33 source when a kit is unpacked here."""
    site = _vllm_033_site()
    if site is None:
        pytest.skip("no vLLM 0.33 site/ here (VLLM_SITE, /work/v33kit/site, /tmp/v33/site)")
    every, required = _dataclass_fields(os.path.join(site, "vllm/distributed/weight_transfer/ipc_engine.py"),
                                        "IPCWeightTransferUpdateInfo")
    info = vb.ipc_update_info([("w", FakeTensor([2, 2]))], fake_handle, "GPU-0")
    assert set(info) <= set(every), set(info) - set(every)
    assert set(required) <= set(info), set(required) - set(info)
    init_every, _ = _dataclass_fields(os.path.join(site, "vllm/distributed/weight_transfer/ipc_engine.py"),
                                      "IPCWeightTransferInitInfo")
    assert "packed" in init_every  # the bench's /init_weight_transfer_engine {"init_info": {"packed": false}}


def test_native_is_refused_on_026_and_allowed_on_033():
    why = vb.native_unavailable("0.26.0")
    assert why is not None and "0.26" in why and "ray" in why and "VLLM_KIT=0.33" in why
    assert vb.native_unavailable("0.26") is not None
    assert vb.native_unavailable("0.33.0") is None


def test_main_refuses_native_on_a_026_site(tmp_path, monkeypatch, capsys):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.26.0'\n")
    monkeypatch.setattr(vb, "VLLM_SITE", str(tmp_path))
    assert vb.main(["--versus", "native", "--shape", "8b"]) == 2
    assert "vLLM 0.26.0 cannot select the ipc weight-transfer backend" in capsys.readouterr().err


def test_main_refuses_native_with_the_controller_or_fp8():
    for extra in (["--controller"], ["--quantization", "fp8_per_tensor"]):
        with pytest.raises(SystemExit) as e:
            vb.main(["--versus", "native", *extra])
        assert e.value.code == 2


def test_quantization_is_refused_off_033():
    """The extension's FP8 layout (_rc_fp8_target, rc_fp8_image) is checked against vLLM 0.33 only."""
    for release in ("0.26.0", "0.26", "0.34.0", ""):
        why = vb.quantization_unavailable(release)
        assert why is not None and "--quantization" in why and "0.33 only" in why and "VLLM_KIT=0.33" in why
    assert "vLLM 0.26.0 is not checked" in vb.quantization_unavailable("0.26.0")
    assert vb.quantization_unavailable("0.33.0") is None and vb.quantization_unavailable("0.33") is None


def test_main_refuses_quantization_on_a_026_site(tmp_path, monkeypatch, capsys):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.26.0'\n")
    monkeypatch.setattr(vb, "VLLM_SITE", str(tmp_path))
    for extra in ([], ["--compare-bf16"], ["--dry-run"]):
        assert vb.main(["--quantization", "fp8_per_block", "--shape", "8b", *extra]) == 2
        assert "--quantization: vLLM 0.26.0 is not checked" in capsys.readouterr().err
    assert vb.main(["--dry-run"]) == 0  # bf16 on 0.26 stays allowed
    capsys.readouterr()
    # No release in the site: the kit's name decides.
    monkeypatch.setattr(vb, "VLLM_SITE", str(tmp_path / "none"))
    monkeypatch.setattr(vb, "VLLM_KIT", "0.26")
    assert vb.main(["--quantization", "fp8_per_tensor", "--dry-run"]) == 2
    assert "vLLM 0.26 is not checked" in capsys.readouterr().err
    monkeypatch.setattr(vb, "VLLM_KIT", "0.33")
    assert vb.main(["--quantization", "fp8_per_tensor", "--dry-run"]) == 0
    assert '"quantization": "fp8_per_tensor"' in capsys.readouterr().out


def test_run_refuses_quantization_on_a_server_reporting_026(tmp_path, monkeypatch):
    """The site may say one release and the server run another: run() checks GET /version's answer
    too, and stops vLLM and the directory before any cycle."""
    import argparse

    from rolloutcore import cluster

    stopped = []

    class FakeServer:
        def __init__(self, name, *a, **k):
            self.name = name

        def wait_url(self, timeout_s):
            return "http://127.0.0.1:1"

        def stop(self):
            stopped.append(self.name)

    class FakeVllm:
        def __init__(self, cfg, port, name, extra=(), **k):
            self.extra = list(extra)

        def wait_healthy(self, timeout_s):
            return 1.0

        def version(self):
            return "0.26.0"

        def stop(self):
            stopped.append("vllm")

        def is_033(self):
            raise AssertionError("run() went on past the release check")

    monkeypatch.setattr(cluster, "Server", FakeServer)
    monkeypatch.setattr(cluster, "find_binary", lambda: "rolloutcore")
    monkeypatch.setattr(vb, "Vllm", FakeVllm)
    monkeypatch.setattr(vb, "OUT", tmp_path)
    monkeypatch.setattr(vb.subprocess, "run", lambda *a, **k: None)
    a = argparse.Namespace(shape="tiny", quantization="fp8_per_channel", delta=None, windows=[("serial", "copy")],
                           versus=None, port=0, gpu_util=None, controller=False)
    with pytest.raises(SystemExit) as e:
        vb.run(a)
    assert "--quantization: vLLM 0.26.0 is not checked" in str(e.value.code)
    assert stopped == ["vllm", "directory"]


def test_versus_pauses_with_pause_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vb, "VLLM_SITE", str(tmp_path))  # no release there: the kit's name decides
    monkeypatch.setattr(vb, "VLLM_KIT", "0.33")
    assert vb.main(["--versus", "native", "--dry-run"]) == 0
    assert '"pause_call": "pause"' in capsys.readouterr().out
    assert vb.main(["--dry-run"]) == 0
    assert '"pause_call": "both"' in capsys.readouterr().out
    assert vb.main(["--versus", "native", "--pause-call", "sleep", "--dry-run"]) == 0
    assert '"pause_call": "sleep"' in capsys.readouterr().out


def test_parse_compute_apps():
    text = "4242, 20480\n4243, [N/A]\n\n4244, 512\n4242, 100\nnot a row\n"
    assert vb.parse_compute_apps(text) == {4242: 20580.0, 4244: 512.0}


def test_growth_prefers_nvidia_smi_per_pid_then_the_device():
    before = {"vllm_mib": 1000.0, "device_used_mib": 50000.0, "bench_reserved_mib": 30000.0}
    after = {"vllm_mib": 17000.0, "device_used_mib": 90000.0, "bench_reserved_mib": 50000.0}
    assert vb.growth_mib(before, after) == {"mib": 16000.0, "ruler": "nvidia-smi per pid"}
    before["vllm_mib"] = None  # nvidia-smi saw none of vLLM's pids
    assert vb.growth_mib(before, after) == {"mib": 20000.0, "ruler": "device used - bench reserved"}
    assert vb.growth_mib({}, after) == {"mib": None, "ruler": None}


def rc_row(k, window, ready, correct_digest=True, mib=(0.0, 0.0)):
    return {"version": f"rc{k}", "path": "rolloutcore", "pause_window_ms": window, "ready_to_serving_ms": ready,
            "stage_ms": 100.0 + k, "publish_ms": 20.0, "install_call_ms": 5.0, "reset_ms": 1.0, "resume_ms": 2.0,
            "first_token_ms": 15.0, "digest_equals_manifest": correct_digest, "label": f"rc{k}",
            "cache_reset": True, "gpu_mib_before": {"vllm_mib": mib[0]}, "gpu_mib_after": {"vllm_mib": mib[1]}}


def native_row(k, window, ready, correct=True, mib=(0.0, 0.0)):
    return {"version": f"ipc{k}", "path": "native", "pause_window_ms": window, "ready_to_serving_ms": ready,
            "start_ms": 3.0, "handles_ms": 8.0, "update_ms": 900.0, "finish_ms": 40.0, "reset_ms": 1.0,
            "resume_ms": 2.0, "first_token_ms": 16.0, "native_weights_correct": correct,
            "gpu_mib_before": {"vllm_mib": mib[0]}, "gpu_mib_after": {"vllm_mib": mib[1]}}


def test_versus_summary_medians_leave_the_warmup_out_and_ratio_is_rc_over_native():
    rc = [rc_row(1, 5000.0, 9000.0, mib=(20000.0, 36000.0))] + [rc_row(k, w, r, mib=(36000.0, 36000.0))
                                                                 for k, w, r in ((2, 40.0, 200.0), (3, 20.0, 180.0),
                                                                                 (4, 30.0, 190.0))]
    nat = [native_row(1, 8000.0, 8000.0, mib=(36000.0, 37500.0))] + [native_row(k, w, r, mib=(37500.0, 37600.0))
                                                                     for k, w, r in ((2, 1000.0, 1000.0),
                                                                                     (3, 1200.0, 1200.0),
                                                                                     (4, 800.0, 800.0))]
    s = vb.versus_summary(rc, nat)
    assert s["measured_cycles"] == {"rolloutcore": 3, "native": 3}
    assert s["median_ms"]["rolloutcore"]["pause_window_ms"] == 30.0
    assert s["median_ms"]["native"]["pause_window_ms"] == 1000.0
    assert s["median_ms"]["rolloutcore"]["stage_ms"] == 103.0
    assert "stage_ms" not in s["median_ms"]["native"] and "update_ms" not in s["median_ms"]["rolloutcore"]
    assert s["rolloutcore_over_native"]["pause_window_ms"] == 0.03
    assert s["rolloutcore_over_native"]["ready_to_serving_ms"] == 0.19
    assert "stage_ms" not in s["rolloutcore_over_native"]  # only metrics both paths have
    assert s["rolloutcore_proved"] == {"cycles": 4, "live_digest_equals_manifest": 4, "label_equals_version": 4,
                                       "cache_reset": 4}
    assert s["native_proved"] is None
    assert s["native_weights_correct"] is True and s["native_weights_correct_per_cycle"] == [True] * 4
    assert s["gpu_memory"]["rolloutcore"] == {"first_update_growth_mib": 16000.0, "later_updates_growth_mib_max": 0.0,
                                              "ruler": "nvidia-smi per pid"}
    assert s["gpu_memory"]["native"]["first_update_growth_mib"] == 1500.0
    assert s["gpu_memory"]["native"]["later_updates_growth_mib_max"] == 100.0


def test_versus_summary_one_wrong_native_update_makes_it_false():
    nat = [native_row(1, 9.0, 9.0), native_row(2, 9.0, 9.0, correct=False), native_row(3, 9.0, 9.0)]
    s = vb.versus_summary([rc_row(1, 1.0, 1.0), rc_row(2, 1.0, 1.0, correct_digest=False)], nat)
    assert s["native_weights_correct"] is False
    assert s["native_weights_correct_per_cycle"] == [True, False, True]
    assert s["rolloutcore_proved"]["live_digest_equals_manifest"] == 1
    # No native row at all (vLLM's path failed at once) is not "correct" either.
    assert vb.versus_summary([rc_row(1, 1.0, 1.0)], [])["native_weights_correct"] is False


def test_versus_summary_and_table_split_the_window_variants():
    rc = []
    for k in range(1, 7):  # serial:copy and atomic:exchange in turn
        r = rc_row(k, 30.0 + k if k % 2 else 10.0 + k, 190.0 if k % 2 else 170.0)
        r["window"] = "serial:copy" if k % 2 else "atomic:exchange"
        rc.append(r)
    nat = [native_row(k, 1000.0, 1000.0) for k in range(1, 7)]
    s = vb.versus_summary(rc, nat)
    bw = s["rolloutcore_by_window"]
    assert list(bw) == ["serial:copy", "atomic:exchange"]
    assert bw["serial:copy"]["n"] == 2 and bw["serial:copy"]["median_ms"]["pause_window_ms"] == 34.0  # 33, 35
    assert bw["atomic:exchange"]["median_ms"]["pause_window_ms"] == 15.0  # 14, 16 (12 left out)
    assert bw["atomic:exchange"]["rolloutcore_over_native"]["pause_window_ms"] == 0.015
    vs = {"shape": "8b", "bytes": 1, "tensors": 1, "vllm_version": "0.33.0", "pause_call": "pause", "error": None}
    vs.update(s)
    lines = vb.versus_table(vs)
    assert "2 --window variants in turn, mixed in the column above" in lines[0]
    row = next(ln for ln in lines if ln.strip().startswith("atomic:exchange"))
    assert "n=2" in row and "window    15.00 (0.015)" in row and "ready->serving   170.00 (0.170)" in row
    # One variant: no split.
    assert vb.versus_summary([rc_row(1, 1.0, 1.0)], nat)["rolloutcore_by_window"] == {}


def test_versus_table():
    rc = [rc_row(k, 30.0, 190.0) for k in range(1, 4)]
    nat = [native_row(k, 1000.0, 1000.0) for k in range(1, 4)]
    vs = {"shape": "8b", "bytes": 16_381_000_000, "tensors": 399, "vllm_version": "0.33.0", "pause_call": "pause",
          "rolloutcore_staging_bytes": 16 * 2**30, "data_ptrs_stable": True, "error": None}
    vs.update(vb.versus_summary(rc, nat))
    lines = vb.versus_table(vs)
    text = "\n".join(lines)
    assert lines[0].startswith("VERSUS rolloutcore vs vLLM's own ipc update: shape 8b, 16.38 GB in 399 tensors")
    assert "medians of 2 / 2 cycles (first 1 of each left out)" in lines[0]
    window = next(ln for ln in lines if ln.startswith("pause window"))
    assert window.split()[-3:] == ["30.00", "1000.00", "0.030"]
    stage = next(ln for ln in lines if ln.startswith("rc_stage"))
    assert stage.split()[-3:] == ["102.50", "-", "-"]  # rolloutcore only (rc2, rc3): no ratio
    update = next(ln for ln in lines if ln.startswith("/update_weights"))
    assert update.split()[-3:] == ["-", "900.00", "-"]
    assert "/update_weight_version" not in text  # no path had a label_ms: the row is left out
    assert "16384.0" in next(ln for ln in lines if ln.startswith("GPU MiB: staging"))
    assert "live digest == manifest 3/3" in text and "native_weights_correct: true" in text
    assert "(fresh live digest == manifest): 3/3" in text
    assert "FAILED" not in text
    vs["error"] = "ipc2: AssertionError: /update_weights answered 500"
    assert vb.versus_table(vs)[-1] == "vLLM's ipc path FAILED, alternation stopped: " + vs["error"]


# ---- the alternation itself, against a fake vLLM, trainer and torch (call order, evidence) ----

class FakeCudaTensor(FakeTensor):
    def detach(self):
        return self

    def contiguous(self):
        return self

    def numel(self):
        n = 1
        for x in self.shape:
            n *= x
        return n

    def element_size(self):
        return 2


class FakeTrainer:
    device = 0

    def __init__(self):
        self.base = {"model.embed_tokens.weight": FakeCudaTensor([16, 4]), "model.norm.weight": FakeCudaTensor([4])}
        self.alive, self.most_alive, self.published = [], 0, []

    def make(self, version, seed, scale):
        self.alive.append(version)
        self.most_alive = max(self.most_alive, len(self.alive))
        return {n: FakeCudaTensor(t.shape) for n, t in self.base.items()}

    def publish(self, version):
        self.published.append(version)
        self.add_shards_ms = 2.0
        return [{"register_ms": 1.0, "digest_ms": 3.0, "publish_ms": 4.0},
                {"register_ms": 1.5, "digest_ms": 3.0, "publish_ms": 5.0}]

    def release(self, version):
        self.alive.remove(version)


class FakeVllm:
    """Speaks the calls the bench makes; vLLM's ipc update installs the version it is finished
    with, except the versions in ``wrong`` (their live digest stays the previous one)."""

    base = "http://fake-vllm"

    def __init__(self, wrong=(), fail_update=()):
        self.calls, self.bodies = [], {}
        self.live, self.label = "d-v0", "default"
        self.wrong, self.fail_update = set(wrong), set(fail_update)
        self.pending = None
        self.installs = []
        self.proc = type("P", (), {"pid": 4242})()

    def post(self, path, body=None, timeout=300.0):
        self.calls.append(path)
        self.bodies.setdefault(path, []).append(body)
        if path == "/update_weights":
            names = body["update_info"]["names"]
            if self.current in self.fail_update:
                return 500, {"error": "update failed"}
            self.pending = names
        if path == "/finish_weight_update" and body is not None:
            if body["weight_version"] not in self.wrong:
                self.live = "d-" + body["weight_version"]
            self.label = body["weight_version"]
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}
        return 200, {"message": "ok"}

    def rpc1(self, method, **kw):
        self.calls.append(method)
        if method == "rc_stage":
            self.current = kw["version"]
            return {"ok": True, "stage_ms": {"total": 1.0}, "bytes_pulled": 96, "manifest_digest": "d-" + kw["version"]}
        if method == "rc_install":
            self.installs.append(dict(kw))
            self.live = "d-" + kw["version"]
            out = {"ok": True, "verified": True, "label": kw["version"], "content_digest": self.live,
                   "install_ms": 0.5, "install_path": "exchange" if kw.get("install") == "exchange" else "fused"}
            if kw.get("atomic"):
                # The engine half ran in the same call: caches reset, vLLM's own label set.
                self.label = kw["version"]
                out["atomic"] = {"engine": "EngineCoreProc", "prefix_cache_reset": True, "vllm_label": kw["version"]}
            return out
        if method == "rc_digest":
            assert kw == {"fresh": True}
            return {"ok": True, "content_digest": self.live, "not_loaded": [], "fallback_tensors": []}
        if method == "rc_native_state":
            return {"ok": True, "after": {"session_active": False, "layers_in_reload": 0, "meta_parameters": 0}}
        if method == "rc_bench_digest":
            return {"ok": True, "staging_alloc_bytes": 192}
        if method == "rc_describe":
            return {"ok": True, "data_ptrs_stable": True}
        raise AssertionError(method)

    def set_weight_version(self, label):
        self.calls.append("/update_weight_version")
        self.label = label

    def weight_info(self):
        return self.label

    def version(self):
        return "0.33.0"

    def tail(self, n=60):
        return ""


class FakeConn:
    """The bench's persistent connection for the calls inside the window, onto the fake."""

    def __init__(self, v):
        self.v = v

    def post(self, path, body=None):
        return self.v.post(path, body)

    def rpc1(self, method, **kw):
        return self.v.rpc1(method, **kw)

    def close(self):
        pass


@pytest.fixture
def fakes(monkeypatch):
    import sys
    import types

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, ipc_collect=lambda: None,
                                       get_device_properties=lambda d: types.SimpleNamespace(uuid="GPU-fake"))
    mp = types.ModuleType("torch.multiprocessing")
    red = types.ModuleType("torch.multiprocessing.reductions")
    red.reduce_tensor = lambda t: ("rebuild_cuda_tensor", fake_handle(t))
    for name, mod in (("torch", torch), ("torch.multiprocessing", mp), ("torch.multiprocessing.reductions", red)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vb, "http", lambda method, url, body=None, timeout=120.0: (200, {"is_paused": False}))
    monkeypatch.setattr(vb, "manifest_digests", lambda durl, model, ver: ("d-" + ver, {}))
    monkeypatch.setattr(vb, "gpu_memory", lambda session: {"vllm_mib": 100.0})
    monkeypatch.setattr(vb, "connect", FakeConn)

    def first_token(v):
        v.calls.append("first token")
        return 1.0

    monkeypatch.setattr(vb, "first_token_ms", first_token)


def run_versus(v, cycles=3):
    import argparse

    a = argparse.Namespace(cycles=cycles, pause_call="pause", quantization=None, shape="tiny")
    trainer = FakeTrainer()
    rows, vs = vb.versus_cycles(a, v, trainer, "m", "http://dir", own_label=True)
    vb.versus_finish(v, vs, None)
    return rows, vs, trainer


RC_CYCLE = ["rc_stage", "/pause?mode=wait&clear_cache=false", "rc_install", "/update_weight_version",
            "/reset_prefix_cache", "/resume", "first token"]
NATIVE_CYCLE = ["/pause?mode=wait&clear_cache=false", "/start_weight_update", "/update_weights",
                "/finish_weight_update", "/reset_prefix_cache", "/resume", "first token",
                "rc_digest", "rc_native_state"]


def test_versus_alternates_in_vllms_order_and_checks_the_native_weights(fakes):
    v = FakeVllm(wrong={"ipc2"})
    rows, vs, trainer = run_versus(v)
    assert v.calls == (["/init_weight_transfer_engine"] + (RC_CYCLE + NATIVE_CYCLE) * 3 +
                       ["rc_bench_digest", "rc_describe"])
    assert v.bodies["/init_weight_transfer_engine"] == [{"init_info": {"packed": False}}]
    assert v.bodies["/finish_weight_update"] == [{"weight_version": f"ipc{k}"} for k in (1, 2, 3)]
    info = v.bodies["/update_weights"][0]["update_info"]
    assert info["names"] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))[1] == {"GPU-fake": fake_handle(FakeTensor([4]))}
    assert [r["version"] for r in rows] == ["rc1", "rc2", "rc3"]
    native = vs["rows"]["native"]
    assert [r["version"] for r in native] == ["ipc1", "ipc2", "ipc3"]
    assert [r["native_weights_correct"] for r in native] == [True, False, True]
    assert native[1]["native_check"]["live_digest"] == "d-rc2"  # vLLM left rc2's weights live
    assert vs["native_weights_correct"] is False and vs["error"] is None
    assert vs["rolloutcore_proved"]["live_digest_equals_manifest"] == 3
    assert all(r["vllm_label"] == r["version"] and r["cache_reset"] for r in rows + native)
    for r in native:  # each call timed, the window inside "ready -> first token"
        assert all(r[k] >= 0 for k in ("start_ms", "handles_ms", "update_ms", "finish_ms", "reset_ms", "resume_ms"))
        assert r["ready_to_serving_ms"] >= r["pause_window_ms"]
    assert all(r["ready_to_serving_ms"] >= r["publish_ms"] + r["pause_window_ms"] for r in rows)
    # Published: every rolloutcore version before its cycle, every native one only for the check.
    assert trainer.published == ["rc1", "ipc1", "rc2", "ipc2", "rc3", "ipc3"]
    assert trainer.most_alive == 2
    assert vs["rolloutcore_staging_bytes"] == 192 and vs["data_ptrs_stable"] is True
    # Where the publish and the stage went: per row, summed over the trainer's ranks; medians.
    parts = {"add_shards": 2.0, "register": 2.5, "digest": 6.0, "directory": 9.0}
    assert all(r["publish_parts_ms"] == parts for r in rows)
    assert vs["rolloutcore_parts_ms"] == {"publish": parts, "stage": {"total": 1.0}}
    table = vb.versus_table(vs)
    assert "rolloutcore publish, ms (medians): add_shards 2.00, register 2.50, digest 6.00, directory 9.00" in table
    assert "rolloutcore stage, ms (medians): total 1.00" in table


def test_publish_parts_sum_the_ranks_and_say_none_when_a_part_is_missing():
    class T:
        add_shards_ms = 7.0

    reports = [{"register_ms": 1.0, "digest_ms": 2.0, "publish_ms": 3.0},
               {"register_ms": 4.0, "digest_ms": None, "publish_ms": 5.0}]
    assert vb.publish_parts(T(), reports) == {"add_shards": 7.0, "register": 5.0, "digest": None, "directory": 8.0}
    assert vb.publish_parts(T(), None) is None  # a trainer that reports nothing
    assert vb.publish_parts(object(), [])["add_shards"] is None


def test_a_failed_native_update_stops_the_alternation_and_leaves_vllm_serving(fakes):
    v = FakeVllm(fail_update={"rc2"})  # the update after rc2's stage: ipc2's
    rows, vs, _ = run_versus(v)
    assert vs["error"].startswith("ipc2: AssertionError: /update_weights answered 500")
    assert [r["version"] for r in rows] == ["rc1", "rc2"] and len(vs["rows"]["native"]) == 1
    # After the failure: vLLM's session finished, resumed, the reload state restored (no rc3).
    tail = v.calls[v.calls.index("/update_weights", v.calls.index("rc_stage", 10)):]
    assert tail[:4] == ["/update_weights", "/finish_weight_update", "/resume", "rc_native_state"]
    assert v.calls.count("rc_stage") == 2 and v.calls[-2:] == ["rc_bench_digest", "rc_describe"]
    assert "FAILED, alternation stopped: ipc2" in vb.versus_table(vs)[-1]


# ---- --delta F ---------------------------------------------------------------------------------------

class FakeDeltaTrainer(FakeTrainer):
    def make_changed(self, version, previous, fraction, seed):
        assert previous in self.alive, (previous, self.alive)
        return self.make(version, seed, 0.0)

    def publish(self, version):
        super().publish(version)
        return [{"delta_changed": 5, "delta_bytes": 40}, {"delta_changed": 6, "delta_bytes": 44}]


class FakeDeltaVllm(FakeVllm):
    """rc_stage follows its delta_policy: a delta pulls 100 bytes in 2 ms, a full stage 10 000 in
    10 ms; auto takes the delta and says why."""

    def __init__(self):
        super().__init__()
        self.policies = []

    def rpc1(self, method, **kw):
        if method != "rc_stage":
            return super().rpc1(method, **kw)
        self.calls.append(method)
        self.current = kw["version"]
        policy = kw.get("delta_policy")
        self.policies.append(policy)
        delta = policy in ("always", "auto") and kw["version"] != "v1"
        choice = None if policy is None or kw["version"] == "v1" else {
            "policy": policy, "mode": "delta" if delta else "full", "reason": "fake",
            "estimated_full_ms": 10.0, "estimated_delta_ms": 2.0, "full_samples": 1, "delta_samples": 1}
        return {"ok": True, "stage_ms": {"total": 2.0 if delta else 10.0}, "bytes_pulled": 100 if delta else 10_000,
                "manifest_digest": "d-" + kw["version"], "mode": "delta" if delta else "full",
                "delta_choice": choice, "delta_ineligible": "", "changed": 11 if delta else 0}


def test_delta_alternates_pinned_policies_with_auto_after_the_first_pair_and_sums_up_per_mode(fakes, capsys):
    import argparse

    a = argparse.Namespace(cycles=2, pause_call="pause", quantization=None, shape="tiny", delta=0.01,
                           delta_transport="shm")
    v, trainer = FakeDeltaVllm(), FakeDeltaTrainer()
    rows, ds = vb.delta_cycles(a, v, trainer, "m", "http://dir", own_label=True)
    # auto right after the first measured pair: a run cut by its time limit has shown the choice.
    assert v.policies == ["never", "always", "never", "auto", "always", "never"]
    assert [r["mode"] for r in rows] == ["full", "delta", "full", "delta", "delta", "full"]
    # A summary of the updates so far after each one, the last equal to the final one.
    so_far = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
              if x.startswith("DELTA_SO_FAR ")]
    assert len(so_far) == len(rows) - 1 and so_far[-1] == json.loads(json.dumps(ds))
    assert so_far[2]["auto"]["mode"] == "delta" and so_far[1].get("auto") is None
    assert rows[0]["warmup"] and all(r["digest_equals_manifest"] for r in rows)
    assert rows[1]["delta_published"] == 11 and rows[1]["delta_bytes_published"] == 84
    assert rows[1]["publish_parts_ms"] == {"add_shards": 2.0, "register": None, "digest": None, "directory": None}
    assert rows[1]["ready_to_serving_ms"] >= rows[1]["publish_ms"] >= 0
    # Every cycle is a whole rolloutcore cycle (stage while serving, install while paused, resume).
    assert v.calls.count("rc_install") == len(rows) and v.calls.count("/resume") == len(rows)
    assert trainer.most_alive <= 2  # the base and the next version, no more
    assert ds["delta"]["n"] == 2 and ds["full"]["n"] == 2
    assert ds["delta"]["bytes_pulled"] == 100 and ds["full"]["bytes_pulled"] == 10_000
    assert ds["bytes_pulled_delta_over_full"] == 0.01
    assert ds["auto"]["mode"] == "delta" and ds["auto"]["delta_choice"]["estimated_delta_ms"] == 2.0
    lines = vb.delta_table(ds)
    assert lines[0].startswith("DELTA shm, change fraction 0.01") and "auto took: delta" in lines[-1]


def test_main_checks_the_delta_arguments(capsys):
    for argv in (["--delta", "1.5"], ["--delta", "0"], ["--delta", "nan"], ["--delta", "0.01", "--controller"],
                 ["--delta", "0.01", "--quantization", "fp8_per_block"]):
        with pytest.raises(SystemExit) as e:
            vb.main(argv + ["--dry-run"])
        assert e.value.code == 2, argv
    assert vb.main(["--delta", "0.01", "--delta-transport", "shm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"pause_call": "pause"' in out and '"delta_transport": "shm"' in out


# ---- --window: the pause window's variants ------------------------------------------------------


def test_parse_windows_takes_variants_in_turn_and_names_a_bad_one():
    ws = vb.parse_windows("serial:copy, atomic:exchange:staged,overlap:exchange")
    assert ws == [("serial", "copy", "reread"), ("atomic", "exchange", "staged"), ("overlap", "exchange", "reread")]
    import argparse
    a = argparse.Namespace(windows=ws)
    assert [vb.window_name(vb.window_of(a, k)) for k in range(1, 5)] == [
        "serial:copy", "atomic:exchange:staged", "overlap:exchange", "serial:copy"]
    for bad, why in (("serial", "SEQUENCE:INSTALL"), ("pipelined:copy", "SEQUENCE:INSTALL"),
                     ("atomic:swap", "SEQUENCE:INSTALL"), ("atomic:copy:staged", "exchange only")):
        with pytest.raises(ValueError, match=why):
            vb.parse_windows(bad)


def test_main_checks_the_window_arguments(capsys):
    assert vb.main(["--window", "serial:exchange", "--controller", "--fold-engine-calls", "--dry-run"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        vb.main(["--fold-engine-calls", "--dry-run"])
    assert e.value.code == 2 and "with --controller only" in capsys.readouterr().err
    for argv in (["--window", "atomic:swap"], ["--window", "atomic:copy", "--controller"],
                 ["--window", "serial:exchange", "--quantization", "fp8_per_block"]):
        with pytest.raises(SystemExit) as e:
            vb.main(argv + ["--dry-run"])
        assert e.value.code == 2, argv
    assert "atomic:swap" in capsys.readouterr().err
    assert vb.main(["--window", "serial:copy,atomic:exchange", "--dry-run"]) == 0
    assert '"pause_call": "sleep"' in capsys.readouterr().out  # the faster pause for the window study


def run_cycle(v, window, own_label=True):
    import argparse

    a = argparse.Namespace(quantization=None)
    v.calls.clear()
    return vb.rolloutcore_cycle(v, a, "m", "http://dir", "v7", True, own_label, window=window)


def test_the_three_sequences_make_exactly_their_calls(fakes):
    v = FakeVllm()
    row = run_cycle(v, ("serial", "copy", "reread"))
    assert v.calls == ["rc_stage", "/sleep?level=0&mode=wait", "rc_install", "/update_weight_version",
                       "/reset_prefix_cache", "/wake_up?tags=scheduling", "first token"]
    assert v.installs[-1] == {"version": "v7", "install": "copy"}
    assert row["window"] == "serial:copy" and row["pause_call_ms"] is not None and row["label"] == "v7"
    row = run_cycle(v, ("overlap", "exchange", "staged"))
    # The reset runs beside the install (either may reach vLLM first); the label only after both.
    assert v.calls[:2] == ["rc_stage", "/sleep?level=0&mode=wait"]
    assert sorted(v.calls[2:4]) == ["/reset_prefix_cache", "rc_install"]
    assert v.calls[4:] == ["/update_weight_version", "/wake_up?tags=scheduling", "first token"]
    assert v.installs[-1] == {"version": "v7", "install": "exchange", "verify": "staged"}
    assert row["install_path"] == "exchange" and row["reset_ms"] is not None
    row = run_cycle(v, ("atomic", "exchange", "reread"))
    # One call: no pause, no reset, no label, no resume sent; the reply says the engine half ran.
    assert v.calls == ["rc_stage", "rc_install", "first token"]
    assert v.installs[-1] == {"version": "v7", "install": "exchange", "verify": "reread", "atomic": True}
    assert row["pause_call_ms"] is None and row["resume_ms"] is None and row["atomic"]["prefix_cache_reset"]
    assert row["pause_window_ms"] == pytest.approx(row["install_call_ms"])
    assert v.label == "v7"


def test_an_atomic_reply_without_the_engine_half_fails_the_cycle(fakes):
    v = FakeVllm()
    real = v.rpc1

    def no_engine_half(method, **kw):
        out = real(method, **kw)
        out.pop("atomic", None)
        return out

    v.rpc1 = no_engine_half
    with pytest.raises(AssertionError):
        run_cycle(v, ("atomic", "copy", "reread"))


def test_window_summary_leaves_each_variants_first_cycle_out_and_the_table_names_refusals():
    rows = []
    for k, (w, ms) in enumerate([("serial:copy", 90.0), ("atomic:exchange", 80.0), ("serial:copy", 30.0),
                                 ("atomic:exchange", 10.0), ("serial:copy", 32.0), ("atomic:exchange", 12.0)]):
        rows.append({"window": w, "pause_window_ms": ms, "install_path": w.split(":")[1].replace("copy", "fused"),
                     "worker_split_ms": {"synchronize": 0.1, "exchange_and_proof": ms / 4},
                     "digest_equals_manifest": True,
                     "exchange_refused": "norm: 2 other reference(s)" if (w == "atomic:exchange" and k == 5) else None})
    ws = vb.window_summary(rows)
    assert ws["serial:copy"]["n"] == 2 and ws["serial:copy"]["pause_window_ms"] == 31.0
    assert ws["atomic:exchange"]["pause_window_ms"] == 11.0
    lines = vb.window_table(ws)
    assert lines[0].startswith("WINDOW") and any(l.startswith("| atomic:exchange | 2 | 11.00") for l in lines)
    assert any("exchange refused: norm: 2 other reference(s)" in l for l in lines)
    assert ws["atomic:exchange"]["worker_split_ms"] == {"exchange_and_proof": 2.75, "synchronize": 0.1}
    assert any("in the worker: exchange_and_proof 2.75, synchronize 0.10" in l for l in lines)


def test_keepalive_uses_one_connection_for_every_call():
    import http.server
    import json
    import threading

    peers = []

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, body):
            peers.append(self.client_address)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer({"ok": True})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n)) if n else None
            self._answer({"results": [{"echo": req}]} if self.path == "/collective_rpc" else {"path": self.path})

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = vb.KeepAlive(f"http://127.0.0.1:{srv.server_address[1]}")
        assert c.post("/sleep?level=0") == (200, {"path": "/sleep?level=0"})
        assert c.rpc1("rc_install", version="v1") == {"echo": {"method": "rc_install", "args": [],
                                                                "kwargs": {"version": "v1"}}}
        c.close()
    finally:
        srv.shutdown()
    assert len(peers) == 3 and len(set(peers)) == 1  # /health, then the two calls, on one connection


def test_find_key_reads_the_install_path_out_of_an_update_record():
    ev = {"validated": {"digest_checked": True}, "install": {"detail": {"workers": [
        {"ok": True, "install_path": "exchange", "exchange_refused": None}]}}}
    assert vb.find_key(ev, "install_path") == "exchange"
    assert vb.find_key(ev, "exchange_refused") is None and vb.find_key(None, "x") is None


def test_main_refuses_counts_ports_and_fractions_out_of_range(capsys):
    for argv, says in ((["--cycles", "0"], "--cycles must be at least 1, got 0"),
                       (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
                       (["--gpu-util", "1.5"], "--gpu-util is vLLM's --gpu-memory-utilization, in (0, 1], got 1.5"),
                       (["--gpu-util", "nan"], "got nan")):
        with pytest.raises(SystemExit) as e:
            vb.main(argv + ["--dry-run"])
        assert e.value.code == 2, argv
        assert says in capsys.readouterr().err, argv
    assert vb.main(["--cycles", "1", "--port", "0", "--gpu-util", "0.5", "--dry-run"]) == 0
