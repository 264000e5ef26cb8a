"""The benchmark harness runs end to end (one step per side, tiny model), so it cannot rot.

It measures nothing here: `make bench` does (benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_step_of_each_side_on_the_tiny_model(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--config", "cpu-tiny", "--tiny", "--steps", "1",
         "--repeats", "1", "--threads", "1", "--parallel", "--out", str(out), "--no-readme",
         "--variant", "async:async_rollouts=true", "--variant", "trl-all-threads:side=trl,threads=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == {}
    ours, trl = result["sides"]["ours"], result["sides"]["trl"]
    for side in (ours, trl):
        # EOS is masked until max_completion_length: both sides score exactly the same number of tokens
        assert side["mean_completion_length"] == result["config"]["max_completion_length"]
        assert side["step_time_s"] > 0 and side["peak_rss_mib"] > 0
        assert 0 < side["generation_share"] < 1
    assert result["ratio_ours_over_trl"]["completion_tokens_per_s"] > 0
    # the variants: our side with a sampler worker, and TRL again with torch's default threads
    (asynchronous,), (trl_all,) = result["raw"]["async"], result["raw"]["trl-all-threads"]
    assert asynchronous["side"] == "ours" and all(s["wait_time"] is not None for s in asynchronous["steps"])
    assert trl_all["side"] == "trl" and result["raw"]["trl"][0]["torch_threads"] == 1
    table = subprocess.run(
        [sys.executable, "-c", f"import json; from benchmarks.run import format_table; "
                               f"print(format_table(json.load(open({str(out)!r}))))"],
        cwd=REPO, env=env, capture_output=True, text=True).stdout
    assert "| ours |" in table and "| trl-all-threads |" in table
    assert "async (async_rollouts): tokens/s" in table and "× trl-all-threads" in table


def test_padding_benchmark_runs_and_counts_the_rows_it_skips(tmp_path, capsys):
    """benchmarks/padding.py on a tiny model: it checks the two settings' log-probs agree and reports rows."""
    from benchmarks import padding
    from tests.tiny import make_prompts, make_tiny_model

    model, data = make_tiny_model(tmp_path / "model"), make_prompts(tmp_path / "train.jsonl")
    assert padding.main(["--model", str(model), "--data", str(data), "--batches", "2", "--prompts", "2",
                         "--group", "4", "--completion", "3:6"]) == 0
    out = capsys.readouterr().out
    padded, free = (int(line.rsplit(" ", 1)[1]) for line in out.splitlines()[1:3])
    assert free < padded  # ragged completions: padding rows are skipped
    with pytest.raises(SystemExit):
        padding.main(["--model", str(model), "--data", str(data), "--completion", "5:2"])


def test_rollout_benchmark_samples_equal_token_counts_with_each_backend(tmp_path):
    """benchmarks/rollout.py's timing of one backend, in this process, on the embedded shape, one round: each
    backend (the real vLLM engine among them) produced exactly prompts x generations x tokens completion
    tokens, so tokens/s compare like for like."""
    from tests.tiny import require_vllm

    require_vllm()
    import torch

    from benchmarks.rollout import format_table, prompt_ids, time_backend, write_model

    write_model("embedded", 4, tmp_path / "model")
    prompts = prompt_ids(tmp_path / "model", 2)
    threads = torch.get_num_threads()
    try:
        rows = {name: time_backend(name, tmp_path / "model", prompts, generations=2, tokens=4, rounds=1,
                                   threads=1)
                for name in ("vllm", "manual")}
    finally:
        torch.set_num_threads(threads)  # time_backend sets this process's threads
    for row in rows.values():
        assert row["tokens_per_round"] == [2 * 2 * 4] and row["tokens_per_s"] > 0
    assert rows["vllm"]["engine_start_s"] > 0 and rows["vllm"]["weight_sync_s"] > 0
    result = {"machine": {"cpu": "x", "cores": 2}, "models": {"embedded": rows},
              "settings": {"prompts": 2, "generations": 2, "tokens": 4, "threads": 1, "rounds": 1}}
    assert "| embedded | vllm | " in format_table(result) and "| 1.00 |" in format_table(result)


# ---------------------------------------------------------------------------------------------------
# The GPU kit (benchmarks/gpu_kit.py): its smoke run, and the pieces a CPU cannot exercise, by hand

TRAINER_PHASES = ("grpo/generate_round", "grpo/ref_logprobs", "grpo/policy_forward", "grpo/backward",
                  "grpo/optimizer_step", "grpo/sync_weights")


@pytest.mark.slow
def test_gpu_kit_smoke_runs_every_part_on_the_tiny_model(tmp_path):
    """`make bench-gpu ARGS=--smoke`: parts a-e of the kit on CPU, the recipe shrunk (4 rows x
    2 micro-batches, G=2, 4 tokens), one JSON and one table naming the machine and the commit."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "cpu-kit.json").read_text())
    assert (tmp_path / "kit-parts" / "kit-part-abcde.json").is_file()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert result["commit"] == head and result["device"] == "cpu" and result["smoke"] is True
    assert set(result["parts"]) == {"a", "b", "c", "d", "e"}

    # (a) + (c): the recipe's own settings, every trainer phase timed and its peak read, the profiled step
    a = result["parts"]["a"]
    assert a["shape"]["mixed_precision"] == "bf16" and a["shape"]["model_dtype"] == "bfloat16"
    assert a["shape"]["gradient_checkpointing"] is True and a["shape"]["rows_per_step"] == 8
    assert set(TRAINER_PHASES) <= set(a["phases"])
    for name in TRAINER_PHASES:
        phase = a["phases"][name]
        assert phase["seconds"] > 0 and phase["rss_mib"] > 0
        assert a["profile"]["labels"][name]["cpu_s"] > 0
    for name in ("grpo/policy_forward", "grpo/backward"):  # once per micro-batch
        assert a["phases"][name]["calls_per_step"] == 2 and a["profile"]["labels"][name]["calls"] == 2
    (metered,) = [s for s in a["steps"] if s["step"] == a["metered_steps"][0]]
    # the step holds its phases
    assert metered["rss_mib"] >= max(a["phases"][n]["rss_mib"] for n in TRAINER_PHASES)
    assert metered["metrics"]["completions/mean_length"] == 4 and a["memory_on_paper_gib"]["total"] > 0
    assert "aten::" in a["profile"]["top_operators"] and a["mfu_whole_step"] is None  # no bf16 peak for a CPU

    # (b): three backends on the recipe's round (4 prompts x 2 x 4 tokens), vLLM left out of the smoke run
    b = result["parts"]["b"]
    assert (set(b["backends"]) == {"hf-dynamic", "hf-static", "manual"}
            and b["settings"]["dtype"] == "bfloat16")
    for row in b["backends"].values():
        assert row["tokens_per_round"] == [4 * 2 * 4] and row["tokens_per_s"] > 0

    # (d): both sides, medians, ratios from the sides' own numbers
    d = result["parts"]["d"]
    assert d["failures"] == {} and d["complete"] and result["inputs"][0]["failures"] == {}
    ours, trl = d["summary"]["ours"], d["summary"]["trl"]
    assert ours["runs"] == trl["runs"] == [0] and trl["weights_dtype"] == "float32"
    for side in (ours, trl):
        assert side["mean_completion_length"] == 4 and side["step_time_s"] > 0
    assert d["ratio_ours_over_trl"]["completion_tokens_per_s"] == pytest.approx(
        ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"])
    # (e): the real-model recipe's loop on the tiny model: one step of 4 prompts' groups, both policies scored
    e = result["parts"]["e"]
    assert e["smoke"] and e["shape"]["steps"] == 1 and len(e["reward_per_step"]) == 1
    assert e["base"]["num_prompts"] == e["trained"]["num_prompts"] == 4
    assert e["delta"] == pytest.approx(e["trained"]["accuracy"] - e["base"]["accuracy"])
    assert 0 < e["completion_tokens_per_s"] and e["train_s"] > 0
    table = (tmp_path / "cpu-kit.md").read_text()
    for heading in ("## (a) + (c)", "## (b)", "## (d)", "## (e)"):
        assert heading in table
    assert all(f"| {name} |" in table for name in TRAINER_PHASES) and "| hf-static |" in table


def _kit_run(r: int, step_times: list[float], generation: float = 0.5, peak: float = 1000.0) -> dict:
    """One run of a side as benchmarks.side writes it (64 completions of 256 tokens a step)."""
    return {"run": r, "steps": [{"step_time": t, "generation_time": generation, "completion_tokens": 64 * 256,
                                 "mean_completion_length": 256.0} for t in step_times],
            "peak_rss_mib": 3000.0, "rss_at_start_mib": 500.0, "cuda_peak_allocated_mib": peak,
            "cuda_peak_reserved_mib": peak + 100, "process_time": 30.0, "device_peak_used_mib": peak + 600,
            "weights_dtype": "float32"}


def _kit_part(name: str, runs: dict, commit: str = "c0ffee") -> dict:
    from benchmarks.gpu_kit import compare_config

    machine = {"device": "nvidia-h100-80gb-hbm3", "device_name": "NVIDIA H100 80GB HBM3",
               "date": "2026-11-25 12:00:00", "commit": {"commit": commit, "source": "git"},
               "versions": {"torch": "2.11.0"}}
    return {"file": name, "parts": ["d"], "runs": sorted({r["run"] for rs in runs.values() for r in rs}),
            "machine": machine, "d": {"config": compare_config(False).to_dict(),
                                      "assets": {"num_parameters": 500_000_000, "mean_prompt_tokens": 32.0},
                                      "runs": runs, "failures": {}}}


def test_gpu_kit_merges_the_runs_of_several_calls_and_refuses_overlaps(tmp_path):
    """Part d split over two calls (runs 0,1 and run 2), as the run tool's 10-minute calls need: the medians
    are over every measured step of the three runs (each run's first step is its warm-up), worked out by
    hand."""
    from benchmarks import gpu_kit

    first = _kit_part("kit-part-d-runs01.json",
                      {"ours": [_kit_run(0, [9, 2.0, 2.2]), _kit_run(1, [9, 2.4, 2.6])],
                       "trl": [_kit_run(0, [9, 6.0, 6.0], 5.0), _kit_run(1, [9, 7.0, 5.0], 5.0)]})
    second = _kit_part("kit-part-d-runs2.json", {"ours": [_kit_run(2, [9, 1.0, 3.0], peak=1200.0)],
                                                 "trl": [_kit_run(2, [9, 6.5, 6.5], 5.0)]})
    second["failures"] = {"b": "benchmarks.rollout --run hf-static exited 1:\nTraceback ...\nboom"}
    for folder, part in (("call1", first), ("call2", second)):
        gpu_kit.write_json(tmp_path / folder / "kit-parts" / part["file"], part)
    assert gpu_kit.main(["--merge", str(tmp_path / "call1"), str(tmp_path / "call2"), "--out",
                         str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "nvidia-h100-80gb-hbm3-kit.json").read_text())
    assert (sorted(p.name for p in (tmp_path / "out" / "kit-parts").iterdir())
            == [first["file"], second["file"]])
    d = merged["parts"]["d"]
    ours, trl = d["summary"]["ours"], d["summary"]["trl"]
    assert d["complete"] and ours["runs"] == trl["runs"] == [0, 1, 2] and merged["commit"] == "c0ffee"
    # ours' measured steps: 2.0 2.2 2.4 2.6 1.0 3.0 -> median 2.3; per run 2.1, 2.5, 2.0
    assert (ours["step_time_s"] == pytest.approx(2.3)
            and ours["run_median_step_s"] == pytest.approx([2.1, 2.5, 2.0]))
    assert trl["step_time_s"] == pytest.approx(6.25) and trl["train_time_s"] == pytest.approx(1.25)
    assert ours["cuda_peak_allocated_mib"] == 1200.0 and ours["device_peak_used_mib"] == 1800.0
    assert d["ratio_ours_over_trl"]["step_time"] == pytest.approx(2.3 / 6.25)
    # whole step, by hand: N = 5e8, B = 64, P + C = 288: 6*N*B*288 + 2*N*B*288 (reference) + 2*N*B*256
    # (sampling)
    flops = 6 * 5e8 * 64 * 288 + 2 * 5e8 * 64 * 288 + 2 * 5e8 * 64 * 256
    assert ours["mfu_whole_step"]["flops_per_step"] == pytest.approx(flops)
    assert ours["mfu_whole_step"]["mfu"] == pytest.approx(flops / 2.3 / 989e12)
    table = (tmp_path / "out" / "nvidia-h100-80gb-hbm3-kit.md").read_text()
    assert ("Not measured here: part(s) a, b, c" in table
            and "FAILED in `kit-part-d-runs2.json`: b: boom" in table)

    with pytest.raises(ValueError, match=r"run\(s\) \[2\]"):  # the same run measured twice
        gpu_kit.merge([first, second, _kit_part("again.json", {"ours": [_kit_run(2, [9, 1.0])], "trl": []})])
    other = _kit_part("other.json", {"ours": [_kit_run(2, [9, 1.0])], "trl": []})
    other["d"]["config"]["max_completion_length"] = 128
    with pytest.raises(ValueError, match="ran other work"):
        gpu_kit.merge([first, other])
    with pytest.raises(ValueError, match="smoke-run parts"):
        gpu_kit.merge([first, {**second, "smoke": True}])
    step = {**first, "file": "a1.json", "parts": ["a"], "a": {"x": 1}}
    with pytest.raises(ValueError, match="part a is in both a1.json and a2.json"):
        gpu_kit.merge([step, {**step, "file": "a2.json"}])


class _FakeGauge:
    """Memory in use that the test moves by hand; peak and reset as the allocator's."""

    kind = "fake"

    def __init__(self):
        self.now = self.max = 0

    def use(self, mib: float) -> None:
        self.now, self.max = mib, max(self.max, mib)

    def peak(self) -> dict:
        return {"x_mib": self.max}

    def reset(self) -> None:
        self.max = self.now


def test_phase_meter_keeps_each_nested_span_peak():
    """A span's peak covers everything inside it; resetting the gauge for an inner span hides no peak from the
    outer one; memory in use when a span opens counts for it."""
    from benchmarks.phase_meter import PhaseMeter

    gauge = _FakeGauge()
    meter = PhaseMeter([gauge], synchronize=lambda: None)
    gauge.use(10)
    with meter.phase("outer"):
        gauge.use(50)
        gauge.use(20)
        with meter.phase("inner"):
            gauge.use(30)
            gauge.use(25)
        gauge.use(22)
    with meter.phase("other"):
        gauge.use(5)
    meter.end_step({"step_time": 1.0})
    with meter.phase("inner"):
        gauge.use(40)
    meter.end_step()
    peaks = {(r["step"], r["phase"]): r["x_mib"] for r in meter.records}
    assert peaks == {(1, "inner"): 30, (1, "outer"): 50, (1, "other"): 22, (2, "inner"): 40}
    assert [s["x_mib"] for s in meter.steps] == [50, 40] and meter.steps[0]["metrics"] == {"step_time": 1.0}
    summary = meter.summary([1, 2])
    assert summary["inner"]["x_mib"] == 40 and summary["inner"]["calls_per_step"] == 1
    assert set(summary) == {"outer", "inner", "other"}


def test_device_gauge_reads_nvidia_smi_and_nvml(tmp_path, monkeypatch):
    """The device gauge as the GPU machine runs it, with stand-ins: nvidia-smi's streaming query
    (MiB per line) when NVML's Python binding is missing, and NVML's bytes when it is there."""
    from types import SimpleNamespace

    from benchmarks.phase_meter import DeviceMemoryGauge

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor v in 100 300 200; do echo $v; sleep 0.05; done\nsleep 30\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails
    gauge = DeviceMemoryGauge()
    try:
        assert gauge.source == "nvidia-smi"
        deadline = time.monotonic() + 10
        while gauge.last != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gauge.peak() == {"device_used_mib": 300}
        gauge.reset()
        assert gauge.peak() == {"device_used_mib": 200}
    finally:
        gauge.close()

    used = iter([2 * 2**20, 7 * 2**20] + [3 * 2**20] * 10_000)
    fake = SimpleNamespace(NVMLError=RuntimeError, nvmlInit=lambda: None,
                           nvmlDeviceGetHandleByIndex=lambda i: i,
                           nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=next(used)))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gauge = DeviceMemoryGauge(interval_s=0.001)
    try:
        time.sleep(0.1)
        assert gauge.source == "nvml" and gauge.peak() == {"device_used_mib": 7.0}
    finally:
        gauge.close()


def test_kit_stamp_names_the_files_that_differ_from_it():
    """On the GPU machine (no .git) the kit compares the files it runs with the stamp written here."""
    import hashlib

    from infra.wheelhouse import check_stamp

    real = hashlib.sha256((REPO / "benchmarks" / "configs.py").read_bytes()).hexdigest()
    stamp = {"files": {"benchmarks/configs.py": real, "benchmarks/rewards.py": "0" * 64,
                       "no/such/file.py": "1" * 64}}
    assert check_stamp(stamp) == {"files_match_stamp": False, "files_differing_count": 2,
                                  "files_differing": ["benchmarks/rewards.py", "no/such/file.py"]}
    assert check_stamp({"files": {"benchmarks/configs.py": real}})["files_match_stamp"] is True
