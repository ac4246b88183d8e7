"""Typed wrappers over the compiled core: planner statistics, model tensors, digests.

The extension ``rolloutcore._core`` is imported by ``core()``; when it is missing (not built for
this interpreter) the error says so and how to get it.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np


def core() -> ModuleType:
    """The compiled extension; ImportError with instructions when it is not available."""
    try:
        from . import _core  # type: ignore[attr-defined]
    except ImportError as e:
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise ImportError(
            f"rolloutcore's compiled core (rolloutcore._core) is not available for Python {v}: {e}. "
            "Install a wheel built for this interpreter (pip install . with pybind11, or the wheel from "
            "scripts/python-wheel.sh), or build with cmake -DROLLOUTCORE_WITH_PYTHON=ON and put "
            "<build>/python on PYTHONPATH. DirectoryClient, ControllerClient, EngineClient and LocalCluster "
            "work without it (docs/python.md)."
        ) from e
    return _core


def core_available() -> bool:
    """True when the compiled core imports."""
    try:
        core()
        return True
    except ImportError:
        return False


def plan(
    model: str,
    source: str,
    target: str,
    *,
    rank: Optional[int] = None,
    budget: int = 64,
    layers: Optional[Tuple[int, int]] = None,
    experts: Sequence[int] = (),
    only: Optional[str] = None,
) -> Dict[str, Any]:
    """Plans a refit like ``rolloutcore plan --json`` and returns its statistics.

    ``model``: a preset (tiny, qwen3-0.6b, ...) or a config.json / model folder; ``source``: the
    trainer layout (fsdp:N, tp:N, replicated[:N]); ``target``: the engine layout (tp:N, ep:M,
    tp:N+ep:M, optional @dtype). Returns ``{model, architecture, parameters, source, target,
    coverage: "ok", ranks: [{rank, copies, selected_copies, bytes_needed, bytes_planned,
    descriptors, full_pulls, full_pull_bytes, converted_copies, staging_bytes, source_shards,
    dest_bytes, dest_bytes_selected, plan_ms, capture_ms}], totals: {...}}``. A plan the planner
    refuses (coverage, geometry) raises InvalidArgumentError / FailedPreconditionError naming the
    tensor.
    """
    return core().plan(model, source, target, rank=rank, budget=budget, layers=layers, experts=list(experts), only=only)


def model_tensors(model: str) -> List[Dict[str, Any]]:
    """The model's Hugging Face tensors in a fixed order: ``[{name, dtype, shape}]``."""
    return core().model_tensors(model)


def trainer_shards(model: str, layout: str) -> List[Dict[str, Any]]:
    """The shards a trainer in ``layout`` (fsdp:N, tp:N, replicated[:N]) owns:
    ``[{name, dtype, global_shape, rank, offset, shape}]``."""
    return core().trainer_shards(model, layout)


def tensor_digest(
    array: Any,
    *,
    global_shape: Optional[Sequence[int]] = None,
    offset: Optional[Sequence[int]] = None,
    dtype: Any = None,
) -> str:
    """The content digest (16 hex digits) of ``array`` as the box at ``offset`` of a tensor of
    ``global_shape`` (default: the whole tensor). Summing the shard digests of a tensor modulo
    2**64 gives the tensor's digest, whatever the sharding."""
    return core().tensor_digest(
        array,
        global_shape=None if global_shape is None else list(global_shape),
        offset=None if offset is None else list(offset),
        dtype=dtype,
    )


def combine_digests(digests: Mapping[str, Union[str, int]]) -> str:
    """The combined content digest of a version from its per-tensor digests (name -> hex or int)."""
    return core().combine_digests(dict(digests))


def fp8_parameter_of(tensor: str) -> Optional[Tuple[str, str]]:
    """(vLLM's fused FP8 parameter, part) of a checkpoint tensor ("...k_proj.weight" ->
    ("...qkv_proj.weight", "k")); None for a tensor served in bf16 (docs/fp8.md)."""
    return core().fp8_parameter_of(tensor)


def transports() -> List[str]:
    """Names of the transports built into the core (local, shm, and ucx when built)."""
    return [t["name"] for t in core().transports()]


def changed_elements(old: Any, new: Any) -> Tuple[Any, Any]:
    """The change mask of a delta refit (docs/refit.md "Delta refit"), computed where the tensor
    lives: ``(offsets, values)`` with the row-major flat offsets (int64, increasing) of the
    elements whose *bits* differ between ``old`` and ``new`` and their new values (same dtype).

    numpy arrays compare on the host; torch tensors compare on their own device (a CUDA tensor's
    mask, nonzero and gather run on the GPU, and only the changed elements come back: no host copy
    of the shard); a DTensor compares its local shard (``to_local()``), so offsets are local to
    this rank's shard, as the Publisher's deltas are. Bits, not values: -0.0 vs +0.0 and NaN
    payloads count as changes, as the digest sees them. ValueError when shapes or dtypes differ.
    """
    if hasattr(old, "to_local") and hasattr(new, "to_local"):
        old, new = old.to_local(), new.to_local()
    if tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
        raise ValueError(f"change mask: old {tuple(old.shape)} {old.dtype} vs new {tuple(new.shape)} {new.dtype}")
    if isinstance(old, np.ndarray):
        width = old.dtype.itemsize
        view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
        a = np.ascontiguousarray(old).reshape(-1).view(view)
        b = np.ascontiguousarray(new).reshape(-1).view(view)
        offsets = np.flatnonzero(a != b).astype(np.int64)
        return offsets, np.ascontiguousarray(new).reshape(-1)[offsets]
    import torch  # a torch tensor: compare bit patterns on its device

    width = old.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    a = old.contiguous().reshape(-1).view(view)
    b = new.contiguous().reshape(-1).view(view)
    offsets = torch.nonzero(a != b, as_tuple=False).reshape(-1)
    return offsets, new.contiguous().reshape(-1)[offsets]
