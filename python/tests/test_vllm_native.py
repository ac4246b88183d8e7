"""The trainer-side sender of vLLM's own weight transfer (rolloutcore.vllm_native.NativeSender):
its HTTP protocol as the controller's vLLM flavour calls it (docs/vllm.md, "vLLM's own transfer").
Runs without torch or vLLM (duck-typed tensors); the NCCL group and the broadcast themselves run
against the real vLLM on the GPU machine (tests/vllm/test_vllm_native.py)."""

import json
import urllib.error
import urllib.request

import pytest

from rolloutcore.vllm_native import NativeSender


class FakeTensor:
    def __init__(self, shape, dtype="torch.bfloat16", cuda=True):
        self.shape = list(shape)
        self.dtype = dtype
        self.is_cuda = cuda

    def contiguous(self):
        return self

    def numel(self):
        n = 1
        for x in self.shape:
            n *= x
        return n

    def element_size(self):
        return 4 if self.dtype == "torch.float32" else 2


def call(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def sender():
    s = NativeSender()
    yield s
    s.close()


def test_update_info_lists_the_offered_tensors_in_send_order(sender):
    sender.offer("v3", [("b.weight", FakeTensor([4, 8])), ("a.bias", FakeTensor([16], "torch.float32"))])
    st, body = call("GET", sender.url + "/rc/native/versions/v3/update_info")
    assert st == 200, body
    assert body["version"] == "v3" and body["bytes"] == 4 * 8 * 2 + 16 * 4
    assert body["update_info"] == {"names": ["b.weight", "a.bias"], "dtype_names": ["bfloat16", "float32"],
                                   "shapes": [[4, 8], [16]], "packed": False}
    st, body = call("GET", sender.url + "/rc/native/state")
    assert st == 200 and body["versions"] == ["v3"] and body["joined"] is False
    assert body["master_address"] == "127.0.0.1" and body["master_port"] > 0


def test_unknown_versions_sends_before_init_and_bad_worlds_are_refused_with_codes(sender):
    sender.offer("v3", [("w", FakeTensor([2]))])
    st, body = call("GET", sender.url + "/rc/native/versions/v9/update_info")
    assert st == 404 and body["code"] == "NotFound" and "v9" in body["error"]
    st, body = call("POST", sender.url + "/rc/native/send", {"version": "v9"})
    assert st == 404 and body["code"] == "NotFound"
    st, body = call("POST", sender.url + "/rc/native/send", {"version": "v3"})
    assert st == 409 and body["code"] == "FailedPrecondition" and "init" in body["error"]
    st, body = call("POST", sender.url + "/rc/native/init", {"world_size": 1})
    assert st == 400 and body["code"] == "InvalidArgument"
    st, body = call("POST", sender.url + "/rc/native/nope", {})
    assert st == 404


def test_offer_refuses_host_tensors_unknown_dtypes_and_empty_versions(sender):
    with pytest.raises(ValueError, match="not on a CUDA device"):
        sender.offer("v1", [("w", FakeTensor([2], cuda=False))])
    with pytest.raises(ValueError, match="dtype int8"):
        sender.offer("v1", [("w", FakeTensor([2], "torch.int8"))])
    with pytest.raises(ValueError, match="no tensors"):
        sender.offer("v1", [])
    sender.offer("v1", [("w", FakeTensor([2]))])
    sender.withdraw("v1")
    st, _ = call("GET", sender.url + "/rc/native/versions/v1/update_info")
    assert st == 404
