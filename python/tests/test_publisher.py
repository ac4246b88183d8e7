"""Publisher end to end: publish -> directory commit -> engine stage/install -> live digest,
rollouts bound to the version, zero-copy evidence, and the errors for bad input."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import rolloutcore
from rolloutcore import errors
from rolloutcore.refit import core
from conftest import MODEL, expected_digest, shared_copy, tiny_weights


def publish_all(cluster, version, weights, **kw):
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL, **kw)
    pub.add_tensors(version, weights, dtype="bf16")
    return pub, pub.publish(version)


def test_publish_commits_with_the_content_digest_of_the_bytes(cluster, version):
    weights = shared_copy(tiny_weights(seed=11))
    pub, report = publish_all(cluster, version, weights)
    assert report["state"] == "COMMITTED"
    assert report["shards"] == len(weights)
    assert report["bytes"] == sum(a.nbytes for a in weights.values())
    want = expected_digest(weights)
    assert report["content_digest"] == want

    listed = {v["version"]: v for v in cluster.directory.list(MODEL)}
    assert listed[version]["state"] == "COMMITTED"
    assert listed[version]["content_digest"] == want
    manifest = cluster.directory.get(MODEL, version)
    assert manifest["content_digest"] == want
    assert sorted(t["name"] for t in manifest["tensors"]) == sorted(weights)
    for t in manifest["tensors"]:
        (shard,) = t["shards"]
        assert shard["digest"] == rolloutcore.tensor_digest(weights[t["name"]], dtype="bf16")
        assert shard["handle"].startswith("shm:")
    pub.close()
    with pytest.raises(errors.NotFoundError):
        cluster.directory.get(MODEL, version)


def test_engine_installs_it_and_rollouts_are_bound_to_it(cluster, version):
    weights = shared_copy(tiny_weights(seed=12))
    pub, report = publish_all(cluster, version, weights)
    rec = cluster.controller.update_to(MODEL, version, timeout_s=120)
    assert rec["outcome"] == "committed", rec

    live = cluster.engine.weights_digest()
    assert live["weight_version"] == version
    assert live["content_digest"] == report["content_digest"] == expected_digest(weights)

    for i in range(3):
        out = cluster.controller.rollout([1, 2, 3, 4 + i], max_tokens=4, temperature=1.0, seed=i,
                                         return_token_ids=True, rollout_id=f"{version}-r{i}")
        assert out["binding"]["label"] == version
        assert out["choices"][0]["weight_version"] == version
        assert len(out["choices"][0]["token_ids"]) == 4
    rows = cluster.controller.trajectories(label=version)
    assert {r["binding"]["rollout_id"] for r in rows} >= {f"{version}-r{i}" for i in range(3)}
    status = cluster.controller.status()
    assert status["engines"][0]["label"] == version
    assert status["engines"][0]["state"] == "READY"
    pub.close()


def test_engine_reads_the_trainers_memory_in_place(cluster, version):
    """Zero copy: the registered address is the array's, and bytes changed after publish are
    what the engine reads (its staging check then fails against the published digest)."""
    weights = shared_copy(tiny_weights(seed=13))
    pub, report = publish_all(cluster, version, weights)
    for s in pub.shards(version):
        assert s["data_ptr"] == weights[s["name"]].ctypes.data
        assert s["source"] == "dlpack"

    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][3, 5] ^= 0x0100  # one bit of one element, after publish
    with pytest.raises(errors.RolloutcoreError) as bad:
        cluster.engine.stage(MODEL, version, cluster.directory_url)
    assert name in str(bad.value)

    weights[name][3, 5] ^= 0x0100
    staged = cluster.engine.stage(MODEL, version, cluster.directory_url)
    assert staged["content_digest"] == report["content_digest"]
    rec = cluster.controller.update_to(MODEL, version)
    assert rec["outcome"] == "committed"
    assert cluster.engine.weights_digest()["content_digest"] == report["content_digest"]
    pub.close()


def test_two_ranks_fsdp_commit_only_when_both_published(cluster, version):
    full = tiny_weights(seed=14)
    pubs = [rolloutcore.Publisher(cluster.directory_url, MODEL, rank=r, world_size=2) for r in range(2)]
    for shard in rolloutcore.trainer_shards(MODEL, "fsdp:2"):  # dim-0 row blocks
        r0, rows = shard["offset"][0], shard["shape"][0]
        buf = rolloutcore.Publisher.allocate(shard["shape"], "bf16")
        buf[...] = full[shard["name"]][r0 : r0 + rows]
        pubs[shard["rank"]].add_shard(version, shard["name"], buf, offset=shard["offset"],
                                      global_shape=shard["global_shape"])
    first = pubs[0].publish(version)
    assert first["state"] == "STAGING" and first["ranks_published"] == 1
    with pytest.raises(errors.FailedPreconditionError):
        cluster.directory.get(MODEL, version)
    second = pubs[1].publish(version)
    assert second["state"] == "COMMITTED"
    assert second["content_digest"] == expected_digest(full)

    rec = cluster.controller.update_to(MODEL, version)
    assert rec["outcome"] == "committed"
    assert cluster.engine.weights_digest()["content_digest"] == expected_digest(full)
    for p in pubs:
        p.close()


def test_copy_true_converts_f32_once_into_shared_memory(cluster, version):
    rng = np.random.default_rng(15)
    f32 = {t["name"]: (rng.standard_normal(t["shape"], dtype=np.float32) * 0.02)
           for t in rolloutcore.model_tensors(MODEL)}
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    pub.add_tensors(version, f32, dtype="bf16", copy=True)
    for s in pub.shards(version):
        assert s["data_ptr"] != f32[s["name"]].ctypes.data  # the copy is the published memory
    report = pub.publish(version)
    from rolloutcore.publisher import _bf16_bits

    assert report["content_digest"] == expected_digest({n: _bf16_bits(a) for n, a in f32.items()})
    pub.close()


def test_bf16_conversion_rounds_to_nearest_even_across_chunks():
    from rolloutcore.publisher import _bf16_bits

    # (f32 bits, bf16 bits): ties to even both ways, carries into the exponent and to infinity,
    # signed zeros, subnormals, infinities, and NaNs of both signs made quiet 0x7FC0.
    table = [(0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81), (0x3F807FFF, 0x3F80),
             (0x3FFFFFFF, 0x4000), (0x7F7FFFFF, 0x7F80), (0xFF7FFFFF, 0xFF80), (0x00000000, 0x0000),
             (0x80000000, 0x8000), (0x00000001, 0x0000), (0x00018000, 0x0002), (0x7F800000, 0x7F80),
             (0xFF800000, 0xFF80), (0x7F800001, 0x7FC0), (0xFFFFFFFF, 0x7FC0), (0x7FC00000, 0x7FC0)]
    f = np.array([a for a, _ in table], np.uint32).view(np.float32)
    assert _bf16_bits(f).tolist() == [b for _, b in table]

    # Random bits over several chunks (many NaNs among them), against the plain 64-bit formula.
    bits = np.random.default_rng(5).integers(0, 2**32, size=(3, 300_001), dtype=np.uint64)
    wide = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    f = bits.astype(np.uint32).view(np.float32)
    want = np.where(np.isnan(f), 0x7FC0, wide).astype(np.uint16)
    out = rolloutcore.Publisher.allocate(f.shape, "bf16")
    assert _bf16_bits(f, out=out) is out
    assert np.array_equal(out, want)
    with pytest.raises(errors.InvalidArgumentError, match="C-contiguous uint16"):
        _bf16_bits(f, out=np.empty((3, 2), np.uint16))


def test_copy_true_reuses_the_shared_buffers_of_a_released_version(cluster, version):
    """The copies of the next version go into the buffers a released version's copies used (no
    fresh memory to fault in), every byte is the new version's, and the engine proves it."""
    first, second = f"{version}-a", f"{version}-b"
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    old = tiny_weights(seed=21)
    pub.add_tensors(first, old, dtype="bf16", copy=True)
    assert pub.publish(first)["content_digest"] == expected_digest(old)
    assert cluster.controller.update_to(MODEL, first)["outcome"] == "committed"
    used = sorted(s["data_ptr"] for s in pub.shards(first))
    total = sum(a.nbytes for a in old.values())
    assert pub.copy_buffers() == {"in_use": len(old), "in_use_bytes": total, "spare": 0, "spare_bytes": 0,
                                  "reused": 0, "allocated": len(old)}

    pub.release(first)  # the engine serves its own copy; nothing reads these buffers any more
    assert pub.copy_buffers() == {"in_use": 0, "in_use_bytes": 0, "spare": len(old), "spare_bytes": total,
                                  "reused": 0, "allocated": len(old)}
    new = tiny_weights(seed=22)
    pub.add_tensors(second, new, dtype="bf16", copy=True)
    assert sorted(s["data_ptr"] for s in pub.shards(second)) == used
    assert pub.copy_buffers()["spare"] == 0
    assert pub.copy_buffers()["reused"] == len(new) and pub.copy_buffers()["allocated"] == len(old)
    report = pub.publish(second)
    assert report["content_digest"] == expected_digest(new) != expected_digest(old)
    rec = cluster.controller.update_to(MODEL, second)
    assert rec["outcome"] == "committed", rec
    assert cluster.engine.weights_digest()["content_digest"] == expected_digest(new)
    pub.close()
    assert pub.copy_buffers() == {"in_use": 0, "in_use_bytes": 0, "spare": 0, "spare_bytes": 0,
                                  "reused": len(new), "allocated": len(old)}


def test_copy_buffers_left_spare_are_freed_at_the_next_publish_and_never_kept_without_reuse(cluster, version):
    weights = tiny_weights(seed=23)
    name = "model.layers.1.mlp.down_proj.weight"
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    pub.add_tensors(f"{version}-a", weights, dtype="bf16", copy=True)
    pub.publish(f"{version}-a")
    pub.release(f"{version}-a")
    assert pub.copy_buffers()["spare"] == len(weights)
    # A copy whose shard is refused (its box is outside the tensor) gives its buffer back.
    rows = weights[name].shape[0]
    with pytest.raises(errors.InvalidArgumentError, match=name):
        pub.add_shard(f"{version}-b", name, weights[name], offset=[rows, 0], dtype="bf16", copy=True)
    assert pub.copy_buffers()["spare"] == len(weights)
    # The next version is published from the caller's own shared memory: no copy takes the spare
    # buffers, and the publish frees them.
    pub.add_tensors(f"{version}-b", shared_copy(weights), dtype="bf16")
    assert pub.copy_buffers()["spare"] == len(weights)
    pub.publish(f"{version}-b")
    assert pub.copy_buffers() == {"in_use": 0, "in_use_bytes": 0, "spare": 0, "spare_bytes": 0,
                                  "reused": 1, "allocated": len(weights)}
    pub.close()

    plain = rolloutcore.Publisher(cluster.directory_url, MODEL, reuse_copies=False)
    plain.add_tensors(f"{version}-c", weights, dtype="bf16", copy=True)
    assert plain.copy_buffers()["in_use"] == len(weights)
    plain.publish(f"{version}-c")
    plain.release(f"{version}-c")
    assert plain.copy_buffers() == {"in_use": 0, "in_use_bytes": 0, "spare": 0, "spare_bytes": 0,
                                  "reused": 0, "allocated": len(weights)}
    plain.close()
    with pytest.raises(errors.InvalidArgumentError, match="reuse_copies must be True or False"):
        rolloutcore.Publisher(cluster.directory_url, MODEL, reuse_copies=1)


@pytest.mark.skipif("ucx" not in rolloutcore.transports(), reason="built without UCX")
def test_ucx_publishes_plain_numpy_memory_in_place(cluster, version):
    weights = tiny_weights(seed=16)  # ordinary numpy arrays, not shared memory
    pub, report = publish_all(cluster, version, weights, transport="ucx")
    for s in pub.shards(version):
        assert s["data_ptr"] == weights[s["name"]].ctypes.data
        assert s["handle"].startswith("ucx:")
    rec = cluster.controller.update_to(MODEL, version)
    assert rec["outcome"] == "committed"
    assert cluster.engine.weights_digest()["content_digest"] == expected_digest(weights)
    pub.close()


# ---- bad input ------------------------------------------------------------------------------


@pytest.fixture
def pub(cluster):
    p = rolloutcore.Publisher(cluster.directory_url, MODEL)
    yield p
    p.close()


def test_wrong_dtype_is_refused_with_the_tensor_named(pub):
    a = rolloutcore.Publisher.allocate([4, 4], "f32")
    with pytest.raises(errors.InvalidArgumentError, match=r"tensor w .*float64 arrays cannot be published"):
        pub.add_shard("vx", "w", np.zeros((4, 4), dtype=np.float64))
    with pytest.raises(ValueError, match=r"dtype bf16 was asked but the array holds float32"):
        pub.add_shard("vx", "w", a, dtype="bf16")
    pub.add_shard("vx", "w", a, global_shape=[8, 4])
    b = rolloutcore.Publisher.allocate([4, 4], "bf16")
    with pytest.raises(errors.InvalidArgumentError, match=r"declared as bf16 \[8, 4\] but an earlier shard says f32"):
        pub.add_shard("vx", "w", b, offset=[4, 0], global_shape=[8, 4])


def test_offset_out_of_range_is_refused(pub):
    a = rolloutcore.Publisher.allocate([4, 8], "bf16")
    with pytest.raises(errors.InvalidArgumentError, match=r"box \[6:10, 0:8\] lies outside the tensor's shape \[8, 8\]"):
        pub.add_shard("vx", "w", a, offset=[6, 0], global_shape=[8, 8])
    with pytest.raises(errors.InvalidArgumentError, match=r"offset has 1 dims"):
        pub.add_shard("vx", "w", a, offset=[0], global_shape=[8, 8])
    pub.add_shard("vx", "w", a, offset=[0, 0], global_shape=[8, 8])
    with pytest.raises(errors.InvalidArgumentError, match=r"overlaps the earlier shard"):
        pub.add_shard("vx", "w", rolloutcore.Publisher.allocate([4, 8], "bf16"), offset=[2, 0], global_shape=[8, 8])


def test_non_contiguous_arrays_are_refused(pub):
    a = rolloutcore.Publisher.allocate([8, 8], "bf16")
    with pytest.raises(errors.InvalidArgumentError, match=r"not contiguous \(shape \[8, 4\], strides \[8, 2\]"):
        pub.add_shard("vx", "w", a[:, ::2])
    with pytest.raises(errors.InvalidArgumentError, match=r"not contiguous"):
        pub.add_shard("vx", "w", a.T)
    pub.add_shard("vx", "w", a[2:4], offset=[2, 0], global_shape=[8, 8])  # a row block is contiguous


def test_shm_refuses_ordinary_memory_and_says_what_to_do(pub):
    with pytest.raises(errors.InvalidArgumentError, match=r"Publisher.allocate.*copy=True.*transport='ucx'"):
        pub.add_shard("vx", "w", np.zeros((4, 4), dtype=np.float32))


def test_labels_and_urls_the_directory_refuses_are_refused_before_anything_is_staged(cluster, pub):
    with pytest.raises(errors.InvalidArgumentError, match=r"directory URL 'localhost:7470' must be http:// or https://"):
        rolloutcore.Publisher("localhost:7470", MODEL)
    with pytest.raises(errors.InvalidArgumentError, match=r"Publisher: model: character 0x2f is not allowed"):
        rolloutcore.Publisher(cluster.directory_url, "org/model")
    with pytest.raises(errors.InvalidArgumentError, match=r"Publisher: model: must not be empty"):
        rolloutcore.Publisher(cluster.directory_url, "")
    for kw, says in (({"lease_ttl_ms": 0}, r"lease_ttl_ms must be in \[1, 86400000\], got 0"),
                     ({"lease_ttl_ms": 10**15}, r"lease_ttl_ms must be in"),
                     ({"keepalive_interval_ms": -1}, r"keepalive_interval_ms must be in \[0, lease_ttl_ms\)"),
                     ({"lease_ttl_ms": 1000, "keepalive_interval_ms": 1000}, r"got 1000 with lease_ttl_ms 1000")):
        with pytest.raises(errors.InvalidArgumentError, match=says):
            rolloutcore.Publisher(cluster.directory_url, MODEL, **kw)
    a = rolloutcore.Publisher.allocate([4, 4], "f32")
    with pytest.raises(errors.InvalidArgumentError, match=r"version: character 0x2f is not allowed"):
        pub.add_shard("step/1", "w", a)
    assert "step/1" not in pub.versions()


def test_state_errors(pub):
    with pytest.raises(errors.NotFoundError, match=r"no shards staged for version v-none"):
        pub.publish("v-none")
    with pytest.raises(errors.NotFoundError):
        pub.release("v-none")
    with pytest.raises(errors.InvalidArgumentError, match=r"expected an array with __dlpack__ or the buffer protocol"):
        pub.add_shard("vx", "w", object())


def test_readonly_arrays_come_through_the_buffer_protocol(pub):
    a = rolloutcore.Publisher.allocate([4], "f32")
    a.flags.writeable = False
    pub.add_shard("vro", "w", a)
    (s,) = pub.shards("vro")
    assert s["source"] in ("buffer", "dlpack")  # numpy < 2 refuses DLPack for read-only arrays
    assert s["data_ptr"] == a.ctypes.data


def test_released_memory_is_freed(cluster, version):
    gc.collect()  # earlier tests' garbage (tracebacks hold arrays) must not be counted
    before = core().shared_allocations()[0]
    weights = shared_copy(tiny_weights(seed=17))
    pub, _ = publish_all(cluster, version, weights)
    assert core().shared_allocations()[0] == before + len(weights)
    del weights
    gc.collect()
    assert core().shared_allocations()[0] == before + len(rolloutcore.model_tensors(MODEL))  # held
    pub.release(version)
    gc.collect()
    assert core().shared_allocations()[0] == before


# ---- plan, directory and controller clients -------------------------------------------------


def test_plan_statistics():
    p = rolloutcore.plan("tiny", "fsdp:2", "tp:2")
    assert p["coverage"] == "ok" and p["architecture"] == "qwen3"
    assert [r["rank"] for r in p["ranks"]] == [0, 1]
    for r in p["ranks"]:
        assert r["bytes_needed"] > 0 and r["bytes_planned"] >= r["bytes_needed"] and r["descriptors"] > 0
        assert r["dest_bytes_selected"] == r["dest_bytes"]
    partial = rolloutcore.plan("tiny", "fsdp:2", "tp:1", layers=(1, 1))
    assert partial["totals"]["bytes_needed"] < p["totals"]["bytes_needed"]
    with pytest.raises(errors.InvalidArgumentError):
        rolloutcore.plan("tiny", "fsdp:two", "tp:2")


def test_directory_client(cluster, version):
    with pytest.raises(errors.NotFoundError):
        cluster.directory.info(MODEL, "v-never")
    assert cluster.directory.list("no-such-model") == []
    weights = shared_copy(tiny_weights(seed=18))
    pub, report = publish_all(cluster, version, weights)
    info = cluster.directory.wait_committed(MODEL, version, timeout_s=5)
    assert info["commit_seq"] == report["commit_seq"]
    commits = cluster.directory.commits(MODEL, after=report["commit_seq"] - 1)
    assert commits["commits"][0]["version"] == version
    cluster.directory.release(MODEL, version)
    with pytest.raises(errors.NotFoundError):
        cluster.directory.release(MODEL, version)
    pub.release(version, in_directory=False)


def test_controller_client_lease_mode_and_journal(cluster):
    binding = cluster.controller.admit(rollout_id="lease-1")
    label = binding["label"]
    cluster.controller.finish("lease-1", token_ids=[5, 6], prompt_token_ids=[1, 2], finish_reason="length")
    rows = [r for r in cluster.controller.trajectories(label=label) if r["binding"]["rollout_id"] == "lease-1"]
    assert len(rows) == 1
    with pytest.raises(errors.NotFoundError):
        cluster.controller.finish("lease-1", token_ids=[])
    with pytest.raises(errors.NotFoundError):
        cluster.controller.update("u-999")
    journal = cluster.controller.journal()
    assert journal


# ---- cleanup and threads ----------------------------------------------------------------


def test_close_releases_every_version_even_when_the_directory_is_down():
    """close() is best effort: each version's memory is released on this rank even though the
    directory cannot be told, and the first error is raised after all of them; a with-block's own
    exception is not replaced by the release's."""
    p = rolloutcore.Publisher("http://127.0.0.1:1", MODEL)
    for v in ("v1", "v2"):
        p.add_shard(v, "model.norm.weight", rolloutcore.Publisher.allocate([64], "bf16"))
    with pytest.raises(errors.UnavailableError, match="2 versions could not be released in the directory"):
        p.close()
    assert p.versions() == []
    with pytest.raises(KeyError, match="the caller's own"):
        with rolloutcore.Publisher("http://127.0.0.1:1", MODEL) as q:
            q.add_shard("v1", "model.norm.weight", rolloutcore.Publisher.allocate([64], "bf16"))
            raise KeyError("the caller's own")
    assert q.versions() == []


def test_a_closed_publisher_stages_and_publishes_nothing(cluster, version):
    """After close() the Publisher's versions are gone; staging or publishing through it again is
    refused by name (before, it staged and committed a new version whose memory nothing owned)."""
    weights = shared_copy(tiny_weights(seed=21))
    pub, report = publish_all(cluster, version, weights)
    assert report["state"] == "COMMITTED"
    pub.close()
    name, array = next(iter(weights.items()))
    for call in (lambda: pub.add_shard(version + "-b", name, array, dtype="bf16"),
                 lambda: pub.add_tensors(version + "-b", weights, dtype="bf16"),
                 lambda: pub.publish(version + "-b"),
                 lambda: pub.publish_empty(version + "-b")):
        with pytest.raises(errors.FailedPreconditionError, match="is closed"):
            call()
    assert pub.versions() == []
    assert version + "-b" not in {v["version"] for v in cluster.directory.list(MODEL)}
    pub.close()  # closing again is harmless


def test_first_allocations_from_several_threads_at_once_do_not_deadlock():
    """pybind11 2.10 set its numpy API up on first use under a static's guard: the first
    allocate() calls from several threads at once could deadlock (1 run in 5). Each run is a fresh
    interpreter (only the first use raced)."""
    code = (
        "import threading, rolloutcore\n"
        "ts = [threading.Thread(target=rolloutcore.Publisher.allocate, args=([256], 'bf16')) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]; print('ok')\n"
    )
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_cluster_never_closed_stops_its_servers_at_exit():
    """A script that ends without closing its LocalCluster does not leave the directory, engine and
    controller running without their (removed) work directory."""
    code = (
        "import rolloutcore\n"
        "c = rolloutcore.LocalCluster(model='tiny', engine_model='tiny', engine_threads=1)\n"
        "print(' '.join(str(s.proc.pid) for s in c.servers), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 3, out.stdout
    for pid in pids:
        try:
            state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"server {pid} still running ({state}) after the script ended"


def test_a_cluster_whose_process_is_killed_stops_its_servers():
    """SIGKILL runs no finalizer: the servers see their parent gone (ROLLOUTCORE_EXIT_WITH_PARENT)
    and stop within seconds instead of running on without their work directory."""
    import signal
    import time

    code = (
        "import sys, time, rolloutcore\n"
        "c = rolloutcore.LocalCluster(model='tiny', engine_model='tiny', engine_threads=1)\n"
        "print(' '.join(str(s.proc.pid) for s in c.servers), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 3, pids
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

        def running(pid):
            try:
                state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
            except FileNotFoundError:
                return False
            return state != "Z"

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(running(p) for p in pids):
            time.sleep(0.1)
        left = [p for p in pids if running(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"servers {left} still running 30 s after their parent was killed"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_ends_the_outcome_inquiry_of_a_lost_publish_at_once():
    """A directory that takes every request and never answers: the publish's outcome is unknown and
    the Publisher asks for it for up to 30 s. Ctrl-C (SIGINT) ends that within a fraction of a
    second with KeyboardInterrupt, the version unresolved (its buffers registered)."""
    import signal
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()

    def lose_every_answer():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1 << 20)  # the request; no answer, the connection just closes
                except OSError:
                    pass

    server = threading.Thread(target=lose_every_answer, daemon=True)
    server.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    p = rolloutcore.Publisher(url, MODEL)
    p.add_shard("v1", "model.norm.weight", rolloutcore.Publisher.allocate([64], "bf16"))
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            p.publish("v1")
        took = time.monotonic() - t0
        assert took < 5, f"Ctrl-C took {took:.1f} s to end the publish"
        assert p.versions() == ["v1"]  # unresolved, kept: publish again to ask again, or release
    finally:
        timer.cancel()
        stop.set()
        server.join()
        listener.close()
        with pytest.raises(errors.UnavailableError, match="not sent"):  # nobody listens now: buffers dropped anyway
            p.release("v1", in_directory=False)
        assert p.versions() == []


def test_constructor_arguments_of_the_wrong_type_are_named():
    for kwargs, field in (({"delta": "no"}, "delta"), ({"world_size": 2**40}, "world_size"), ({"rank": 1.5}, "rank"),
                          ({"transport": None}, "transport")):
        with pytest.raises(errors.InvalidArgumentError, match=f"Publisher: {field}"):
            rolloutcore.Publisher("http://127.0.0.1:1", MODEL, **kwargs)
