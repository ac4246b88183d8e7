"""The `rolloutcore` command line refuses what it cannot use at parse time, naming it: unknown
commands (with the commands there are), numbers out of range (NaN included), URLs without a scheme.
Nothing is started for any of these."""

from __future__ import annotations

import os
import subprocess

import pytest

import rolloutcore


def run(*args: str) -> subprocess.CompletedProcess:
    binary = os.environ.get("ROLLOUTCORE_BIN") or rolloutcore.find_binary()
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("args, says", [
    (["nosuch"], "unknown command 'nosuch' for `rolloutcore`; its commands are: simulate, plan"),
    (["bench", "refti"], "unknown command 'refti' for `rolloutcore bench`; its commands are: engine, refit, cycle"),
    (["directory", "lst"], "unknown command 'lst' for `rolloutcore directory`; its commands are: serve, list"),
])
def test_an_unknown_command_is_named_with_the_commands_there_are(args, says):
    out = run(*args)
    assert out.returncode != 0
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize("args, says", [
    (["engine", "serve", "--model", "tiny", "--load-format", "dummy", "--port", "70000"],
     "--port: Value 70000 not in range 0 to 65535"),
    (["engine", "serve", "--model", "tiny", "--load-format", "dummy", "--num-kv-blocks", "-1"],
     "--num-kv-blocks: Value -1 not in range"),
    (["controller", "serve", "--engine", "embedded", "--state-dir", "unused", "--lease-timeout", "nan"],
     "--lease-timeout: Value nan is not a finite number"),
    (["controller", "serve", "--engine", "embedded", "--state-dir", "unused", "--drain-deadline-ms", "0"],
     "--drain-deadline-ms: Value 0 not in range 1 to 86400000"),
    (["controller", "serve", "--engine", "embedded", "--state-dir", "unused", "--directory", "127.0.0.1:7470"],
     "--directory: '127.0.0.1:7470' is not the base URL of a service"),
    (["bench", "refit", "--repeats", "0"], "--repeats: Value 0 not in range 1 to 100000"),
    (["bench", "refit", "--delta", "--change-fractions", "0.01", "nan"], "--change-fractions: Value nan is not a finite"),
    (["demo", "--versions", "0"], "--versions: Value 0 not in range 1 to 10000"),
    (["plan", "--model", "tiny", "--source", "fsdp:2", "--target", "tp:2", "--budget", "-3"],
     "--budget: Value -3 not in range 0 to"),
    (["trainer", "export", "--model", "tiny", "--version", "v1", "--out", "unused", "--lr", "inf"],
     "--lr: Value inf is not a finite number"),
])
def test_out_of_range_flags_are_refused_before_anything_starts(tmp_path, args, says):
    out = run(*args)
    assert out.returncode != 0
    assert says in out.stderr, out.stderr
    assert not (tmp_path / "unused").exists() and not os.path.exists("unused")


def test_a_preset_runs_with_the_default_load_format_and_safetensors_names_the_folder(tmp_path):
    """`engine serve --model tiny` (README, engine.md: --load-format defaults to auto) serves the
    preset's seeded random weights; --load-format safetensors needs a folder and says so."""
    from pathlib import Path
    from rolloutcore.cluster import Server
    binary = os.environ.get("ROLLOUTCORE_BIN") or rolloutcore.find_binary()
    s = Server("engine", ["engine", "serve", "--model", "tiny", "--port", "0", "--threads", "1"],
               Path(tmp_path) / "engine.log", binary)
    try:
        url = s.wait_url(60)
        out = rolloutcore.EngineClient(url).completions(prompt=[1, 2, 3], max_tokens=2)
        assert len(out["choices"][0]["text"]) >= 1 or out["choices"][0]["finish_reason"] in ("length", "stop")
        assert "is a preset (no folder of that name): serving seeded random weights" in s.log_tail()
    finally:
        s.stop()
    refused = run("engine", "serve", "--model", "tiny", "--load-format", "safetensors", "--port", "0")
    assert refused.returncode != 0
    assert "--load-format safetensors needs a model folder" in refused.stderr + refused.stdout


def test_change_fractions_take_a_comma_list_as_the_docs_write_it():
    """performance.md and refit.md write `--change-fractions 0.01,0.1`; a bad element is named."""
    out = run("bench", "refit", "--delta", "--change-fractions", "0.01,nan")
    assert out.returncode != 0 and "--change-fractions: Value nan is not a finite" in out.stderr, out.stderr
    out = run("bench", "refit", "--delta", "--model", "tiny", "--change-fractions", "0.01,0.1", "--json")
    assert out.returncode == 0, out.stderr
    import json
    assert [r["change_fraction"] for r in json.loads(out.stdout)["rows"]] == [0.01, 0.1]
