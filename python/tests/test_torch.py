"""PyTorch: tensors through DLPack, CUDA refusal, DTensor with 2 ranks (torchrun, gloo).

Skipped where torch is not installed (CI); the lead runs them on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rolloutcore  # noqa: E402
from rolloutcore import errors, torch_utils  # noqa: E402
from conftest import MODEL  # noqa: E402


def bf16_bits(t):
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_torch_cpu_tensor_is_published_in_place(cluster, version):
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    g = torch.Generator().manual_seed(3)
    expected = {}
    keep = {}
    for t in rolloutcore.model_tensors(MODEL):
        buf = torch.from_numpy(rolloutcore.Publisher.allocate(t["shape"], "bf16")).view(torch.bfloat16)
        buf.copy_(torch.randn(t["shape"], generator=g) * 0.02)
        pub.add_shard(version, t["name"], buf)
        keep[t["name"]] = buf
        expected[t["name"]] = rolloutcore.tensor_digest(bf16_bits(buf), dtype="bf16")
    for s in pub.shards(version):
        assert s["data_ptr"] == keep[s["name"]].data_ptr()
        assert s["dtype"] == "bf16" and s["source"] == "dlpack"
    report = pub.publish(version)
    assert report["state"] == "COMMITTED"
    assert report["content_digest"] == rolloutcore.combine_digests(expected)
    rec = cluster.controller.update_to(MODEL, version)
    assert rec["outcome"] == "committed"
    assert cluster.engine.weights_digest()["content_digest"] == report["content_digest"]
    pub.close()


def test_torch_plain_tensor_needs_shared_memory_or_copy(cluster):
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(errors.InvalidArgumentError, match="Publisher.allocate"):
        pub.add_shard("vt", "w", t)
    pub.add_shard("vt", "w", t, copy=True)
    with pytest.raises(errors.InvalidArgumentError, match="not contiguous"):
        pub.add_shard("vt2", "w", torch.from_numpy(rolloutcore.Publisher.allocate([4, 4], "f32")).t())
    pub.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_is_refused_unless_copied(cluster, version):
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    t = torch.randn(8, 8, device="cuda")
    with pytest.raises(errors.InvalidArgumentError, match="CUDA device memory"):
        pub.add_shard("vc", "w", t)
    pub.add_shard("vc", "w", t, dtype="bf16", copy=True)
    (s,) = pub.shards("vc")
    assert s["dtype"] == "bf16"
    want = rolloutcore.tensor_digest(bf16_bits(t.cpu()), dtype="bf16")
    assert pub.publish("vc")["tensor_digests"]["w"] == want
    pub.close()


def test_shard_geometry_arithmetic():
    from torch.distributed.tensor import Replicate, Shard

    # torch.chunk semantics: 10 rows over 4 ranks -> 3, 3, 3, 1.
    got = [torch_utils.shard_geometry([10, 6], [4], [c], [Shard(0)]) for c in range(4)]
    assert got == [([0, 0], [3, 6]), ([3, 0], [3, 6]), ([6, 0], [3, 6]), ([9, 0], [1, 6])]
    # 2-D mesh: Shard(0) then Shard(1); Replicate keeps the extent.
    assert torch_utils.shard_geometry([8, 6], [2, 3], [1, 2], [Shard(0), Shard(1)]) == ([4, 4], [4, 2])
    assert torch_utils.shard_geometry([8, 6], [2, 3], [1, 2], [Replicate(), Shard(1)]) == ([0, 4], [8, 2])
    # 2 rows over 4 ranks: the last two own nothing.
    assert torch_utils.shard_geometry([2, 6], [4], [3], [Shard(0)]) == ([2, 0], [0, 6])


def test_dtensor_two_ranks_publish_and_engine_installs(cluster, version, tmp_path):
    sync = tmp_path
    worker = Path(__file__).with_name("dtensor_worker.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), cluster.directory_url, MODEL, version, str(sync)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        info = cluster.directory.wait_committed(MODEL, version, timeout_s=120)
        # The expected digest from the full weights, computed here independently of the ranks.
        g = torch.Generator().manual_seed(21)
        expected = {}
        for t in rolloutcore.model_tensors(MODEL):
            v = torch.randn(t["shape"], generator=g) * 0.02
            if t["name"].endswith("norm.weight"):
                v += 1.0
            expected[t["name"]] = rolloutcore.tensor_digest(bf16_bits(v), dtype="bf16")
        assert info["content_digest"] == rolloutcore.combine_digests(expected)
        manifest = cluster.directory.get(MODEL, version)
        by_name = {t["name"]: t for t in manifest["tensors"]}
        emb = by_name["model.embed_tokens.weight"]
        assert sorted(s["offset"] for s in emb["shards"]) == [[0, 0], [0, 32]]  # Shard(1) of [256, 64]
        norm = by_name["model.norm.weight"]
        assert [s["offset"] for s in norm["shards"]] == [[0], [0]]  # replicas on both ranks

        rec = cluster.controller.update_to(MODEL, version)
        assert rec["outcome"] == "committed"
        assert cluster.engine.weights_digest()["content_digest"] == info["content_digest"]
    finally:
        (sync / "done").write_text("ok")
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out


def test_refused_inputs_name_the_tensor_and_leave_nothing_staged():
    """A numpy array (or a dict for a module) is an InvalidArgumentError naming it, not an
    AttributeError; a tensor refused half-way drops the tensors this call had staged, so the same
    call can be made again once the input is fixed."""
    pub = rolloutcore.Publisher("http://127.0.0.1:1", "m")  # add_tensors does not call the directory
    good = torch.ones(4, 4, dtype=torch.bfloat16)
    with pytest.raises(errors.InvalidArgumentError, match=r"tensor b: expected a torch.Tensor, got ndarray"):
        torch_utils.add_tensors(pub, "v1", [("a", good), ("b", np.ones((4, 4), dtype=np.float32))])
    assert pub.versions() == [], "the good tensor staged before the refusal was dropped"
    staged = torch_utils.add_tensors(pub, "v1", [("a", good), ("b", torch.ones(4, 4))])
    assert [s["name"] for s in staged] == ["a", "b"]
    with pytest.raises(errors.InvalidArgumentError, match="expected a torch.nn.Module, got dict"):
        torch_utils.publish_module(pub, "v2", {"a": good})
    pub.release("v1", in_directory=False)
