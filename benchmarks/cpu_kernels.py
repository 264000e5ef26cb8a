"""What capping torch's CPU kernels costs, and what it gives: the embedded default's stages under each
``model.cpu_kernels`` level this CPU has, timed, with the sha256 of the weights each writes.

    python -m benchmarks.cpu_kernels                        # levels native, avx2 (avx512 where the CPU has
                                                            # it), scalar: prepare, validate, calibrate, train
                                                            # as params.yaml says
    python -m benchmarks.cpu_kernels --train-steps 20       # train 20 steps only
    python -m benchmarks.cpu_kernels --levels native avx2 --train-steps 0     # prepare only

Each level runs `python -m flows.stages <stage>` in a clone of this repository's HEAD with params.yaml's
``model.cpu_kernels`` set to it (and ``train.max_steps`` to ``--train-steps`` if given): prepare's base model
and train's model are hashed, each stage timed. The record of this machine (CPU model, the level ATen picks on
its own, torch) replaces its earlier one in ``--out`` (default benchmarks/results/cpu-kernels.json): one file,
a record per machine, so the hashes of different CPUs sit side by side. Runs one after the other, one torch
thread each (params.yaml's ``embedded.num_threads`` and ``model.cpu_threads``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PIN_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
OUTPUTS = {"prepare": "artifacts/base_model/model.safetensors", "train": "artifacts/model/model.safetensors"}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_level() -> str:
    out = subprocess.run([sys.executable, "-c",
                          "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True, check=True, env=stage_env())
    return out.stdout.strip().lower()


def stage_env() -> dict[str, str]:
    """The caller's environment without a pin of its own (the level under test sets it) or a tracking
    server."""
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS and k != "MLFLOW_TRACKING_URI"}
    return {**env, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_level(level: str, train_steps: int | None, workdir: Path) -> dict:
    clone = workdir / level
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    raw = yaml.safe_load((clone / "params.yaml").read_text())
    raw["model"]["cpu_kernels"] = level
    if train_steps:
        raw["train"]["max_steps"] = train_steps
    (clone / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    stages = ["prepare"] if train_steps == 0 else ["prepare", "validate", "calibrate", "train"]
    result: dict = {}
    for stage in stages:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "flows.stages", stage], cwd=clone, env=stage_env(),
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{level}: {stage} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        result[f"{stage}_s"] = round(time.perf_counter() - start, 1)
        if stage in OUTPUTS:
            result[f"{stage}_sha256"] = sha256(clone / OUTPUTS[stage])
        print(f"{level:>7} {stage:<9} {result[f'{stage}_s']:7.1f} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", default=None,
                        help="model.cpu_kernels values (default: all this CPU has)")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="train steps after prepare (default: params.yaml's train.max_steps); "
                             "0 = prepare only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/cpu-kernels.json")
    args = parser.parse_args(argv)
    native = native_level()
    levels = args.levels or ["native", "avx2", *(["avx512"] if native == "avx512" else []), "scalar"]
    with tempfile.TemporaryDirectory(prefix="cpu-kernels-") as tmp:
        results = {level: run_level(level, args.train_steps, Path(tmp)) for level in levels}
    import torch

    machine = {"cpu": cpu_model(), "aten_native_level": native, "cores": os.cpu_count(),
               "torch": torch.__version__}
    record = {"machine": machine, "train_steps": args.train_steps, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python -m benchmarks.cpu_kernels",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "levels": results}
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {"records": []}
    doc["records"] = [r for r in doc["records"] if r["machine"]["cpu"] != machine["cpu"]
                      or r["machine"]["aten_native_level"] != native] + [record]
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_text(json.dumps(doc, indent=2) + "\n")
    tmp_out.replace(args.out)
    base = results[levels[0]]
    for level, r in results.items():
        same = {k: r[k] == base[k] for k in r if k.endswith("_sha256")}
        print(f"{level:>7}: " + ", ".join(f"{k} {r[k]}" for k in r if k.endswith("_s"))
              + f"; same bytes as {levels[0]}: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
