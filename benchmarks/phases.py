"""Where a step's time goes: process CPU seconds per phase, for one side, on the cpu-tiny work.

    python -m benchmarks.phases --side ours|trl [--steps 11] [--levers generation=hf]

Our side: the trainer names its phases with ``torch.profiler.record_function`` (``grpo/generate_round``,
``grpo/ref_logprobs``, ``grpo/policy_forward``, ``grpo/backward``, ``grpo/optimizer_step``,
``grpo/sync_weights``, ...); a CPU profile of the run sums each label's time. TRL's side: its methods wrapped
with ``time.process_time``. The first step (warm-up) is included in the totals, so compare per-step numbers
over many steps. One torch thread, as the cpu-tiny benchmark; the profiler slows our side down, so read its
shares, not its absolute times.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import torch


def _wrap(owner, name: str, label, acc: dict, cnt: collections.Counter) -> None:
    inner = getattr(owner, name)

    def timed(*a, **k):
        key = label() if callable(label) else label
        t0 = time.process_time()
        try:
            return inner(*a, **k)
        finally:
            acc[key] += time.process_time() - t0
            cnt[key] += 1

    setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["ours", "trl"], required=True)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--levers", default="", help="our side's levers, lever=value,... (benchmarks/levers.py), "
                                                "e.g. generation=hf")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    import accelerate

    from benchmarks import side
    from benchmarks.configs import CONFIGS
    from benchmarks.prepare import prepare
    from benchmarks.profiling import label_times
    from benchmarks.run import parse_variant

    acc: dict[str, float] = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    if a.side == "trl":
        from trl import GRPOTrainer

        _wrap(accelerate.Accelerator, "backward", "backward", acc, cnt)
        _wrap(torch.optim.AdamW, "step", "optimizer", acc, cnt)
        _wrap(GRPOTrainer, "_generate_single_turn", "generation", acc, cnt)
        _wrap(GRPOTrainer, "_get_per_token_logps_and_entropies",
              lambda: "policy forward" if torch.is_grad_enabled() else "reference log-probs", acc, cnt)
        _wrap(GRPOTrainer, "_calculate_rewards", "rewards", acc, cnt)

    cfg = CONFIGS["cpu-tiny"].replace(steps=a.steps)
    with tempfile.TemporaryDirectory(prefix="grpo-phases-") as tmp:
        assets = prepare(cfg, Path(tmp) / "assets")
        spec = {"side": a.side, "config": cfg.to_dict(), "assets": assets, "workdir": str(Path(tmp) / "w"),
                "variant": parse_variant(":" + a.levers)[1]}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        run_side = ["--spec", str(Path(tmp) / "spec.json"), "--out", str(Path(tmp) / "out.json")]
        if a.side == "ours":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                side.main(run_side)
            for key, times in label_times(prof).items():
                acc[key] += times["cpu_s"]
                cnt[key] += times["calls"]
        else:
            side.main(run_side)
        result = json.loads((Path(tmp) / "out.json").read_text())
    cpu = [s["cpu_step_time"] for s in result["steps"]]
    print(f"{a.side}: CPU s per step {[round(x, 3) for x in cpu]}")
    for key, value in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {key:22s} {value / a.steps:7.4f} s/step  ({cnt[key]} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
