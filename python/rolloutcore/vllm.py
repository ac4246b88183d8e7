"""rolloutcore inside vLLM: a worker extension that stages, installs, labels and proves weights.

Start vLLM 0.26 or 0.33 with::

    VLLM_SERVER_DEV_MODE=1 python3 -m vllm.entrypoints.cli.main serve MODEL \\
        --worker-extension-cls rolloutcore.vllm.Extension \\
        --enable-prompt-tokens-details --enable-prefix-caching ...

vLLM appends :class:`Extension` to the bases of every GPU worker, so its ``rc_*`` methods run with
``self`` being the worker and are called by the controller's adapter through
``POST /collective_rpc {"method": "rc_...", "kwargs": {...}}`` (docs/vllm.md has the protocol).

How it works, per worker (one tensor-parallel rank):

* **Capture** (first stage of a source layout): vLLM's *own* ``model.load_weights`` is run over
  lazy source tensors (meta tensors, one per tensor of the committed manifest) under a
  ``TorchFunctionMode`` that records every view the loader takes (narrow, slicing, select, chunk,
  split, unbind, transpose/permute, unit-dim view/reshape, dtype casts) and the destination region
  of every ``copy_`` / ``__setitem__`` into a live parameter (element offset and strides inside the
  fused runtime parameter, e.g. ``qkv_proj``, ``gate_up_proj``). Every other in-place operation on a
  real tensor is suppressed while capturing, so capture never writes a live byte. There is no
  hand-written table of vLLM's fused or sharded layouts. A source whose views cannot be expressed
  (arithmetic, a copy into a temporary, an exception in the loader on a meta tensor) falls back:
  it is pulled whole and loaded through ``load_weights`` with real bytes at install, and the
  evidence lists it under ``fallback_tensors`` (its live digest is then not proven).
* **Stage** (while vLLM serves; nothing live is touched): the C++ ``DeviceStager`` (CUDA build of
  ``rolloutcore._core``) plans this rank's reads from the capture, pulls them over the manifest's
  transport (``cuda_ipc``: GPU to GPU, no host copy) into GPU staging kept across refits, and checks
  the staged bytes against the published per-tensor digests on the GPU.
* **Install** (only while vLLM is paused; the adapter pauses first): copies staging into the live
  parameters *in place* (``copy_`` into strided views of the live storage: the addresses CUDA graphs
  captured stay valid), runs ``load_weights`` for fallback tensors, then digests the live weights
  and sets the label and generation. The outcome is typed where the first live byte is written:
  ``refused_untouched`` / ``installed`` / ``failed_after_mutation``. With
  ``ROLLOUTCORE_VLLM_INSTALL=exchange`` (and vLLM in eager mode) the staging image is laid out in
  slabs, one per live parameter, and ``rc_install(install="exchange")`` points every live parameter
  at its slab instead of copying (the old storage becomes the next slab); ``atomic=True`` also
  resets vLLM's caches and sets its label in the same call, between two engine steps, without a
  pause (docs/vllm.md "Closing the pause window").
* **Digest**: the content digest of the live parameters in source (HF) coordinates, on the GPU,
  through the captured mapping: the same definition as the directory's manifest digest.
* **Label**: the label and generation are written only by ``rc_install``, and by ``rc_adopt`` after
  vLLM's own transfer only when a fresh live digest equals the manifest's (nothing else writes
  them), plus a boot id per worker process, so a restarted vLLM is recognised.

Methods never raise to vLLM: failures return ``{"ok": False, "code": ..., "error": ...}`` with a
rolloutcore status code name.

Every attribute this class defines is named ``rc_*`` or ``_rc_*`` (its one instance attribute:
``_rc_state_obj``): vLLM asserts that an extension redefines nothing its ``Worker`` has
(``v1/worker/worker_base.py``, 0.26 and 0.33 alike) and 0.33 added worker methods such as
``compute_weight_checksums``, ``reset_weights``, ``synchronize_device``, ``discard``; none of them,
in either release, starts with ``rc_`` or ``_rc_`` (checked against both releases' ``Worker`` and
``WorkerBase``; python/tests/test_vllm_extension.py keeps the rule).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import struct
import threading
import time
import traceback
import uuid
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

EXTENSION_VERSION = "0.1.0"
_BOOT_ID = uuid.uuid4().hex

# refit dtype names <-> torch dtypes (only what vLLM parameters hold for dense models).
_REFIT_OF_TORCH = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}
_ELEM = {"bf16": 2, "f16": 2, "f32": 4}
# A projection of the checkpoint and the vLLM parameter it is fused into (docs/fp8.md; the rule of
# `rolloutcore model fp8-digest`): q, k, v -> qkv_proj; gate, up -> gate_up_proj; o, down alone.
_PROJ_RE = None
_FUSED_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up", "o": "o", "down": "down"}
_PART_ORDER = ["q", "k", "v", "o", "gate", "up", "down"]
# vLLM 0.33's online FP8 methods and the quantizer's scheme for each.
_FP8_SCHEMES = {"fp8_per_tensor": "per_tensor", "fp8_per_channel": "per_channel", "fp8_per_block": "block"}


def _projection(name: str) -> Optional[Tuple[str, str]]:
    """(vLLM parameter, part) for a q/k/v/o/gate/up/down_proj weight of the checkpoint, else None."""
    global _PROJ_RE
    if _PROJ_RE is None:
        import re

        _PROJ_RE = re.compile(r"(.*)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight")
    m = _PROJ_RE.fullmatch(name)
    if not m:
        return None
    return f"{m.group(1)}.{m.group(2)}.{_FUSED_OF[m.group(3)]}_proj.weight", m.group(3)


def _torch():
    import torch

    return torch


def _plain(torch: Any) -> Any:
    """A context in which tensor methods skip subclasses' ``__torch_function__``. vLLM's parameters
    (``BasevLLMParameter``) define one that only forwards, yet costs a Python round per call: ~10 us
    on every ``data_ptr()``, ``numel()``, ``.data`` of 291 parameters, several milliseconds inside the
    pause window (measured on the H200, 2026-12-05). The extension's own walks over the parameters
    (addresses, sizes, storage checks, the exchange's swaps) run inside it; what vLLM computes does
    not."""
    ctx = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


def _torch_dtype(refit_name: str):
    torch = _torch()
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[refit_name]


def _refit_dtype(torch_dtype) -> str:
    name = _REFIT_OF_TORCH.get(str(torch_dtype))
    if name is None:
        raise _Failure("InvalidArgument", f"parameter dtype {torch_dtype} is not bf16, f16 or f32")
    return name


class _Failure(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _fail(code: str, message: str, **extra: Any) -> Dict[str, Any]:
    out = {"ok": False, "code": code, "error": message}
    out.update(extra)
    return out


# ---- capture: a source view is a box in global source coordinates plus the order its dims walk ----


class _View:
    __slots__ = ("name", "dtype", "source_shape", "start", "extent", "v2s", "reason", "convert")

    def __init__(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        self.name = name
        self.dtype = dtype
        self.source_shape = list(shape)
        self.start = [0] * len(shape)
        self.extent = list(shape)
        self.v2s = list(range(len(shape)))
        self.reason = ""
        self.convert = False

    def copy(self) -> "_View":
        v = _View.__new__(_View)
        v.name, v.dtype, v.source_shape = self.name, self.dtype, self.source_shape
        v.start, v.extent, v.v2s = list(self.start), list(self.extent), list(self.v2s)
        v.reason, v.convert = self.reason, self.convert
        return v

    def shape(self) -> List[int]:
        return [self.extent[s] if s >= 0 else 1 for s in self.v2s]

    def unsupported(self, reason: str) -> "_View":
        v = self.copy()
        if not v.reason:
            v.reason = reason
        return v

    def _dim(self, d: int) -> int:
        n = len(self.v2s)
        if d < -n or d >= max(n, 1):
            raise IndexError(d)
        return d + n if d < 0 else d

    def narrow(self, d: int, start: int, length: int) -> "_View":
        v = self.copy()
        d = v._dim(d)
        size = v.shape()[d]
        if start < 0:
            start += size
        if start < 0 or length < 0 or start + length > size:
            return v.unsupported(f"narrow({d}, {start}, {length}) outside size {size}")
        s = v.v2s[d]
        if s < 0:
            return v if (start, length) == (0, 1) else v.unsupported("narrow of an inserted dim")
        v.start[s] += start
        v.extent[s] = length
        return v

    def select(self, d: int, index: int) -> "_View":
        v = self.copy()
        d = v._dim(d)
        size = v.shape()[d]
        if index < 0:
            index += size
        if not 0 <= index < size:
            return v.unsupported(f"select({d}, {index}) outside size {size}")
        s = v.v2s.pop(d)
        if s >= 0:
            v.start[s] += index
            v.extent[s] = 1
        return v

    def slice(self, d: int, sl: slice) -> "_View":
        size = self.shape()[self._dim(d)]
        start, stop, step = sl.indices(size)
        if step != 1:
            return self.unsupported(f"slice with step {step}")
        return self.narrow(d, start, max(0, stop - start))

    def permute(self, order: Sequence[int]) -> "_View":
        v = self.copy()
        order = [v._dim(o) for o in order]
        if sorted(order) != list(range(len(v.v2s))):
            return v.unsupported(f"permute{tuple(order)}")
        v.v2s = [self.v2s[o] for o in order]
        return v

    def transpose(self, a: int, b: int) -> "_View":
        order = list(range(len(self.v2s)))
        if not order:
            return self.copy()
        a, b = self._dim(a), self._dim(b)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    def unsqueeze(self, d: int) -> "_View":
        v = self.copy()
        n = len(v.v2s) + 1
        if d < 0:
            d += n
        if not 0 <= d < n:
            return v.unsupported(f"unsqueeze({d})")
        v.v2s.insert(d, -1)
        return v

    def squeeze(self, dims: Optional[Sequence[int]] = None) -> "_View":
        v = self.copy()
        shape = v.shape()
        drop = set(range(len(shape))) if dims is None else {v._dim(d) for d in dims}
        keep = [i for i in range(len(shape)) if not (i in drop and shape[i] == 1)]
        for i in range(len(shape)):
            if i not in keep and v.v2s[i] >= 0:
                pass  # a selected unit source dim: start/extent already describe it
        v.v2s = [v.v2s[i] for i in keep]
        return v

    def reshape(self, shape: Sequence[int]) -> "_View":
        """Supported only when it adds or removes unit dims (one extent may be -1)."""
        cur = self.shape()
        numel = 1
        for x in cur:
            numel *= x
        shape = list(shape)
        if shape.count(-1) > 1:
            return self.unsupported(f"reshape{tuple(shape)}")
        if -1 in shape:
            known = 1
            for x in shape:
                if x != -1:
                    known *= x
            if known == 0 or numel % known:
                return self.unsupported(f"reshape{tuple(shape)}")
            shape[shape.index(-1)] = numel // known
        if [x for x in cur if x != 1] != [x for x in shape if x != 1]:
            return self.unsupported(f"reshape {tuple(cur)} -> {tuple(shape)} merges or splits dims")
        v = self.copy()
        walking = [s for s, x in zip(self.v2s, cur) if x != 1]
        unit_src = [s for s, x in zip(self.v2s, cur) if x == 1 and s >= 0]
        out: List[int] = []
        it = iter(walking)
        for x in shape:
            out.append(next(it) if x != 1 else -1)
        # Source dims of extent 1 that were walked stay selected (start/extent hold them).
        del unit_src
        v.v2s = out
        return v


def _flatten_index(idx: Any) -> Tuple[Any, ...]:
    return idx if isinstance(idx, tuple) else (idx,)


def _getitem(v: _View, idx: Any) -> _View:
    import sys

    torch = sys.modules.get("torch")  # only tensors can be tensor indices, so torch is loaded then
    tensor = torch.Tensor if torch is not None else ()
    items = list(_flatten_index(idx))
    n_real = sum(1 for it in items if it is not None and it is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items[e : e + 1] = [slice(None)] * (len(v.v2s) - n_real)
    out = v
    d = 0
    for it in items:
        if it is None:
            out = out.unsqueeze(d)
            d += 1
        elif isinstance(it, bool):
            return v.unsupported("boolean index")
        elif isinstance(it, int) or (isinstance(it, tensor) and it.dim() == 0 and not it.is_floating_point()
                                      and not it.is_meta):
            out = out.select(d, int(it))
        elif isinstance(it, slice):
            if any(isinstance(x, tensor) for x in (it.start, it.stop, it.step)):
                return v.unsupported("tensor slice bounds")
            out = out.slice(d, it)
            d += 1
        else:
            return v.unsupported(f"index {type(it).__name__}")
    return out


def _split_sizes(size: int, split: Any) -> List[int]:
    if isinstance(split, int):
        return [min(split, size - i) for i in range(0, size, split)] if split > 0 else []
    return [int(x) for x in split]


class _Capture:
    """What one load_weights run over lazy sources recorded."""

    def __init__(self, params: Dict[str, Any]) -> None:
        self.params = params  # live name -> nn.Parameter
        self.by_storage: Dict[int, str] = {}
        for name, p in params.items():
            self.by_storage.setdefault(p.data.untyped_storage().data_ptr(), name)
        self.copies: List[Dict[str, Any]] = []
        self.unsupported: Dict[str, str] = {}
        self.suppressed_writes: Dict[str, int] = {}

    def record(self, dest: Any, view: Optional[_View], what: str) -> None:
        if view is None:
            return
        if view.reason:
            self.unsupported.setdefault(view.name, view.reason)
            return
        if dest.is_meta:
            self.unsupported.setdefault(view.name, f"{what} into a meta tensor")
            return
        name = self.by_storage.get(dest.untyped_storage().data_ptr())
        if name is None:
            self.unsupported.setdefault(view.name, f"{what} into a tensor that is not a live parameter")
            return
        if list(dest.shape) != view.shape():
            self.unsupported.setdefault(
                view.name, f"{what} of shape {tuple(view.shape())} into {name} region {tuple(dest.shape)} (broadcast)")
            return
        p = self.params[name]
        dst_dtype = _refit_dtype(p.dtype)
        self.copies.append(
            {
                "source": view.name,
                "source_dtype": view.dtype,
                "source_shape": list(view.source_shape),
                "box_start": list(view.start),
                "box_extent": list(view.extent),
                "view_to_source": list(view.v2s),
                "param_name": name,
                "dest_offset": int(dest.storage_offset() - p.data.storage_offset()),
                "dest_shape": list(dest.shape),
                "dest_strides": list(dest.stride()),
                "convert": dst_dtype != view.dtype,
            }
        )


_VIEW_IDENTITY = {"contiguous", "clone", "detach", "cuda", "cpu", "detach_", "pin_memory", "__get__data",
                  "__get__real", "alias"}
_CASTS = {"float": "f32", "half": "f16", "bfloat16": "bf16"}


_QUERIES = {"size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
            "__len__", "__get__", "ndimension", "is_floating_point", "is_complex", "get_device", "__format__",
            "__repr__", "__bool__"}


def _make_mode(capture: _Capture, views: Any):
    """A TorchFunctionMode that follows views of the lazy sources and records their copies.

    Ops on a source never run on its (meta) data: a known view returns a fresh meta tensor of the
    view's shape that carries the view's geometry; queries (size, dim, shape, ...) run as usual; any
    other op runs (on meta) and marks the source unsupported."""
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    props = {}
    for attr in ("T", "mT", "data", "real", "H", "mH"):
        prop = getattr(torch.Tensor, attr, None)
        if prop is not None and hasattr(prop, "__get__"):
            props[prop.__get__] = "__get__" + attr

    def view_of(x: Any) -> Optional[_View]:
        return views.get(x) if isinstance(x, torch.Tensor) else None

    def first_view(args: Any, kwargs: Any) -> Optional[_View]:
        for a in list(args) + list(kwargs.values()):
            v = view_of(a)
            if v is not None:
                return v
            if isinstance(a, (list, tuple)):
                for b in a:
                    v = view_of(b)
                    if v is not None:
                        return v
        return None

    def materialize(v: Any, dtype: Any) -> Any:
        if isinstance(v, list):
            return tuple(materialize(x, dtype) for x in v)
        t = torch.empty(v.shape(), dtype=dtype, device="meta")
        views[t] = v
        return t

    def cast_target(name: str, a: List[Any], kw: Dict[str, Any]) -> Any:
        if name in _CASTS:
            return _torch_dtype(_CASTS[name])
        for x in a + list(kw.values()):
            if isinstance(x, torch.dtype):
                return x
            if isinstance(x, torch.Tensor) and name == "type_as":
                return x.dtype
        return None

    def derive(name: str, v: _View, args: Any, kwargs: Any) -> Any:
        """The view(s) an op makes of a source, or None when the op is not a view we follow."""
        a = list(args[1:])
        kw = dict(kwargs)
        if name in _VIEW_IDENTITY:
            return v.copy()
        if name in _CASTS or name in ("to", "type", "type_as"):
            dt = cast_target(name, a, kw)
            out = v.copy()
            if dt is not None:
                rd = _REFIT_OF_TORCH.get(str(dt))
                if rd is None:
                    return v.unsupported(f"cast to {dt}")
                out.convert = out.convert or rd != v.dtype
            return out
        if name == "narrow":
            return v.narrow(int(kw.get("dim", a[0])), int(kw.get("start", a[1])), int(kw.get("length", a[2])))
        if name == "select":
            return v.select(int(kw.get("dim", a[0])), int(kw.get("index", a[1])))
        if name == "__getitem__":
            return _getitem(v, a[0])
        if name in ("t", "__get__T"):
            n = len(v.v2s)
            return v.copy() if n < 2 else v.permute(list(reversed(range(n))))
        if name == "__get__mT":
            return v.transpose(-2, -1)
        if name in ("transpose", "swapaxes", "swapdims"):
            return v.transpose(int(kw.get("dim0", a[0] if a else 0)), int(kw.get("dim1", a[1] if len(a) > 1 else 1)))
        if name == "permute":
            order = a[0] if len(a) == 1 and isinstance(a[0], (list, tuple)) else a
            return v.permute([int(x) for x in kw.get("dims", order)])
        if name == "unsqueeze":
            return v.unsqueeze(int(kw.get("dim", a[0])))
        if name == "squeeze":
            d = kw.get("dim", a[0] if a else None)
            if d is None:
                return v.squeeze(None)
            return v.squeeze([int(x) for x in (d if isinstance(d, (list, tuple)) else [d])])
        if name in ("view", "reshape"):
            shp = a[0] if len(a) == 1 and isinstance(a[0], (list, tuple, torch.Size)) else a
            if any(isinstance(x, torch.dtype) for x in shp):
                return v.unsupported("view as another dtype")
            return v.reshape([int(x) for x in shp])
        if name == "unbind":
            dim = int(kw.get("dim", a[0] if a else 0))
            return [v.select(dim, i) for i in range(v.shape()[v._dim(dim)])]
        if name in ("chunk", "split"):
            dim = int(kw.get("dim", a[1] if len(a) > 1 else 0))
            size = v.shape()[v._dim(dim)]
            if name == "chunk":
                chunks = int(kw.get("chunks", a[0]))
                sizes = _split_sizes(size, -(-size // chunks) if chunks > 0 else size)
            else:
                sizes = _split_sizes(size, kw.get("split_size_or_sections", kw.get("split_size", a[0] if a else 1)))
            out, off = [], 0
            for n in sizes:
                out.append(v.narrow(dim, off, n))
                off += n
            return out
        return None

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = props.get(func) or getattr(func, "__name__", str(func))
            if name == "copy_" and len(args) >= 2 and isinstance(args[0], torch.Tensor):
                src = view_of(args[1])
                if src is not None:
                    capture.record(args[0], src, "copy_")
                    return args[0]
                if not args[0].is_meta:
                    capture.suppressed_writes[name] = capture.suppressed_writes.get(name, 0) + 1
                    return args[0]
            if name == "__setitem__" and len(args) >= 3 and isinstance(args[0], torch.Tensor):
                src = view_of(args[2])
                if src is not None:
                    if args[0].is_meta:
                        capture.record(args[0], src.unsupported("__setitem__ into a meta tensor"), "__setitem__")
                    else:
                        capture.record(args[0][args[1]], src, "__setitem__")
                    return None
                if not args[0].is_meta:
                    capture.suppressed_writes[name] = capture.suppressed_writes.get(name, 0) + 1
                    return None
            if (name.endswith("_") and not name.startswith("__") and args and isinstance(args[0], torch.Tensor)
                    and not args[0].is_meta and name != "requires_grad_"):
                # Capture must never write a live byte (e.g. a loader zero-filling padding rows).
                capture.suppressed_writes[name] = capture.suppressed_writes.get(name, 0) + 1
                return args[0]
            v = first_view(args, kwargs)
            if v is None or name in _QUERIES:
                return func(*args, **kwargs)
            if args and view_of(args[0]) is v:
                dv = derive(name, v, args, kwargs)
                if dv is not None:
                    dt = args[0].dtype
                    if name in _CASTS or name in ("to", "type", "type_as"):
                        dt = cast_target(name, list(args[1:]), dict(kwargs)) or dt
                    return materialize(dv, dt)
            # Not a view we follow (arithmetic, torch.cat with other tensors, ...): run it on meta for
            # its shape and mark every tensor it returns as an unsupported view of the source.
            result = func(*args, **kwargs)
            bad = v.unsupported(f"{name} is not a view the capture can follow")
            if isinstance(result, torch.Tensor):
                views[result] = bad
            elif isinstance(result, (list, tuple)):
                for r in result:
                    if isinstance(r, torch.Tensor):
                        views[r] = bad
            return result

    return Recorder()


def capture_load_weights(model: Any, sources: Sequence[Tuple[str, str, Sequence[int]]]) -> _Capture:
    """Runs ``model.load_weights`` over lazy (meta) sources and records every copy into a live
    parameter. ``sources``: (HF name, refit dtype, global shape). Never writes a live byte."""
    torch = _torch()
    from torch.utils.weak import WeakIdKeyDictionary

    params = dict(model.named_parameters(remove_duplicate=False))
    cap = _Capture(params)
    views = WeakIdKeyDictionary()
    mode = _make_mode(cap, views)
    for name, dtype, shape in sources:
        t = torch.empty(list(shape), dtype=_torch_dtype(dtype), device="meta")
        views[t] = _View(name, dtype, shape)
        before = len(cap.copies)
        try:
            with mode:
                model.load_weights([(name, t)])
        except Exception as e:  # the loader did something a meta tensor cannot do
            cap.unsupported.setdefault(name, f"load_weights raised {type(e).__name__}: {e}")
            del cap.copies[before:]
        if name in cap.unsupported:
            del cap.copies[before:]
    return cap


# ---- helpers ---------------------------------------------------------------------------------------


def _http_get_json(url: str, timeout_s: float, api_key: Optional[str]) -> Any:
    import urllib.request

    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", "Bearer " + api_key)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode("utf-8"))


def _safetensors_specs(folder: str) -> List[Tuple[str, str, List[int]]]:
    """(name, refit dtype, shape) of every tensor in the safetensors files of a model folder."""
    names = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
    out = []
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".safetensors"):
            continue
        path = os.path.join(folder, fn)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise _Failure("InvalidArgument", f"{path}: safetensors header of {n} bytes")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in names:
                raise _Failure("InvalidArgument", f"{path}: tensor {name} has dtype {info['dtype']}")
            out.append((name, names[info["dtype"]], [int(x) for x in info["shape"]]))
    return sorted(out)


# ---- install by exchange and the atomic install (docs/vllm.md "Install by exchange", "Atomic install") ----

INSTALL_MODES = ("copy", "exchange")
VERIFY_MODES = ("reread", "staged")


def _install_mode(requested: Optional[str]) -> str:
    """rc_install's install mode: the argument, else ROLLOUTCORE_VLLM_INSTALL, else copy."""
    mode = requested if requested is not None else os.environ.get("ROLLOUTCORE_VLLM_INSTALL", "copy")
    if mode not in INSTALL_MODES:
        raise _Failure("InvalidArgument", f"install mode must be one of {', '.join(INSTALL_MODES)}, got {mode!r} "
                                          "(rc_install's install= or ROLLOUTCORE_VLLM_INSTALL)")
    return mode


def _verify_mode(requested: Optional[str]) -> str:
    """How an exchange proves the live weights: the argument, else ROLLOUTCORE_VLLM_EXCHANGE_VERIFY, else
    reread (the digest kernel re-reads them inside the pause)."""
    mode = requested if requested is not None else os.environ.get("ROLLOUTCORE_VLLM_EXCHANGE_VERIFY", "reread")
    if mode not in VERIFY_MODES:
        raise _Failure("InvalidArgument", f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r} "
                                          "(rc_install's verify= or ROLLOUTCORE_VLLM_EXCHANGE_VERIFY)")
    return mode


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when ``strides`` walk ``shape`` row-major without gaps (unit dims may carry any stride)."""
    if len(shape) != len(strides):
        return False
    expect = 1
    for n, st in zip(reversed(list(shape)), reversed(list(strides))):
        if n == 1:
            continue
        if st != expect:
            return False
        expect *= n
    return True


def _tiling_issue(name: str, numel: int, copies: Sequence[Dict[str, Any]]) -> Optional[str]:
    """Why the copies into parameter ``name`` (``numel`` elements) do not tile it with dense boxes,
    each byte written once (None when they do): only then can a slab of the parameter's shape hold
    every copy's staging buffer at the copy's own offset (receiver/exchange.h)."""
    if not copies:
        return f"{name}: no copy writes it"
    at = 0
    for c in sorted(copies, key=lambda c: c["dest_offset"]):
        if not _dense(c["dest_shape"], c["dest_strides"]):
            return f"{name}: the copy of {c['source']} is a strided box (strides {list(c['dest_strides'])})"
        if c["dest_offset"] != at:
            what = "overlaps the one before" if c["dest_offset"] < at else f"leaves elements {at}..{c['dest_offset']} unwritten"
            return f"{name}: the copy of {c['source']} at element {c['dest_offset']} {what}"
        n = 1
        for x in c["dest_shape"]:
            n *= int(x)
        at += n
    if at != numel:
        return f"{name}: the copies write {at} of its {numel} elements"
    return None


def _use_count(torch: Any, t: Any) -> int:
    """References to the storage under ``t`` (tensors sharing it, plus the probe's own)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _alias_issue(torch: Any, params: Dict[str, Any], names: Iterable[str]) -> Optional[str]:
    """Why exchanging the storage of these parameters would leave someone reading the old one: another
    tensor sharing a parameter's storage (a view kept by a layer, a second Parameter over the same
    bytes) would keep computing with what becomes the next staging image. None when no parameter's
    storage has more references than a fresh Parameter's."""
    probe = torch.nn.Parameter(torch.empty(1), requires_grad=False)
    base = _use_count(torch, probe)
    with _plain(torch):
        for n in names:
            p = params[n]
            if p.storage_offset() != 0 or not p.is_contiguous() or \
                    p.untyped_storage().nbytes() != p.numel() * p.element_size():
                return f"{n}: not the whole of its own contiguous storage"
            extra = _use_count(torch, p) - base
            if extra > 0:
                return f"{n}: {extra} other reference(s) to its storage (a tensor sharing it)"
    return None


def _engine_core_of(worker: Any) -> Tuple[Optional[Any], str]:
    """vLLM's engine core when this worker runs inside it (vLLM's uniproc executor: TP=1, no Ray), found
    on the call stack of the collective_rpc now running; else (None, why). The engine core runs utility
    calls between two engine steps on its one busy-loop thread, so whatever this call does to the
    engine's caches and label is atomic with respect to every step."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and type(obj).__module__.startswith("vllm.v1.engine.core") \
                and hasattr(obj, "scheduler") and callable(getattr(obj, "reset_prefix_cache", None)):
            driver = getattr(getattr(obj, "model_executor", None), "driver_worker", None)
            if getattr(driver, "worker", None) is not worker:
                return None, (f"the engine core's executor ({type(getattr(obj, 'model_executor', None)).__name__}) "
                              "does not run this worker in its thread")
            return obj, ""
        f = f.f_back
    return None, ("vLLM's engine core is not on this call's stack: the worker runs in its own process "
                  "(multiprocessing or Ray executor: TP > 1, or VLLM_ENABLE_V1_MULTIPROCESSING) or the call "
                  "did not come through collective_rpc")


# vLLM's scheduler queues of waiting requests, any of which may hold a request that already ran:
# ``waiting`` (both releases; a preempted request goes back to its head), ``skipped_waiting`` (0.26:
# requests the scheduling scan skipped, or enqueued blocked on a grammar, remote KV or a streamed input;
# v1/core/sched/scheduler.py:185, :1056-1057, :1962-1974) and ``kv_holding_waiting`` (0.33: waiting
# requests that hold KV blocks, scheduler.py:236). 0.33's ``deferred_waiting`` is a set of requests
# that are also in one of these two queues (scheduler.py:1056, :2709-2715), not a queue of its own.
_WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")


def _request_started(r: Any) -> bool:
    """Whether a waiting request already ran on the weights now live: it has computed tokens (holding
    KV, a chunked prefill), produced output tokens, or was preempted. Preemption sets
    num_computed_tokens back to 0 and puts the request back in ``waiting`` (0.26 scheduler.py:1225,
    :1233; 0.33 :1822, :1842) but keeps its output tokens (Request.num_output_tokens /
    output_token_ids) and counts num_preemptions (0.26 v1/request.py:275, :195; 0.33 :303, :216).
    0.26's /pause?mode=keep with clear_cache=true preempts every running request so (v1/engine/core.py
    :847 -> reset_prefix_cache(reset_running_requests=True), scheduler.py:2336-2346)."""
    if int(getattr(r, "num_computed_tokens", 0) or 0) > 0:
        return True
    if int(getattr(r, "num_output_tokens", 0) or 0) > 0 or len(getattr(r, "output_token_ids", None) or ()) > 0:
        return True
    return int(getattr(r, "num_preemptions", 0) or 0) > 0


def _engine_busy(core: Any) -> Optional[str]:
    """Why the engine core has work that an install now would split across two versions, or why it
    cannot tell (None when it has none): a running request; a request in any of the scheduler's
    waiting queues (``waiting``, and 0.26's ``skipped_waiting`` or 0.33's ``kv_holding_waiting``,
    whichever exist) that already started: computed tokens, output tokens, or a preemption
    (``_request_started``); a scheduler with ``running`` but none of those queues (a layout this
    check does not know, so its waiting requests cannot be read: refused, not skipped); or a step in
    flight (the batch queue). A request queued and never started is not: it runs after this call, on
    the new weights. (vLLM's own count is not used: under a keep pause it answers 0 with frozen
    requests running.)"""
    sched = core.scheduler
    running = getattr(sched, "running", None)
    if running is None:  # another scheduler: its own count
        n = sched.get_num_unfinished_requests() if callable(getattr(sched, "get_num_unfinished_requests", None)) else None
        if n:
            return f"{n} request(s) in flight"
        if n is None and sched.has_unfinished_requests():
            return "requests in flight"
    else:
        if len(running):
            return f"{len(running)} request(s) in flight (running)"
        queues = [(name, getattr(sched, name)) for name in _WAITING_QUEUES if getattr(sched, name, None) is not None]
        if not queues:
            return (f"cannot tell: the scheduler ({type(sched).__name__}) has none of the waiting queues "
                    f"{', '.join(_WAITING_QUEUES)} (vLLM 0.26 / 0.33), so its waiting requests cannot be checked")
        started = 0
        where = []
        for name, queue in queues:
            n = sum(1 for r in list(queue) if _request_started(r))
            if n:
                started += n
                where.append(name)
        if started:
            return (f"{started} request(s) in flight (waiting after they started: tokens computed, output "
                    f"produced or preempted; in {', '.join(where)})")
    if getattr(core, "batch_queue", None):
        return "an engine step is in flight (batch queue)"
    return None


class _State:
    """Per-worker state of the extension (one per vLLM worker process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.label = os.environ.get("ROLLOUTCORE_WEIGHT_VERSION", "v0")
        self.generation = 0
        self.sources_key: Optional[Tuple[Any, ...]] = None
        self.capture: Optional[_Capture] = None
        self.stager: Any = None
        self.staging: Any = None  # one uint8 device buffer
        self.staging_views: List[Any] = []  # per supported copy, then per fallback source
        self.fallback: List[str] = []
        self.not_loaded: List[str] = []
        self.staged_version: Optional[str] = None
        self.staged_evidence: Optional[Dict[str, Any]] = None
        self.published: Dict[str, str] = {}
        self.live_digest: Optional[Dict[str, Any]] = None
        self.first_ptrs: Optional[Dict[str, int]] = None
        self.capture_ms = 0.0
        self.faults: Dict[str, int] = {}
        self.fused: Optional[Dict[str, Any]] = None  # prepare_install's reply for the staged buffers
        # FP8 serving (docs/fp8.md): the scheme, and per FP8 vLLM parameter (module, bf16 shadow name).
        self.fp8: Optional[Dict[str, Any]] = None
        # Install by exchange: one slab per live parameter (its twin; the copies' staging buffers are
        # views at their live offsets), or None with the reason the staging image is one dense
        # allocation instead. staged_mode: the last stage's mode (full / delta); exchange: the
        # stager's prepare_exchange reply for the staged version.
        self.slabs: Optional[Dict[str, Any]] = None
        self.exchange_issue: Optional[str] = None
        self.staged_mode: Optional[str] = None
        self.staged_policy: Optional[str] = None
        self.exchange: Optional[Dict[str, Any]] = None


class Extension:
    """Mixed into vLLM's GPU worker by ``--worker-extension-cls rolloutcore.vllm.Extension``."""

    # ---- internals (names start with _rc_ so they never collide with vLLM's worker) ----

    def _rc_state(self) -> _State:
        st = getattr(self, "_rc_state_obj", None)
        if st is None:
            st = _State()
            self._rc_state_obj = st
        return st

    def _rc_model(self) -> Any:
        get = getattr(self, "get_model", None)
        model = get() if callable(get) else self.model_runner.model
        return model

    def _rc_device(self) -> int:
        torch = _torch()
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device) and dev.index is not None:
            return dev.index
        return torch.cuda.current_device()

    def _rc_tp(self) -> Tuple[int, int]:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:
            return 0, 1

    def _rc_params(self) -> Dict[str, Any]:
        return dict(self._rc_model().named_parameters())

    def _rc_fp8_layers(self) -> Dict[str, Any]:
        """vLLM parameter name ('...qkv_proj.weight') -> module, for every layer vLLM keeps in FP8."""
        torch = _torch()
        fp8 = getattr(torch, "float8_e4m3fn", None)
        modules = getattr(self._rc_model(), "named_modules", None)
        if fp8 is None or not callable(modules):
            return {}
        return {m + ".weight": mod for m, mod in modules()
                if isinstance(getattr(mod, "weight", None), torch.Tensor) and mod.weight.dtype == fp8}

    def _rc_fp8_capture(self, model: Any, specs: List[Tuple[str, str, List[int]]],
                        layers: Dict[str, Any]) -> Tuple[_Capture, Dict[str, Any]]:
        """The capture when vLLM serves FP8 (docs/fp8.md): the loader is followed for every tensor
        that lands in a bf16 parameter (embeddings, norms, lm_head), and every projection is staged
        into a bf16 shadow of its fused vLLM parameter ([out, in], parts in vLLM's order) that the
        receiver installs and proves like a live parameter; rc_install then quantizes each shadow
        into vLLM's FP8 parameter and scales with rolloutcore's GPU quantizer."""
        torch = _torch()
        rank, size = self._rc_tp()
        quant = getattr(self.vllm_config.model_config, "quantization", None)
        if size != 1:
            raise _Failure("FailedPrecondition", f"refit into FP8 parameters (quantization {quant}) at tensor-parallel "
                                                 f"size {size}: only 1 is supported so far")
        scheme = _FP8_SCHEMES.get(str(quant))
        if scheme is None:
            raise _Failure("FailedPrecondition", f"vLLM serves FP8 parameters under quantization {quant}; refit "
                                                 f"quantizes only for {sorted(_FP8_SCHEMES)} (docs/fp8.md)")
        parts: Dict[str, Dict[str, Tuple[str, str, List[int]]]] = {}
        other = []
        for spec in specs:
            pj = _projection(spec[0])
            if pj is None:
                other.append(spec)
            else:
                parts.setdefault(pj[0], {})[pj[1]] = spec
        cap = capture_load_weights(model, other)
        missing = sorted(set(layers) - set(parts))
        if missing:
            raise _Failure("FailedPrecondition", f"FP8 parameters {missing[:4]} get no tensor of the version")
        device = self._rc_device()
        shadows: Dict[str, Any] = {}
        for pname, by_part in sorted(parts.items()):
            mod = layers.get(pname)
            if mod is None:
                raise _Failure("FailedPrecondition", f"{pname} (from {sorted(p[0] for p in by_part.values())}) is "
                                                     "not a parameter vLLM keeps in FP8")
            ordered = [by_part[k] for k in _PART_ORDER if k in by_part]
            cols = ordered[0][2][1]
            rows = sum(sp[2][0] for sp in ordered)
            if (rows, cols) != (mod.output_size_per_partition, mod.input_size_per_partition) or any(
                    sp[1] != "bf16" or len(sp[2]) != 2 or sp[2][1] != cols for sp in ordered):
                raise _Failure("FailedPrecondition",
                               f"{pname}: the version's {[(sp[0], sp[1], sp[2]) for sp in ordered]} do not fuse into "
                               f"vLLM's [{mod.output_size_per_partition}, {mod.input_size_per_partition}] bf16")
            sname = "rc.bf16." + pname
            shadow = torch.empty(rows, cols, dtype=torch.bfloat16, device=f"cuda:{device}")
            cap.params[sname] = shadow
            row = 0
            for name, dtype, shape in ordered:
                cap.copies.append({
                    "source": name, "source_dtype": dtype, "source_shape": list(shape), "box_start": [0, 0],
                    "box_extent": list(shape), "view_to_source": [0, 1], "param_name": sname,
                    "dest_offset": row * cols, "dest_shape": list(shape), "dest_strides": [cols, 1], "convert": False})
                row += shape[0]
            shadows[pname] = (mod, sname)
        return cap, {"scheme": scheme, "quantization": quant, "layers": shadows}

    def _rc_fp8_target(self, st: _State, pname: str) -> Tuple[Any, Any, Any, int, int, Tuple[int, int]]:
        """(bf16 shadow, vLLM's [out, in] E4M3 view, its scales, rows, cols, scale grid) of an FP8
        parameter: vLLM keeps the [out, in] bytes contiguous (per tensor and per channel as
        qweight.t(), per block as is) and the scales as their grid of contiguous float32."""
        torch = _torch()
        mod, sname = st.fp8["layers"][pname]
        scheme = st.fp8["scheme"]
        shadow = st.capture.params[sname]
        rows, cols = shadow.shape
        w = mod.weight
        q = w.t() if tuple(w.shape) == (cols, rows) and tuple(w.stride()) == (1, cols) else w
        if tuple(q.shape) != (rows, cols) or not q.is_contiguous():
            raise _Failure("FailedPrecondition", f"{pname}: vLLM keeps the FP8 weight as {tuple(w.shape)} strides "
                                                 f"{tuple(w.stride())}, not the [out, in] bytes the quantizer writes")
        s = getattr(mod, "weight_scale_inv" if scheme == "block" else "weight_scale", None)
        grid = {"per_tensor": (1, 1), "per_channel": (rows, 1),
                "block": (-(-rows // 128), -(-cols // 128))}[scheme]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or not s.is_contiguous() or \
                s.numel() != grid[0] * grid[1]:
            raise _Failure("FailedPrecondition", f"{pname}: vLLM's scales are not the {scheme} grid {list(grid)} of "
                                                 "contiguous float32 the quantizer writes")
        return shadow, q, s, rows, cols, grid

    def _rc_fp8_quantize(self, st: _State, fault: str = "") -> Dict[str, Any]:
        """Quantizes every bf16 shadow (installed and digested like a live parameter) into vLLM's FP8
        parameter and its scales, in place, with rolloutcore's GPU quantizer (the bits of formats/fp8.h,
        which are vLLM's: docs/fp8.md). `fault` (tests only, rc_fault fp8_install) leaves a wrong
        image behind that the proof must catch: wrong_scale (every scale doubled), stale_scales (the
        previous version's scales), swizzled_scales (the scale grid re-laid out: rows exchanged
        pairwise, block columns reversed), stale_image (nothing quantized: the previous version's
        bytes and scales)."""
        torch = _torch()
        from . import _core

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device = self._rc_device()
        scheme = st.fp8["scheme"]
        for pname in sorted(st.fp8["layers"]):
            shadow, q, s, rows, cols, grid = self._rc_fp8_target(st, pname)
            if fault == "stale_image":
                continue
            before = s.clone() if fault == "stale_scales" else None
            _core.quantize_fp8_device(device, shadow.data_ptr(), rows, cols, scheme, q.data_ptr(), s.data_ptr(),
                                      name=pname)
            with torch.no_grad():
                if fault == "wrong_scale":
                    s.mul_(2.0)
                elif fault == "stale_scales":
                    s.copy_(before)
                elif fault == "swizzled_scales":
                    g = s.view(grid[0], grid[1])
                    n = grid[0] - grid[0] % 2
                    g[:n] = g[:n].view(n // 2, 2, grid[1]).flip(1).reshape(n, grid[1]).clone()
                    if scheme == "block":
                        g.copy_(g.flip(1).clone())
        torch.cuda.synchronize()
        out = {"scheme": scheme, "parameters": len(st.fp8["layers"]), "quantize_ms": (time.perf_counter() - t0) * 1e3}
        if fault:
            out["fault"] = fault
        return out

    def _rc_fp8_expected(self, st: _State, staged: bool) -> Dict[str, Any]:
        """Per FP8 parameter, the FP8 image digest of the quantization of its bf16: of the staged
        parts (``staged``: rc_stage, while vLLM still serves; the staged bytes are proven equal to
        the manifest on landing) or of the installed shadow (proven by the content digest). The
        quantization runs into scratch memory, at most about 1 GiB of image at a time."""
        torch = _torch()
        from . import _core

        torch.cuda.synchronize()
        device = self._rc_device()
        scheme = st.fp8["scheme"]
        expected: Dict[str, Any] = {}
        batch: List[Tuple[str, Any, Any]] = []
        batch_bytes = 0
        parts: Dict[str, List[Tuple[int, Any]]] = {}
        if staged:
            for i, c in enumerate(st.capture.copies):
                if c["param_name"].startswith("rc.bf16."):
                    parts.setdefault(c["param_name"], []).append((c["dest_offset"], st.staging_views[i]))

        def flush() -> None:
            nonlocal batch, batch_bytes
            if batch:
                got = _core.fp8_image_digest_device(
                    device, [(n, q.data_ptr(), q.shape[0], q.shape[1], s.data_ptr(), s.shape[0], s.shape[1])
                             for n, q, s in batch])
                expected.update(got["parameters"])
            batch, batch_bytes = [], 0

        for pname in sorted(st.fp8["layers"]):
            shadow, _, _, rows, cols, grid = self._rc_fp8_target(st, pname)
            src = shadow
            if staged:
                views = [v for _, v in sorted(parts.get(st.fp8["layers"][pname][1], []), key=lambda x: x[0])]
                src = views[0] if len(views) == 1 else torch.cat([v.reshape(-1, cols) for v in views], dim=0)
                src = src.reshape(rows, cols).contiguous()
            eq = torch.empty((rows, cols), dtype=torch.uint8, device=shadow.device)
            es = torch.empty(grid, dtype=torch.float32, device=shadow.device)
            _core.quantize_fp8_device(device, src.data_ptr(), rows, cols, scheme, eq.data_ptr(), es.data_ptr(),
                                      name=pname)
            batch.append((pname, eq, es))
            batch_bytes += rows * cols
            if batch_bytes >= 1 << 30:
                flush()
        flush()
        return expected

    def _rc_fp8_evidence(self, st: _State, expected: Optional[Dict[str, Any]] = None,
                         expected_from: str = "shadows") -> Dict[str, Any]:
        """The proof of the FP8 image (docs/fp8.md): the FP8 image digest of what vLLM computes with
        (its E4M3 parameters and scales, read in place on the GPU) against the digest of the
        quantization of the proven bf16: ``expected`` when rc_stage computed it from the staged
        bytes (outside the pause), else of the bf16 shadows, whose content the content digest proves
        to be the published version (both with refit/fp8_digest.h's rule, which `rolloutcore model
        fp8-digest` applies to a checkpoint). The shape of the embedded engine's GET
        /rc/weights/digest "fp8"."""
        torch = _torch()
        from . import _core

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device = self._rc_device()
        scheme = st.fp8["scheme"]
        live_entries = []
        for pname in sorted(st.fp8["layers"]):
            _, q, s, rows, cols, grid = self._rc_fp8_target(st, pname)
            live_entries.append((pname, q.data_ptr(), rows, cols, s.data_ptr(), grid[0], grid[1]))
        live = _core.fp8_image_digest_device(device, live_entries)
        if st.fp8.get("expected_from_live"):
            expected, expected_from = live["parameters"], "live (fault self_consistent_wrong_scale)"
        if expected is None:
            expected, expected_from = self._rc_fp8_expected(st, staged=False), "shadows"
        params: Dict[str, Any] = {}
        mismatch = ""
        for pname in sorted(st.fp8["layers"]):
            got, want = live["parameters"][pname], expected.get(pname)
            if want is None:
                raise _Failure("Internal", f"no expected FP8 image digest for {pname}")
            p = {"live": got["digest"], "expected": want["digest"],
                 "bytes_match": got["bytes_digest"] == want["bytes_digest"],
                 "scales_match": got["scales_digest"] == want["scales_digest"]}
            params[pname] = p
            if not mismatch and got["digest"] != want["digest"]:
                what = [k for k in ("bytes", "scales") if not p[k + "_match"]]
                mismatch = (f"{pname}: the {' and '.join(what)} vLLM computes with are not the {scheme} quantization "
                            f"of the proven bf16 (live {got['digest']}, expected {want['digest']})")
        exp_combined = _core.combine_digests({n: int(expected[n]["digest"], 16) for n in st.fp8["layers"]})
        out = {"quantization": st.fp8["quantization"], "scheme": scheme, "live_digest": live["combined"],
               "expected_digest": exp_combined, "expected_from": expected_from,
               "match": live["combined"] == exp_combined and not mismatch,
               "parameters": params, "ms": (time.perf_counter() - t0) * 1e3}
        if mismatch:
            out["mismatch"] = mismatch
        return out

    def _rc_fp8_shadows_from_checkpoint(self, st: _State, folder: str) -> None:
        """Before the first install the bf16 shadows hold nothing; vLLM quantized the checkpoint it
        loaded from `folder` (a local folder). The shadows are filled from that checkpoint, so the
        content digest covers the bf16 whose quantization vLLM serves and the FP8 evidence proves
        (or refutes) that vLLM's own quantization of it is the image it computes with."""
        torch = _torch()
        from safetensors import safe_open

        want: Dict[str, List[Dict[str, Any]]] = {}
        for c in st.capture.copies:
            if c["param_name"].startswith("rc.bf16."):
                want.setdefault(c["source"], []).append(c)
        dev = f"cuda:{self._rc_device()}"
        found = set()
        with torch.no_grad():
            for fn in sorted(os.listdir(folder)):
                if not fn.endswith(".safetensors"):
                    continue
                with safe_open(os.path.join(folder, fn), framework="pt", device=dev) as f:
                    for name in f.keys():
                        for c in want.get(name, []):
                            p = st.capture.params[c["param_name"]]
                            n = 1
                            for x in c["dest_shape"]:
                                n *= x
                            p.view(-1)[c["dest_offset"]:c["dest_offset"] + n].view(c["dest_shape"]).copy_(
                                f.get_tensor(name))
                            found.add(name)
        missing = sorted(set(want) - found)
        if missing:
            raise _Failure("FailedPrecondition", f"{folder} lacks {missing[:4]}: the FP8 image's bf16 cannot be read")
        torch.cuda.synchronize()
        st.fp8["installed"] = True
        st.fp8["from_checkpoint"] = folder

    def _rc_ensure_capture(self, st: _State, specs: List[Tuple[str, str, List[int]]]) -> None:
        """Captures vLLM's loader for this source tensor set (once per set) and allocates staging."""
        torch = _torch()
        from . import _core  # the CUDA build

        key = tuple((n, d, tuple(s)) for n, d, s in specs)
        if st.sources_key == key and st.capture is not None:
            return
        if not getattr(_core, "cuda_built", False):
            raise _Failure("FailedPrecondition",
                           "rolloutcore._core was built without CUDA: the vLLM extension needs the CUDA build")
        t0 = time.perf_counter()
        model = self._rc_model()
        fp8_layers = self._rc_fp8_layers()
        fp8 = None
        if fp8_layers:
            cap, fp8 = self._rc_fp8_capture(model, specs, fp8_layers)
        else:
            cap = capture_load_weights(model, specs)
        loaded = {c["source"] for c in cap.copies}
        fallback = sorted(cap.unsupported)
        not_loaded = sorted(n for n, _, _ in specs if n not in loaded and n not in cap.unsupported)
        params = cap.params
        # Staging: one dense buffer per supported copy (in the live parameter's dtype), then one per
        # fallback source (whole tensor, source dtype), 256-byte aligned in one allocation.
        spec_by_name = {n: (d, s) for n, d, s in specs}
        layout = []
        off = 0
        for c in cap.copies:
            dt = _refit_dtype(params[c["param_name"]].dtype)
            nbytes = _ELEM[dt]
            for x in c["dest_shape"]:
                nbytes *= x
            layout.append((dt, c["dest_shape"], off, nbytes))
            off += (nbytes + 255) & ~255
        for name in fallback:
            dt, shape = spec_by_name[name]
            nbytes = _ELEM[dt]
            for x in shape:
                nbytes *= x
            layout.append((dt, list(shape), off, nbytes))
            off += (nbytes + 255) & ~255
        device = self._rc_device()
        # Install by exchange wants the staging image laid out as the live parameters are (a slab
        # per parameter); otherwise it is one dense allocation.
        slabs, st.exchange_issue = None, None
        if _install_mode(None) == "exchange":
            st.exchange_issue = self._rc_exchange_static_issue(cap, fp8, fallback)
            if st.exchange_issue is None:
                # Plain contiguous tensors (not Parameters: the parameter object stays vLLM's).
                slabs = {n: torch.empty(tuple(params[n].shape), dtype=params[n].dtype, device=params[n].device)
                         for n in sorted({c["param_name"] for c in cap.copies})}
        else:
            st.exchange_issue = "ROLLOUTCORE_VLLM_INSTALL is not exchange when vLLM started (the staging layout)"
        if slabs is None:
            staging = torch.empty(max(off, 256), dtype=torch.uint8, device=f"cuda:{device}")
            views = [staging[o : o + n].view(_torch_dtype(dt)).view(shape) for dt, shape, o, n in layout]
        else:
            staging = None
            views = self._rc_slab_views(cap, slabs)
        staging_params, staging_copies = [], []
        for i, c in enumerate(cap.copies):
            dt, shape, _, _ = layout[i]
            pname = f"rc.staging.{i}"
            staging_params.append((pname, dt, shape))
            strides = []
            acc = 1
            for x in reversed(shape):
                strides.append(acc)
                acc *= x
            sc = dict(c)
            sc.update(param=i, dest_offset=0, dest_strides=list(reversed(strides)))
            staging_copies.append(sc)
        for j, name in enumerate(fallback):
            i = len(cap.copies) + j
            dt, shape, _, _ = layout[i]
            pname = f"rc.staging.{i}"
            staging_params.append((pname, dt, shape))
            strides, acc = [], 1
            for x in reversed(shape):
                strides.append(acc)
                acc *= x
            staging_copies.append({
                "source": name, "source_dtype": dt, "source_shape": list(shape), "box_start": [0] * len(shape),
                "box_extent": list(shape), "view_to_source": list(range(len(shape))), "param": i,
                "dest_offset": 0, "dest_shape": list(shape), "dest_strides": list(reversed(strides)),
                "convert": False})
        live_names = sorted({c["param_name"] for c in cap.copies})
        live_index = {n: i for i, n in enumerate(live_names)}
        live_params = [(n, _refit_dtype(params[n].dtype), list(params[n].shape)) for n in live_names]
        live_copies = []
        for c in cap.copies:
            lc = dict(c)
            lc["param"] = live_index[c["param_name"]]
            live_copies.append(lc)
        # The stager asks for the buffers when it needs them (the DeviceLiveWeights of
        # receiver/live_weights.h): the addresses are read from PyTorch at that moment. Weak
        # references, so that the state and its stager do not keep each other alive.
        st_ref, cls = weakref.ref(st), type(self)
        stager = _core.DeviceStager(device, staging_buffers=lambda: cls._rc_staging_buffers(st_ref()),
                                    live_buffers=lambda: cls._rc_live_buffers(st_ref()))
        stager.set_captures(staging_params, staging_copies, live_params, live_copies)
        st.capture, st.stager, st.staging, st.staging_views, st.slabs = cap, stager, staging, views, slabs
        st.exchange = None
        st.fallback, st.not_loaded, st.sources_key = fallback, not_loaded, key
        st.staged_version = None
        st.fused = None
        st.fp8 = fp8
        st.capture_ms = (time.perf_counter() - t0) * 1e3
        if st.first_ptrs is None:
            st.first_ptrs = {n: p.data_ptr() for n, p in params.items()}

    def _rc_exchange_static_issue(self, cap: _Capture, fp8: Any, fallback: List[str]) -> Optional[str]:
        """Why this worker's live parameters can never be installed by exchange (None when they can;
        the storage aliases are checked at every install)."""
        if fp8 is not None:
            return "vLLM serves FP8: the install quantizes into the live parameters"
        if fallback:
            return f"fallback tensors {fallback[:4]} load through load_weights"
        cc = getattr(getattr(self, "vllm_config", None), "compilation_config", None)
        if cc is None:
            return "vLLM's compilation config is not readable: cannot tell whether CUDA graphs hold the addresses"
        graphs = getattr(getattr(cc, "cudagraph_mode", None), "name", str(getattr(cc, "cudagraph_mode", None)))
        compiled = getattr(getattr(cc, "mode", None), "name", str(getattr(cc, "mode", None)))
        if graphs != "NONE" or compiled != "NONE":
            return (f"CUDA graphs / torch.compile keep the parameters' addresses (cudagraph_mode={graphs}, "
                    f"mode={compiled}): exchange needs vLLM started with --enforce-eager")
        by_param: Dict[str, List[Dict[str, Any]]] = {}
        for c in cap.copies:
            by_param.setdefault(c["param_name"], []).append(c)
        for n, copies in sorted(by_param.items()):
            why = _tiling_issue(n, cap.params[n].numel(), copies)
            if why:
                return why
        # Shared storages are checked at every install (_rc_exchange_refusal), not here: right after
        # the capture, garbage of the loader's run may still hold views that the next collection frees.
        return None

    @staticmethod
    def _rc_views(st: _State) -> List[Any]:
        """The staging views (rebuilt from the slabs after an exchange dropped them)."""
        if st.staging_views is None:
            with _plain(_torch()):
                st.staging_views = Extension._rc_slab_views(st.capture, st.slabs)
        return st.staging_views

    @staticmethod
    def _rc_slab_views(cap: _Capture, slabs: Dict[str, Any]) -> List[Any]:
        """Copy i's staging buffer: the dense box at its live offset inside its parameter's slab."""
        views = []
        for c in cap.copies:
            n = 1
            for x in c["dest_shape"]:
                n *= int(x)
            o = int(c["dest_offset"])
            views.append(slabs[c["param_name"]].view(-1)[o : o + n].view(list(c["dest_shape"])))
        return views

    @staticmethod
    def _rc_live_buffers(st: _State) -> Dict[str, Tuple[int, int]]:
        params = st.capture.params
        out = {}
        with _plain(_torch()):
            for c in st.capture.copies:
                p = params[c["param_name"]]
                out[c["param_name"]] = (p.data_ptr(), p.numel() * p.element_size())
        return out

    def _rc_digest_live(self, st: _State) -> Dict[str, Any]:
        torch = _torch()
        torch.cuda.synchronize()
        d = st.stager.live_digest()
        st.live_digest = d
        return d

    @staticmethod
    def _rc_staging_buffers(st: _State) -> Dict[str, Tuple[int, int]]:
        views = Extension._rc_views(st)
        with _plain(_torch()):
            return {f"rc.staging.{i}": (v.data_ptr(), v.numel() * v.element_size()) for i, v in enumerate(views)}

    def _rc_digest_fields(self, st: _State, d: Dict[str, Any], per_tensor: bool) -> Dict[str, Any]:
        """The digest part of rc_digest's reply for the live digest ``d`` (also part of rc_install's)."""
        out: Dict[str, Any] = {"content_digest": d["content_digest"], "digest_source": d.get("source", "reread"),
                               "fallback_tensors": list(st.fallback), "not_loaded": list(st.not_loaded)}
        rank, size = self._rc_tp()
        if size > 1:
            # Partial sums per tensor: the adapter adds them across ranks (or takes one when every
            # rank holds the whole tensor) and checks the element counts add up (docs/vllm.md).
            held: Dict[str, int] = {}
            numel: Dict[str, int] = {}
            for c in st.capture.copies:
                n = 1
                for x in c["dest_shape"]:
                    n *= x
                held[c["source"]] = held.get(c["source"], 0) + n
                total = 1
                for x in c["source_shape"]:
                    total *= x
                numel[c["source"]] = total
            out["content_digest"] = None
            out["tensor_sums"] = {n: {"sum": h, "elements": held.get(n, 0), "numel": numel.get(n, 0),
                                      "full": held.get(n, 0) == numel.get(n, -1)}
                                  for n, h in d["tensors"].items()}
        if per_tensor:
            out["tensors"] = dict(d["tensors"])
        return out

    def rc_bench_digest(self, repeats: int = 5) -> Dict[str, Any]:
        """Benchmark (not used by the controller): over the staging buffer (one allocation holding a
        copy of every staged byte), the GPU time of a plain 16-byte-load read sweep and of the
        staged digest kernel over the same bytes; over the live parameters, the live digest
        (re-read) kernel. Best of ``repeats``. Nothing is written."""
        from . import _core

        st = self._rc_state()
        with st.lock:
            try:
                if st.capture is None:
                    raise _Failure("FailedPrecondition", "nothing captured yet: stage a version first")
                dev = self._rc_device()
                views = self._rc_views(st)
                staged_bytes = sum(v.numel() * v.element_size() for v in views)
                # The read sweep over the staging allocation, or over every slab (summed) in the
                # exchange layout.
                allocs = [st.staging] if st.staging is not None else list(st.slabs.values())
                spans = [(a.data_ptr(), (a.numel() * a.element_size() // 16) * 16) for a in allocs]
                total = sum(n for _, n in spans)
                read = [sum(float(_core.read_sweep_ms(ptr, n, dev)) for ptr, n in spans if n)
                        for _ in range(int(repeats))]
                live = [float(self._rc_digest_live(st)["kernel_ms"]) for _ in range(int(repeats))]
                live_bytes = sum(b for _, b in self._rc_live_buffers(st).values())
                out = {"ok": True, "staging_alloc_bytes": total, "staged_bytes": staged_bytes,
                       "read_sweep_ms": min(read), "read_gbps": total / min(read) / 1e6,
                       "live_digest_kernel_ms": min(live), "live_param_bytes": live_bytes,
                       "live_digest_gbps": staged_bytes / min(live) / 1e6,
                       "digest_to_read_ratio": (staged_bytes / min(live)) / (total / min(read)),
                       "staging_layout": "dense" if st.staging is not None else "slabs"}
                return out
            except _Failure as f:
                return _fail(f.code, str(f))
            except Exception as e:
                return _fail(_code_of(e), f"rc_bench_digest: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    # ---- the protocol (docs/vllm.md) -------------------------------------------------------

    def rc_describe(self) -> Dict[str, Any]:
        try:
            st = self._rc_state()
            params = self._rc_params()
            rank, size = self._rc_tp()
            import vllm  # lazily, as every vLLM import of this module: the package imports without vLLM

            stable = None
            if st.first_ptrs is not None:
                stable = all(params[n].data_ptr() == p for n, p in st.first_ptrs.items() if n in params)
            return {
                "ok": True,
                "extension": "rolloutcore.vllm",
                "extension_version": EXTENSION_VERSION,
                # The release this worker runs (the controller and the tests tell 0.26 from 0.33 by it:
                # the pause, sleep and weight-version endpoints differ between them).
                "vllm_version": str(getattr(vllm, "__version__", "unknown")),
                "boot_id": _BOOT_ID,
                "tp_rank": rank,
                "tp_size": size,
                "device": f"cuda:{self._rc_device()}",
                "label": st.label,
                "generation": st.generation,
                "num_parameters": len(params),
                "parameter_bytes": int(sum(p.numel() * p.element_size() for p in params.values())),
                "captured": st.capture is not None,
                "data_ptrs_stable": stable,
                # How rc_install installs (docs/vllm.md "Install by exchange", "Atomic install"): the
                # mode vLLM started with, the staging layout, why an exchange cannot run (None: it
                # can), and whether an atomic install can reach vLLM's engine core from here.
                "install": {"mode": os.environ.get("ROLLOUTCORE_VLLM_INSTALL", "copy"),
                            "staging_layout": None if st.capture is None else (
                                "slabs" if st.slabs is not None else "dense"),
                            "exchange_issue": st.exchange_issue,
                            "atomic": dict(zip(("available", "reason"), self._rc_atomic_available()))},
                # rc_replay: on by default; ROLLOUTCORE_VLLM_REPLAY=0 in vllm serve's environment opts out.
                "offers_replay": os.environ.get("ROLLOUTCORE_VLLM_REPLAY", "1") != "0",
                # What the kernels compute with: vLLM's --quantization when it keeps weights in FP8
                # ("" otherwise); the controller replays only probes computed under the same.
                "quantization": (str(getattr(self.vllm_config.model_config, "quantization", None) or "")
                                 if self._rc_fp8_layers() else ""),
                "parameters": [
                    {"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                    for n, p in params.items()
                ],
            }
        except Exception as e:
            return _fail("Internal", f"rc_describe: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    def rc_stage(self, model: str, version: str, directory: str, timeout_ms: int = 120_000,
                 api_key: Optional[str] = None, delta_policy: Optional[str] = None,
                 install: Optional[str] = None) -> Dict[str, Any]:
        """Stages ``version`` into the GPU staging image while vLLM serves (receiver::DeviceReceiver).
        A version published with deltas on the version the staging image holds may be staged as a
        delta (docs/refit.md "Delta on the GPU"): ``delta_policy`` auto (the cheaper by the
        receiver's measurements), always or never; unset: the environment's
        ROLLOUTCORE_VLLM_DELTA_POLICY, else ``never`` (the GPU delta has not run on a GPU yet).
        The answer's ``mode`` says which ran and ``delta_choice`` / ``delta_ineligible`` why.
        ``install``: the install that will follow (rc_install's; default ROLLOUTCORE_VLLM_INSTALL):
        what is prepared for it while vLLM still serves (``install_prepared`` for a copy,
        ``exchange_prepared`` for an exchange)."""
        st = self._rc_state()
        t0 = time.perf_counter()
        with st.lock:
            try:
                if not model or not version or not directory:
                    raise _Failure("InvalidArgument", "rc_stage needs model, version and directory")
                if int(timeout_ms) <= 0:
                    raise _Failure("InvalidArgument", f"rc_stage timeout_ms must be positive, got {timeout_ms}")
                import urllib.error
                import urllib.parse

                url = (directory.rstrip("/") + "/v1/models/" + urllib.parse.quote(model, safe="") + "/versions/" +
                       urllib.parse.quote(version, safe=""))
                try:
                    manifest = _http_get_json(url, max(1.0, int(timeout_ms) / 1e3), api_key)
                except urllib.error.HTTPError as e:
                    body = e.read().decode("utf-8", "replace")
                    code = {404: "NotFound", 400: "InvalidArgument", 409: "FailedPrecondition",
                            412: "FailedPrecondition"}.get(e.code, "Unavailable")
                    raise _Failure(code, f"GET {url} answered {e.code}: {body}")
                except OSError as e:
                    raise _Failure("Unavailable", f"GET {url}: {e}")
                m = manifest["manifest"]
                specs = sorted((t["name"], t["dtype"], [int(x) for x in t["shape"]]) for t in m["tensors"])
                if not specs:
                    raise _Failure("InvalidArgument", f"version {version} of {model} has no tensors")
                mode = _install_mode(install)
                st.staged_version = None
                st.fused = None
                st.exchange = None
                t1 = time.perf_counter()
                self._rc_ensure_capture(st, specs)
                capture_ms = (time.perf_counter() - t1) * 1e3
                remaining = max(1, int(timeout_ms) - int((time.perf_counter() - t0) * 1e3))
                if delta_policy is None:
                    delta_policy = os.environ.get("ROLLOUTCORE_VLLM_DELTA_POLICY", "never")
                if delta_policy not in ("auto", "always", "never"):
                    raise _Failure("InvalidArgument",
                                   f"rc_stage delta_policy must be auto, always or never, got {delta_policy!r}")
                ev = st.stager.stage(directory, model, version, remaining,
                                     pull_delay_ms=int(st.faults.get("stage_pull_delay_ms", 0)),
                                     delta_policy=delta_policy)
                ev["stage_ms"]["capture"] = capture_ms
                ev["stage_ms"]["total"] = (time.perf_counter() - t0) * 1e3
                st.published = dict(ev.pop("published"))
                st.staged_version = version
                st.staged_mode = ev.get("mode", "full")
                st.staged_policy = delta_policy
                ev.update(ok=True, version=version, model=model,
                          fallback_tensors=list(st.fallback), not_loaded=list(st.not_loaded),
                          captured_copies=len(st.capture.copies),
                          suppressed_writes=dict(st.capture.suppressed_writes),
                          fallback_reasons={n: st.capture.unsupported[n] for n in st.fallback})
                # An exchange: the stager checks now, while vLLM serves, that pointing the live
                # parameters at the slabs makes them exactly the staged bytes, and builds the live
                # digest table of the slabs.
                if mode == "exchange" and st.slabs is not None and st.staged_mode != "delta" \
                        and delta_policy == "never":
                    torch = _torch()
                    alias = _alias_issue(torch, st.capture.params, list(st.slabs))
                    if alias is not None:
                        # Garbage (a loader's views in a reference cycle) is collected now, while
                        # serving, so that the install's own check finds only what lives on.
                        gc.collect()
                        alias = _alias_issue(torch, st.capture.params, list(st.slabs))
                    if alias is None:
                        live_after = {n: (t.data_ptr(), t.numel() * t.element_size()) for n, t in st.slabs.items()}
                        st.exchange = dict(st.stager.prepare_exchange(live_after))
                    else:
                        st.exchange = {"ok": False, "reason": alias}
                    ev["exchange_prepared"] = dict(st.exchange)
                elif mode == "exchange":
                    ev["exchange_prepared"] = {"ok": False, "reason": self._rc_exchange_refusal(st)}
                # The fused install table (copy + digest in one launch) is built and uploaded now, while
                # vLLM still serves, so the install inside the pause only launches it.
                if st.exchange and st.exchange.get("ok"):
                    st.fused = {"ok": False, "reason": "an exchange is prepared (the copy's table is built if needed)"}
                elif st.fallback:
                    st.fused = {"ok": False, "reason": f"fallback tensors {st.fallback[:4]} load through load_weights"}
                elif os.environ.get("ROLLOUTCORE_VLLM_FUSED_INSTALL", "1") == "0":
                    st.fused = {"ok": False, "reason": "ROLLOUTCORE_VLLM_FUSED_INSTALL=0"}
                else:
                    st.fused = dict(st.stager.prepare_install())
                ev["install_prepared"] = dict(st.fused)
                if st.fp8 is not None:
                    # FP8 serving: the expected image of this version, from the proven staged bytes,
                    # computed now so that the pause only quantizes and digests the live image.
                    t2 = time.perf_counter()
                    st.fp8["expected"] = {"version": version, "digests": self._rc_fp8_expected(st, staged=True)}
                    ev["stage_ms"]["fp8_expected"] = (time.perf_counter() - t2) * 1e3
                st.staged_evidence = ev
                return ev
            except _Failure as f:
                return _fail(f.code, str(f))
            except Exception as e:
                return _fail(_code_of(e), f"rc_stage {version}: {type(e).__name__}: {e}",
                             traceback=traceback.format_exc())

    def _rc_exchange_refusal(self, st: _State) -> Optional[str]:
        """Why this install cannot be an exchange (None when it can)."""
        if st.slabs is None:
            return st.exchange_issue or "the staging image is not laid out in slabs"
        if st.staged_mode == "delta" or st.staged_policy in ("auto", "always"):
            how = "as a delta" if st.staged_mode == "delta" else f"under delta policy {st.staged_policy}"
            return (f"the version was staged {how}: an install by copy keeps the staging image at the live "
                    "version, the base of the next delta (an exchange would leave the previous version there)")
        if not (st.exchange and st.exchange.get("ok")):
            return "prepare_exchange: " + str((st.exchange or {}).get("reason", "not run for this stage"))
        return _alias_issue(_torch(), st.capture.params, list(st.slabs))

    def _rc_exchange(self, st: _State, reread: bool,
                     lap: Any = lambda name: None) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """Points every live parameter at its staged slab and keeps the old storage as the next slab,
        then has the stager prove the live weights. On any failure every parameter gets its storage
        back (nothing live changed) and the reason is returned instead of a digest."""
        torch = _torch()
        params = st.capture.params
        swapped: List[str] = []
        st.staging_views = None
        try:
            with torch.no_grad(), _plain(torch):
                for n in st.slabs:
                    p = params[n]
                    old = p.data
                    p.data = st.slabs[n]
                    st.slabs[n] = old
                    swapped.append(n)
            lap("exchange_swaps")
            d = dict(st.stager.complete_exchange(reread=reread))
            lap("exchange_proof")
            return d, None
        except Exception as e:  # noqa: BLE001 - undone below and reported
            with torch.no_grad(), _plain(torch):
                for n in reversed(swapped):
                    p = params[n]
                    cur = p.data
                    p.data = st.slabs[n]
                    st.slabs[n] = cur
            return None, f"{type(e).__name__}: {e}"

    def _rc_atomic_available(self) -> Tuple[bool, Optional[str]]:
        core, why = _engine_core_of(self)
        return (core is not None), (why or None)

    @staticmethod
    def _rc_engine_side(core: Any, version: str) -> Dict[str, Any]:
        """The atomic install's engine half, on the engine core's thread between two steps: every cache
        computed under the old weights reset, vLLM's own weight version set (0.33; 0.26 has none)."""
        t0 = time.perf_counter()
        out: Dict[str, Any] = {"engine": type(core).__name__}
        if core.reset_prefix_cache() is False:
            raise _Failure("Internal", "vLLM's reset_prefix_cache answered false after the install (a KV block is "
                                       "still held): cached prefixes of the old weights may be served")
        out["prefix_cache_reset"] = True
        for m in ("reset_mm_cache", "reset_encoder_cache"):
            f = getattr(core, m, None)
            out[m] = callable(f)
            if callable(f):
                f()
        setv = getattr(core, "set_weight_version", None)
        if callable(setv):
            setv(version)
        out["vllm_label"] = version if callable(setv) else None
        out["ms"] = (time.perf_counter() - t0) * 1e3
        return out

    def rc_install(self, version: str, install: Optional[str] = None, verify: Optional[str] = None,
                   atomic: bool = False) -> Dict[str, Any]:
        """Installs the staged ``version`` into the live parameters, only while vLLM runs no step on
        them (paused, or ``atomic``), and proves them.

        * ``install="copy"`` (default; ROLLOUTCORE_VLLM_INSTALL): one fused kernel copies the staging
          image into the live storage and digests what it writes; the addresses stay.
        * ``install="exchange"``: every live parameter is pointed at its staged slab and the old
          storage becomes the next slab: no byte moves (docs/vllm.md "Install by exchange"). Only
          when vLLM started with the slab layout (ROLLOUTCORE_VLLM_INSTALL=exchange), runs without
          CUDA graphs, no other tensor shares a parameter's storage and the version was staged in
          full; otherwise by copy, the reply's ``exchange_refused`` says why. ``verify``: reread
          (default; ROLLOUTCORE_VLLM_EXCHANGE_VERIFY) re-digests the live weights, staged takes
          the digest the stage proved for these very bytes.
        * ``atomic=True``: in the same call, vLLM's prefix, multimodal and encoder caches are reset
          and vLLM's own weight version set, on the engine core's thread between two steps, so no
          pause is needed (docs/vllm.md "Atomic install"). Refused untouched unless the engine core
          runs this worker in its thread and has no request in flight: none running, none waiting
          after it started (tokens computed, output produced or preempted; every waiting queue of
          0.26 / 0.33 read, and a scheduler with none of them refused), no step in the batch queue.
          A queued, never-started request runs after, on the new weights (``_engine_busy``).
        """
        torch = _torch()
        st = self._rc_state()
        with st.lock:
            def refuse(code: str, msg: str) -> Dict[str, Any]:
                return _fail(code, msg, outcome="refused_untouched", label=st.label, generation=st.generation)

            if st.staged_version != version or st.capture is None:
                return refuse("FailedPrecondition", f"nothing staged for {version} (staged: {st.staged_version})")
            try:
                mode, vmode = _install_mode(install), _verify_mode(verify)
            except _Failure as f:
                return refuse(f.code, str(f))
            core = None
            if atomic:
                core, why = _engine_core_of(self)
                if core is None:
                    return refuse("FailedPrecondition", f"atomic install: {why}")
                busy = _engine_busy(core)
                if busy:
                    return refuse("FailedPrecondition", f"atomic install: the engine is not idle ({busy}): "
                                                        "drain or pause it first")
            t0 = time.perf_counter()
            mutated = False
            try:
                params = st.capture.params
                nbytes = 0
                d = None
                path = None
                exchange_refused = None
                # Where the worker's time goes (the bench names every part of the pause window).
                split: Dict[str, float] = {}
                tick = [time.perf_counter()]

                def lap(name: str) -> None:
                    now = time.perf_counter()
                    split[name] = split.get(name, 0.0) + (now - tick[0]) * 1e3
                    tick[0] = now

                if mode == "exchange":
                    exchange_refused = self._rc_exchange_refusal(st)
                    lap("checks")
                    if exchange_refused is None:
                        torch.cuda.synchronize()
                        lap("synchronize")
                        mutated = True
                        d, exchange_refused = self._rc_exchange(st, reread=vmode == "reread", lap=lap)
                        if d is None:
                            lap("exchange_undone")
                            mutated = False  # every parameter has its storage back
                        else:
                            path = "exchange"
                            nbytes = int(st.exchange["bytes"])  # the slabs' bytes, summed by prepare_exchange
                            if st.faults.get("install_sleep_ms"):
                                time.sleep(st.faults["install_sleep_ms"] / 1e3)
                            install_ms = (time.perf_counter() - t0) * 1e3
                fused = path is None and bool(st.fused and st.fused.get("ok"))
                if path is None and not fused and st.slabs is not None and not st.fallback and st.fp8 is None:
                    # The stage prepared an exchange only: the fused table now (inside the pause).
                    st.fused = dict(st.stager.prepare_install())
                    fused = bool(st.fused.get("ok"))
                    lap("prepare_install")
                fused_refused = None
                if fused:
                    # One launch: every staging copy into its live destination, digesting what it
                    # writes (the digest of the live weights without a second pass over them). The
                    # stager refuses, writing nothing, when the buffers are not the prepared ones.
                    torch.cuda.synchronize()
                    lap("synchronize")
                    mutated = True
                    d = dict(st.stager.install())
                    lap("fused_install_call")
                    if not d.get("ok"):
                        mutated, fused, fused_refused, d = False, False, d.get("reason"), None
                if fused:
                    path = "fused"
                    nbytes = int(d["bytes"])
                    if st.faults.get("install_sleep_ms"):
                        time.sleep(st.faults["install_sleep_ms"] / 1e3)
                    install_ms = (time.perf_counter() - t0) * 1e3
                if path is None:
                    path = "copy_then_digest"
                    views = self._rc_views(st)
                    with torch.no_grad():
                        for i, c in enumerate(st.capture.copies):
                            p = params[c["param_name"]]
                            dst = torch.as_strided(p.data, c["dest_shape"], c["dest_strides"],
                                                   p.data.storage_offset() + c["dest_offset"])
                            mutated = True
                            dst.copy_(views[i])
                            if i == 0 and st.faults.get("install_sleep_ms"):
                                torch.cuda.synchronize()
                                time.sleep(st.faults["install_sleep_ms"] / 1e3)
                            nbytes += views[i].numel() * views[i].element_size()
                        if st.fallback:
                            base = len(st.capture.copies)
                            model = self._rc_model()
                            for j, name in enumerate(st.fallback):
                                mutated = True
                                model.load_weights([(name, views[base + j])])
                                nbytes += views[base + j].numel() * views[base + j].element_size()
                    torch.cuda.synchronize()
                    install_ms = (time.perf_counter() - t0) * 1e3
                    lap("copies")
                fp8_report = None
                if st.fp8 is not None:
                    fault = str(st.faults.pop("fp8_install", ""))
                    fp8_report = self._rc_fp8_quantize(
                        st, "wrong_scale" if fault == "self_consistent_wrong_scale" else fault)
                    if fault:
                        fp8_report["fault"] = fault
                    # A self-check that reads the live image (the fault self_consistent_wrong_scale),
                    # until the next install: only the trainer's published image can catch it.
                    st.fp8["expected_from_live"] = fault == "self_consistent_wrong_scale"
                    st.fp8["installed"] = True
                    st.fp8.pop("from_checkpoint", None)
                st.label = version
                st.generation += 1
                st.staged_version = None
                st.exchange = None
                lap("fp8_and_label")
                if d is None:
                    d = self._rc_digest_live(st)
                    lap("live_digest")
                else:
                    st.live_digest = d
                mismatch = [n for n, h in d["tensors"].items() if st.published.get(n) != h]
                out = {"ok": True, "outcome": "installed", "label": st.label, "generation": st.generation,
                       "boot_id": _BOOT_ID, "bytes_installed": nbytes, "install_ms": install_ms,
                       "install_path": path, "install_mode": mode,
                       "bytes_copied": 0 if path == "exchange" else nbytes,
                       "exchange_refused": exchange_refused if mode == "exchange" else None,
                       "fused_refused": fused_refused if fused_refused else (
                           None if path in ("fused", "exchange") else (st.fused or {}).get("reason")),
                       "digest_ms": d["digest_ms"] if path != "fused" else 0.0, "kernel_ms": d.get("kernel_ms"),
                       "verified": not mismatch, "mismatched_tensors": mismatch[:16],
                       "fallback_tensors": list(st.fallback), "not_loaded": list(st.not_loaded)}
                if path == "exchange":
                    out["exchange_verify"] = vmode
                if fp8_report is not None:
                    # The proof of the FP8 image, inside the pause (read by the adapter with the digest).
                    pre = st.fp8.pop("expected", None)
                    if pre is not None and pre["version"] == version:
                        st.fp8["evidence"] = self._rc_fp8_evidence(st, pre["digests"], "staged")
                    else:
                        st.fp8["evidence"] = self._rc_fp8_evidence(st)
                    out["fp8"] = {**fp8_report, **st.fp8["evidence"]}
                # What rc_label and rc_digest(fresh=False) would answer now, so the adapter needs no
                # further round trip inside the pause.
                out.update(self._rc_digest_fields(st, d, per_tensor=False))
                if core is not None:
                    if mismatch:
                        # Not proven: the engine keeps its caches and label, the caller taints.
                        out["atomic"] = {"engine": type(core).__name__, "skipped": "the live digest did not verify"}
                    else:
                        out["atomic"] = self._rc_engine_side(core, version)
                lap("reply" if core is None else "reply_and_engine_side")
                out["worker_split_ms"] = {k: round(v, 3) for k, v in split.items()}
                out["call_ms"] = (time.perf_counter() - t0) * 1e3
                return out
            except Exception as e:
                outcome = "failed_after_mutation" if mutated else "refused_untouched"
                if mutated:
                    st.label = "<unknown after a failed install of " + version + ">"
                    st.live_digest = None
                return _fail(_code_of(e), f"rc_install {version}: {type(e).__name__}: {e}", outcome=outcome,
                             label=st.label, generation=st.generation, traceback=traceback.format_exc())

    def rc_digest(self, per_tensor: bool = False, fresh: bool = False) -> Dict[str, Any]:
        st = self._rc_state()
        with st.lock:
            try:
                if st.capture is None:
                    # Nothing staged yet: capture against the checkpoint vLLM loaded from disk.
                    folder = self.vllm_config.model_config.model
                    if not os.path.isdir(folder):
                        raise _Failure("FailedPrecondition",
                                       f"no capture yet and the model {folder} is not a local folder")
                    specs = _safetensors_specs(folder)
                    if not specs:
                        raise _Failure("FailedPrecondition",
                                       f"no capture yet and {folder} holds no safetensors weights (vLLM started "
                                       "with --load-format dummy?): nothing proves the live weights until a "
                                       "version is staged and installed")
                    self._rc_ensure_capture(st, specs)
                if st.fp8 is not None and not st.fp8.get("installed"):
                    # The bf16 shadows of vLLM's FP8 parameters hold nothing before an install: they
                    # take the checkpoint vLLM quantized at load, and the evidence proves its image.
                    folder = self.vllm_config.model_config.model
                    if not os.path.isdir(folder) or not _safetensors_specs(folder):
                        raise _Failure("FailedPrecondition",
                                       f"vLLM serves FP8 ({st.fp8['quantization']}) quantized from {folder}, which is "
                                       "not a local folder of safetensors (--load-format dummy?): nothing is proven "
                                       "before the first rc_install")
                    self._rc_fp8_shadows_from_checkpoint(st, folder)
                    st.live_digest = None
                cached = st.live_digest is not None and not fresh
                d = st.live_digest if cached else self._rc_digest_live(st)
                out = {"ok": True, "label": st.label, "generation": st.generation, "digest_ms": d["digest_ms"],
                       "cached": cached}
                out.update(self._rc_digest_fields(st, d, per_tensor=per_tensor))
                if st.fp8 is not None:
                    if not cached or "evidence" not in st.fp8:
                        st.fp8["evidence"] = self._rc_fp8_evidence(st)
                    out["fp8"] = dict(st.fp8["evidence"])
                    if st.fp8.get("from_checkpoint"):
                        out["fp8"]["bf16_from"] = st.fp8["from_checkpoint"]
                return out
            except _Failure as f:
                return _fail(f.code, str(f))
            except Exception as e:
                return _fail(_code_of(e), f"rc_digest: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    # ---- FP8 serving (docs/fp8.md, "vLLM") ---------------------------------------------------------

    def rc_fp8_image(self) -> Dict[str, Any]:
        """The FP8 image this worker serves: for every linear layer whose weight vLLM keeps in
        float8_e4m3fn (--quantization fp8_per_tensor / fp8_per_channel / fp8_per_block), the layout it keeps
        the weight and its scales in, and the digests `rolloutcore model fp8-digest` computes for that
        vLLM parameter from the bf16 checkpoint: the E4M3 bytes as the [out, in] matrix and the scales
        as their grid (per tensor [1, 1], per channel [out, 1], per block weight_scale_inv's grid).
        Read by logical index, so a layout that only changes strides (vLLM keeps qweight.t()) reads as
        the same matrix; a kernel that re-lays out the values would show as a different digest.
        Tensor parallelism 1 only, for now (a rank's box and the replicated per-tensor scale are not
        handled yet): FailedPrecondition otherwise."""
        torch = _torch()
        try:
            import numpy as np

            from rolloutcore import _core

            tp_rank, tp_size = self._rc_tp()
            if tp_size != 1:
                raise _Failure("FailedPrecondition",
                               f"rc_fp8_image: tensor-parallel size {tp_size}; only 1 is handled so far")
            t0 = time.perf_counter()
            params: Dict[str, Any] = {}
            for mname, mod in self._rc_model().named_modules():
                w = getattr(mod, "weight", None)
                if not isinstance(w, torch.Tensor) or w.dtype != torch.float8_e4m3fn:
                    continue
                rows = getattr(mod, "output_size_per_partition", None)
                cols = getattr(mod, "input_size_per_partition", None)
                info: Dict[str, Any] = {"weight": {"shape": list(w.shape), "stride": list(w.stride())},
                                        "rows": rows, "cols": cols}
                q = w
                if rows is not None and cols is not None and tuple(w.shape) == (cols, rows) and (
                        rows != cols or tuple(w.stride()) == (1, cols)):
                    q = w.t()  # vLLM keeps qweight.t(): the [out, in] matrix read through a transpose
                info["transposed"] = q is not w
                sname = next((n for n in ("weight_scale_inv", "weight_scale")
                              if isinstance(getattr(mod, n, None), torch.Tensor)), None)
                if sname is None:
                    info["error"] = "no weight_scale or weight_scale_inv"
                    params[mname + ".weight"] = info
                    continue
                s = getattr(mod, sname)
                info["scale"] = {"name": sname, "shape": list(s.shape), "stride": list(s.stride()), "dtype": str(s.dtype)}
                n_out = q.shape[0]
                if s.numel() == 1:
                    grid = [1, 1]
                elif s.dim() == 2 and sname == "weight_scale_inv":
                    grid = list(s.shape)
                elif s.numel() == n_out:
                    grid = [n_out, 1]
                else:
                    grid = list(s.shape)
                qb = q.contiguous().view(torch.uint8).cpu().numpy()
                sb = np.ascontiguousarray(s.float().cpu().numpy().reshape(grid))
                info["scales_shape"] = grid
                info["bytes_digest"] = _core.tensor_digest(qb, dtype="f8_e4m3")
                info["scales_digest"] = _core.tensor_digest(sb, dtype="f32")
                params[mname + ".weight"] = info
            quant = getattr(self.vllm_config.model_config, "quantization", None)
            return {"ok": True, "tp_rank": tp_rank, "quantization": quant, "parameters": params,
                    "digest_ms": (time.perf_counter() - t0) * 1e3}
        except _Failure as f:
            return _fail(f.code, str(f))
        except Exception as e:
            return _fail(_code_of(e), f"rc_fp8_image: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    # ---- vLLM's own transfer (controller serve --vllm-transfer native-nccl; docs/vllm.md) ----------

    def _rc_reload_state(self, model: Any) -> Dict[str, Any]:
        """How much of the model is inside vLLM's layerwise reload (between a start_weight_update
        and its finalize): such layers hold meta tensors, their kernel tensors set aside."""
        in_reload = 0
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

            for m in model.modules():
                info = LAYERWISE_INFO.get(m)
                if info is not None and info.can_load():
                    in_reload += 1
        except ImportError:  # pragma: no cover - another vLLM
            in_reload = -1
        meta = sum(1 for p in model.parameters() if p.is_meta)
        return {"session_active": bool(getattr(self, "_weight_update_active", False)),
                "layers_in_reload": in_reload, "meta_parameters": meta}

    def rc_native_state(self, restore: bool = False) -> Dict[str, Any]:
        """The state vLLM's weight-transfer session left the model in. vLLM 0.26 resets its session
        when ``update_weights`` raises, but does not finalize the layerwise reload that
        ``start_weight_update`` began: the model's layers stay on meta tensors (their kernel tensors,
        still holding the old values where nothing was loaded, set aside), and ``finish`` is then
        refused ("without a matching start"). ``restore=True`` (only with no session active) runs
        vLLM's own ``finalize_layerwise_reload``, which puts the kernel tensors back (layers that
        received nothing keep their old values; a layer that received part of its weights is
        processed with what it got). Nothing here sets the label: rc_adopt does, by proof."""
        try:
            model = self._rc_model()
            before = self._rc_reload_state(model)
            out: Dict[str, Any] = {"ok": True, "before": before, "restored": False}
            if restore and before["layers_in_reload"] > 0:
                if before["session_active"]:
                    raise _Failure("FailedPrecondition",
                                   "rc_native_state: a weight-transfer session is active: finish it "
                                   "(/finish_weight_update) instead of restoring under it")
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(model, self.vllm_config.model_config)
                out["restored"] = True
            out["after"] = self._rc_reload_state(model)
            return out
        except _Failure as f:
            return _fail(f.code, str(f))
        except Exception as e:
            return _fail(_code_of(e), f"rc_native_state: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    def rc_adopt(self, version: str, content_digest: str, specs: Optional[List[Any]] = None) -> Dict[str, Any]:
        """After vLLM's own transfer (start/update/finish) installed ``version``: computes a fresh
        digest of the live weights (re-read, through the captured mapping; ``specs`` =
        [[HF name, torch dtype name, shape], ...] of the sent tensors, i.e. the update_info, select
        the capture) and sets the label to ``version`` only if it equals ``content_digest`` (the
        manifest's). The label is thus produced by proof, never written to match. Refused (the
        reply's outcome ``failed_after_mutation``: vLLM's transfer already wrote the weights) when
        the digest differs, the model is still inside a layerwise reload, or a captured parameter
        is no longer the module's. On a mismatch the label stays only if the live digest still
        equals the one the label was proven with; otherwise it says the weights are unknown.
        TP=1 only (several ranks hold partial sums: the two-GPU issue)."""
        torch = _torch()
        st = self._rc_state()
        with st.lock:
            t0 = time.perf_counter()
            try:
                if not version or not isinstance(content_digest, str) or len(content_digest) != 16:
                    raise _Failure("InvalidArgument",
                                   f"rc_adopt needs a version and a 16-hex-digit content_digest, got {content_digest!r}")
                rank, size = self._rc_tp()
                if size > 1:
                    raise _Failure("FailedPrecondition", f"rc_adopt: TP={size}: only TP=1 can compare the "
                                   "whole digest in one rank (the partial sums need the adapter)")
                model = self._rc_model()
                rs = self._rc_reload_state(model)
                if rs["layers_in_reload"] or rs["meta_parameters"] or rs["session_active"]:
                    raise _Failure("FailedPrecondition",
                                   f"rc_adopt {version}: the model is not out of vLLM's weight update: {rs}")
                if specs:
                    torch_to_refit = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
                    conv = []
                    for name, dt, shape in specs:
                        if dt not in torch_to_refit:
                            raise _Failure("InvalidArgument", f"rc_adopt: tensor {name} has dtype {dt}")
                        conv.append((str(name), torch_to_refit[dt], [int(x) for x in shape]))
                    self._rc_ensure_capture(st, sorted(conv))
                elif st.capture is None:
                    folder = self.vllm_config.model_config.model
                    self._rc_ensure_capture(st, _safetensors_specs(folder))
                live = dict(model.named_parameters())
                moved = [n for n, p in st.capture.params.items()
                         if n in {c["param_name"] for c in st.capture.copies} and live.get(n) is not p]
                if moved:
                    raise _Failure("FailedPrecondition", f"rc_adopt {version}: {len(moved)} captured parameter(s) are "
                                   f"no longer the module's (e.g. {moved[0]}): the capture does not describe the model")
                proven = st.live_digest["content_digest"] if st.live_digest else None
                d = self._rc_digest_live(st)
                ms = (time.perf_counter() - t0) * 1e3
                if d["content_digest"] != content_digest:
                    if proven != d["content_digest"]:
                        st.label = f"<unknown after vLLM's transfer of {version}>"
                    return _fail("DataLoss", f"rc_adopt {version}: live digest {d['content_digest']} != the "
                                 f"manifest's {content_digest}: label not set", outcome="failed_after_mutation",
                                 label=st.label, generation=st.generation, boot_id=_BOOT_ID,
                                 live_digest=d["content_digest"], expected_digest=content_digest,
                                 label_kept=proven == d["content_digest"], adopt_ms=ms)
                st.label = version
                st.generation += 1
                st.staged_version = None
                nbytes = 0
                for p in {c["param_name"]: st.capture.params[c["param_name"]] for c in st.capture.copies}.values():
                    nbytes += p.numel() * p.element_size()
                out = {"ok": True, "outcome": "installed", "label": st.label, "generation": st.generation,
                       "boot_id": _BOOT_ID, "bytes_installed": nbytes, "install_ms": ms, "adopt_ms": ms,
                       "install_path": "vllm_native", "verified": True, "digest_ms": d["digest_ms"]}
                out.update(self._rc_digest_fields(st, d, per_tensor=False))
                torch.cuda.synchronize()
                return out
            except _Failure as f:
                return _fail(f.code, str(f), outcome="failed_after_mutation", label=st.label, generation=st.generation)
            except Exception as e:
                return _fail(_code_of(e), f"rc_adopt {version}: {type(e).__name__}: {e}",
                             outcome="failed_after_mutation", label=st.label, generation=st.generation,
                             traceback=traceback.format_exc())

    def rc_fault(self, **faults: Any) -> Dict[str, Any]:
        """Tests only (``ROLLOUTCORE_VLLM_FAULT_INJECTION=1`` in vLLM's environment, else refused):
        replaces the fault set. ``install_sleep_ms``: rc_install sleeps that long after its first
        live copy (mutation has begun), so a test can kill vLLM mid-install.
        ``stage_pull_delay_ms``: rc_stage holds its pull that long (within its timeout) after the
        trainer's memory was imported and before the reads are posted, so a test can kill the
        trainer mid-pull. ``fp8_install``: when vLLM serves FP8, the next rc_install leaves the FP8
        image wrong in one way (wrong_scale, stale_scales, swizzled_scales, stale_image, or
        self_consistent_wrong_scale: wrong_scale with the extension's own expected image read from
        the live one until the next install, which only the trainer's published image catches; see
        _rc_fp8_quantize) and its proof must fail; once. ``rc_fault()`` with no argument clears them."""
        if os.environ.get("ROLLOUTCORE_VLLM_FAULT_INJECTION") != "1":
            return _fail("FailedPrecondition", "fault injection is off (ROLLOUTCORE_VLLM_FAULT_INJECTION=1 enables it)")
        known = {"install_sleep_ms", "stage_pull_delay_ms", "fp8_install"}
        bad = sorted(set(faults) - known)
        if bad:
            return _fail("InvalidArgument", f"unknown faults {bad}; known: {sorted(known)}")
        fp8_faults = ("wrong_scale", "stale_scales", "swizzled_scales", "stale_image", "self_consistent_wrong_scale")
        if "fp8_install" in faults:
            f = faults["fp8_install"]
            quant = str(getattr(self.vllm_config.model_config, "quantization", None))
            if f not in fp8_faults:
                return _fail("InvalidArgument", f"fp8_install {f!r}: one of {list(fp8_faults)}")
            if quant not in _FP8_SCHEMES:
                return _fail("FailedPrecondition", f"fp8_install {f}: vLLM does not serve FP8 from bf16 "
                                                   f"(quantization {quant})")
            if f == "swizzled_scales" and quant == "fp8_per_tensor":
                return _fail("InvalidArgument", "fp8_install swizzled_scales: fp8_per_tensor has one scale per "
                                                "parameter, nothing to re-lay out")
        st = self._rc_state()
        st.faults = {k: (str(v) if k == "fp8_install" else int(v)) for k, v in faults.items()}
        return {"ok": True, "faults": dict(st.faults)}

    def rc_label(self) -> Dict[str, Any]:
        st = self._rc_state()
        d = st.live_digest
        return {"ok": True, "label": st.label, "generation": st.generation, "boot_id": _BOOT_ID,
                "content_digest": None if d is None else d["content_digest"]}

    # ---- requests frozen by a keep pause (policy modes keep / recompute) ----------------------

    def _rc_runner_requests(self) -> Tuple[str, Dict[str, Any]]:
        """Which GPU model runner this worker has and the requests it holds, by vLLM's internal id.

        * ``("v2", {req_id: slot})``: the V2 runner (``v1/worker/gpu/model_runner.py``), whose
          per-request state is ``self.req_states`` (``v1/worker/gpu/states.py`` ``RequestState``:
          ``req_id_to_index``, ``prompt_len``, ``total_len``). It is the default for dense models
          in 0.26 (``config/vllm.py`` ``use_v2_model_runner``: every non-MoE generate model) and for
          every configuration without a V2-unsupported feature in 0.33; ``VLLM_USE_V2_MODEL_RUNNER``
          overrides both.
        * ``("v1", {req_id: CachedRequestState})``: the V1 runner (``v1/worker/gpu_model_runner.py``
          ``self.requests``).
        """
        runner = self.model_runner
        live = getattr(runner, "requests", None)
        if isinstance(live, dict):
            return "v1", live
        states = getattr(runner, "req_states", None)
        index = getattr(states, "req_id_to_index", None)
        if isinstance(index, dict):
            return "v2", index
        raise _Failure("Unimplemented", f"model runner {type(runner).__module__}.{type(runner).__name__} holds its "
                       "requests neither in .requests (V1) nor in .req_states (V2)")

    def rc_frozen(self) -> Dict[str, Any]:
        """The requests the model runner holds and how many output tokens each has generated so far,
        read while the engine is paused with ``/pause?mode=keep`` (or ``/sleep?level=0&mode=keep``).
        For the keep and recompute policy modes: each count is that request's swap index, the
        index of its first output token sampled after the pause (by the new weights).

        ``{"ok": true, "runner": "v2"|"v1", "requests": [{"request_id", "output_tokens"}, ...]}``,
        sorted by id; ``{"ok": false, "code": "Unimplemented", "error": why}`` when this runner
        cannot give an exact count (never a guess). ``request_id`` is vLLM's internal id, as the
        scheduler hands it to the worker: for ``/v1/completions`` with ``"request_id": R`` (and no
        ``X-Request-Id`` header, which would replace R) it is ``cmpl-R-0-<8 lowercase hex>`` in both
        0.26 and 0.33 (``entrypoints/openai/completion/serving.py:147,183``: ``cmpl-{R}``, then
        ``-{prompt index}``; ``v1/engine/input_processor.py`` ``assign_request_id``, 0.26 :240,
        0.33 :371: ``-{random_uuid():.8}``).

        What the count is: the number of output tokens the sampler produced for the request and
        the runner recorded, including those generated before a preemption (a resumed request is
        re-added with prompt + outputs as its prefill).

        * V2: ``total_len[slot] - prompt_len[slot]``. ``total_len`` starts at the prefill length
          (``states.py`` ``add_request``) and only ``_post_update_kernel`` moves it, by the number
          of tokens sampled and accepted in a step (``v1/worker/gpu/input_batch.py``, 0.26 :480-487,
          0.33 :597-604; a partial prefill chunk samples none). It lives on the GPU, written by
          kernels only (no placeholder tokens exist in V2), so it is read after a device
          synchronize. ``prompt_len`` is the user prompt's length (CPU).
        * V1: ``len(requests[id].output_token_ids)``: one entry per sampled token. With async
          scheduling the entry is a ``-1`` placeholder (``gpu_model_runner.py`` 0.26 :3768, 0.33
          :3529) until the next step fills it, but there is still exactly one per sampled token;
          only the length is used. Refused with async scheduling plus speculative decoding: V1 then
          appends one placeholder per step although several tokens may have been accepted, and
          corrects the list only in the next step (0.33 :1364, :1409-1413).
        * Pipeline parallelism is refused: the non-last stages learn the sampled tokens a step late.

        Why it is exact while paused: a keep pause completes (``/pause`` or ``/sleep`` answers)
        only when the engine core has no work left: ``_pause_complete()`` is ``not has_work()``,
        and ``has_work`` includes the batch queue (``v1/engine/core.py`` 0.26 :1346-1352, :1797;
        0.33 :1608-1614, :2217). Paused with keep the scheduler schedules nothing
        (``token_budget = 0``, ``v1/core/sched/scheduler.py`` 0.26 :446, 0.33 :723) and counts no
        unfinished request (0.26 :2290, 0.33 :3148), so by then every batch that async scheduling
        had in flight has been sampled and its output processed (``update_from_output``): every
        token counted here was
        sent to the client before the pause, and in 0.33 under the label current then
        (``_attach_weight_version``, core.py:657-660). A request that finished in those last steps
        is removed from the runner by the step that carries its id in ``finished_req_ids``
        (``has_requests`` counts finished requests) before the pause completes. Nothing steps
        until the resume; this method runs in the worker's own loop, between steps. So the count
        equals the output length the client has received, and 0.33's own ``weight_versions``
        boundary for the request (``v1/engine/output_processor.py:531-536, 822``: a span starts at
        the number of tokens already emitted when a step's label differs). Outside such a pause the numbers are
        only a snapshot between two steps: the worker cannot see the scheduler's pause state, so
        the caller must have paused first."""
        try:
            torch = _torch()
            pc = self.vllm_config.parallel_config
            pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
            if pp > 1:
                raise _Failure("Unimplemented", f"rc_frozen: pipeline parallel size {pp}: the non-last stages learn "
                               "the sampled tokens one step late, so their counts are not exact")
            kind, live = self._rc_runner_requests()
            runner = self.model_runner
            out: List[Dict[str, Any]] = []
            if kind == "v2":
                states = runner.req_states
                total_len = getattr(getattr(states, "total_len", None), "gpu", None)
                prompt_len = getattr(getattr(states, "prompt_len", None), "np", None)
                if total_len is None or prompt_len is None:
                    raise _Failure("Unimplemented", "rc_frozen: the V2 runner's RequestState has no total_len.gpu / "
                                   "prompt_len.np (another vLLM release?): the output length cannot be read")
                torch.cuda.synchronize()  # every sampling kernel that moved total_len has finished
                totals = total_len.detach().to("cpu").tolist()
                for rid, slot in sorted(live.items()):
                    n = int(totals[int(slot)]) - int(prompt_len[int(slot)])
                    if n < 0:
                        raise _Failure("Internal", f"rc_frozen: request {rid}: total length {totals[int(slot)]} < "
                                       f"prompt length {int(prompt_len[int(slot)])} in slot {slot}")
                    out.append({"request_id": str(rid), "output_tokens": n})
            else:
                spec = getattr(self.vllm_config, "speculative_config", None)
                if spec is not None and getattr(runner, "use_async_scheduling", False):
                    raise _Failure("Unimplemented", "rc_frozen: the V1 model runner with async scheduling and "
                                   "speculative decoding keeps one placeholder per step, not per accepted token, "
                                   "until the next step: the output length cannot be read exactly")
                for rid, state in sorted(live.items()):
                    out.append({"request_id": str(rid), "output_tokens": len(state.output_token_ids)})
            return {"ok": True, "runner": kind, "tp_rank": self._rc_tp()[0], "boot_id": _BOOT_ID, "requests": out}
        except _Failure as f:
            return _fail(f.code, str(f))
        except Exception as e:  # noqa: BLE001 - every failure is reported, typed
            return _fail(_code_of(e), f"rc_frozen: {type(e).__name__}: {e}", traceback=traceback.format_exc())

    # ---- replay validation (issue 18) -------------------------------------------------------
    def _rc_run_once(self, so: Any) -> Any:
        out = self.execute_model(so)
        if out is None:
            out = self.sample_tokens(None)
        if hasattr(out, "get_output"):
            out = out.get_output()
        return out

    def rc_replay(self, prompt: List[int], steps: int, top_k: int = 5, probe: str = "") -> Dict[str, Any]:
        """Replays one probe on the live weights through vLLM's own model runner, while the engine
        is paused and drained: a greedy continuation of `steps` tokens after `prompt`, each step
        one prefill of the sequence so far with temperature 0 and top_k logprobs, so every step is
        computed by the kernels that serve users. The request never passes the scheduler: nothing
        a user sent can run, and nothing of it stays in the runner.

        Refused unless the model runner holds no request (pause mode wait or abort, after the
        drain): the probe's KV is written into blocks 1..n, which is harmless only when no request
        owns a block and the prefix cache was reset (the controller replays in VALIDATING, after
        INVALIDATING)."""
        t0 = time.monotonic()
        try:
            from vllm.sampling_params import SamplingParams
            from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
            runner = self.model_runner
            try:
                _, live = self._rc_runner_requests()  # V1: .requests; V2 (the default): .req_states
            except _Failure:
                live = None  # a runner of neither shape: nothing to check here, as before
            if live:
                raise _Failure("FailedPrecondition",
                               f"rc_replay: {len(live)} request(s) live in the model runner; "
                               "replay needs a drained engine (pause mode wait or abort)")
            seq = [int(t) for t in prompt]
            steps = int(steps)
            top_k = int(top_k)
            if not seq:
                raise _Failure("InvalidArgument", f"rc_replay {probe}: empty prompt")
            if not 1 <= steps <= 64:
                raise _Failure("InvalidArgument", f"rc_replay {probe}: steps {steps} outside 1..64")
            if not 0 <= top_k <= 20:
                raise _Failure("InvalidArgument", f"rc_replay {probe}: top_k {top_k} outside 0..20")
            kv_cfg = runner.kv_cache_config
            groups = kv_cfg.kv_cache_groups
            max_tokens = int(getattr(runner, "max_num_tokens", 0) or 0)
            if max_tokens and len(seq) + steps > max_tokens:
                raise _Failure("InvalidArgument", f"rc_replay {probe}: {len(seq) + steps} tokens, over "
                               f"max_num_batched_tokens {max_tokens}")
            out_steps: List[Dict[str, Any]] = []
            for s in range(steps):
                n = len(seq)
                block_ids = []
                for g in groups:
                    bs = int(g.kv_cache_spec.block_size)
                    nb = -(-n // bs)
                    if nb + 1 > int(kv_cfg.num_blocks):
                        raise _Failure("InvalidArgument",
                                       f"rc_replay {probe}: {nb} KV blocks needed, {kv_cfg.num_blocks} exist")
                    block_ids.append(list(range(1, 1 + nb)))
                rid = f"rc-replay-{os.getpid()}-{time.monotonic_ns()}"
                sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=max(top_k, 1))
                # prefill_token_ids: the V2 model runner (vLLM 0.26's default for dense models)
                # asserts it is set (the empty AssertionError seen on the H200).
                new = NewRequestData(req_id=rid, prompt_token_ids=list(seq), mm_features=[], sampling_params=sp,
                                     pooling_params=None, block_ids=tuple(block_ids), num_computed_tokens=0,
                                     lora_request=None, prefill_token_ids=list(seq))
                so = SchedulerOutput.make_empty()
                so.scheduled_new_reqs = [new]
                so.num_scheduled_tokens = {rid: n}
                so.total_num_scheduled_tokens = n
                so.num_common_prefix_blocks = [0] * len(groups)
                try:
                    out = self._rc_run_once(so)
                finally:
                    fin = SchedulerOutput.make_empty()
                    fin.finished_req_ids = {rid}
                    fin.num_common_prefix_blocks = [0] * len(groups)
                    self._rc_run_once(fin)
                idx = out.req_id_to_index[rid]
                token = int(out.sampled_token_ids[idx][0])
                lp = out.logprobs
                if lp is None:
                    raise _Failure("Internal", f"rc_replay {probe}: the model runner returned no logprobs")
                row_ids = [int(x) for x in lp.logprob_token_ids[idx]]
                row_lps = [float(x) for x in lp.logprobs[idx]]
                if row_ids[0] != token:
                    raise _Failure("Internal", f"rc_replay {probe}: step {s}: logprob row is for token "
                                   f"{row_ids[0]}, sampled {token}")
                top = [[row_ids[j], row_lps[j]] for j in range(1, top_k + 1)]
                out_steps.append({"token": token, "logprob": row_lps[0], "top": top})
                seq.append(token)
            return {"ok": True, "steps": out_steps, "engine_ms": (time.monotonic() - t0) * 1000.0,
                    "tp_rank": self._rc_tp()[0]}
        except _Failure as f:
            return _fail(f.code, str(f))
        except Exception as e:  # noqa: BLE001 - every failure is reported, typed
            return _fail(_code_of(e), f"rc_replay {probe}: {type(e).__name__}: {e}", traceback=traceback.format_exc())


def _code_of(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if isinstance(code, str) and (isinstance(e, _Failure) or type(e).__module__.startswith("rolloutcore")):
        return code
    name = type(e).__name__
    known = {"NotFoundError": "NotFound", "UnavailableError": "Unavailable", "DeadlineExceededError": "DeadlineExceeded",
             "DataLossError": "DataLoss", "InvalidArgumentError": "InvalidArgument",
             "FailedPreconditionError": "FailedPrecondition"}
    return known.get(name, "Internal")
