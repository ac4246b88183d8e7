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
