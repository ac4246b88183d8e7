"""Trainer side of vLLM's own weight transfer (``controller serve --vllm-transfer native-nccl``).

vLLM 0.26's NCCL weight transfer is a session the *inference* side drives
(``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``,
``/update_weights {update_info}``, ``/finish_weight_update``) while the *trainer* joins the same
NCCL group as rank 0 and broadcasts. The transfer calls block on the collective, so the two sides
must run at the same time. :class:`NativeSender` is the trainer's half, driven by the controller:

* the trainer offers each version's tensors (checkpoint/HF names, CUDA tensors, the same bytes it
  publishes to the directory, whose manifest digest the controller checks afterwards)::

      sender = NativeSender()                    # HTTP on 127.0.0.1, an ephemeral port
      sender.offer("v7", model.state_dict().items())
      # controller serve --vllm-transfer native-nccl --vllm-native-trainer <sender.url>

* the controller calls its HTTP endpoints (127.0.0.1 only by default; JSON):

  - ``GET  /rc/native/state`` → ``{ok, joined, world_size, master_address, master_port, versions,
    broken}``;
  - ``GET  /rc/native/versions/{V}/update_info`` → ``{ok, version, update_info: {names,
    dtype_names, shapes, packed: false}, bytes}`` (404 for a version not offered). The controller
    asks this *before* ``/start_weight_update`` (a missing version or a dead sender is then a
    refusal with nothing touched) and passes ``update_info`` to vLLM's ``/update_weights``;
  - ``POST /rc/native/init {world_size}`` → joins vLLM's group as rank 0
    (``NCCLWeightTransferEngine.trainer_init``; blocks until every vLLM worker joined: the
    controller posts vLLM's ``/init_weight_transfer_engine`` at the same time);
  - ``POST /rc/native/send {version}`` → ``NCCLWeightTransferEngine.trainer_send_weights`` of the
    version's tensors in ``update_info`` order, then a device synchronize (returns once every
    broadcast completed, i.e. vLLM received them) → ``{ok, version, tensors, bytes, send_ms}``.

Errors answer ``{"ok": false, "code": <status name>, "error": ...}`` with 400/404/409/500.

A send that fails or is abandoned half-way leaves the NCCL communicator in an unknown state (a
broadcast kernel may wait forever for a peer); the sender then reports ``broken`` and
``joined: false`` and refuses further sends until the next ``init``, which the controller issues
(with vLLM's ``/init_weight_transfer_engine``) before the next update.

NCCL puts one rank per GPU: the sender's device (``torch.cuda.current_device()`` unless
``device`` is given) must not be one of vLLM's devices.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterable, List, Optional, Tuple

_TORCH_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class NativeSender:
    """rank 0 of vLLM's weight-transfer NCCL group, sending offered versions on the controller's
    request (module docstring). Thread safety: every method may be called from any thread; one
    init or send runs at a time (a second answers 409)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, master_address: str = "127.0.0.1",
                 master_port: int = 0, device: Optional[int] = None) -> None:
        self.master_address = master_address
        self.master_port = master_port or _free_port(master_address)
        self.device = device
        self._lock = threading.Lock()  # guards the fields below
        self._busy = threading.Lock()  # one collective at a time
        self._versions: Dict[str, List[Tuple[str, Any]]] = {}
        self._group: Any = None
        self._world_size = 0
        self._broken: Optional[str] = None
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="rc-native-sender", daemon=True)
        self._thread.start()

    # ---- the trainer's side --------------------------------------------------------------------

    def offer(self, version: str, named_tensors: Iterable[Tuple[str, Any]]) -> None:
        """Makes ``version`` sendable: (HF name, CUDA tensor) pairs, kept by reference (the
        trainer must not modify them until it withdraws the version)."""
        items = []
        for name, t in named_tensors:
            dt = str(t.dtype).replace("torch.", "")
            if dt not in _TORCH_DTYPE_NAMES:
                raise ValueError(f"offer {version}: tensor {name} has dtype {dt}")
            if not t.is_cuda:
                raise ValueError(f"offer {version}: tensor {name} is not on a CUDA device")
            items.append((str(name), t.contiguous()))
        if not items:
            raise ValueError(f"offer {version}: no tensors")
        with self._lock:
            self._versions[version] = items

    def withdraw(self, version: str) -> None:
        with self._lock:
            self._versions.pop(version, None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- what the endpoints do -----------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        with self._lock:
            return {"ok": True, "joined": self._group is not None, "world_size": self._world_size,
                    "master_address": self.master_address, "master_port": self.master_port,
                    "versions": sorted(self._versions), "broken": self._broken}

    def update_info(self, version: str) -> Dict[str, Any]:
        with self._lock:
            items = self._versions.get(version)
        if items is None:
            raise _Error(404, "NotFound", f"version {version} is not offered by this sender")
        info = {"names": [n for n, _ in items],
                "dtype_names": [str(t.dtype).replace("torch.", "") for _, t in items],
                "shapes": [list(t.shape) for _, t in items], "packed": False}
        return {"ok": True, "version": version, "update_info": info,
                "bytes": int(sum(t.numel() * t.element_size() for _, t in items))}

    def init(self, world_size: int) -> Dict[str, Any]:
        if int(world_size) < 2:
            raise _Error(400, "InvalidArgument", f"init: world_size {world_size} < 2 (the sender plus >= 1 worker)")
        if not self._busy.acquire(blocking=False):
            raise _Error(409, "FailedPrecondition", "init: another init or send is running")
        try:
            import torch
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            if self.device is not None:
                torch.cuda.set_device(self.device)
            t0 = time.perf_counter()
            with self._lock:
                self._group, self._broken = None, None
            group = NCCLWeightTransferEngine.trainer_init(
                {"master_address": self.master_address, "master_port": self.master_port,
                 "world_size": int(world_size)})
            with self._lock:
                self._group, self._world_size = group, int(world_size)
            return {"ok": True, "init_ms": (time.perf_counter() - t0) * 1e3, "world_size": int(world_size),
                    "nccl_disabled": bool(getattr(group, "disabled", False))}
        except _Error:
            raise
        except Exception as e:
            with self._lock:
                self._broken = f"init: {type(e).__name__}: {e}"
            raise _Error(500, "Unavailable", f"init (world_size {world_size}): {type(e).__name__}: {e}")
        finally:
            self._busy.release()

    def send(self, version: str) -> Dict[str, Any]:
        with self._lock:
            items = self._versions.get(version)
            group = self._group
        if items is None:
            raise _Error(404, "NotFound", f"send: version {version} is not offered by this sender")
        if group is None:
            raise _Error(409, "FailedPrecondition", "send: not joined to vLLM's group (POST /rc/native/init first)"
                         + (f"; last failure: {self._broken}" if self._broken else ""))
        if not self._busy.acquire(blocking=False):
            raise _Error(409, "FailedPrecondition", "send: another init or send is running")
        try:
            import torch
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            t0 = time.perf_counter()
            NCCLWeightTransferEngine.trainer_send_weights(iter(items), {"group": group, "packed": False})
            torch.cuda.synchronize()
            return {"ok": True, "version": version, "tensors": len(items),
                    "bytes": int(sum(t.numel() * t.element_size() for _, t in items)),
                    "send_ms": (time.perf_counter() - t0) * 1e3,
                    "nccl_disabled": bool(getattr(group, "disabled", False))}
        except Exception as e:
            with self._lock:
                self._group = None  # the communicator's state is unknown now: re-init before the next send
                self._broken = f"send {version}: {type(e).__name__}: {e}"
            raise _Error(500, "Unavailable", f"send {version}: {type(e).__name__}: {e}")
        finally:
            self._busy.release()

    # ---- HTTP ----------------------------------------------------------------------------------

    def _handler(self):
        sender = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet
                pass

            def _reply(self, status: int, body: Dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _run(self, fn) -> None:
                try:
                    self._reply(200, fn())
                except _Error as e:
                    self._reply(e.status, {"ok": False, "code": e.code, "error": str(e)})
                except Exception as e:  # noqa: BLE001
                    self._reply(500, {"ok": False, "code": "Internal", "error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()})

            def _body(self) -> Dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except ValueError as e:
                    raise _Error(400, "InvalidArgument", f"body is not JSON: {e}")
                if not isinstance(body, dict):
                    raise _Error(400, "InvalidArgument", "body is not a JSON object")
                return body

            def do_GET(self) -> None:  # noqa: N802
                path = urllib.parse.urlparse(self.path).path
                if path == "/rc/native/state":
                    return self._run(sender.state)
                parts = path.split("/")
                if len(parts) == 6 and parts[1:4] == ["rc", "native", "versions"] and parts[5] == "update_info":
                    v = urllib.parse.unquote(parts[4])
                    return self._run(lambda: sender.update_info(v))
                self._reply(404, {"ok": False, "code": "NotFound", "error": f"no route GET {path}"})

            def do_POST(self) -> None:  # noqa: N802
                path = urllib.parse.urlparse(self.path).path

                def with_body(fn):
                    def go():
                        return fn(self._body())
                    return go

                if path == "/rc/native/init":
                    return self._run(with_body(lambda b: sender.init(int(b.get("world_size", 0)))))
                if path == "/rc/native/send":
                    return self._run(with_body(lambda b: sender.send(str(b.get("version", "")))))
                self._reply(404, {"ok": False, "code": "NotFound", "error": f"no route POST {path}"})

        return Handler


def main(argv: Optional[List[str]] = None) -> int:  # pragma: no cover - a manual entry point
    import argparse

    p = argparse.ArgumentParser(description="Serve a safetensors folder as version V over vLLM's NCCL transfer")
    p.add_argument("folder")
    p.add_argument("--version", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", type=int, default=0)
    a = p.parse_args(argv)
    from safetensors.torch import load_file

    tensors = {}
    for fn in sorted(os.listdir(a.folder)):
        if fn.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(a.folder, fn), device=f"cuda:{a.device}"))
    s = NativeSender(port=a.port, device=a.device)
    s.offer(a.version, sorted(tensors.items()))
    print(s.url, flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
