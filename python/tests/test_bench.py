"""`rolloutcore bench cycle --model tiny --json` end to end: the report is complete and its
accounting is consistent (no timing targets here: those are read from the benchmark's figures)."""

from __future__ import annotations

import json
import os
import subprocess

import rolloutcore


def _bin() -> str:
    return os.environ.get("ROLLOUTCORE_BIN") or rolloutcore.find_binary()


def test_bench_cycle_reports_each_cycle_and_splits_the_controller_overhead(tmp_path) -> None:
    out = subprocess.run(
        [_bin(), "bench", "cycle", "--model", "tiny", "--cycles", "2", "--restarts", "1", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    cycle = report["cycle"]
    cycles = cycle["cycles"]
    assert len(cycles) == 3  # one cold (shadow allocation), then the two timed ones
    assert [c["cold"] for c in cycles] == [True, False, False]
    for c in cycles:
        # Every update carried 2 probes of 8 tokens, pre-replayed on the staged image and served in
        # the pause window from that pre-replay.
        assert c["replay"]["match"] and c["replay"]["probes"] == 2
        assert c["prereplay"]["ran"], c["prereplay"]
        parts = c["controller_overhead_parts_ms"]
        # The engine reports its whole stage and install calls (`call_ms`), which hold their named
        # parts and more (locks, evidence, mprotect): subtracting the whole calls leaves less than
        # subtracting the parts, and the calls' dispatch is what is left of their intervals.
        assert parts["stage_engine_beyond_parts"] > 0 and parts["install_engine_beyond_parts"] > 0
        assert c["controller_overhead_ms"] <= c["controller_overhead_named_parts_ms"] + 1e-9
        # Each call is timed from before the adapter's method is entered to its answer, so it holds
        # the engine's own time for the call (an embedded adapter runs part of a call on the
        # caller's thread: a timer started after the method returned went negative here).
        assert parts["stage_call_beyond_engine"] >= -1e-6, parts
        assert parts["install_call_beyond_engine"] >= -1e-6, parts
        assert c["controller_overhead_ms"] > 0
        assert parts["journal_commits"] >= 3 and parts["journal_records"] >= parts["journal_commits"]
        assert {"pause", "install", "resume", "stage"} <= set(c["calls_ms"])
    assert cycle["served_label_after"] == cycles[-1]["version"]
    assert report["restart"]["ready_ms_median"] > 0


def test_publish_bench_alternates_reused_and_fresh_copies(tmp_path) -> None:
    """`rolloutcore bench publish --json` (python -m rolloutcore.publish_bench, the package found beside
    the binary or on PYTHONPATH): both publishers published every version, and
    the reusing one held the released version's buffers spare while the other freed them."""
    import sys

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(rolloutcore.__file__)))
    env = {**os.environ, "ROLLOUTCORE_BIN": _bin(), "RC_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([_bin(), "bench", "publish", "--gb", "0.02", "--tensors", "4",
                          "--cols", "256", "--versions", "4", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    model_bytes = report["model_bytes"]
    assert model_bytes == 4 * report["shape"][0] * 256 * 2 and report["shape"][1] == 256
    for mode in ("reuse", "fresh"):
        rows = report["per_version"][mode]
        assert len(rows) == 4
        assert all(r["bytes"] == model_bytes and r["copy_ms"] > 0 and r["publish_ms"] > 0 for r in rows)
        assert report["median"][mode]["copy_gb_per_s"] > 0
    # From the second version on, each publish released the one before it (--keep 1).
    assert [r["spare_after_release"] for r in report["per_version"]["reuse"]] == [0] + [model_bytes] * 3
    assert [r["spare_after_release"] for r in report["per_version"]["fresh"]] == [0] * 4
    assert report["copy_reuse_over_fresh"] > 0

    bad = subprocess.run([_bin(), "bench", "publish", "--versions", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert bad.returncode == 2 and "--versions must be at least 3, got 2" in bad.stderr
