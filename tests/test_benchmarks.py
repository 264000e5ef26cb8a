"""The benchmark harness runs end to end (one step per side, tiny model), so it cannot rot.

It measures nothing here: `make bench` does (benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_step_of_each_side_on_the_tiny_model(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--config", "cpu-tiny", "--tiny", "--steps", "1", "--repeats", "1",
         "--threads", "1", "--parallel", "--out", str(out), "--no-readme",
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
    backend (the real vLLM engine among them) produced exactly prompts x generations x tokens completion tokens,
    so tokens/s compare like for like."""
    from tests.tiny import require_vllm

    require_vllm()
    import torch

    from benchmarks.rollout import format_table, prompt_ids, time_backend, write_model

    write_model("embedded", 4, tmp_path / "model")
    prompts = prompt_ids(tmp_path / "model", 2)
    threads = torch.get_num_threads()
    try:
        rows = {name: time_backend(name, tmp_path / "model", prompts, generations=2, tokens=4, rounds=1, threads=1)
                for name in ("vllm", "manual")}
    finally:
        torch.set_num_threads(threads)  # time_backend sets this process's threads
    for row in rows.values():
        assert row["tokens_per_round"] == [2 * 2 * 4] and row["tokens_per_s"] > 0
    assert rows["vllm"]["engine_start_s"] > 0 and rows["vllm"]["weight_sync_s"] > 0
    result = {"machine": {"cpu": "x", "cores": 2}, "models": {"embedded": rows},
              "settings": {"prompts": 2, "generations": 2, "tokens": 4, "threads": 1, "rounds": 1}}
    assert "| embedded | vllm | " in format_table(result) and "| 1.00 |" in format_table(result)
