"""Publisher: one trainer rank publishes the shards it owns, zero-copy.

The C++ ``rc::trainer::Publisher`` (docs/trainer.md) registers each shard's memory with a
transport, digests it and publishes the rank's shard table to the directory; the directory
commits a version once every rank has published. Engines then pull the bytes they need straight
out of this process's memory. This wrapper adds typed signatures, ``copy=True`` and whole-dict
publishing.

Zero-copy rules (docs/python.md):

* ``add_shard`` takes the caller's memory through DLPack (``__dlpack__``: numpy >= 1.22, torch
  CPU tensors) or the buffer protocol and copies nothing. The array is kept alive, and must stay
  unchanged, until ``release(version)``: engines read it at any time after ``publish``.
* Transport ``shm`` (default; same host) can only register shared memory: allocate shard memory
  with ``Publisher.allocate(shape, dtype)`` and write the weights into it. Other memory is refused
  with InvalidArgumentError at ``add_shard``.
* Transport ``ucx`` (when built) registers any host memory: plain numpy arrays and torch CPU
  tensors are published in place.
* ``copy=True`` is the explicit copy: the array (any device, dtype convertible, any strides) is
  copied once into a shared allocation, which is then published zero-copy. The allocations of a
  released version are reused by the next version's copies of the same shape and dtype
  (``reuse_copies``): a fresh allocation's pages are faulted in by the copy, one at a time, which
  bounded it at about 1--2 GB/s.
* CUDA tensors are refused (this build has no CUDA transport) unless ``copy=True``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import FailedPreconditionError, InvalidArgumentError
from .refit import core

_log = logging.getLogger("rolloutcore.publisher")

DTypeLike = Any  # a refit name ("bf16", "f32"), a numpy dtype, or a torch dtype
_CopyKey = Tuple[Tuple[int, ...], str]  # a copy=True buffer's (shape, refit dtype)

_TORCH_TO_REFIT = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float8_e4m3fn": "f8_e4m3",
    "float8_e5m2": "f8_e5m2",
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "int64": "i64",
}


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def refit_dtype_name(dtype: DTypeLike) -> str:
    """The refit name (f32, bf16, ...) of a refit name, numpy dtype or torch dtype."""
    if isinstance(dtype, str):
        return _TORCH_TO_REFIT.get(dtype, dtype)
    text = str(dtype)
    if text.startswith("torch."):
        name = text[len("torch.") :]
        if name in _TORCH_TO_REFIT:
            return _TORCH_TO_REFIT[name]
        raise InvalidArgumentError(f"torch dtype {text} has no refit dtype (refit: {', '.join(sorted(set(_TORCH_TO_REFIT.values())))})")
    import numpy as np

    return _TORCH_TO_REFIT.get(np.dtype(dtype).name, np.dtype(dtype).name)


def allocate(shape: Sequence[int], dtype: DTypeLike) -> Any:
    """A zero-filled numpy array over new shared memory (memfd), registrable by the shm transport.

    bf16 allocations are ``uint16`` arrays holding the bf16 bits (numpy has no bfloat16), f8 ones
    ``uint8``; view them as torch tensors without a copy with
    ``torch.from_numpy(a).view(torch.bfloat16)``. The memory lives as long as any array or tensor
    viewing it (and as long as a Publisher holds a shard inside it).
    """
    return core().allocate([int(d) for d in shape], dtype)


def _bf16_bits(values: Any, out: Any = None) -> Any:
    """float32 numpy values -> bf16 bits (round to nearest even, NaN kept quiet), as uint16; into
    ``out`` (a C-contiguous uint16 array of the same shape) when given. Converted a chunk at a time
    in 32-bit arithmetic (no carry can leave 32 bits but a NaN's, and NaNs are replaced): no
    temporary the size of the array, about 14x the whole-array uint64 arithmetic it replaced."""
    import numpy as np

    f = np.ascontiguousarray(values, dtype=np.float32)
    if out is None:
        out = np.empty(f.shape, np.uint16)
    elif out.dtype != np.uint16 or out.shape != f.shape or not out.flags.c_contiguous:
        raise InvalidArgumentError(f"bf16 conversion: out must be a C-contiguous uint16 array of shape {f.shape}, "
                                   f"got {out.dtype} {out.shape}")
    flat, bits, dst = f.reshape(-1), f.reshape(-1).view(np.uint32), out.reshape(-1)
    chunk = 1 << 18
    t = np.empty(min(chunk, bits.size), np.uint32)
    for lo in range(0, bits.size, chunk):
        b = bits[lo:lo + chunk]
        r = t[: b.size]
        np.right_shift(b, 16, out=r)
        np.bitwise_and(r, 1, out=r)
        r += 0x7FFF
        r += b
        np.right_shift(r, 16, out=r)
        d = dst[lo:lo + chunk]
        d[...] = r
        nan = np.isnan(flat[lo:lo + chunk])
        if nan.any():
            d[nan] = 0x7FC0
    return out


def _shapes(model: Optional[Mapping[str, Sequence[int]]]) -> Optional[Dict[str, List[int]]]:
    return None if model is None else {str(k): [int(x) for x in v] for k, v in model.items()}


def torch_amax_exchange(group: Any = None) -> Any:
    """An ``fp8_exchange`` for :meth:`Publisher.publish` over a ``torch.distributed`` process group:
    every rank's amaxes are gathered (``all_gather_object``; a few MB for an 8B model) and merged by
    elementwise max, so ranks may hold different parameters. Every rank of the group must publish
    the version together (the gather is a collective), and with the NCCL backend each rank's CUDA
    device must be set (``torch.cuda.set_device``), as object collectives require."""
    import numpy as np
    import torch.distributed as dist

    def exchange(quantization: str, amax: Mapping[str, Any]) -> Dict[str, Any]:
        gathered: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, {k: np.asarray(v) for k, v in amax.items()}, group=group)
        merged: Dict[str, Any] = {}
        for part in gathered:
            for k, v in part.items():
                merged[k] = v if k not in merged else np.maximum(merged[k], v)
        return merged

    return exchange


class Publisher:
    """One trainer rank's publisher for one model in one directory.

    ``Publisher(directory_url, model, rank=r, world_size=n, transport="shm")``. Each rank of an
    n-rank trainer makes its own (usually in its own process). The version commits when all n
    ranks published it. A lease (``lease_ttl_ms``) is renewed in the background while the
    Publisher lives; a crashed trainer's STAGING versions become ABANDONED after one TTL.

    ``reuse_copies`` (default True): the shared buffers ``add_shard(copy=True)`` copied a version
    into are reused by the next versions' copies of the same shape and dtype once it is released
    (no fresh pages to fault in: docs/python.md, "The copies reuse the memory of released
    versions"); :meth:`copy_buffers` says what is held.

    Thread safety: methods may be called from several threads; ``publish`` releases the GIL.
    """

    def __init__(
        self,
        directory: str,
        model: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        transport: str = "shm",
        lease_ttl_ms: int = 30_000,
        keepalive_interval_ms: int = 0,
        delta: bool = False,
        reuse_copies: bool = True,
    ) -> None:
        # reuse_copies=True: the shared buffers ``add_shard(copy=True)`` made for a version are kept
        # when it is released and reused by later copies of the same shape and dtype (every byte is
        # overwritten); the ones no copy took are freed at the next successful publish and at close.
        # False frees them at release.
        # delta=True: keep one copy of every shard as last published (memory: one copy of each
        # shard, where it lives: host shards on the host in the C++ Publisher, CUDA shards on their
        # device here) so that ``publish(version, delta=True)`` can send sparse deltas against it.
        for arg, flag in (("delta", delta), ("reuse_copies", reuse_copies)):
            if not isinstance(flag, bool):
                raise InvalidArgumentError(f"Publisher: {arg} must be True or False, got {flag!r}")
        for arg, value, top in (("rank", rank, 2**31), ("world_size", world_size, 2**31),
                                ("lease_ttl_ms", lease_ttl_ms, 2**63), ("keepalive_interval_ms", keepalive_interval_ms, 2**63)):
            if isinstance(value, bool) or not isinstance(value, int) or not -top <= value < top:
                raise InvalidArgumentError(f"Publisher: {arg} must be an integer below {top}, got {value!r}")
        if not isinstance(transport, str):
            raise InvalidArgumentError(f"Publisher: transport must be a name (shm, ucx, local...), got {transport!r}")
        self._delta = delta
        # (name, offset) -> the CUDA tensor as last published (delta publishing of device shards).
        self._previous_device: Dict[Any, Any] = {}
        self._impl = core().Publisher(
            directory, model, rank, world_size, transport, lease_ttl_ms, keepalive_interval_ms, self._delta
        )
        # version -> [(name, global_shape, offset, array)] of the bf16 shards staged, for FP8 parts.
        self._staged: Dict[str, List[Any]] = {}
        # close() was called: nothing more is staged or published through this Publisher.
        self._closed = False
        # The copy=True buffers, each with its key (shape, refit dtype): version -> those its shards
        # live in; key -> the spare ones of released versions, for the next copies to reuse.
        self._reuse_copies = reuse_copies
        self._copy_lock = threading.Lock()
        self._copies: Dict[str, List[Tuple[_CopyKey, Any]]] = {}
        self._spare: Dict[_CopyKey, List[Any]] = {}
        self._copies_reused = 0  # copies that went into a spare buffer, since the Publisher was made
        self._copies_allocated = 0  # copies that needed a new allocation

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise FailedPreconditionError(
                f"Publisher.{what}: this Publisher (model {self.model!r}, rank {self.rank}) is closed; "
                "its versions were released. Make a new Publisher to publish again")

    allocate = staticmethod(allocate)

    @property
    def model(self) -> str:
        return self._impl.model

    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def world_size(self) -> int:
        return self._impl.world_size

    @property
    def transport(self) -> str:
        return self._impl.transport

    def add_shard(
        self,
        version: str,
        name: str,
        array: Any,
        *,
        offset: Optional[Sequence[int]] = None,
        global_shape: Optional[Sequence[int]] = None,
        dtype: Optional[DTypeLike] = None,
        copy: bool = False,
    ) -> None:
        """Stages the box ``[offset, offset + array.shape)`` of tensor ``name`` for ``version``.

        ``offset`` defaults to zeros and ``global_shape`` to ``array.shape`` (a whole tensor).
        ``dtype`` reinterprets raw bits of the same width (a uint16 array as ``"bf16"``); with
        ``copy=True`` it converts instead. Geometry is checked at once (box inside the tensor, no
        overlap with this rank's other shards of it, same dtype and global shape as earlier
        shards): InvalidArgumentError naming the tensor, rank and version. The bytes are read
        (digested) at :meth:`publish`, not here; a CUDA tensor's digest runs on its GPU, one launch
        for every CUDA shard of the version.
        """
        self._check_open("add_shard")
        buf: Optional[Tuple[_CopyKey, Any]] = None
        if copy:
            array, dtype, buf = self._copy_to_shared(array, dtype)
        try:
            self._impl.add_shard(
                version,
                name,
                array,
                offset=None if offset is None else [int(x) for x in offset],
                global_shape=None if global_shape is None else [int(x) for x in global_shape],
                dtype=None if dtype is None else refit_dtype_name(dtype),
            )
        except BaseException:
            if buf is not None:
                self._give_back([buf])  # not staged: nothing reads it
            raise
        if buf is not None:
            with self._copy_lock:
                self._copies.setdefault(version, []).append(buf)
        shape = [int(x) for x in array.shape]
        self._staged.setdefault(version, []).append((
            name, [int(x) for x in global_shape] if global_shape is not None else shape,
            [int(x) for x in offset] if offset is not None else [0] * len(shape), array,
            refit_dtype_name(dtype) if dtype is not None else None))

    def add_tensors(
        self, version: str, tensors: Mapping[str, Any], *, dtype: Optional[DTypeLike] = None, copy: bool = False
    ) -> None:
        """Stages whole tensors (offset zero, global shape = the array's shape), name -> array."""
        for name, array in tensors.items():
            self.add_shard(version, name, array, dtype=dtype, copy=copy)

    # ---- FP8 expected images (docs/fp8.md, "The expected image, from the trainer") -------------

    def _fp8_shards(self, version: str) -> List[Any]:
        """[(name, global_shape, offset, bf16 bits as a host uint16 array)] of the projections
        staged for ``version`` (device tensors are copied to the host: the parts are computed by the
        CPU quantizer, the bits of formats/fp8.h)."""
        import numpy as np

        from .refit import fp8_parameter_of

        out = []
        for name, global_shape, offset, array, dtype in self._staged.get(version, []):
            if fp8_parameter_of(name) is None:
                continue
            if _is_torch(array):
                import torch

                t = array.detach()
                if t.dtype != torch.bfloat16:
                    raise InvalidArgumentError(f"FP8 parts of {name}: the tensor is {t.dtype}; FP8 is quantized from bfloat16")
                bits = t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
            else:
                a = np.asarray(array)
                if a.dtype != np.uint16 or (dtype not in (None, "bf16")):
                    raise InvalidArgumentError(f"FP8 parts of {name}: the array is {a.dtype} ({dtype}); FP8 is quantized from "
                                     "bf16 bits (uint16)")
                bits = np.ascontiguousarray(a)
            out.append((name, global_shape, offset, bits))
        return out

    def fp8_amax(self, version: str, quantization: str, model: Optional[Mapping[str, Sequence[int]]] = None) -> Any:
        """This rank's amax per scale group of every FP8 parameter its staged projections touch:
        ``({parameter: uint16 array}, partial)``, ``partial`` naming the first group this rank holds
        only part of ("" when none). Merge the dicts of every rank by elementwise max (what
        :func:`torch_amax_exchange` does over a process group) and pass the result to
        :meth:`attach_fp8`. ``model`` ({name: global shape} of the model's bf16 tensors) is needed
        when this rank holds no shard of some part of a fused parameter (fsdp over more ranks than a
        k_proj has rows)."""
        return core().fp8_local_amax(self._fp8_shards(version), quantization, model=_shapes(model))

    def attach_fp8(self, version: str, quantization: str, merged: Mapping[str, Any],
                   model: Optional[Mapping[str, Sequence[int]]] = None) -> int:
        """Computes and attaches every staged projection's part of the ``quantization`` image from
        the amaxes merged over the trainer's ranks; returns the number of parts attached."""
        self._check_open("attach_fp8")
        return self._attach_fp8(version, self._fp8_shards(version), quantization, merged, model)

    def _attach_fp8(self, version: str, shards: List[Any], quantization: str, merged: Mapping[str, Any],
                    model: Optional[Mapping[str, Sequence[int]]]) -> int:
        parts = core().fp8_parts_from_amax(shards, quantization, dict(merged), model=_shapes(model))
        out = [(name, offset, quantization, p[0], p[1]) for (name, _, offset, _), p in zip(shards, parts) if p]
        self._impl.attach_fp8_parts(version, out)
        return len(out)

    def publish(self, version: str, delta: Optional[bool] = None, fp8: Optional[Sequence[str]] = None,
                fp8_exchange: Optional[Any] = None,
                fp8_model: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[str, Any]:
        """Registers, digests and publishes this rank's shards of ``version``.

        Returns ``{version, state, ranks_published, expected_ranks, commit_seq, content_digest,
        lease_id, shards, bytes, register_ms, digest_ms, publish_ms, tensor_digests}``; ``state``
        is ``COMMITTED`` when this publish completed the version (``content_digest`` is then the
        version's), else ``STAGING``. A refused publish leaves the version staged (retry or
        release). A publish whose answer was lost (the directory died, perhaps after committing)
        keeps its buffers and asks the directory for the outcome; if it cannot tell in time this
        raises ``UnavailableError`` ("outcome unknown") and the buffers stay registered: call
        ``publish`` again to ask again, or ``release``.

        ``delta=True`` (the default for a ``Publisher(..., delta=True)``) also publishes, per
        shard, the elements whose bits changed since this publisher's previous version when the
        directory reports that one COMMITTED (docs/refit.md "Delta refit"); the full shards stay
        published. The report then names ``delta_base``, ``delta_shards``, ``delta_changed`` and
        ``delta_bytes``. Deltas need the copy kept since the last publish: ValueError for a
        publisher made without ``delta=True``. For a shard in CUDA memory (``cuda_ipc``) the copy
        is a CUDA tensor kept here; the change mask runs on the GPU
        (:func:`rolloutcore.refit.changed_elements`), only the changed offsets and values come to the
        host to be encoded, and the payload is published from device memory.

        ``fp8=["fp8_per_block", ...]`` also publishes, with every shard of a projection, its part
        of the FP8 image an engine serving that quantization computes from this version (docs/fp8.md,
        "The expected image, from the trainer"); the controller then holds an FP8 engine's live
        image to the trainer's. A scale group split over ranks needs ``fp8_exchange(quantization,
        amax) -> merged`` (every rank calls it, so they publish together; see
        :func:`torch_amax_exchange`); without one such a group raises ValueError naming it.
        ``fp8_model`` ({name: global shape} of the model's tensors) is needed when this rank holds no
        shard of some part of a fused parameter.
        """
        self._check_open("publish")
        if delta is not None and bool(delta) != self._delta:
            raise InvalidArgumentError(
                f"publish(delta={bool(delta)}) on a Publisher made with delta={self._delta}: delta publishing keeps a "
                "copy of every shard from one publish to the next, so it is chosen when the Publisher is made"
            )
        if fp8:
            shards = self._fp8_shards(version)  # one host copy of the projections for every quantization
            for q in fp8:
                amax, partial = core().fp8_local_amax(shards, q, model=_shapes(fp8_model))
                if fp8_exchange is not None:
                    amax = fp8_exchange(q, amax)
                elif partial:
                    raise InvalidArgumentError(f"{partial}: its scale needs the amax of every rank that holds the rest; pass "
                                     "fp8_exchange (e.g. rolloutcore.publisher.torch_amax_exchange(group))")
                self._attach_fp8(version, shards, q, amax, fp8_model)
        if self._delta:
            self._attach_device_deltas(version)
        report = self._impl.publish(version)
        self._drop_spare()
        if self._delta:
            self._remember_device_shards(version)
        return report

    def _device_shards(self, version: str) -> List[Any]:
        """[(name, offset, tensor)] of the CUDA torch shards staged for ``version``."""
        out = []
        for name, _, offset, array, _ in self._staged.get(version, []):
            if _is_torch(array) and getattr(array, "is_cuda", False):
                out.append((name, tuple(offset), array))
        return out

    def _attach_device_deltas(self, version: str) -> None:
        """Encodes, for every CUDA shard also published last time, the elements whose bits changed
        since (on the GPU), and attaches the payload (device memory) to the shard. The C++ Publisher
        publishes it when that last version is committed and is its delta base, else publishes in
        full."""
        shards = self._device_shards(version)
        if not shards:
            return
        import numpy as np
        import torch  # CUDA shards are torch tensors

        from .refit import changed_elements

        for name, offset, t in shards:
            prev = self._previous_device.get((name, offset))
            if prev is None or tuple(prev.shape) != tuple(t.shape) or prev.dtype != t.dtype:
                continue
            offsets, values = changed_elements(prev, t)
            o = offsets.to(torch.int64).cpu().numpy()
            v = values.contiguous().view(torch.uint8).cpu().numpy() if values.numel() else np.zeros(0, np.uint8)
            payload, changed = core().encode_delta_from_changes(refit_dtype_name(t.dtype), list(t.shape), o, v)
            on_device = torch.from_numpy(payload).to(t.device)
            self._impl.attach_delta_payload(version, name, list(offset), on_device, int(changed))

    def _remember_device_shards(self, version: str) -> None:
        """Keeps a copy of every CUDA shard of ``version`` on its device: the next version's delta
        base."""
        shards = self._device_shards(version)
        if not shards:
            return
        self._previous_device = {(name, offset): t.detach().clone() for name, offset, t in shards}

    def attach_probes(self, version: str, probes: Sequence[Mapping[str, Any]]) -> None:
        """Attaches replay probes to ``version`` (rank 0 only), published with this rank's tables
        and stored with the version in the directory; the controller replays them on the engine
        before it resumes (docs/lifecycle.md, "Replay validation"). ``probes`` is what
        :func:`rolloutcore.probes.make_probes` returns. Bad bounds raise ``InvalidArgumentError``
        naming the field (``probes[1].steps[3].top[0].logprob``)."""
        import json

        self._check_open("attach_probes")
        self._impl.attach_probes(version, json.dumps(list(probes)))

    def publish_empty(self, version: str) -> Dict[str, Any]:
        """Publishes a rank that owns nothing of ``version`` (its publish still counts)."""
        self._check_open("publish_empty")
        report = self._impl.publish_empty(version)
        self._drop_spare()
        return report

    def release(self, version: str, in_directory: bool = True) -> None:
        """Deregisters the version's memory and drops the arrays; with ``in_directory`` also
        releases it in the directory first (so no engine discovers it afterwards); without, a
        published version is marked UNAVAILABLE there first (its handles are about to die)."""
        try:
            self._impl.release(version, in_directory)
        finally:
            # The memory is deregistered whenever the version is gone from this rank, even when the
            # directory call failed (the error says so): the arrays it held go with it.
            if version not in self._impl.versions():
                self._staged.pop(version, None)
                with self._copy_lock:
                    copies = self._copies.pop(version, [])
                self._give_back(copies)

    def shards(self, version: str) -> List[Dict[str, Any]]:
        """This rank's shards of ``version``: ``{name, dtype, global_shape, offset, shape,
        data_ptr, bytes, source, published, handle, digest}`` (``data_ptr`` is the registered
        address: the caller's own memory)."""
        return self._impl.shards(version)

    def versions(self) -> List[str]:
        return self._impl.versions()

    def is_published(self, version: str) -> bool:
        return self._impl.is_published(version)

    def close(self, release_in_directory: bool = True) -> None:
        """Releases every version this Publisher holds (in the directory too, by default: their
        memory is about to go away). Best effort: every version is released here even when the
        directory cannot be told (a directory that is down); the first such error is raised after
        all of them, naming how many failed. Afterwards the Publisher stages and publishes nothing
        (FailedPreconditionError); closing again releases what is left, if anything."""
        self._closed = True
        self._previous_device = {}
        errors: List[BaseException] = []
        for v in self.versions():
            try:
                self.release(v, release_in_directory)
            except Exception as e:  # noqa: BLE001 - keep releasing the others, raise below
                errors.append(e)
        self._drop_spare()
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.args = (f"{first.args[0] if first.args else first} ({len(errors)} versions could not be "
                              "released in the directory; all were released on this rank)",)
            raise first

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # The block raised: that exception goes on; a failure to release is only logged, not put
        # in its place.
        try:
            self.close()
        except Exception as e:  # noqa: BLE001
            _log.warning("Publisher.close after %s: %s", exc_type.__name__, e)

    # ---- the explicit copy ---------------------------------------------------------------

    def _copy_to_shared(self, array: Any, dtype: Optional[DTypeLike]) -> Tuple[Any, str, Tuple[_CopyKey, Any]]:
        """(the copy, its refit dtype, (key, the shared numpy buffer under it)): one copy of ``array``
        into shared memory, a spare buffer of a released version when one has this shape and
        dtype, else a new one."""
        import numpy as np

        torch_source = _is_torch(array)
        src = array.detach() if torch_source else np.asarray(array)
        name = refit_dtype_name(dtype if dtype is not None else src.dtype)
        key = (tuple(int(d) for d in src.shape), name)
        buf = self._shared_buffer(key)
        try:
            if torch_source:
                import torch

                dst = torch.from_numpy(buf)
                view = {"bf16": torch.bfloat16, "f8_e4m3": getattr(torch, "float8_e4m3fn", None),
                        "f8_e5m2": getattr(torch, "float8_e5m2", None)}.get(name)
                if view is not None:
                    dst = dst.view(view)
                dst.copy_(src)  # device -> host, dtype conversion and strides, in one copy
                return dst, name, (key, buf)
            if name == "bf16" and src.dtype != np.uint16:
                _bf16_bits(src, out=buf)
            else:
                np.copyto(buf, src, casting="same_kind")
            return buf, name, (key, buf)
        except BaseException:
            self._give_back([(key, buf)])  # nothing was staged in it
            raise

    def _shared_buffer(self, key: _CopyKey) -> Any:
        with self._copy_lock:
            spare = self._spare.get(key)
            if spare:
                self._copies_reused += 1
                return spare.pop()
            self._copies_allocated += 1
        return allocate(key[0], key[1])

    def _give_back(self, buffers: List[Tuple[_CopyKey, Any]]) -> None:
        """Buffers no registration reads any more (their version was released, or their shard was
        never staged): spare for the next copies, or freed without ``reuse_copies``."""
        if not self._reuse_copies or self._closed:
            return
        with self._copy_lock:
            for key, buf in buffers:
                self._spare.setdefault(key, []).append(buf)

    def _drop_spare(self) -> None:
        """Frees the spare buffers no copy took since the last publish (the model's shapes
        changed, or fewer shards were copied): reuse never holds more than a release gave back."""
        with self._copy_lock:
            self._spare = {}

    def copy_buffers(self) -> Dict[str, int]:
        """``{"in_use", "in_use_bytes", "spare", "spare_bytes", "reused", "allocated"}``: the shared
        buffers ``add_shard(copy=True)`` made that shards of live versions use, the spare ones of
        released versions kept for reuse, and how many copies so far went into a spare buffer or a
        new one."""
        with self._copy_lock:
            return {"in_use": sum(len(b) for b in self._copies.values()),
                    "spare": sum(len(b) for b in self._spare.values()),
                    "spare_bytes": sum(int(x.nbytes) for b in self._spare.values() for x in b),
                    "in_use_bytes": sum(int(x.nbytes) for b in self._copies.values() for _, x in b),
                    "reused": self._copies_reused, "allocated": self._copies_allocated}
