#!/usr/bin/env python3
"""The trainer's side of a version over shm: ``Publisher.add_shard(copy=True)`` and ``publish``.

    rolloutcore bench publish [--gb 2] [--tensors 16] [--versions 6] [--source numpy]
    python3 -m rolloutcore.publish_bench ...          (the same; what the subcommand runs)

A directory is started on loopback (``rolloutcore directory serve``; $ROLLOUTCORE_BIN or the
package's binary). Two publishers of the same model shape publish ``--versions`` versions each,
in turn, every version with new values: one made with ``reuse_copies=True`` (the default: the
copies of a version go into the shared buffers of the version released before it), one with
``reuse_copies=False`` (a fresh shared allocation per copy, whose pages the copy faults in). Each
publisher keeps ``--keep`` versions published and releases the oldest after each publish, as
``rolloutcore.trl`` does. Per version: the ``add_shard(copy=True)`` calls (the copy), the
``publish`` call (registration, digest, directory), and the copy's rate. The first version of
each publisher, and the next ``--keep`` (published while the first ones still were), have
nothing to reuse; they are left out of the medians.

``--source``: ``numpy`` (bf16 bits as uint16, copied as they are), ``f32`` (float32 numpy,
rounded to bf16 in the copy), ``torch`` (a bf16 CPU tensor), ``cuda`` (a bf16 CUDA tensor: the
copy is the device-to-host transfer). Prints one line per version and the medians; ``--json``
prints the report as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .cluster import Server, _wait_ok, find_binary
from .directory import DirectoryClient
from .publisher import Publisher


def _sources(kind: str, shape: List[int], count: int, version: int) -> List[Any]:
    """``count`` tensors of ``shape``, their values new for every version (one fill each)."""
    import numpy as np

    out = []
    for i in range(count):
        seed = version * 1009 + i
        if kind == "f32":
            a = np.empty(shape, np.float32)
            a.fill(1.0 + seed * 1e-3)
            a[0, : min(shape[1], 64)] = np.arange(min(shape[1], 64), dtype=np.float32) * seed
            out.append(a)
            continue
        a = np.empty(shape, np.uint16)
        a.fill(0x3F80 + (seed % 127))
        a[0, : min(shape[1], 64)] = np.arange(min(shape[1], 64), dtype=np.uint16) + seed
        if kind == "numpy":
            out.append(a)
            continue
        import torch

        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        out.append(t.to("cuda") if kind == "cuda" else t.clone())
    return out


def _one_version(pub: Publisher, version: str, names: List[str], sources: List[Any], kind: str) -> Dict[str, float]:
    sync = None
    if kind == "cuda":
        import torch

        sync = torch.cuda.synchronize
    t0 = time.perf_counter()
    for name, src in zip(names, sources):
        pub.add_shard(version, name, src, dtype=None if kind in ("torch", "cuda") else "bf16", copy=True)
    if sync is not None:
        sync()
    t1 = time.perf_counter()
    report = pub.publish(version)
    t2 = time.perf_counter()
    if report.get("state") not in ("COMMITTED", "STAGING"):
        raise RuntimeError(f"publish of {version}: {report}")
    return {"copy_ms": (t1 - t0) * 1e3, "publish_ms": (t2 - t1) * 1e3, "bytes": float(report.get("bytes") or 0)}


def run(args: argparse.Namespace, directory_url: str) -> Dict[str, Any]:
    rows = max(1, int(args.gb * 1e9 / args.tensors / (args.cols * 2)))
    shape = [rows, args.cols]
    names = [f"layers.{i}.weight" for i in range(args.tensors)]
    model_bytes = rows * args.cols * 2 * args.tensors
    pubs = {
        "reuse": Publisher(directory_url, "bench-reuse", reuse_copies=True),
        "fresh": Publisher(directory_url, "bench-fresh", reuse_copies=False),
    }
    published: Dict[str, List[str]] = {k: [] for k in pubs}
    per: Dict[str, List[Dict[str, float]]] = {k: [] for k in pubs}
    try:
        for v in range(1, args.versions + 1):
            sources = _sources(args.source, shape, args.tensors, v)
            for mode in (("reuse", "fresh") if v % 2 else ("fresh", "reuse")):  # alternated, both orders
                pub = pubs[mode]
                row = _one_version(pub, f"v{v}", names, sources, args.source)
                published[mode].append(f"v{v}")
                while len(published[mode]) > args.keep:
                    pub.release(published[mode].pop(0))
                row["spare_after_release"] = float(pub.copy_buffers()["spare_bytes"])
                per[mode].append(row)
                gbps = model_bytes / (row["copy_ms"] * 1e-3) / 1e9
                print(f"v{v} {mode:5s}: copy {row['copy_ms']:9.1f} ms ({gbps:6.2f} GB/s), publish "
                      f"{row['publish_ms']:8.1f} ms", file=sys.stderr if args.json else sys.stdout, flush=True)
            del sources
    finally:
        for pub in pubs.values():
            pub.close()

    def med(mode: str, key: str) -> Optional[float]:
        warm = [r[key] for r in per[mode][args.keep + 1:]]
        return statistics.median(warm) if warm else None

    summary = {}
    for mode in pubs:
        copy_ms = med(mode, "copy_ms")
        summary[mode] = {"copy_ms": copy_ms, "publish_ms": med(mode, "publish_ms"),
                         "copy_gb_per_s": None if not copy_ms else model_bytes / (copy_ms * 1e-3) / 1e9}
    ratio = None
    if summary["reuse"]["copy_ms"] and summary["fresh"]["copy_ms"]:
        ratio = summary["reuse"]["copy_ms"] / summary["fresh"]["copy_ms"]
    return {"source": args.source, "model_bytes": model_bytes, "tensors": args.tensors, "shape": shape,
            "versions": args.versions, "keep": args.keep, "per_version": per, "median": summary,
            "copy_reuse_over_fresh": ratio}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="rolloutcore bench publish", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="model size in GB (bf16), default 2")
    ap.add_argument("--tensors", type=int, default=16, help="tensors in the model, default 16")
    ap.add_argument("--cols", type=int, default=4096, help="columns of each tensor, default 4096")
    ap.add_argument("--versions", type=int, default=6, help="versions each publisher publishes (>= keep + 2), default 6")
    ap.add_argument("--keep", type=int, default=1, help="versions kept published after each publish (>= 1), default 1")
    ap.add_argument("--source", choices=("numpy", "f32", "torch", "cuda"), default="numpy",
                    help="what the trainer's tensors are (see above), default numpy")
    ap.add_argument("--json", action="store_true", help="print the report as JSON (the per-version lines go to stderr)")
    args = ap.parse_args(argv)
    for flag, value, low in (("--gb", args.gb, 1e-6), ("--tensors", args.tensors, 1), ("--cols", args.cols, 1),
                             ("--keep", args.keep, 1), ("--versions", args.versions, args.keep + 2)):
        if not value >= low:
            ap.error(f"{flag} must be at least {low:g}, got {value:g}")
    with tempfile.TemporaryDirectory(prefix="rc-publish-bench-") as tmp:
        # The directory stops by itself should this process die (src/apps/stop_signals.h).
        env = {**os.environ, "ROLLOUTCORE_EXIT_WITH_PARENT": str(os.getpid())}
        d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
                   Path(tmp) / "directory.log", find_binary(), env=env)
        try:
            url = d.wait_url(60.0)
            _wait_ok(DirectoryClient(url).health, "directory", d, 60.0)
            report = run(args, url)
        finally:
            d.stop()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["median"]
    print(f"model {report['model_bytes'] / 1e9:.2f} GB in {report['tensors']} tensors, source {report['source']}, "
          f"medians of versions {report['keep'] + 2}..{report['versions']}:")
    for mode in ("reuse", "fresh"):
        print(f"  {mode:5s}: copy {m[mode]['copy_ms']:9.1f} ms ({m[mode]['copy_gb_per_s']:.2f} GB/s), "
              f"publish {m[mode]['publish_ms']:8.1f} ms")
    print(f"  copy reuse / fresh: {report['copy_reuse_over_fresh']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
