"""EngineClient against the real embedded engine of the session's cluster: one series of
/metrics by name (the engine labels every series with its model_name), and errors in vLLM's
shape raised with their message; and find_binary from a build tree's package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rolloutcore
from rolloutcore.errors import InvalidArgumentError


def test_metrics_by_name_sums_the_labelled_samples_and_filters_by_label(cluster) -> None:
    e = rolloutcore.EngineClient(cluster.engine_url)
    before = e.metrics("vllm:generation_tokens_total")
    assert before is not None  # labelled {model_name="tiny"}: found by its name
    e.completions(prompt=[1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)
    assert e.metrics("vllm:generation_tokens_total") == before + 3
    lengths = e.metrics('vllm:request_success_total{finished_reason="length"}')
    total = e.metrics("vllm:request_success_total")
    assert lengths is not None and lengths >= 1 and total >= lengths
    assert e.metrics('vllm:request_success_total{finished_reason="nonesuch"}') is None
    assert e.metrics("no_such_metric") is None


def test_an_engine_error_is_raised_with_its_message(cluster) -> None:
    e = rolloutcore.EngineClient(cluster.engine_url)
    with pytest.raises(InvalidArgumentError, match=r": prompt\[1\]\[0\]: token id 999999 is outside the vocabulary"):
        e.completions(prompt=[[1, 2], [999999]], max_tokens=2)


def test_find_binary_from_a_build_trees_package() -> None:
    """PYTHONPATH=build/X/python (python.md): the package finds build/X/src/apps/rolloutcore."""
    binary = Path(rolloutcore.find_binary()).resolve()
    tree = binary.parent.parent.parent  # build/X
    package = tree / "python"
    if not (package / "rolloutcore" / "cluster.py").is_file():
        pytest.skip(f"{binary} is not in a build tree with a python/ package")
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTCORE_BIN"}
    env["PYTHONPATH"] = str(package)
    env["PATH"] = "/usr/bin:/bin"
    out = subprocess.run([sys.executable, "-c", "import rolloutcore; print(rolloutcore.find_binary())"],
                         env=env, capture_output=True, text=True, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == binary
