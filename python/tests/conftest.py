"""Fixtures: a real directory + engine + controller on loopback (rolloutcore binary children).

The binary comes from $ROLLOUTCORE_BIN (CTest sets it) or rolloutcore.find_binary(). The package
comes from PYTHONPATH (CTest points it at <build>/python) or an installed wheel.
"""

from __future__ import annotations

import itertools
import os
from typing import Dict, Iterator

import numpy as np
import pytest

import rolloutcore
from rolloutcore.publisher import _bf16_bits

MODEL = "tiny"


# Every server of the session requires this key for mutating requests, and every client (the
# pure-Python ones and the compiled Publisher's directory client) sends it from the environment.
API_KEY = "rc-pytest-key"


@pytest.fixture(scope="session")
def cluster() -> Iterator[rolloutcore.LocalCluster]:
    os.environ["ROLLOUTCORE_API_KEY"] = API_KEY
    with rolloutcore.LocalCluster(model=MODEL, engine_model="tiny", engine_threads=2) as c:
        yield c


_versions = itertools.count(1)


@pytest.fixture
def version() -> str:
    """A fresh version label for each test (labels cannot be published twice)."""
    return f"v{next(_versions)}"


def tiny_weights(seed: int) -> Dict[str, np.ndarray]:
    """Random bf16 weights (as uint16 bits) for every tensor of the tiny preset, norms near 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in rolloutcore.model_tensors(MODEL):
        values = rng.standard_normal(t["shape"], dtype=np.float32) * 0.02
        if t["name"].endswith("norm.weight"):
            values += 1.0
        out[t["name"]] = _bf16_bits(values)
    return out


def shared_copy(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The weights in Publisher.allocate()d shared memory (what the shm transport needs)."""
    out = {}
    for name, bits in weights.items():
        buf = rolloutcore.Publisher.allocate(bits.shape, "bf16")
        buf[...] = bits
        out[name] = buf
    return out


def expected_digest(weights: Dict[str, np.ndarray]) -> str:
    return rolloutcore.combine_digests({n: rolloutcore.tensor_digest(a, dtype="bf16") for n, a in weights.items()})
