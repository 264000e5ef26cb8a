"""Guards that act: watch each step's metrics and warn, skip the update, stop, or roll back.

Training quietly going wrong is the usual way a long run is lost: KL blows up, entropy collapses,
completions run to the length limit, the loss or gradients turn NaN, or the policy games a format
reward while getting answers wrong. Each guard has a threshold (``None`` = off) and an action:

- ``warn``: log it (and tag the tracker run); training goes on;
- ``skip_step``: discard this step's update (the optimizer does not step);
- ``stop``: end training with an error naming the guard; the last checkpoint stays the good one;
- ``rollback``: restore the last checkpoint, multiply the learning rate by ``rollback_lr_factor``
  and continue (at most ``max_rollbacks`` times, then stop).

Every guard is checked before ``optimizer.step()``: the step's KL, entropy, lengths and rewards are
known from its forward pass, so ``skip_step`` really keeps a bad update out of the weights.
Non-finite loss or gradients are always checked; their action can be chosen but never ``warn``:
training on NaN is not an option.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from grpo_core.common.errors import TrainingFailure
from grpo_core.common.options import Options, option

Action = Literal["warn", "skip_step", "stop", "rollback"]


@dataclass
class ThresholdGuard(Options):
    threshold: float | None = option(None, "trigger level (null = guard off)")
    action: Action = option("warn", "warn | skip_step | stop | rollback")
    window: int = option(1, "the median of the last `window` steps' values is compared with the threshold "
                         "(1 = each step alone): a single step's outlier, e.g. the heavy-tailed KL estimate, "
                         "does not act", ge=1)


@dataclass
class NonFiniteGuard(Options):
    action: Literal["skip_step", "stop", "rollback"] = option(
        "stop", "NaN/inf loss or gradient norm: skip_step | stop | rollback")


@dataclass
class RewardHackingGuard(Options):
    format_reward: str | None = option(None, "name of the format reward watched (null = off)")
    correctness_reward: str | None = option(None, "name of the correctness reward watched")
    window: int = option(10, "steps per window: the last window is compared with the one before", ge=1)
    format_rise: float = option(0.1, "format mean rose by at least this", ge=0)
    correctness_drop: float = option(0.05, "while correctness fell by at least this", ge=0)
    action: Action = option("warn", "warn | skip_step | stop | rollback")


@dataclass
class RewardSilentGuard(Options):
    steps: int | None = option(3, "consecutive steps in which a reward scored no completion (every value "
                               "None or NaN: its advantages are zero) before the guard acts (null = off)",
                               ge=1)
    action: Action = option("stop", "warn | skip_step | stop | rollback")


@dataclass
class GuardsConfig(Options):
    """params.yaml `guards:`: what the guards watch and how each acts."""

    kl_max: ThresholdGuard = field(default_factory=ThresholdGuard, metadata={"help": "kl above threshold"})
    entropy_min: ThresholdGuard = field(default_factory=ThresholdGuard,
                                        metadata={"help": "entropy below threshold"})
    clipped_ratio_max: ThresholdGuard = field(
        default_factory=ThresholdGuard,
        metadata={"help": "share of completions hitting max_completion_length above threshold (length "
                          "blow-up)"})
    nonfinite: NonFiniteGuard = field(default_factory=NonFiniteGuard,
                                      metadata={"help": "NaN/inf loss or gradients"})
    reward_hacking: RewardHackingGuard = field(default_factory=RewardHackingGuard,
                                               metadata={"help": "format saturating while correctness falls"})
    reward_silent: RewardSilentGuard = field(default_factory=RewardSilentGuard,
                                             metadata={"help": "a reward that scores nothing, step after "
                                                               "step"})
    rollback_lr_factor: float = option(0.5, "learning rate x this after a rollback", gt=0, le=1)
    max_rollbacks: int = option(2, "rollbacks allowed before a rollback becomes a stop", ge=0)

SEVERITY = {"warn": 0, "skip_step": 1, "rollback": 2, "stop": 3}


@dataclass(frozen=True)
class GuardEvent:
    guard: str
    action: Action
    message: str


class GuardStop(TrainingFailure, RuntimeError):
    """Training stopped by a guard; the message names the guard, the step and the value."""


class GuardMonitor:
    """Checks one step's metrics against the configured guards; keeps the history the hacking guard needs."""

    def __init__(self, cfg: GuardsConfig):
        self.cfg = cfg
        n = cfg.reward_hacking.window
        self._format: deque[float] = deque(maxlen=2 * n)
        self._correct: deque[float] = deque(maxlen=2 * n)
        self._recent: dict[str, deque[float]] = {name: deque(maxlen=getattr(cfg, name).window)
                                                 for name in ("kl_max", "entropy_min", "clipped_ratio_max")}
        self._silent_steps: dict[str, int] = {}  # reward name -> consecutive steps it scored nothing

    def check(self, step: int, metrics: dict) -> list[GuardEvent]:
        """Events for this step (empty if all is well). ``metrics`` uses the trainer's metric names."""
        cfg, events = self.cfg, []
        loss, grad_norm = metrics.get("loss"), metrics.get("grad_norm")
        bad = [name for name, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None
               and not math.isfinite(v)]
        if bad:
            events.append(GuardEvent("nonfinite", cfg.nonfinite.action,
                                     f"step {step}: {' and '.join(f'{b}={metrics[b]}' for b in bad)} is not "
                                     "finite"))
        self._threshold(events, "kl_max", cfg.kl_max, metrics.get("kl"), step, above=True)
        self._threshold(events, "entropy_min", cfg.entropy_min, metrics.get("entropy"), step, above=False)
        self._threshold(events, "clipped_ratio_max", cfg.clipped_ratio_max,
                        metrics.get("completions/clipped_ratio"), step, above=True)
        hacking = self._hacking(step, metrics)
        if hacking:
            events.append(hacking)
        events += self._silent_rewards(step, metrics)
        return events

    def _silent_rewards(self, step: int, metrics: dict) -> list[GuardEvent]:
        """A reward whose step mean is None or NaN scored no completion (every call None, NaN or failed): its
        advantages are zero and training learns nothing from it. One such step can be chance (a reward that
        applies to some tasks only); ``steps`` of them in a row is a broken reward."""
        g = self.cfg.reward_silent
        if g.steps is None:
            return []
        events = []
        for key, value in metrics.items():
            if not (key.startswith("rewards/") and key.endswith("/mean")):
                continue
            name = key[len("rewards/"):-len("/mean")]
            silent = value is None or not math.isfinite(value)
            self._silent_steps[name] = self._silent_steps.get(name, 0) + 1 if silent else 0
            if self._silent_steps[name] >= g.steps:
                events.append(GuardEvent("reward_silent", g.action, (
                    f"step {step}: reward '{name}' scored none of the completions (every value None or NaN) "
                    f"for {self._silent_steps[name]} steps in a row: it gives no advantage, nothing is "
                    "learnt from it; check the function, its gold column and train.reward_errors")))
        return events

    def _threshold(self, events, name, guard: ThresholdGuard, value, step, above: bool) -> None:
        """The guard acts when the median of its last ``window`` finite values (a full window) crosses the
        threshold. Why a median: GRPO's KL estimate exp(r) - r - 1 is heavy-tailed - one sampled token the
        policy has made far less likely than the reference did gives a one-step spike (measured on the
        embedded default: 2.7 and 4.1 in runs whose KL otherwise stays under 0.45), while a run that is really
        drifting stays high."""
        if guard.threshold is None or value is None or not math.isfinite(value):
            return
        recent = self._recent[name]
        recent.append(value)
        if len(recent) < guard.window:
            return
        level = statistics.median(recent)
        if (level > guard.threshold) if above else (level < guard.threshold):
            relation, metric = ("above" if above else "below"), name.rsplit("_", 1)[0]
            what = f"{metric}={value:.6g}" if guard.window == 1 else (
                f"median {metric} of the last {guard.window} steps {level:.6g} (this step {value:.6g})")
            events.append(GuardEvent(name, guard.action, f"step {step}: {what} is {relation} "
                                                         f"the threshold {guard.threshold:g}"))

    def _hacking(self, step: int, metrics: dict) -> GuardEvent | None:
        g = self.cfg.reward_hacking
        if g.format_reward is None or g.correctness_reward is None:
            return None
        fmt = metrics.get(f"rewards/{g.format_reward}/mean")
        cor = metrics.get(f"rewards/{g.correctness_reward}/mean")
        if fmt is None or cor is None or not (math.isfinite(fmt) and math.isfinite(cor)):
            return None
        self._format.append(fmt)
        self._correct.append(cor)
        n = g.window
        if len(self._format) < 2 * n:
            return None
        fmt_before, fmt_now = _mean(list(self._format)[:n]), _mean(list(self._format)[n:])
        cor_before, cor_now = _mean(list(self._correct)[:n]), _mean(list(self._correct)[n:])
        if fmt_now - fmt_before >= g.format_rise and cor_before - cor_now >= g.correctness_drop:
            return GuardEvent("reward_hacking", g.action,
                              f"step {step}: {g.format_reward} rose {fmt_before:.3f} -> {fmt_now:.3f} while "
                              f"{g.correctness_reward} fell {cor_before:.3f} -> {cor_now:.3f} over {n}-step "
                              "windows")
        return None

    def reset_history(self) -> None:
        """After a rollback the windows describe steps that no longer exist."""
        self._format.clear()
        self._correct.clear()
        self._silent_steps.clear()
        for recent in self._recent.values():
            recent.clear()


def decide(events: list[GuardEvent]) -> GuardEvent | None:
    """The most severe event decides what happens to the step (stop > rollback > skip_step > warn)."""
    return max(events, key=lambda e: SEVERITY[e.action]) if events else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
