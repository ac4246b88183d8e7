"""Child processes of the ``rolloutcore`` binary on loopback: directory, engine, controller.

Used by the test suite and examples/rl_loop.py; pure Python. Every server is started with
``--port 0`` and its URL is read from the line it prints when listening, so there is no race for
free ports. Logs go to files in the work directory. ``LocalCluster`` starts the three in order
and stops them (SIGTERM, then SIGKILL after a grace period) on exit.

The binary is found by ``find_binary()``: ``$ROLLOUTCORE_BIN``, then ``bin/rolloutcore`` inside
this package (wheels carry it), then ``rolloutcore`` on ``PATH``, then ``build/*/src/apps`` of a
source checkout this package lives in.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .controller import ControllerClient
from .directory import DirectoryClient
from .engine import EngineClient
from .errors import DeadlineExceededError, UnavailableError

# The URL a server announces ("... listening on URL", "... serving M on URL"): not the first URL in
# its log, which may be a peer's (a restarted controller logs its engines' URLs first).
_URL = re.compile(r"\bon (https?://[0-9.]+:[0-9]+)")


def find_binary() -> str:
    """Path of the ``rolloutcore`` binary (see the module docstring); FileNotFoundError if none."""
    env = os.environ.get("ROLLOUTCORE_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise FileNotFoundError(f"ROLLOUTCORE_BIN={env} is not an executable")
        return env
    here = Path(__file__).resolve().parent
    candidates = [here / "bin" / "rolloutcore"]
    on_path = shutil.which("rolloutcore")
    if on_path:
        candidates.append(Path(on_path))
    # A package inside a build tree (build/X/python/rolloutcore, what PYTHONPATH=build/X/python
    # gives): that tree's binary first. Then the trees of the checkout: python/rolloutcore, or
    # build/X/python/rolloutcore, lives two or four levels below its root.
    candidates.append(here.parent.parent / "src" / "apps" / "rolloutcore")
    for root in (here.parent.parent, here.parent.parent.parent.parent):
        for preset in ("dev", "release"):
            candidates.append(root / "build" / preset / "src" / "apps" / "rolloutcore")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(
        "cannot find the rolloutcore binary: set ROLLOUTCORE_BIN, put it on PATH, or install a wheel that carries it"
    )


class Server:
    """One child process of the binary, with the URL it listens on and its log file."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path, binary: str, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.args = [binary, *args]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def wait_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = _URL.search(self.log_path.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise UnavailableError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.02)
        raise DeadlineExceededError(f"{self.name} did not print its URL within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def run_binary(args: Sequence[str], binary: Optional[str] = None, timeout_s: float = 120.0) -> str:
    """Runs a one-shot subcommand (``model init``, ``plan``...) and returns its stdout;
    RuntimeError with the output when it fails."""
    out = subprocess.run([binary or find_binary(), *args], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"rolloutcore {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def _wait_ok(check: Any, what: str, server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception = RuntimeError("not tried")
    while time.monotonic() < deadline:
        if not server.alive():
            raise UnavailableError(f"{what} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            check()
            return
        except Exception as e:  # noqa: BLE001 - any failure means "not up yet"
            last = e
        time.sleep(0.05)
    raise DeadlineExceededError(f"{what} not healthy within {timeout_s} s ({last}):\n{server.log_tail()}")


class LocalCluster:
    """A directory, one engine and a controller on loopback, as child processes.

    ``engine_model`` is a preset (started with ``--load-format dummy --seed engine_seed``) or a
    Hugging Face folder (``rolloutcore model init`` writes one). ``model`` is the directory's model
    name the trainer publishes under and the controller stages. Use as a context manager::

        with LocalCluster(model="tiny", engine_model="tiny") as c:
            pub = Publisher(c.directory_url, "tiny")
            ...
            c.controller.update_to("tiny", "v1")
    """

    def __init__(
        self,
        model: str,
        engine_model: str,
        *,
        workdir: Optional[str] = None,
        binary: Optional[str] = None,
        engine_seed: int = 1,
        engine_version: str = "init",
        engine_tp: int = 1,
        engine_threads: int = 0,
        engine_args: Sequence[str] = (),
        controller_args: Sequence[str] = (),
        directory_store: str = "memory",
        start_controller: bool = True,
        timeout_s: float = 60.0,
        api_key: Optional[str] = None,
    ) -> None:
        self.model = model
        # With api_key, every server requires it for mutating requests (given through
        # $ROLLOUTCORE_API_KEY, never on a command line, where `ps` would show it) and every client
        # here sends it; None: whatever $ROLLOUTCORE_API_KEY says.
        self.api_key = api_key
        # The servers stop by themselves once this process is gone, even killed by SIGKILL, when no
        # finalizer runs (ROLLOUTCORE_EXIT_WITH_PARENT, src/apps/stop_signals.h).
        self._env = {**os.environ, "ROLLOUTCORE_EXIT_WITH_PARENT": str(os.getpid())}
        if api_key is not None:
            self._env["ROLLOUTCORE_API_KEY"] = api_key
        self.binary = binary or find_binary()
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="rolloutcore-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.servers: List[Server] = []
        # A cluster that is never closed (a script that ends, an exception outside a with-block)
        # stops its servers when it is collected or at interpreter exit, instead of leaving them
        # running without their work directory (which the temporary directory's own finalizer,
        # created before this one and so run after it, removes).
        self._finalizer = weakref.finalize(self, LocalCluster._stop_servers, self.servers, self._tmp)
        try:
            d = self._start("directory", ["directory", "serve", "--store", directory_store, "--port", "0"], timeout_s)
            self.directory_url = d.url
            self.directory = DirectoryClient(d.url, api_key=api_key)
            _wait_ok(self.directory.health, "directory", d, timeout_s)

            eargs = ["engine", "serve", "--model", engine_model, "--port", "0", "--weight-version", engine_version,
                     "--served-model-name", model, "--tensor-parallel-size", str(engine_tp)]
            if not os.path.isdir(engine_model):
                eargs += ["--load-format", "dummy", "--seed", str(engine_seed)]
            if engine_threads:
                eargs += ["--threads", str(engine_threads)]
            e = self._start("engine", [*eargs, *engine_args], timeout_s)
            self.engine_url = e.url
            self.engine = EngineClient(e.url, api_key=api_key)
            _wait_ok(self.engine.health, "engine", e, timeout_s)

            self.controller_url = ""
            if start_controller:
                c = self._start(
                    "controller",
                    ["controller", "serve", "--engine", e.url, "--directory", d.url, "--model", model,
                     "--state-dir", str(self.workdir / "controller"), "--port", "0", *controller_args],
                    timeout_s,
                )
                self.controller_url = c.url
                self.controller = ControllerClient(c.url, api_key=api_key)
                _wait_ok(self.controller.health, "controller", c, timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, args: List[str], timeout_s: float) -> Server:
        s = Server(name, args, self.workdir / f"{name}.log", self.binary, env=self._env)
        self.servers.append(s)
        s.wait_url(timeout_s)
        return s

    @staticmethod
    def _stop_servers(servers: List[Server], tmp: Optional[tempfile.TemporaryDirectory]) -> Dict[str, int]:
        codes = {}
        for s in reversed(servers):
            codes[s.name] = s.stop()
        servers.clear()
        if tmp is not None:
            tmp.cleanup()
        return codes

    def close(self) -> Dict[str, int]:
        """Stops every server (controller first); returns their exit codes by name. Also done
        when the cluster is collected or the interpreter exits without it."""
        codes = self._finalizer() if self._finalizer.alive else None
        self._tmp = None
        return codes or {}

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
