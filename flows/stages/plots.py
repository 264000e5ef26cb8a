"""The pipeline's PNG figures (matplotlib, Agg), written atomically.

plots/training.png    (train)    reward (+/- reward_std), KL, mean completion length over steps
                                 (and eval/accuracy)
plots/evaluation.png  (evaluate) reward and KL over steps, base vs trained accuracy and pass@k
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_core.common.files import atomic_path


def read_train_log(path: Path):
    """The per-step CSV as a DataFrame (empty when the file is absent or has no rows)."""
    import pandas as pd

    if not Path(path).is_file():
        return pd.DataFrame()
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    return df.apply(pd.to_numeric, errors="coerce")


def _pyplot():
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _curve(ax, log, column: str, title: str, color: str, band: str | None = None) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    if log.empty or column not in log.columns or log[column].isna().all():
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    x, y = log["step"], log[column]
    ax.plot(x, y, color=color, marker="o" if len(log) < 30 else None, markersize=3)
    if band and band in log.columns:
        ax.fill_between(x, y - log[band], y + log[band], color=color, alpha=0.15, linewidth=0)
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return Path(path)


def training_figure(log, path: Path) -> Path:
    """Reward, KL and length over steps; with evaluation during training, held-out greedy accuracy too; with
    tools, tool calls per completion and the share of calls that failed."""
    plt = _pyplot()
    evals = log.dropna(subset=["eval/accuracy"]) if "eval/accuracy" in log.columns else log.iloc[0:0]
    tools = "tools/call_frequency" in log.columns
    panels = 3 + bool(len(evals)) + tools
    fig, axes = plt.subplots(1, panels, figsize=(4.3 * panels, 3.6))
    _curve(axes[0], log, "reward", "reward (weighted, mean)", "tab:blue", band="reward_std")
    _curve(axes[1], log, "kl", "KL to reference", "tab:red")
    _curve(axes[2], log, "completions/mean_length", "mean completion length", "tab:green")
    if len(evals):
        _curve(axes[3], evals, "eval/accuracy", "held-out greedy accuracy (eval)", "tab:purple")
    if tools:
        _curve(axes[-1], log, "tools/call_frequency", "tool calls per completion", "tab:brown")
        _curve(axes[-1], log, "tools/failure_frequency", "tool calls (brown) / failed share (olive)",
               "tab:olive")
    fig.suptitle("GRPO training")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def _num(x: Any) -> float:
    return (float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            else math.nan)


def evaluation_figure(log, metrics: Mapping[str, Any], pass_k: list[int], path: Path) -> Path:
    """Reward and KL curves from the train log, and base vs trained accuracy / pass@k bars."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    _curve(axes[0], log, "reward", "training reward", "tab:blue", band="reward_std")
    _curve(axes[1], log, "kl", "KL to reference", "tab:red")
    ax = axes[2]
    labels = ["accuracy\n(greedy)"] + [f"pass@{k}" for k in pass_k]
    keys = ["accuracy"] + [f"pass@{k}" for k in pass_k]
    # with tools: completions with a call that succeeded (greedy)
    if "tool_success_rate" in metrics["trained"]:
        labels, keys = labels + ["tool\nsuccess"], keys + ["tool_success_rate"]
    base = [_num(metrics["base"].get(k)) for k in keys]
    trained = [_num(metrics["trained"].get(k)) for k in keys]
    width = 0.38
    xs = list(range(len(keys)))
    b1 = ax.bar([x - width / 2 for x in xs], base, width, label="base", color="tab:gray")
    b2 = ax.bar([x + width / 2 for x in xs], trained, width, label="trained", color="tab:orange")
    for bars in (b1, b2):
        for bar in bars:
            h = bar.get_height()
            if math.isfinite(h):
                ax.annotate(f"{h:.2f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom",
                            fontsize=8)
    ax.set_xticks(xs, labels)
    ax.set_ylim(0, 1.08)
    ax.set_title(f"held-out accuracy ({metrics['trained'].get('num_prompts', '?')} prompts)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle("GRPO: training curves and evaluation")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
