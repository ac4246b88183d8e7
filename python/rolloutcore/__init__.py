"""rolloutcore: safe, fast weight updates ("refit") for RL rollouts, from Python.

Pure Python (no compiled code needed, any Python 3.8+):
    DirectoryClient   read the version directory (list / get manifests / wait / release)
    ControllerClient  rollouts bound to versions, updates, status, journal, trajectories
    EngineClient      the engine's evidence endpoints (live weights digest, state, stage/install)
    LocalCluster      start directory / engine / controller child processes on loopback
    errors            the exception classes (one per status code)

Compiled core (``rolloutcore._core``, imported on first use):
    Publisher         publish a trainer rank's shards zero-copy (DLPack / buffer protocol)
    allocate          numpy arrays over shared memory, for the ``shm`` transport
    plan              refit planner statistics for (model, trainer layout, engine layout)
    model_tensors, trainer_shards, tensor_digest, combine_digests, transports

Torch helpers live in ``rolloutcore.torch_utils`` (imported only when asked for). See
docs/python.md.
"""

from __future__ import annotations

from typing import Any

from . import errors
from .cluster import LocalCluster, find_binary
from .controller import ControllerClient
from .directory import DirectoryClient
from .engine import EngineClient
from .errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RolloutcoreError,
    UnauthenticatedError,
    UnavailableError,
)

__version__ = "0.1.0"

_LAZY = {
    "Publisher": ".publisher",
    "allocate": ".publisher",
    "plan": ".refit",
    "model_tensors": ".refit",
    "trainer_shards": ".refit",
    "tensor_digest": ".refit",
    "combine_digests": ".refit",
    "transports": ".refit",
    "core_available": ".refit",
}

__all__ = [
    "ControllerClient",
    "DirectoryClient",
    "EngineClient",
    "LocalCluster",
    "find_binary",
    "errors",
    "RolloutcoreError",
    "InvalidArgumentError",
    "NotFoundError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "FailedPreconditionError",
    "UnavailableError",
    "DeadlineExceededError",
    "DataLossError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    # The compiled core is loaded on first use, so the HTTP clients work without it.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'rolloutcore' has no attribute {name!r}")
