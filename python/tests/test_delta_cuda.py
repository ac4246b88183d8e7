"""Delta refit on the GPU (issue 14, docs/refit.md "Delta refit"): the change mask of
``rolloutcore.refit.changed_elements`` on torch CUDA tensors (bf16, f16, f32), contiguous and
DTensor-sharded (2 ranks on one GPU, gloo), computed on the device (offsets and values stay on the
GPU; the model is never copied to the host by the mask), and a delta round trip from torch CUDA
weights through the Python Publisher into the embedded engine. Skipped without torch or CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import rolloutcore  # noqa: E402
from rolloutcore import torch_utils  # noqa: E402
from rolloutcore.refit import changed_elements  # noqa: E402
from conftest import MODEL  # noqa: E402

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
NP_VIEW = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32}


def adam_like_step(master: "torch.Tensor", lr: float, seed: int) -> "torch.Tensor":
    """An f32 master weight after one Adam-sized step (|update| ~ lr for every element)."""
    g = torch.Generator(device=master.device).manual_seed(seed)
    return master - lr * torch.sign(torch.randn(master.shape, generator=g, device=master.device))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_change_mask_of_cuda_tensors_is_computed_on_the_gpu(name):
    dtype = getattr(torch, name)
    g = torch.Generator(device="cuda").manual_seed(3)
    master = torch.randn(1024, 2048, generator=g, device="cuda") * 0.02
    old = master.to(dtype)
    new = adam_like_step(master, 1e-5, seed=4).to(dtype)
    before = torch.cuda.memory_allocated()
    offsets, values = changed_elements(old, new)
    assert offsets.is_cuda and values.is_cuda, "mask, offsets and values stay on the GPU"
    assert offsets.dtype == torch.int64 and values.dtype == dtype
    # Only the changed elements were materialized beyond the inputs (no full host or device copy
    # of the model survives the call: the temporaries of a contiguous input are views).
    kept = torch.cuda.memory_allocated() - before
    assert kept <= offsets.numel() * (8 + old.element_size()) + (1 << 21), kept
    # Reference, independently on the host (test only): the bit patterns that differ.
    a = old.cpu().view(INT_VIEW[dtype]).numpy().view(NP_VIEW[dtype]).reshape(-1)
    b = new.cpu().view(INT_VIEW[dtype]).numpy().view(NP_VIEW[dtype]).reshape(-1)
    want = np.flatnonzero(a != b)
    np.testing.assert_array_equal(offsets.cpu().numpy(), want)
    np.testing.assert_array_equal(values.cpu().view(INT_VIEW[dtype]).numpy().view(NP_VIEW[dtype]), b[want])
    frac = offsets.numel() / old.numel()
    print(f"FIGURE change_fraction_{name}_lr1e-5 = {frac:.4f}")
    # bf16 absorbs most of a 1e-5 step at |w| ~ 0.02 (half an ulp is ~6e-5); f32 keeps all of it.
    if dtype == torch.float32:
        assert frac > 0.99
    if dtype == torch.bfloat16:
        assert frac < 0.5


def test_change_mask_non_contiguous_cuda_tensor():
    base = torch.randn(64, 96, device="cuda").to(torch.bfloat16)
    old = base.t()  # a transposed view: the mask is in the view's row-major order
    new = old.clone()
    new[5, 7] = new[5, 7] * 3 + 1
    offsets, values = changed_elements(old, new)
    assert offsets.tolist() == [5 * old.shape[1] + 7]
    assert values.tolist() == [new[5, 7].item()]


WORKER = r"""
import os, sys, torch, torch.distributed as dist
from rolloutcore.refit import changed_elements
try:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:
    from torch.distributed._tensor import DTensor, Shard
    from torch.distributed._tensor.device_mesh import DeviceMesh
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(0)  # both ranks share the one GPU
mesh = DeviceMesh("cuda", list(range(world)))
name = sys.argv[1]
dtype = getattr(torch, name)
g = torch.Generator(device="cuda").manual_seed(7)
full_master = torch.randn(512, 256, generator=g, device="cuda") * 0.02   # identical on both ranks
step = torch.sign(torch.randn(512, 256, generator=g, device="cuda")) * 1e-5
full_old, full_new = full_master.to(dtype), (full_master - step).to(dtype)
rows = 512 // world
lo = rank * rows
old = DTensor.from_local(full_old[lo:lo + rows].contiguous(), mesh, [Shard(0)], run_check=False)
new = DTensor.from_local(full_new[lo:lo + rows].contiguous(), mesh, [Shard(0)], run_check=False)
offsets, values = changed_elements(old, new)
assert offsets.is_cuda and values.is_cuda
iv = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
want = torch.nonzero(full_old.view(iv)[lo:lo + rows].reshape(-1) != full_new.view(iv)[lo:lo + rows].reshape(-1)).reshape(-1)
assert torch.equal(offsets, want), (rank, offsets.numel(), want.numel())
assert torch.equal(values.view(iv), full_new[lo:lo + rows].reshape(-1)[want].view(iv))
n = torch.tensor([offsets.numel()])
dist.all_reduce(n)
total = int(torch.count_nonzero(full_old.view(iv) != full_new.view(iv)))
assert int(n) == total, (int(n), total)
print(f"rank {rank}: {offsets.numel()} local changes of {total}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_change_mask_of_dtensor_shards_on_cuda_two_ranks(name, tmp_path):
    pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
    worker = tmp_path / "dtensor_delta_worker.py"
    worker.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), name], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("local changes of") == 2, r.stdout


def test_delta_from_torch_cuda_weights_round_trips_through_the_engine(cluster, version):
    """Trainer weights live on the GPU; one Adam-sized step on the f32 masters; the change mask of
    the bf16 cast is computed on the GPU and equals what the Publisher's delta carries; the engine
    stages in delta mode and commits with the live digest == the published digest."""
    base, nxt = version + "-cbase", version + "-cnext"
    g = torch.Generator(device="cuda").manual_seed(13)
    masters = {}
    for t in rolloutcore.model_tensors(MODEL):
        v = torch.randn(t["shape"], generator=g, device="cuda") * 0.02
        if t["name"].endswith("norm.weight"):
            v += 1.0
        masters[t["name"]] = v
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL, delta=True)
    old = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    torch_utils.add_tensors(pub, base, old, dtype="bf16")
    r0 = pub.publish(base)
    assert r0["state"] == "COMMITTED"
    assert cluster.controller.update_to(MODEL, base, timeout_s=120)["outcome"] == "committed"

    new = {n: adam_like_step(m, 1e-6, seed=i).to(torch.bfloat16) for i, (n, m) in enumerate(sorted(masters.items()))}
    changed = sum(changed_elements(old[n], new[n])[0].numel() for n in old)
    total = sum(t.numel() for t in old.values())
    print(f"FIGURE roundtrip_change_fraction = {changed / total:.4f}")
    assert 0 < changed < total
    torch_utils.add_tensors(pub, nxt, new, dtype="bf16")
    r1 = pub.publish(nxt, delta=True)
    assert r1["delta_base"] == base
    assert r1["delta_changed"] == changed, (r1["delta_changed"], changed)
    staged = cluster.engine.stage(MODEL, nxt, cluster.directory_url)
    assert staged["mode"] == "delta", staged
    rec = cluster.controller.update_to(MODEL, nxt, timeout_s=120)
    assert rec["outcome"] == "committed", rec
    live = cluster.engine.weights_digest()
    assert live["weight_version"] == nxt
    want = rolloutcore.combine_digests(
        {n: rolloutcore.tensor_digest(t.cpu().view(torch.int16).numpy().view(np.uint16), dtype="bf16")
         for n, t in new.items()})
    assert live["content_digest"] == r1["content_digest"] == want
    pub.close()


def test_delta_of_cuda_shards_published_over_cuda_ipc(cluster, version):
    """Shards in CUDA memory published over cuda_ipc (no host copy of the model): the Publisher keeps
    the last published shards on the GPU, computes the change mask there, encodes only the changed
    offsets and values on the host and publishes the payload from device memory. The version's
    report carries the delta on the committed base with exactly the changed elements; a shard whose
    shape changed is published in full."""
    base, nxt = version + "-ibase", version + "-inext"
    g = torch.Generator(device="cuda").manual_seed(17)
    old = {t["name"]: (torch.randn(t["shape"], generator=g, device="cuda") * 0.02).to(torch.bfloat16)
           for t in rolloutcore.model_tensors(MODEL)}
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL, transport="cuda_ipc", delta=True)
    pub.add_tensors(base, old, dtype="bf16")
    r0 = pub.publish(base)
    assert r0["state"] == "COMMITTED" and r0["delta_base"] == ""
    new = {}
    for n, t in old.items():
        u = t.clone()
        flat = u.view(-1).view(torch.int16)
        flat[::101] ^= 1  # about 1 % of the elements, the lowest mantissa bit
        new[n] = u
    changed = sum(changed_elements(old[n], new[n])[0].numel() for n in old)
    pub.add_tensors(nxt, new, dtype="bf16")
    r1 = pub.publish(nxt, delta=True)
    assert r1["state"] == "COMMITTED"
    assert r1["delta_base"] == base
    assert r1["delta_shards"] == len(new)
    assert r1["delta_changed"] == changed, (r1["delta_changed"], changed)
    assert r1["delta_bytes"] < r1["bytes"] * 0.05, (r1["delta_bytes"], r1["bytes"])
    print(f"FIGURE cuda_ipc_delta_bytes = {r1['delta_bytes']} of {r1['bytes']}")
    pub.close()
