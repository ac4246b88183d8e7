#!/usr/bin/env python3
"""TRL's GRPOTrainer on digit reversal, generating and syncing through rolloutcore (rolloutcore.trl)
or through TRL's own vLLM modes (server, colocate), for a side-by-side (docs/trl.md).

The task: the prompt is a digit string and "=" (text, tokenized by the model's tokenizer), the
answer must be the digits reversed. Reward per completion, over the first --digits characters of
its text: format_bonus * [a digit] + (1 - format_bonus) * [the right digit], averaged.

  --backend rolloutcore   GRPOTrainer(rollout_func=rc.rollout_func, callbacks=[rc]): every completion
                          through the controller's POST /v1/rollouts, bound to one committed version;
                          after every optimizer step the trainer's parameters are published
                          (rolloutcore.Publisher; cuda_ipc in place on a GPU, shm on CPU), one
                          controller update, commit awaited, digest proven.
                          --engine vllm: vLLM (with rolloutcore's worker extension) + controller +
                          directory; --engine embedded: the rolloutcore engine (CPU) instead.
  --backend trl           GRPOConfig(use_vllm=True, vllm_mode="server"): TRL's own path against a stock
                          `vllm serve` with --weight-transfer-config nccl (NCCL broadcast from the
                          trainer; vLLM must run on another GPU than the trainer).
  --backend trl-colocate  GRPOConfig(use_vllm=True, vllm_mode="colocate"): TRL builds a vllm.LLM inside
                          this process on the trainer's GPU and, before each generation after an
                          optimizer step, copies every parameter into it (VLLMGeneration.sync_weights:
                          model.load_weights per parameter + reset_prefix_cache). One GPU is enough;
                          vLLM must be importable here (PYTHONPATH with the vLLM kit's site/). The only
                          departure from stock TRL: the vLLM engine gets enforce_eager=True and the
                          TRITON_ATTN attention backend, the flags every vLLM of this project runs with
                          (TRL 1.16 has no GRPOConfig field for them; see install_engine_flags).
  --skip-sync-at K        the negative control: the sync after step K is skipped while the trainer
                          expects it (rolloutcore backend); --on-mismatch warn records it, raise stops.

Prints one JSON line per step ({"step", "backend", "version", "bound", "reward", "sync_ms",
"pause_ms", "logprob_gap", "step_ms", ...}) and a summary line {"summary": {...}} (mean reward of
the first 10 vs the last 10 steps, medians of step and sync time, and under "proves" what the backend
checked: the same keys for every backend); everything goes to OUT/trl_grpo.json.
Exit code: 0 when the run ended as expected (for the negative control: when the stale step was
caught), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import rolloutcore  # noqa: E402
from rolloutcore.cluster import Server, find_binary  # noqa: E402

MODEL = "m"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["rolloutcore", "trl", "trl-colocate"], default="rolloutcore")
    p.add_argument("--engine", choices=["vllm", "embedded"], default="vllm")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="trl_grpo_out")
    p.add_argument("--shape", default="tiny", help="rolloutcore.vllm_models shape: tiny | 0.6b")
    p.add_argument("--model-dir", default=None, help="the model folder (made there when missing; default OUT/model)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=6, help="max_completion_length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--format-bonus", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--skip-sync-at", type=int, action="append", default=[])
    p.add_argument("--on-mismatch", choices=["raise", "warn"], default="raise")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="trainer device")
    p.add_argument("--vllm-gpu", type=int, default=None,
                   help="GPU of vLLM (default: 1 when two are visible, else 0; --backend trl needs another GPU; "
                        "--backend trl-colocate: the trainer's)")
    p.add_argument("--vllm-port", type=int, default=8731)
    p.add_argument("--gpu-util", type=float, default=0.3,
                   help="vLLM's gpu_memory_utilization (--backend trl-colocate: GRPOConfig.vllm_gpu_memory_utilization, "
                        "the share of the GPU the in-process vLLM takes next to the trainer)")
    p.add_argument("--max-model-len", type=int, default=512, help="vLLM's max_model_len")
    return p.parse_args()


# ---- task --------------------------------------------------------------------------------------


def make_dataset(n: int, digits: int, seed: int):
    import datasets

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        rows.append({"prompt": s + "=", "answer": s[::-1]})
    return datasets.Dataset.from_list(rows)


def make_reward(format_bonus: float):
    def digit_reversal(completions: List[str], answer: List[str], **kw: Any) -> List[float]:
        out = []
        for text, want in zip(completions, answer):
            score = 0.0
            for i, ch in enumerate(want):
                got = text[i] if i < len(text) else ""
                score += format_bonus * got.isdigit() + (1.0 - format_bonus) * (got == ch)
            out.append(score / len(want))
        return out

    return digit_reversal


# ---- servers ------------------------------------------------------------------------------------


class Vllm:
    """`vllm serve` of the model on one GPU; rolloutcore's extension, or TRL's weight transfer."""

    def __init__(self, model_dir: Path, port: int, gpu: int, backend: str, log: Path, gpu_util: float,
                 max_num_seqs: int, max_model_len: int = 512) -> None:
        env = dict(os.environ)
        site = os.environ.get("VLLM_SITE", "")
        rc_path = os.environ.get("RC_PYTHONPATH", "")
        env.update(PYTHONPATH=":".join(x for x in (rc_path, site, env.get("PYTHONPATH", "")) if x),
                   CUDA_VISIBLE_DEVICES=str(gpu), VLLM_SERVER_DEV_MODE="1", VLLM_USE_FLASHINFER_SAMPLER="0",
                   VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", GLOO_SOCKET_IFNAME="lo",
                   NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0",
                   VLLM_ENGINE_READY_TIMEOUT_S="300")
        args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--served-model-name",
                MODEL, "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "TRITON_ATTN",
                "--enforce-eager", "--gpu-memory-utilization", str(gpu_util), "--max-model-len", str(max_model_len),
                "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if backend == "rolloutcore":
            args += ["--worker-extension-cls", "rolloutcore.vllm.Extension"]
        else:  # TRL 1.16's server mode: vLLM's own NCCL weight-transfer engine (trl/generation/vllm_client.py)
            args += ["--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs"]
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.log_path = log
        self.t0 = time.time()
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 400.0) -> float:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.time() - self.t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy within {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def wait_ready(controller: rolloutcore.ControllerClient, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            st = controller.status()
            states = [e.get("state") for e in st.get("engines", [st])]
            if states and all(s == "READY" for s in states):
                return
        except rolloutcore.RolloutcoreError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"controller not READY within {timeout_s} s: {controller.status()}")


# ---- TRL's colocate mode ----------------------------------------------------------------------------

# The environment of vLLM inside this process: what the `vllm serve` of the other backends gets (Vllm
# above). RANK, LOCAL_RANK, WORLD_SIZE and MASTER_PORT are TRL's to set (VLLMGeneration._init_vllm sets
# them from the accelerator, then ensure_master_addr_port picks a free port); vLLM's external_launcher
# executor (distributed_executor_backend TRL passes) rendezvous through env:// with them, world size 1.
COLOCATE_ENV = {"MASTER_ADDR": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The engine flags every vLLM of this project runs with (`--enforce-eager --attention-backend TRITON_ATTN`),
# as vllm.LLM keyword arguments (vllm/entrypoints/llm.py: enforce_eager, attention_config). TRL 1.16 builds
# the LLM with a fixed set of arguments and has no GRPOConfig field for these.
ENGINE_FLAGS: Dict[str, Any] = {"enforce_eager": True, "attention_config": {"backend": "TRITON_ATTN"}}


def colocate_preflight(device: str) -> None:
    """Fails at once, saying what is missing, where TRL's colocate mode cannot run."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SystemExit("--backend trl-colocate runs vLLM inside this process (TRL's vllm_mode='colocate'), and "
                         "vLLM is not importable here: put the vLLM kit's site/ on PYTHONPATH before starting "
                         "Python ($VLLM_SITE, as scripts/gpu/run_trl.sh does); TRL decides whether vLLM is there "
                         "when it is imported. On a machine without a GPU use --backend rolloutcore --engine embedded.")
    if device not in ("cuda", "cuda:0"):
        raise SystemExit(f"--backend trl-colocate needs the trainer on cuda:0 (got --device {device}): TRL's "
                         "in-process vLLM takes the GPU of LOCAL_RANK 0; choose the GPU with CUDA_VISIBLE_DEVICES.")


def install_engine_flags(record: Dict[str, Any]) -> None:
    """Adds ENGINE_FLAGS to the vllm.LLM that TRL's colocate mode constructs.

    TRL's module calls the name `LLM` it imported from vLLM (VLLMGeneration._init_vllm); that name, in TRL's
    module, is replaced by a function that calls the same vllm.LLM with TRL's own arguments plus the two flags
    (TRL's arguments win where it passes one of them itself). The engine object, TRL's code and its weight
    sync are unchanged. `record` gets the arguments TRL passed and the flags added.
    """
    import trl.generation.vllm_generation as tvg

    stock = getattr(tvg, "LLM", None)
    if stock is None:
        raise SystemExit("TRL was imported without vLLM (trl.generation.vllm_generation has no LLM: TRL's "
                         "is_vllm_available() was False at import): put the vLLM kit's site/ on PYTHONPATH.")

    def LLM(*a: Any, **k: Any) -> Any:  # noqa: N802 (the name TRL calls)
        record["trl_llm_kwargs"] = {key: repr(v) for key, v in k.items()}
        added = {key: v for key, v in ENGINE_FLAGS.items() if key not in k}
        record["engine_flags_added"] = added
        return stock(*a, **{**k, **added})

    tvg.LLM = LLM


def time_trl_sync(trainer: Any, timings: Dict[int, float], on_gpu: bool) -> None:
    """Times TRL's own sync (VLLMGeneration.sync_weights, which GRPOTrainer calls before a generation when the
    step changed) by wrapping the bound method on this trainer's instance: same call, same arguments, TRL
    unchanged. The clock stops after a torch.cuda.synchronize(), so that copies still queued count (the
    generation right after would wait for them anyway). Keyed by trainer.state.global_step at the call (the
    sync before the generation of step k+1 is under k)."""
    vg = trainer.vllm_generation
    inner = vg.sync_weights

    def timed_sync(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        r = inner(*a, **k)
        if on_gpu:
            torch.cuda.synchronize()
        timings[int(trainer.state.global_step)] = (time.perf_counter() - t0) * 1e3
        return r

    vg.sync_weights = timed_sync


# What each backend checks (the same keys for every backend, for run_trl.sh's side-by-side) and what its
# sync_ms and logprob_gap measure.
PROVES: Dict[str, Dict[str, bool]] = {
    "rolloutcore": {"completion_bound_to_synced_version": True, "sync_outcome_checked": True,
                    "live_digest_equals_published": True, "stale_generation_caught": True},
    "trl": {"completion_bound_to_synced_version": False, "sync_outcome_checked": False,
            "live_digest_equals_published": False, "stale_generation_caught": False},
    "trl-colocate": {"completion_bound_to_synced_version": False, "sync_outcome_checked": False,
                     "live_digest_equals_published": False, "stale_generation_caught": False},
}
MEASURES: Dict[str, Dict[str, str]] = {
    "rolloutcore": {"sync_ms": "Publisher.publish + the controller's update until committed (digest proven)",
                    "logprob_gap": "rolloutcore/logprob_gap: |trainer - engine| logprob of the sampled tokens "
                                   "(raw logprobs, extra no-grad forward before training)",
                    "pause_ms": "the engine paused: QUIESCED through RESUMING of the update"},
    "trl": {"sync_ms": "VLLMGeneration.sync_weights: NCCL broadcast of every parameter to vLLM + "
                       "reset_prefix_cache (timed around TRL's call, CUDA synchronized)",
            "logprob_gap": "TRL's sampling/sampling_logp_difference: |trainer old logps - vLLM "
                           "processed_logprobs| over completion tokens",
            "pause_ms": "not measured"},
    "trl-colocate": {"sync_ms": "VLLMGeneration.sync_weights: model.load_weights per parameter into the "
                                "in-process vLLM + reset_prefix_cache (timed around TRL's call, CUDA synchronized)",
                     "logprob_gap": "TRL's sampling/sampling_logp_difference: |trainer old logps - vLLM "
                                    "processed_logprobs| over completion tokens",
                     "pause_ms": "not measured (generation and training alternate in one process: vLLM is idle "
                                 "during the sync by construction)"},
}


# ---- per-step records ----------------------------------------------------------------------------


class Recorder(TrainerCallback):
    """One JSON line per optimizer step from TRL's own logs (logging_steps=1) plus rolloutcore's history."""

    def __init__(self, backend: str, rc: Any, timings: Dict[int, float]) -> None:
        self.backend, self.rc, self.timings = backend, rc, timings
        self.rows: List[Dict[str, Any]] = []
        self._t = time.perf_counter()

    def on_train_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()  # step 1 from here, not from the trainer's construction

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs or "reward" not in logs:
            return
        now = time.perf_counter()
        step = int(state.global_step)
        row: Dict[str, Any] = {"step": step, "backend": self.backend, "reward": logs.get("reward"),
                               "step_ms": (now - self._t) * 1e3, "loss": logs.get("loss")}
        self._t = now
        if self.rc is not None:
            gen = next((h for h in reversed(self.rc.history) if h["kind"] == "generation" and h["step"] == step), {})
            sync = next((h for h in reversed(self.rc.history) if h["kind"] == "sync" and h["step"] == step), {})
            row.update(version=gen.get("expected"), bound=gen.get("bound"), mismatched=gen.get("mismatched"),
                       logprob_gap=gen.get("logprob_gap"), logprob_gap_max=gen.get("logprob_gap_max"),
                       rollout_ms=gen.get("rollout_ms"), synced=sync.get("version"), skipped=sync.get("skipped", False),
                       sync_ms=sync.get("sync_ms"), publish_ms=sync.get("publish_ms"),
                       update_ms=sync.get("update_ms"), pause_ms=sync.get("pause_ms"), in_place=sync.get("in_place"))
        else:
            row.update(version=f"trl-step-{step - 1}", bound=None, sync_ms=self.timings.get(step - 1),
                       pause_ms=None, logprob_gap=logs.get("sampling/sampling_logp_difference/mean"),
                       logprob_gap_max=logs.get("sampling/sampling_logp_difference/max"))
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def summary(rows: List[Dict[str, Any]], backend: str = "rolloutcore") -> Dict[str, Any]:
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def median(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    return {"steps": len(rows), "reward_first10": mean(r["reward"] for r in rows[:10]),
            "reward_last10": mean(r["reward"] for r in rows[-10:]),
            "step_ms_median": median(r["step_ms"] for r in rows[1:]),
            "sync_ms_median": median(r.get("sync_ms") for r in rows),
            "pause_ms_median": median(r.get("pause_ms") for r in rows),
            "logprob_gap_max": max((r["logprob_gap"] for r in rows if r.get("logprob_gap") is not None), default=None),
            "proves": PROVES[backend], "measures": MEASURES[backend]}


# ---- main ------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out / "work", ignore_errors=True)
    (out / "work").mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.backend != "rolloutcore" and args.engine != "vllm":
        raise SystemExit(f"--backend {args.backend} needs --engine vllm (TRL's vLLM modes run vLLM)")
    if args.backend != "rolloutcore" and args.skip_sync_at:
        raise SystemExit("--skip-sync-at is rolloutcore's negative control (TRL's sync has no such switch)")
    colocate = args.backend == "trl-colocate"
    engine_record: Dict[str, Any] = {}
    if colocate:
        colocate_preflight(args.device)
        for key, value in COLOCATE_ENV.items():
            os.environ.setdefault(key, value)
        install_engine_flags(engine_record)
    model_dir = Path(args.model_dir).resolve() if args.model_dir else out / "model"
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "rolloutcore.vllm_models", str(model_dir), "--shape", args.shape,
                        "--seed", str(args.seed)], check=True)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    on_gpu = args.device.startswith("cuda")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.to(args.device)

    batch = args.prompts * args.group
    servers: List[Any] = []
    vllm: Optional[Vllm] = None
    rc = None
    timings: Dict[int, float] = {}
    t_start = time.perf_counter()
    try:
        if args.engine == "vllm" and not colocate:
            ngpu = torch.cuda.device_count()
            gpu = args.vllm_gpu if args.vllm_gpu is not None else (1 if ngpu >= 2 else 0)
            vllm = Vllm(model_dir, args.vllm_port, gpu, args.backend, out / "work" / "vllm.log", args.gpu_util,
                        max_num_seqs=batch, max_model_len=args.max_model_len)
            print(f"vLLM on GPU {gpu} healthy after {vllm.wait_healthy():.0f} s", flush=True)
        kw = dict(output_dir=str(out / "work" / "trainer"), max_steps=args.steps, per_device_train_batch_size=batch,
                  num_generations=args.group, max_completion_length=args.max_tokens, learning_rate=args.lr,
                  beta=0.0, logging_steps=1, report_to="none", save_strategy="no", seed=args.seed, temperature=1.0,
                  disable_tqdm=True, dataloader_num_workers=0, use_cpu=not on_gpu, bf16=False)
        callbacks: List[Any] = []
        if args.backend == "rolloutcore":
            binary = find_binary()
            d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
                       out / "work" / "directory.log", binary)
            servers.append(d)
            d.wait_url(60)
            if args.engine == "embedded":
                e = Server("engine", ["engine", "serve", "--model", str(model_dir), "--port", "0",
                                      "--weight-version", "init", "--served-model-name", MODEL],
                           out / "work" / "engine.log", binary)
                servers.append(e)
                engine_url = "rolloutcore+" + e.wait_url(120)
            else:
                engine_url = "vllm+" + vllm.base  # type: ignore[union-attr]
            c = Server("controller", ["controller", "serve", "--engine", engine_url, "--directory", d.url,
                                      "--model", MODEL, "--state-dir", str(out / "work" / "controller"),
                                      "--port", "0"], out / "work" / "controller.log", binary)
            servers.append(c)
            c.wait_url(120)
            from rolloutcore.trl import RolloutcoreGRPO

            rc = RolloutcoreGRPO(c.url, d.url, MODEL, sync_every=args.sync_every, skip_sync_at=args.skip_sync_at,
                                 on_mismatch=args.on_mismatch, update_timeout_s=120, seed=args.seed)
            wait_ready(rc.controller)
            config = trl.GRPOConfig(use_vllm=False, **kw)
            callbacks.append(rc)
        elif colocate:
            # TRL builds vllm.LLM(model=model.name_or_path, ...) in GRPOTrainer.__init__, on this GPU;
            # max_num_seqs is TRL's (per_device_train_batch_size * tensor parallel * steps_per_generation).
            config = trl.GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_util,
                                    vllm_max_model_length=args.max_model_len, vllm_tensor_parallel_size=1,
                                    vllm_enable_sleep_mode=False, **kw)
        else:
            config = trl.GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=vllm.base,  # type: ignore[union-attr]
                                    vllm_server_timeout=120, **kw)
        rec = Recorder(args.backend, rc, timings)
        t_init = time.perf_counter()
        trainer = trl.GRPOTrainer(model=model, reward_funcs=make_reward(args.format_bonus), args=config,
                                  train_dataset=make_dataset(max(1024, args.steps * args.prompts), args.digits, args.seed),
                                  processing_class=tok, rollout_func=rc.rollout_func if rc else None,
                                  callbacks=[*callbacks, rec])
        init_s = time.perf_counter() - t_init  # colocate: includes starting vLLM in this process
        if colocate:
            print(f"TRL's in-process vLLM started in {init_s:.0f} s (trainer construction)", flush=True)
        if args.backend != "rolloutcore":
            time_trl_sync(trainer, timings, on_gpu)
        error: Optional[BaseException] = None
        try:
            trainer.train()
        except rolloutcore.RolloutcoreError as e:  # VersionMismatchError, UpdateFailedError
            error = e
            print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        result = {"args": vars(args), "rows": rec.rows, "summary": summary(rec.rows, args.backend),
                  "wall_s": time.perf_counter() - t_start, "error": None if error is None else str(error),
                  "init_s": init_s, "vllm_engine": engine_record or None,
                  "history": rc.history if rc else None}
    finally:
        if rc is not None:
            rc.close()
        for s in reversed(servers):
            s.stop()
        if vllm is not None:
            vllm.stop()
    (out / "trl_grpo.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"summary": {**result["summary"], "backend": args.backend, "wall_s": result["wall_s"],
                                  "error": result["error"]}}), flush=True)
    if args.skip_sync_at:
        k = min(args.skip_sync_at)
        if args.on_mismatch == "raise":
            ok = error is not None and "VersionMismatch" in type(error).__name__ and len(rec.rows) == k
        else:
            stale = [r for r in rec.rows if r["step"] == k + 1]
            ok = error is None and bool(stale) and stale[0]["mismatched"] == batch
        print(f"negative control (sync after step {k} skipped): {'caught' if ok else 'NOT CAUGHT'}", flush=True)
        return 0 if ok else 1
    code = 0 if error is None and len(rec.rows) == args.steps else 1
    if colocate:
        # vLLM's engine and process group live in this process; leave without running their teardown at
        # interpreter exit (results are written and flushed above).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
