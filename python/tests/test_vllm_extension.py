"""The vLLM worker extension's parts that need neither vLLM nor a GPU: its naming rule (vLLM asserts
that an extension redefines nothing its Worker has, v1/worker/worker_base.py in 0.26 and 0.33),
rc_describe's vllm_version and rc_frozen's reading of both model runners' request state, against
stand-ins shaped like vLLM 0.26's and 0.33's (v1/worker/gpu/states.py RequestState for the V2
runner, v1/worker/gpu_model_runner.py `requests` for the V1 one). The real runners are exercised on
the GPU machine (tests/vllm/test_vllm.py, test_vllm_033.py)."""

from __future__ import annotations

import sys
import types

import pytest

import rolloutcore.vllm as ext
from rolloutcore.vllm import Extension

# Worker / WorkerBase attributes vLLM 0.33 added (../shared/vllm/VLLM_033_NOTES.md section 6) plus a
# few old ones: an extension method of the same name would make vLLM refuse to start.
WORKER_NAMES_033 = {
    "compute_weight_checksums", "reset_weights", "shutdown_weight_transfer_engine", "synchronize_device",
    "checkpoint_prepare", "checkpoint_restore", "discard", "randomize_dummy_inputs", "sleep_mode_backend",
    "supports_draft_weight_updates", "set_kv_cache_layout", "get_supported_kv_cache_layouts",
    "get_simple_cpu_offload_num_cpu_blocks", "handle_ft_command", "release_late_interaction_query_cache",
    "execute_model", "sample_tokens", "model_runner", "vllm_config", "start_weight_update", "update_weights",
    "finish_weight_update", "init_weight_transfer_engine", "sleep", "wake_up", "load_model", "get_model",
}


def test_every_extension_attribute_is_rc_prefixed_and_none_is_a_worker_name():
    names = [a for a in dir(Extension) if not a.startswith("__")]
    assert names, "no attributes?"
    bad = [a for a in names if not (a.startswith("rc_") or a.startswith("_rc_"))]
    assert bad == [], f"attributes vLLM's Worker might also have: {bad}"
    assert not set(names) & WORKER_NAMES_033
    assert "rc_frozen" in names and "rc_describe" in names


class FakeTensor:
    """What rc_frozen touches of a torch tensor: .detach().to("cpu").tolist()."""

    def __init__(self, values):
        self.values = list(values)

    def detach(self):
        return self

    def to(self, device):
        assert device == "cpu"
        return self

    def tolist(self):
        return list(self.values)


class FakeTorch:
    """The torch calls the extension makes here: cuda.synchronize, cuda.current_device, device."""

    class device:  # noqa: N801 - torch's spelling
        def __init__(self, index=None):
            self.index = index

    def __init__(self):
        self.synced = 0
        parent = self

        class _Cuda:
            @staticmethod
            def synchronize():
                parent.synced += 1

            @staticmethod
            def current_device():
                return 0

        self.cuda = _Cuda()


@pytest.fixture
def fake_torch(monkeypatch):
    t = FakeTorch()
    monkeypatch.setattr(ext, "_torch", lambda: t)
    return t


def worker(runner, pp: int = 1, spec=None):
    w = Extension()
    w.model_runner = runner
    w.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=pp),
                                          speculative_config=spec)
    return w


def v2_runner(slots, prompt_len, total_len):
    """V2: req_states.req_id_to_index, prompt_len.np (CPU), total_len.gpu (device)."""
    states = types.SimpleNamespace(req_id_to_index=dict(slots),
                                   prompt_len=types.SimpleNamespace(np=list(prompt_len)),
                                   total_len=types.SimpleNamespace(gpu=FakeTensor(total_len)))
    return types.SimpleNamespace(req_states=states)


def test_rc_frozen_v2_counts_total_minus_prompt_after_a_device_sync(fake_torch):
    # slot 2: prompt 32, 17 generated; slot 0: prompt 40 re-added after a preemption with 5 outputs
    # in its prefill and 3 more since (total 48); slot 1: free (not in req_id_to_index).
    w = worker(v2_runner({"cmpl-b-0-0123abcd": 2, "cmpl-a-0-89abcdef": 0}, [40, 0, 32, 0], [48, 999, 49, 0]))
    r = w.rc_frozen()
    assert r["ok"], r
    assert r["runner"] == "v2"
    assert r["requests"] == [{"request_id": "cmpl-a-0-89abcdef", "output_tokens": 8},
                             {"request_id": "cmpl-b-0-0123abcd", "output_tokens": 17}]
    assert fake_torch.synced == 1


def test_rc_frozen_v2_with_no_request_is_an_empty_list(fake_torch):
    r = worker(v2_runner({}, [0, 0], [0, 0])).rc_frozen()
    assert r["ok"] and r["requests"] == [], r


def test_rc_frozen_v2_refuses_a_total_below_the_prompt(fake_torch):
    r = worker(v2_runner({"x": 0}, [10], [9])).rc_frozen()
    assert not r["ok"] and r["code"] == "Internal", r


def test_rc_frozen_v2_without_the_length_tensors_is_unimplemented(fake_torch):
    runner = types.SimpleNamespace(req_states=types.SimpleNamespace(req_id_to_index={"x": 0}))
    r = worker(runner).rc_frozen()
    assert not r["ok"] and r["code"] == "Unimplemented", r


def test_rc_frozen_v1_counts_the_output_list_placeholders_included(fake_torch):
    reqs = {"cmpl-r-0-00000000": types.SimpleNamespace(output_token_ids=[5, 6, 7, -1]),
            "cmpl-q-0-11111111": types.SimpleNamespace(output_token_ids=[])}
    runner = types.SimpleNamespace(requests=reqs, use_async_scheduling=True)
    r = worker(runner).rc_frozen()
    assert r["ok"] and r["runner"] == "v1", r
    assert r["requests"] == [{"request_id": "cmpl-q-0-11111111", "output_tokens": 0},
                             {"request_id": "cmpl-r-0-00000000", "output_tokens": 4}]


def test_rc_frozen_v1_async_with_speculative_decoding_is_unimplemented(fake_torch):
    runner = types.SimpleNamespace(requests={"x": types.SimpleNamespace(output_token_ids=[1])},
                                   use_async_scheduling=True)
    r = worker(runner, spec=object()).rc_frozen()
    assert not r["ok"] and r["code"] == "Unimplemented" and "speculative" in r["error"], r
    runner.use_async_scheduling = False  # synchronous: the list holds the accepted tokens, exact
    assert worker(runner, spec=object()).rc_frozen()["ok"]


def test_rc_frozen_refuses_pipeline_parallelism_and_unknown_runners(fake_torch):
    r = worker(v2_runner({}, [0], [0]), pp=2).rc_frozen()
    assert not r["ok"] and r["code"] == "Unimplemented" and "pipeline" in r["error"], r
    r = worker(types.SimpleNamespace()).rc_frozen()
    assert not r["ok"] and r["code"] == "Unimplemented", r


class FakeParam:
    shape = (2, 3)
    dtype = "torch.bfloat16"

    def numel(self):
        return 6

    def element_size(self):
        return 2

    def data_ptr(self):
        return 1234


def test_rc_describe_reports_the_vllm_version(fake_torch, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    w = worker(types.SimpleNamespace())
    w.device = FakeTorch.device(0)
    model = types.SimpleNamespace(named_parameters=lambda: [("layer.weight", FakeParam())])
    w.get_model = lambda: model
    d = w.rc_describe()
    assert d["ok"], d
    assert d["vllm_version"] == "0.33.0"
    assert d["num_parameters"] == 1 and d["parameter_bytes"] == 12
    assert d["quantization"] == "", "no FP8 parameter: the weights as installed"


def test_rc_fault_fp8_install_names_the_bad_input(monkeypatch):
    """The FP8 negative controls (docs/fp8.md): only the four kinds, only when vLLM quantizes bf16
    into FP8 itself, and no scale re-layout under per-tensor (one scale); fault injection off refuses."""
    w = Extension()

    def at(quant):
        w.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=quant))
        return w

    monkeypatch.delenv("ROLLOUTCORE_VLLM_FAULT_INJECTION", raising=False)
    r = at("fp8_per_block").rc_fault(fp8_install="wrong_scale")
    assert not r["ok"] and "ROLLOUTCORE_VLLM_FAULT_INJECTION=1" in r["error"], r
    monkeypatch.setenv("ROLLOUTCORE_VLLM_FAULT_INJECTION", "1")
    for kind in ("wrong_scale", "stale_scales", "swizzled_scales", "stale_image"):
        r = at("fp8_per_block").rc_fault(fp8_install=kind)
        assert r["ok"] and r["faults"] == {"fp8_install": kind}, r
    r = at("fp8_per_block").rc_fault(fp8_install="flipped")
    assert not r["ok"] and r["code"] == "InvalidArgument" and "'flipped'" in r["error"], r
    r = at("fp8_per_tensor").rc_fault(fp8_install="swizzled_scales")
    assert not r["ok"] and r["code"] == "InvalidArgument" and "one scale" in r["error"], r
    r = at(None).rc_fault(fp8_install="wrong_scale")
    assert not r["ok"] and r["code"] == "FailedPrecondition" and "quantization None" in r["error"], r
    r = at("fp8_per_block").rc_fault(install_sleep_ms=5)
    assert r["ok"] and r["faults"] == {"install_sleep_ms": 5}, r
    assert at("fp8_per_block").rc_fault()["faults"] == {}
