"""TRL's GRPOTrainer generating through the controller and syncing through the Publisher
(rolloutcore.trl, docs/trl.md), on CPU: a real GRPOTrainer for a few steps on the tiny Qwen3
(`rolloutcore model init --preset tiny`, seeded random weights) with a byte-level tokenizer (token
id = byte, as the embedded engine's), the controller with the embedded engine, an in-memory digit
reversal dataset and a verifiable reward.

Skipped where torch, transformers, datasets or trl are not installed."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("RC_REQUIRE_TRL") == "1":
    # CTest python_trl_tests runs this in build/trl-venv (scripts/trl-env.sh): a missing package
    # there is a failure, not a skip.
    import datasets  # noqa: F401
    import torch
    import transformers  # noqa: F401
    import trl
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")

import rolloutcore  # noqa: E402
from rolloutcore.cluster import run_binary  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
if os.environ.get("RC_REQUIRE_TRL") == "1":
    import rolloutcore.trl as rc_trl
else:
    rc_trl = pytest.importorskip("rolloutcore.trl")

MODEL = "tiny"
DIGITS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trl") / "model"
    run_binary(["model", "init", "--preset", MODEL, "--seed", "7", "--out", str(out)])
    return out


def byte_tokenizer():
    """A Hugging Face tokenizer whose ids are the UTF-8 bytes (the embedded engine's own encoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte <-> printable character table, so that every byte is one vocabulary entry.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=chars[0], eos_token=chars[0])
    assert fast("12=")["input_ids"] == [49, 50, 61]
    return fast


def dataset(n: int, seed: int):
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("0123456789") for _ in range(DIGITS))
        rows.append({"prompt": s + "=", "answer": s[::-1]})
    return datasets.Dataset.from_list(rows)


class Reward:
    """Verifiable and dense (so every GRPO group has a spread): per answer position
    1 - |token - wanted byte| / 255, averaged. Records what reached it from rollout_func."""

    __name__ = "digit_distance"

    def __init__(self) -> None:
        self.seen_versions = []

    def __call__(self, prompts, completions, completion_ids, answer, rc_version, rc_version_spans, **kw):
        assert len(rc_version) == len(completion_ids) == len(answer) == len(rc_version_spans)
        self.seen_versions.append(list(rc_version))
        out = []
        for ids, want in zip(completion_ids, answer):
            score = 0.0
            for i, ch in enumerate(want.encode()):
                got = ids[i] if i < len(ids) else 0
                score += 1.0 - abs(got - ch) / 255.0
            out.append(score / len(want))
        return out


def make_trainer(model_dir: Path, rc, reward, tmp_path: Path, steps: int, lr: float = 1e-2, callbacks=()):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=DIGITS, learning_rate=lr, beta=0.0, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, seed=0, temperature=1.0, disable_tqdm=True,
        use_vllm=False, dataloader_num_workers=0)
    return trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset(64, 1),
                           processing_class=byte_tokenizer(), rollout_func=rc.rollout_func,
                           callbacks=[*callbacks, rc])


def cluster(model_dir: Path, tmp_path: Path, faults: bool = False):
    return rolloutcore.LocalCluster(model=MODEL, engine_model=str(model_dir), workdir=str(tmp_path / "work"),
                                    engine_threads=2,
                                    engine_args=["--enable-fault-injection"] if faults else [])


def test_grpo_generates_bound_to_the_synced_version_and_syncs_every_step(model_dir, tmp_path):
    steps = 4
    with cluster(model_dir, tmp_path) as c:
        rc = rc_trl.RolloutcoreGRPO(c.controller_url, c.directory_url, MODEL, update_timeout_s=60)
        reward = Reward()
        trainer = make_trainer(model_dir, rc, reward, tmp_path, steps)
        trainer.train()

        syncs = [h for h in rc.history if h["kind"] == "sync"]
        gens = [h for h in rc.history if h["kind"] == "generation"]
        # One sync before training (step-0) and one per optimizer step, each its own committed update.
        assert [s["version"] for s in syncs] == [f"step-{k}" for k in range(steps + 1)]
        assert len({s["update_id"] for s in syncs}) == steps + 1
        for s in syncs:
            assert s["transport"] == "shm" and s["staged"] > 0 and s["host_copy"] == s["staged"]
        # keep=2: step-0 is released after step-2's publish, so from step-3 on every copy goes into
        # the shared memory of a released version.
        assert [s["host_copy_reused"] for s in syncs] == [0, 0, 0] + [s["staged"] for s in syncs[3:]]
        for s in syncs:
            assert s["pause_ms"] >= 0 and s["update_ms"] >= s["pause_ms"]
            # rolloutcore.trl checked the live digest against the manifest's when the update committed
            assert len(s["content_digest"]) == 16
        # Generation for step k ran on step-(k-1), every completion bound to it.
        assert [g["expected"] for g in gens] == [f"step-{k}" for k in range(steps)]
        for g in gens:
            assert g["bound"] == [g["expected"]] and g["mismatched"] == 0 and g["completions"] == 8
            assert g["spans"] == 1
            # the engine serves the trainer's weights: only bf16 rounding separates the logprobs
            assert g["logprob_gap"] < 0.02, g
        # The labels reached the reward function with the completions.
        assert reward.seen_versions == [[f"step-{k}"] * 8 for k in range(steps)]
        # The trainer actually trained: the published digests differ step to step.
        assert len({s["content_digest"] for s in syncs}) == steps + 1
        # on_train_end closed the Publisher: every version it published is released.
        assert c.directory.list(MODEL) == []
        # The engine serves the last version, byte for byte.
        live = c.engine.weights_digest()
        assert live["weight_version"] == f"step-{steps}"
        assert live["content_digest"] == syncs[-1]["content_digest"]
        # The controller's trajectory store has every rollout under the label it was bound to.
        recorded = {t["binding"]["rollout_id"]: t["binding"]["label"] for t in c.controller.trajectories()}
        assert len(recorded) == 8 * steps
        assert sorted(set(recorded.values())) == [f"step-{k}" for k in range(steps)]
        # TRL's logs carry the figures, per step.
        logged = [h for h in trainer.state.log_history if "rolloutcore/logprob_gap/mean" in h]
        assert len(logged) == steps
        for k, h in enumerate(logged):
            assert h["rolloutcore/bound_step"] == k == h["rolloutcore/expected_step"]
            assert h["rolloutcore/version_mismatch"] == 0.0
            assert h["rolloutcore/synced_step"] == k + 1 or k == 0  # step 1's log also holds step-0's sync
            assert h["rolloutcore/pause_ms"] >= 0 and "reward" in h
        print(json.dumps({"syncs": syncs, "generations": gens}, default=str))


def test_a_skipped_sync_is_caught_at_the_next_generation(model_dir, tmp_path):
    with cluster(model_dir, tmp_path) as c:
        rc = rc_trl.RolloutcoreGRPO(c.controller_url, c.directory_url, MODEL, skip_sync_at={2})
        trainer = make_trainer(model_dir, rc, Reward(), tmp_path, 4)
        with pytest.raises(rc_trl.VersionMismatchError, match="expected every one bound to step-2") as info:
            trainer.train()
        assert info.value.expected == "step-2" and info.value.found == {"step-1": 8}
        rc.close()


def test_warn_mode_records_the_stale_generation_and_its_logprob_gap(model_dir, tmp_path):
    with cluster(model_dir, tmp_path) as c:
        rc = rc_trl.RolloutcoreGRPO(c.controller_url, c.directory_url, MODEL, skip_sync_at={2}, on_mismatch="warn")
        trainer = make_trainer(model_dir, rc, Reward(), tmp_path, 4)
        trainer.train()
        gens = {g["step"]: g for g in rc.history if g["kind"] == "generation"}
        stale = gens[3]
        assert stale["expected"] == "step-2" and stale["bound"] == ["step-1"] and stale["mismatched"] == 8
        synced = [g["logprob_gap"] for s, g in gens.items() if s != 3]
        assert max(synced) < 0.02
        # The trainer's step-2 weights are not what sampled: the gap shows it.
        print(json.dumps({"synced_gaps": synced, "stale_gap": stale["logprob_gap"]}))
        assert stale["logprob_gap"] > 5 * max(synced) and stale["logprob_gap"] > 0.01, gens
        # The sync after the skipped one brings the engine back.
        assert gens[4]["bound"] == ["step-3"] and gens[4]["mismatched"] == 0
        logged = {h["step"]: h for h in trainer.state.log_history if "rolloutcore/version_mismatch" in h}
        assert logged[3]["rolloutcore/version_mismatch"] == 1.0 and logged[4]["rolloutcore/version_mismatch"] == 0.0
        assert logged[2]["rolloutcore/sync_skipped"] == 1.0


class TaintAtStep:
    """Sets the engine's fault that fails an install after it touched live weights (the update
    taints), at the end of one step, before RolloutcoreGRPO's sync runs (callback order)."""

    def __new__(cls, engine_url: str, step: int):
        from transformers import TrainerCallback

        class _Cb(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step == step:
                    req = urllib.request.Request(engine_url + "/rc/fault", method="POST",
                                                 data=json.dumps({"fail_install_after_first_rank": True}).encode(),
                                                 headers={"Content-Type": "application/json"})
                    key = os.environ.get("ROLLOUTCORE_API_KEY")
                    if key:
                        req.add_header("Authorization", f"Bearer {key}")
                    urllib.request.urlopen(req, timeout=10).read()

        return _Cb()


def test_a_tainted_update_fails_the_training_loudly_and_in_bounded_time(model_dir, tmp_path):
    with cluster(model_dir, tmp_path, faults=True) as c:
        rc = rc_trl.RolloutcoreGRPO(c.controller_url, c.directory_url, MODEL, update_timeout_s=30)
        trainer = make_trainer(model_dir, rc, Reward(), tmp_path, 4, callbacks=[TaintAtStep(c.engine_url, 2)])
        t0 = time.monotonic()
        with pytest.raises(rc_trl.UpdateFailedError) as info:
            trainer.train()
        err = info.value
        assert err.version == "step-2" and err.outcome == "tainted"
        assert err.update_id.startswith("u-") and err.update_id in str(err) and "tainted" in str(err)
        assert "failed_after_mutation" in err.reason or "install" in err.reason, err.reason
        assert time.monotonic() - t0 < 30 + 20
        status = c.controller.status()
        assert any(e.get("state") == "TAINTED" for e in status.get("engines", [status])), status
        # steps 0 and 1 committed before it, the generations were bound to them
        syncs = [h["version"] for h in rc.history if h["kind"] == "sync"]
        assert syncs == ["step-0", "step-1"]
        rc.close()


def test_pause_window_counts_the_paused_phases():
    rec = {"engines": [{"phases_ms": {"DRAINING": 7, "QUIESCED": 1, "UPDATING": 5, "INVALIDATING": 2,
                                      "VALIDATING": 3, "RESUMING": 1}},
                       {"phases_ms": {"DRAINING": 2, "UPDATING": 30}}]}
    assert rc_trl.pause_window_ms(rec) == (30.0, 7.0)
    assert rc_trl.pause_window_ms({"engines": []}) == (0.0, 0.0)
    assert not math.isnan(rc_trl.pause_window_ms(rec)[0])


def _two_rank_worker(rank: int, port: int, controller: str, directory: str, model_dir: str, out_dir: str) -> None:
    """One rank of a two-process trainer (gloo on loopback) whose parameters are DTensors sharded on
    their first dimension, as FSDP2 keeps them: each rank publishes its own shards, rank 0 drives the
    controller's update, both wait for the commit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoModelForCausalLM

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
        rc = rc_trl.RolloutcoreGRPO(controller, directory, MODEL, update_timeout_s=60)
        if rank == 1:
            # Rank 1 publishes last: rank 0 must not ask the controller for the version before it
            # commits (it did, now and then, when rank 1 happened to be the slower one).
            time.sleep(1.0)
        row = rc.sync(model, 0)
        out = {k: row.get(k) for k in ("version", "staged", "in_place", "host_copy", "transport", "update_id",
                                       "content_digest")}
        if rank == 0:
            m = rolloutcore.DirectoryClient(directory).get(MODEL, "step-0")
            out["manifest_digest"] = m["content_digest"]
            out["expected_ranks"] = m["expected_ranks"]
            out["shards"] = {t["name"]: sorted((s["rank"], tuple(s["offset"])) for s in t["shards"])
                             for t in m["tensors"]}
            out["shapes"] = {t["name"]: t["shape"] for t in m["tensors"]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # rank 0 has read the manifest: the shards may be released
        rc.close()
    finally:
        dist.destroy_process_group()


def test_two_ranks_publish_their_own_shards_and_rank_0_drives_the_update(model_dir, tmp_path):
    """No gather: each rank of a sharded trainer publishes its own half of every parameter, the
    version commits only with both, one controller update per sync, and the content digest is the
    same as a one-process trainer's publish of the same weights (the digest is sharding-invariant)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with cluster(model_dir, tmp_path) as c:
        mp.spawn(_two_rank_worker, args=(port, c.controller_url, c.directory_url, str(model_dir), str(tmp_path)),
                 nprocs=2, join=True)
        r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
        assert r0["expected_ranks"] == 2
        # Rank 0 drove the one update; rank 1 published and waited.
        assert r0["update_id"] and r1["update_id"] is None
        assert r0["staged"] > 0 and r1["staged"] > 0 and r0["transport"] == r1["transport"] == "shm"
        # Every parameter long enough to split has one shard per rank, at offsets 0 and ceil(n/2).
        split = 0
        for name, shards in r0["shards"].items():
            n = r0["shapes"][name][0]
            if n >= 2:
                half = (n + 1) // 2
                assert [(r, o[0]) for r, o in shards] == [(0, 0), (1, half)], (name, shards)
                split += 1
        assert split == len(r0["shards"])
        # The update committed with the live digest equal to the manifest's (checked by rolloutcore.trl).
        assert r0["content_digest"] == r0["manifest_digest"]
        live = c.engine.weights_digest()
        assert live["weight_version"] == "step-0" and live["content_digest"] == r0["manifest_digest"]
        # The same weights from one process: the same content digest.
        from transformers import AutoModelForCausalLM

        whole = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        rc = rc_trl.RolloutcoreGRPO(c.controller_url, c.directory_url, MODEL, update_timeout_s=60)
        one = rc.sync(whole, 1)
        rc.close()
        assert one["content_digest"] == r0["manifest_digest"]
