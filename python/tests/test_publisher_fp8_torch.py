"""torch_amax_exchange over a real torch.distributed group (gloo, two processes on loopback): each
rank holds half of every row of one projection (a column split, so every per-channel scale and the
per-tensor scale span both ranks), and after the exchange each rank holds the amaxes of the whole
weight; the parts both ranks attach then add up to the whole parameter's image. Skips without torch
(the CI machine has none; the GPU machine runs it)."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

NAME = "model.layers.0.self_attn.o_proj.weight"
ROWS, COLS = 24, 320  # the column split at 160 cuts the second 128-column block


def _weights():
    rng = np.random.default_rng(3)
    from rolloutcore.publisher import _bf16_bits

    return _bf16_bits(rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02)


def _worker(rank: int, port: int, out_dir: str, quantization: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import rolloutcore
        from rolloutcore.publisher import torch_amax_exchange

        w = _weights()
        half = COLS // 2
        mine = rolloutcore.Publisher.allocate((ROWS, half), "bf16")
        mine[...] = w[:, rank * half:(rank + 1) * half]
        pub = rolloutcore.Publisher("http://127.0.0.1:1", "m", rank=rank, world_size=2)
        pub.add_shard("v", NAME, mine, offset=[0, rank * half], global_shape=[ROWS, COLS], dtype="bf16")
        amax, partial = pub.fp8_amax("v", quantization)
        assert partial, "a column split holds every group only in part"
        merged = torch_amax_exchange()(quantization, amax)
        np.save(os.path.join(out_dir, f"amax{rank}.npy"), np.asarray(merged[NAME]))
        # The parts this rank would publish with the merged amaxes.
        from rolloutcore.refit import core

        parts = core().fp8_parts_from_amax([(NAME, [ROWS, COLS], [0, rank * half], np.ascontiguousarray(mine))],
                                           quantization, merged)
        np.save(os.path.join(out_dir, f"part{rank}.npy"), np.array(parts[0], dtype=np.uint64))
        pub.close(release_in_directory=False)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("quantization", ["fp8_per_tensor", "fp8_per_channel", "fp8_per_block"])
def test_torch_amax_exchange_merges_the_ranks_amaxes(tmp_path, quantization):
    import torch.multiprocessing as mp

    from rolloutcore.refit import core

    mp.spawn(_worker, args=(_free_port(), str(tmp_path), quantization), nprocs=2, join=True)
    w = _weights()
    whole, _ = core().fp8_local_amax([(NAME, [ROWS, COLS], [0, 0], w)], quantization)
    for r in range(2):
        assert np.array_equal(np.load(tmp_path / f"amax{r}.npy"), whole[NAME]), r
    got = [np.load(tmp_path / f"part{r}.npy") for r in range(2)]
    want = core().fp8_parts_from_amax([(NAME, [ROWS, COLS], [0, 0], w)], quantization, whole)[0]
    total = tuple(int(sum(int(g[i]) for g in got) % 2**64) for i in range(2))
    assert total == (int(want[0]), int(want[1]))
