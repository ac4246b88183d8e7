"""One rank of the 2-rank DTensor publish test (run by torchrun, gloo, CPU).

Builds the tiny model's weights from a seed (identical on every rank), distributes them as
DTensors (2-D weights Shard(0), 1-D norms Replicate(), embed_tokens Shard(1) to exercise another
dim), cross-checks rolloutcore's placement arithmetic against torch's, publishes this rank's
shards through rolloutcore.torch_utils, and keeps the memory alive until the parent test writes
the 'done' file (engines read the shards after the publish).

argv: DIRECTORY_URL MODEL VERSION SYNC_DIR
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import rolloutcore
from rolloutcore import torch_utils

try:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
except ImportError:  # older torch
    from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    from torch.distributed._tensor.device_mesh import init_device_mesh


def full_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in rolloutcore.model_tensors(model):
        v = torch.randn(t["shape"], generator=g) * 0.02
        if t["name"].endswith("norm.weight"):
            v += 1.0
        out[t["name"]] = v
    return out


def main():
    directory, model, version, sync = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    params = {}
    for name, full in full_weights(model, seed=21).items():
        if full.dim() == 1:
            placement = Replicate()
        elif name == "model.embed_tokens.weight":
            placement = Shard(1)
        else:
            placement = Shard(0)
        d = distribute_tensor(full, mesh, [placement])
        # rolloutcore's own arithmetic must agree with torch's for every tensor.
        offset, local = torch_utils.shard_geometry(list(full.shape), list(mesh.shape), mesh.get_coordinate(), d.placements)
        t_offset, t_local, _ = torch_utils.dtensor_geometry(d)
        assert (offset, local) == (t_offset, t_local), (name, offset, local, t_offset, t_local)
        assert list(d.to_local().shape) == local
        params[name] = torch.nn.Parameter(d)

    pub = rolloutcore.Publisher(directory, model, rank=rank, world_size=world)
    report = torch_utils.publish(pub, version, params.items(), dtype="bf16")
    with open(os.path.join(sync, f"rank{rank}.state"), "w") as f:
        f.write(report["state"])
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(sync, "done")) and time.monotonic() < deadline:
        time.sleep(0.05)
    pub.close(release_in_directory=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
