"""Publishing PyTorch parameters: plain tensors, DTensor and FSDP2 (fully_shard) parameters.

Imported only on demand (``import rolloutcore.torch_utils``), so numpy users never need torch.

For a DTensor each rank publishes its local shard at the global offset its placements give:
``Shard(d)`` on mesh dimension m splits tensor dim ``d`` into ``mesh.size(m)`` torch.chunk pieces
(``ceil(size / n)`` rows each, the last ones short or empty) and this rank holds piece
``mesh coordinate[m]``; ``Replicate()`` keeps the whole extent (replicas publish identical boxes,
which the directory accepts when their digests agree); ``Partial`` cannot be published (reduce it
first). Placements apply in mesh-dimension order, as DTensor does. When torch's own
``compute_local_shape_and_global_offset`` is importable it is used (it also knows FSDP2+TP's
``_StridedShard``), and ``shard_geometry`` below is the fallback and the cross-check.

The shm transport needs shared memory, and trainer parameters usually live on the GPU or in
f32, so by default each local shard is copied once into a shared bf16 buffer
(``Publisher.add_shard(copy=True)``): one device-to-host copy and conversion per version. With
``transport="ucx"``, CPU parameters that already have the published dtype are registered in place
(zero copy); they must then not change until the version is released.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .errors import InvalidArgumentError
from .publisher import Publisher, refit_dtype_name

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
    except ImportError:
        DTensor = None  # type: ignore[assignment,misc]
        Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def shard_geometry(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> Tuple[List[int], List[int]]:
    """(global offset, local shape) of the shard at ``coordinate`` of a mesh of ``mesh_shape``.

    Pure arithmetic over placements (``Shard(dim)`` / ``Replicate()``), usable without a process
    group. ValueError for other placements (Partial, _StridedShard).
    """
    offset = [0] * len(global_shape)
    local = [int(s) for s in global_shape]
    for mesh_dim, p in enumerate(placements):
        if Replicate is not None and isinstance(p, Replicate):
            continue
        if Shard is not None and type(p) is Shard:
            d = p.dim if p.dim >= 0 else p.dim + len(global_shape)
            n = int(mesh_shape[mesh_dim])
            size = local[d]
            chunk = (size + n - 1) // n if size > 0 else 0
            start = min(chunk * int(coordinate[mesh_dim]), size)
            length = max(0, min(chunk, size - start))
            offset[d] += start
            local[d] = length
            continue
        raise InvalidArgumentError(
            f"placement {p} on mesh dim {mesh_dim} cannot be published: only Shard(dim) and Replicate() "
            "have a box in the global tensor (reduce Partial placements first)"
        )
    return offset, local


def dtensor_geometry(t: Any) -> Tuple[List[int], List[int], List[int]]:
    """(global offset, local shape, global shape) of this rank's shard of DTensor ``t``."""
    global_shape = [int(s) for s in t.shape]
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return [0] * len(global_shape), [0] * len(global_shape), global_shape  # not in the mesh: owns nothing
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # type: ignore

        local, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        return [int(o) for o in offset], [int(s) for s in local], global_shape
    except (ImportError, TypeError):  # a private API: absent, or its signature changed
        offset, local = shard_geometry(global_shape, list(mesh.shape), coordinate, t.placements)
        return offset, local, global_shape


def _replica_owner(t: Any) -> bool:
    """True when this rank has coordinate 0 on every mesh dim where ``t`` is replicated."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, t.placements) if Replicate is not None and isinstance(p, Replicate))


def add_tensors(
    publisher: Publisher,
    version: str,
    named_tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]],
    *,
    dtype: Any = "bf16",
    copy: Optional[bool] = None,
    replicas: str = "all",
    name_map: Optional[Any] = None,
) -> List[Dict[str, Any]]:
    """Stages this rank's part of every tensor for ``version``; returns what was staged.

    ``named_tensors``: ``model.named_parameters()``, a state dict, or any (name, tensor) pairs;
    DTensors (FSDP2 / tensor-parallel parameters) publish their local shard at its global offset,
    plain tensors publish whole. ``dtype``: the published dtype (refit or torch name).
    ``copy``: None (default) copies when needed (CUDA, another dtype, non-contiguous, or the shm
    transport); False refuses instead. ``replicas``: ``"all"`` (every replica publishes its box)
    or ``"first"`` (only coordinate 0 of replicated mesh dims). ``name_map``: optional
    ``callable(name) -> name or None`` (None skips the tensor), e.g. to strip FSDP prefixes.
    """
    if replicas not in ("all", "first"):
        raise InvalidArgumentError(f"replicas must be 'all' or 'first', got {replicas!r}")
    target = refit_dtype_name(dtype)
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    # A tensor refused half-way leaves nothing behind that this call staged: a version this call
    # began is dropped again (a retry would otherwise find the good tensors "already staged").
    began = version not in publisher.versions()
    try:
        return _add_each(publisher, version, items, target, copy, replicas, name_map)
    except BaseException:
        if began and version in publisher.versions():
            publisher.release(version, in_directory=False)
        raise


def _add_each(publisher: Publisher, version: str, items: Iterable[Tuple[str, Any]], target: str,
              copy: Optional[bool], replicas: str, name_map: Optional[Any]) -> List[Dict[str, Any]]:
    staged: List[Dict[str, Any]] = []
    for name, t in items:
        if name_map is not None:
            name = name_map(name)
            if name is None:
                continue
        if isinstance(t, torch.nn.Parameter):
            t = t.data
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"tensor {name}: expected a torch.Tensor, got {type(t).__name__} (publish numpy arrays with "
                "Publisher.add_shard)"
            )
        t = t.detach()
        if is_dtensor(t):
            if replicas == "first" and not _replica_owner(t):
                continue
            offset, local_shape, global_shape = dtensor_geometry(t)
            local = t.to_local()
            if list(local.shape) != local_shape:
                raise InvalidArgumentError(
                    f"tensor {name}: the local shard has shape {list(local.shape)} but its placements "
                    f"{t.placements} give {local_shape}"
                )
        else:
            offset, global_shape, local = [0] * t.dim(), list(t.shape), t
            local_shape = global_shape
        if any(s == 0 for s in local_shape) and len(local_shape) > 0:
            continue  # this rank holds no rows of it
        needs_copy = (
            local.device.type != "cpu"
            or refit_dtype_name(local.dtype) != target
            or not local.is_contiguous()
            or publisher.transport == "shm"
        )
        if needs_copy and copy is False:
            raise InvalidArgumentError(
                f"tensor {name}: publishing it needs a copy ({local.device}, {local.dtype}, "
                f"contiguous={local.is_contiguous()}, transport {publisher.transport}) and copy=False"
            )
        publisher.add_shard(version, name, local, offset=offset, global_shape=global_shape, dtype=target,
                            copy=needs_copy)
        staged.append({"name": name, "offset": offset, "shape": local_shape, "global_shape": global_shape,
                       "copied": needs_copy})
    return staged


def publish(
    publisher: Publisher,
    version: str,
    named_tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]],
    **kwargs: Any,
) -> Dict[str, Any]:
    """``add_tensors`` then ``publish`` (``publish_empty`` when this rank owns nothing)."""
    staged = add_tensors(publisher, version, named_tensors, **kwargs)
    report = publisher.publish(version) if staged else publisher.publish_empty(version)
    report["staged"] = staged
    return report


def publish_module(publisher: Publisher, version: str, module: torch.nn.Module, **kwargs: Any) -> Dict[str, Any]:
    """Publishes ``module.named_parameters()`` (FSDP2-sharded or not) under their HF names.

    Buffers are not weights and are not published. Tied parameters appear once
    (named_parameters removes duplicates).
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(
            f"publish_module: expected a torch.nn.Module, got {type(module).__name__} (a state dict goes to publish)"
        )
    return publish(publisher, version, module.named_parameters(), **kwargs)


__all__ = ["add_tensors", "publish", "publish_module", "dtensor_geometry", "shard_geometry", "is_dtensor"]
