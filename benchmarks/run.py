"""Our GRPO trainer against TRL 1.16's GRPOTrainer on the same work, in one invocation.

    python -m benchmarks.run --config cpu-tiny|gpu-0.5b [--steps N] [--repeats R] [--out FILE]
                             [--variant NAME:lever=value,...] [--profile] [--tiny]

Builds the model once (saved to a temp dir; both sides load it), then runs each side in its own
subprocess — ours and TRL alternating, R times — and reports per side: seconds per optimizer step
(median over the steps after each run's first, generation included), completion tokens/s, the
generation share of a step, peak memory (RSS on CPU, torch.cuda.max_memory_allocated on GPU) and the
ratio ours/TRL. JSON goes to benchmarks/results/<config>-<device>.json; the table in
benchmarks/README.md is regenerated from every JSON there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.configs import CONFIGS, REPO, TINY_SIZES, BenchConfig

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"
PEAK_BF16_FLOPS = {"h100": 989e12, "h200": 989e12}  # dense bf16, SXM


def device_slug() -> tuple[str, str]:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), name
    return "cpu", platform.processor() or platform.machine()


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:lever=value,lever=value' -> (name, {lever: value}); values parsed as JSON when they can be."""
    name, _, body = text.partition(":")
    out: dict = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return name, out


def run_threads(variant: dict, default: int | None) -> int | None:
    """A run's torch threads: the variant's ``threads`` lever (0 = torch's default), else the harness's."""
    if "threads" not in variant:
        return default
    return int(variant["threads"]) or None


def run_side(side: str, cfg: BenchConfig, assets: dict, workdir: Path, variant: dict, tag: str,
             profile_out: Path | None, threads: int | None, timeout: float | None) -> dict:
    spec = {"side": side, "config": cfg.to_dict(), "assets": assets, "workdir": str(workdir / tag),
            "variant": variant, "profile": profile_out is not None,
            "profile_out": str(profile_out) if profile_out else None, "threads": threads}
    spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.side", "--spec", str(spec_path), "--out",
                           str(out_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"benchmark side {tag} failed (exit {proc.returncode})")
    result = json.loads(out_path.read_text())
    result["subprocess_time"] = time.perf_counter() - t0
    return result


def summarize(runs: list[dict], cfg: BenchConfig) -> dict:
    """Medians over every measured step (each run's first step is the warm-up) of all runs of one side."""
    measured = []
    for r in runs:
        steps = r["steps"]
        measured += steps[1:] if len(steps) > 1 else steps
    step_t = statistics.median(s["step_time"] for s in measured)
    gen_t = statistics.median(s["generation_time"] for s in measured)
    tokens = statistics.median(s["completion_tokens"] for s in measured)
    share = statistics.median(s["generation_time"] / s["step_time"] for s in measured)
    train_t = statistics.median(s["step_time"] - s["generation_time"] for s in measured)
    out = {
        "step_time_s": step_t,
        "generation_time_s": gen_t,
        "train_time_s": train_t,
        "generation_share": share,
        "completion_tokens_per_step": tokens,
        "completion_tokens_per_s": tokens / step_t,
        "generation_tokens_per_s": tokens / gen_t if gen_t > 0 else None,
        "mean_completion_length": statistics.mean(s["mean_completion_length"] for s in measured),
        "measured_steps": len(measured),
        "step_times_s": [round(s["step_time"], 4) for s in measured],
        "warmup_step_time_s": [r["steps"][0]["step_time"] for r in runs if r["steps"]],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "rss_at_start_mib": max(r["rss_at_start_mib"] for r in runs),
        "cuda_peak_allocated_mib": max((r["cuda_peak_allocated_mib"] or 0) for r in runs) or None,
        "cuda_peak_reserved_mib": max((r["cuda_peak_reserved_mib"] or 0) for r in runs) or None,
        "process_time_s": statistics.median(r["process_time"] for r in runs),
    }
    cpu = [s for s in measured if s.get("cpu_step_time") is not None]
    if cpu:  # process CPU seconds: what a step costs, whatever else the (shared) machine is doing
        out["cpu_step_time_s"] = statistics.median(s["cpu_step_time"] for s in cpu)
        gen = [s["cpu_generation_time"] for s in cpu if s.get("cpu_generation_time") is not None]
        out["cpu_generation_time_s"] = statistics.median(gen) if gen else None
        out["cpu_completion_tokens_per_s"] = tokens / out["cpu_step_time_s"]
        # The fastest step: interference from other processes only ever adds time, so on a shared machine
        # the minimum is the steadiest estimate of what a step costs.
        out["cpu_step_time_min_s"] = min(s["cpu_step_time"] for s in cpu)
        out["cpu_completion_tokens_per_s_best_step"] = tokens / out["cpu_step_time_min_s"]
    out["peak_memory_mib"] = out["cuda_peak_allocated_mib"] or out["peak_rss_mib"]
    return out


def mfu(summary: dict, cfg: BenchConfig, assets: dict, gpu_name: str) -> dict | None:
    """Training part (step minus generation): 6·N·tokens / time / peak bf16 FLOP/s."""
    key = next((k for k in PEAK_BF16_FLOPS if k in gpu_name.lower()), None)
    if key is None:
        return None
    tokens = cfg.batch_size * (assets["mean_prompt_tokens"] + summary["mean_completion_length"])
    flops = 6 * assets["num_parameters"] * tokens
    achieved = flops / summary["train_time_s"]
    return {"training_tokens_per_step": tokens, "model_flops_per_step": flops,
            "achieved_tflops": achieved / 1e12, "peak_tflops": PEAK_BF16_FLOPS[key] / 1e12,
            "mfu": achieved / PEAK_BF16_FLOPS[key]}


WHOLE_STEP_FORMULA = (
    "(6·N·B·(P+C) policy forward+backward + 2·N·B·(P+C) per frozen forward (the reference when beta > 0; old "
    "log-probs when a round outlives the policy) + 2·N·B·C sampling, one forward per generated token) / step "
    "time / peak dense bf16 FLOP/s; N = all parameters (a tied head counted once), B = completions per step, "
    "P and C = mean prompt and completion tokens. Not counted: attention's own FLOPs, the prompts' prefill "
    "while sampling, gradient checkpointing's recompute")


def whole_step_mfu(num_parameters: int, rows: int, prompt_tokens: float, completion_tokens: float,
                   frozen_forwards: int, step_s: float, gpu_name: str) -> dict | None:
    """MFU of a whole optimizer step, generation included (WHOLE_STEP_FORMULA); None for a device without a
    peak in PEAK_BF16_FLOPS (a CPU, an unlisted GPU)."""
    key = next((k for k in PEAK_BF16_FLOPS if k in gpu_name.lower()), None)
    if key is None:
        return None
    n, tokens = num_parameters, rows * (prompt_tokens + completion_tokens)
    terms = {"policy_forward_backward": 6 * n * tokens, "frozen_forwards": 2 * n * tokens * frozen_forwards,
             "sampling": 2 * n * rows * completion_tokens}
    flops = sum(terms.values())
    return {"formula": WHOLE_STEP_FORMULA, "flops_per_step": flops, "terms": terms, "step_s": step_s,
            "achieved_tflops": flops / step_s / 1e12, "peak_tflops": PEAK_BF16_FLOPS[key] / 1e12,
            "mfu": flops / step_s / PEAK_BF16_FLOPS[key]}


def ratios(summaries: dict[str, dict]) -> dict | None:
    """ours/TRL of the summaries' medians (None unless both sides ran)."""
    if "ours" not in summaries or "trl" not in summaries:
        return None
    o, t = summaries["ours"], summaries["trl"]
    out = {
        "completion_tokens_per_s": o["completion_tokens_per_s"] / t["completion_tokens_per_s"],
        "step_time": o["step_time_s"] / t["step_time_s"],
        "generation_time": o["generation_time_s"] / t["generation_time_s"],
        "train_time": o["train_time_s"] / t["train_time_s"],
        "peak_memory": o["peak_memory_mib"] / t["peak_memory_mib"],
    }
    if o.get("cpu_step_time_s") and t.get("cpu_step_time_s"):
        out["cpu_completion_tokens_per_s"] = (o["cpu_completion_tokens_per_s"]
                                              / t["cpu_completion_tokens_per_s"])
        out["cpu_completion_tokens_per_s_best_step"] = (
            o["cpu_completion_tokens_per_s_best_step"] / t["cpu_completion_tokens_per_s_best_step"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GRPO throughput: ours vs TRL 1.16 GRPOTrainer")
    p.add_argument("--config", choices=sorted(CONFIGS), default="cpu-tiny")
    p.add_argument("--steps", type=int, help="optimizer steps per run (the first is a warm-up)")
    p.add_argument("--repeats", type=int, help="runs per side, alternating ours and TRL")
    p.add_argument("--out", help="result JSON (default benchmarks/results/<config>-<device>.json)")
    p.add_argument("--variant", action="append", default=[],
                   help="extra run of our side with levers switched: NAME:lever=value,... (see "
                        "benchmarks/levers.py)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours,trl")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables next to the JSON")
    p.add_argument("--tiny", action="store_true", help="tiny model sizes (for the test)")
    p.add_argument("--threads", type=int, help="torch threads in each side (default: torch's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per side run")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite the README table")
    p.add_argument("--parallel", action="store_true",
                   help="run the sides at the same time (a quick check of the harness, not a measurement)")
    p.add_argument("--smoke", action="store_true",
                   help="check the code paths only: 2 prompts x G=2, 4 tokens, "
                        "any device (not a measurement)")
    a = p.parse_args(argv)

    cfg = CONFIGS[a.config]
    if a.steps:
        cfg = cfg.replace(steps=a.steps)
    if a.repeats:
        cfg = cfg.replace(repeats=a.repeats)
    if a.tiny:
        cfg = cfg.replace(embedded_overrides=dict(TINY_SIZES))
    if a.smoke:
        cfg = cfg.replace(num_prompts=2, num_generations=2, max_completion_length=4, device="any")
    slug, device_name = device_slug()
    if cfg.device == "cuda" and slug == "cpu":
        print(f"{cfg.name} needs a CUDA GPU and none is visible: nothing measured", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else RESULTS / f"{cfg.name}-{slug}.json"
    variants = [("ours", {})] + [parse_variant(v) for v in a.variant]
    sides = a.sides.split(",")

    from benchmarks.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        assets = prepare(cfg, workdir / "assets")
        print(f"[bench] {cfg.name} on {device_name}: model {assets['num_parameters'] / 1e6:.2f}M params, "
              f"prepared in {time.perf_counter() - t0:.1f}s", flush=True)
        runs: dict[str, list[dict]] = {}
        failures: dict[str, str] = {}

        def write_result() -> dict:
            summaries = {name: summarize(rs, cfg) for name, rs in runs.items()}
            result = {
                "config": cfg.to_dict(), "device": slug, "device_name": device_name,
                "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "assets": {k: v for k, v in assets.items()
                                                                        if k not in ("model_dir", "data")},
                "versions": versions(), "sides": summaries, "variants": {n: v for n, v in variants},
                "raw": {name: [{k: v for k, v in r.items()} for r in rs] for name, rs in runs.items()},
                "failures": failures,
            }
            if ratios(summaries) is not None:
                result["ratio_ours_over_trl"] = ratios(summaries)
            if slug != "cpu":
                result["mfu_training_part"] = {n: mfu(s, cfg, assets, device_name)
                                               for n, s in summaries.items()}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
            return result

        # ours and TRL first (the comparison), then the lever variants of our side
        plan = [(name, v.get("side", "ours"), v) for name, v in variants if v.get("side", "ours") in sides]
        plan = plan[:1] + ([("trl", "trl", {})] if "trl" in sides else []) + plan[1:]
        if a.parallel:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(plan)) as pool:
                futures = {name: pool.submit(run_side, side, cfg, assets, workdir, variant, f"{name}-0", None,
                                             run_threads(variant, a.threads or cfg.threads), a.timeout)
                           for name, side, variant in plan}
            for name, future in futures.items():
                try:
                    runs.setdefault(name, []).append(future.result())
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    failures[f"{name}-0"] = str(err)
        for r in range(0 if a.parallel else cfg.repeats):
            order = plan if r % 2 == 0 else plan[1::-1] + plan[2:]  # alternate who goes first
            for name, side, variant in order:
                prof = out.with_name(f"{out.stem}.profile-{name}.txt") if a.profile and r == 0 else None
                try:
                    res = run_side(side, cfg, assets, workdir, variant, f"{name}-{r}", prof,
                                   run_threads(variant, a.threads or cfg.threads), a.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    failures[f"{name}-{r}"] = str(err)
                    print(f"[bench] {name} run {r} FAILED: {err}", flush=True)
                    continue
                runs.setdefault(name, []).append(res)
                st = [round(s["step_time"], 3) for s in res["steps"]]
                print(f"[bench] {name} run {r}: step times {st}", flush=True)
                write_result()  # partial results survive a run cut short

    result = write_result()
    print(format_table(result))
    print(f"[bench] wrote {out}")
    if not a.no_readme and out.parent.resolve() == RESULTS.resolve():
        update_readme()
    return 0


def versions(packages=("torch", "transformers", "trl", "accelerate")) -> dict:
    """Python's version and each package's (None when it is not installed)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"**{cfg['name']}** on {result['device_name']} — {cfg['num_prompts']} prompts × "
             f"G={cfg['num_generations']}, {cfg['max_completion_length']} completion tokens, beta "
             f"{cfg['beta']}, {cfg['dtype']}, {cfg['loss_type']}, num_iterations {cfg['num_iterations']}; "
             f"{cfg['steps']} steps × {cfg['repeats']} run(s) per side (first step of each run = warm-up)",
             "",
             "| side | s/step (median) | completion tok/s | generation share | generation s | training s "
             "| CPU s/step (median; best) | peak memory (MiB) | ours/TRL tok/s (wall; CPU median; "
             "CPU best) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    trl = result["sides"].get("trl")
    for name, s in result["sides"].items():
        ratio = ""
        if trl and name != "trl":
            ratio = f"{s['completion_tokens_per_s'] / trl['completion_tokens_per_s']:.2f}×"
            if s.get("cpu_completion_tokens_per_s") and trl.get("cpu_completion_tokens_per_s"):
                ratio += f"; {s['cpu_completion_tokens_per_s'] / trl['cpu_completion_tokens_per_s']:.2f}×"
            if s.get("cpu_step_time_min_s") and trl.get("cpu_step_time_min_s"):
                ratio += f"; {trl['cpu_step_time_min_s'] / s['cpu_step_time_min_s']:.2f}×"
        mem = s["peak_memory_mib"]
        kind = "CUDA alloc" if s["cuda_peak_allocated_mib"] else "RSS"
        cpu_t = (f"{s['cpu_step_time_s']:.3f}; {s['cpu_step_time_min_s']:.3f}" if s.get("cpu_step_time_min_s")
                 else "–")
        lines.append(f"| {name} | {s['step_time_s']:.3f} | {s['completion_tokens_per_s']:.0f} | "
                     f"{s['generation_share']:.0%} | {s['generation_time_s']:.3f} | {s['train_time_s']:.3f} "
                     f"| {cpu_t} | {mem:.0f} ({kind}) | {ratio} |")
    if result.get("ratio_ours_over_trl"):
        r = result["ratio_ours_over_trl"]
        lines.append("")
        cpu_ratio = (f", tokens per CPU-second {r['cpu_completion_tokens_per_s']:.2f}× (median step), "
                     f"{r['cpu_completion_tokens_per_s_best_step']:.2f}× (best step)"
                     if r.get("cpu_completion_tokens_per_s_best_step") else "")
        lines.append(f"ours/TRL: tokens/s {r['completion_tokens_per_s']:.2f}×{cpu_ratio}, step time "
                     f"{r['step_time']:.2f}, generation time {r['generation_time']:.2f}, training time "
                     f"{r['train_time']:.2f}, peak memory {r['peak_memory']:.2f}")
    lines += async_ratios(result)
    if result.get("mfu_training_part"):
        parts = [f"{n} {m['mfu']:.1%} ({m['achieved_tflops']:.0f} TFLOP/s)"
                 for n, m in result["mfu_training_part"].items() if m]
        if parts:
            lines.append(f"MFU of the training part (6·N·tokens / (step − generation) / "
                         f"{next(iter(result['mfu_training_part'].values()))['peak_tflops']:.0f} TFLOP/s): "
                         + ", ".join(parts))
    lines.append("")
    lines.append(f"Reproduce: `{result['command']}` ({result['date']}; torch {result['versions']['torch']}, "
                 f"transformers {result['versions']['transformers']}, trl {result['versions']['trl']})")
    return "\n".join(lines)


def async_ratios(result: dict) -> list[str]:
    """For each async_rollouts variant: its tokens/s over our synchronous side's and over each TRL run's
    (TRL's variants included, e.g. TRL with torch's default threads)."""
    sides, variants = result["sides"], result.get("variants", {})
    trl_runs = [n for n in sides if n == "trl" or variants.get(n, {}).get("side") == "trl"]
    lines = []
    for name, s in sides.items():
        if not variants.get(name, {}).get("async_rollouts") or "ours" not in sides:
            continue
        tok = s["completion_tokens_per_s"]
        parts = [f"{tok / sides['ours']['completion_tokens_per_s']:.2f}× ours (synchronous)"]
        parts += [f"{tok / sides[t]['completion_tokens_per_s']:.2f}× {t}" for t in trl_runs]
        lines += ["", f"{name} (async_rollouts): tokens/s " + ", ".join(parts)]
    return lines


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def update_readme() -> None:
    """Rewrite the block between the markers in benchmarks/README.md from every results/*.json."""
    blocks = []
    for path in sorted(RESULTS.glob("*.json")):
        try:
            result = json.loads(path.read_text())
            blocks.append(format_table(result) + f"\n\nJSON: `benchmarks/results/{path.name}`")
        except (ValueError, KeyError):
            continue
    body = "\n\n".join(blocks) if blocks else "(no results yet)"
    text = README.read_text() if README.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
