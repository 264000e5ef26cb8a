"""Offline reward calibration: statistics of a reward matrix and the weight rule.

Input everywhere is a reward matrix ``rewards`` of shape (N, K): N = P * G completions (P prompts,
G = ``group_size`` completions per prompt, rows grouped G at a time, as in ``compute_advantages``),
K reward functions; NaN where function k returned ``None`` ("does not apply") for completion i.
Generation happens elsewhere; everything here is plain numpy on that matrix.

The weight rule (``calibrate_weights``)
---------------------------------------
GRPO learns from the *within-group* spread of the combined reward R_i = sum_k w_k r_ik (the advantage
is R_i minus its group mean, optionally divided by the group std). Ignoring covariance between reward
functions, the within-group variance of R decomposes as

    Var_g(R) ~= sum_k w_k^2 v_k,    v_k = mean over groups g of Var_g(r_k)   (Bessel, NaN ignored)

so function k's share of the advantage variance is  w_k^2 v_k / sum_j w_j^2 v_j.  Setting that share to
the target s_k (target shares renormalised to sum 1 over *live* functions) gives

    w_k = c * sqrt(s_k / v_k)

Normalisation (the constant c): the weights of live functions sum to the sum of the configured target
shares (1.0 in the default params.yaml, where the targets already sum to 1). With ``scale="group"`` the
overall scale cancels in the advantage; with ``scale="none"`` it keeps the summed weight - and so the
reward magnitude - what the user configured.

Dead functions - mean within-group std below ``dead_std_threshold`` (or no group with two valid
values) - get weight 0 and the flag ``dead``; their target share is redistributed over the live ones
by the renormalisation above. When every function is dead the sample has nothing to weigh them by, and
the weights are the configured target shares themselves (all zeros would make training a no-op). A
function is flagged ``dominant`` when its share of the (diagonal) within-group variance under *uniform*
weights (all 1), v_k / sum_j v_j, exceeds ``dominant_share``.

Ignoring covariance is an approximation (format and correctness are usually positively correlated).
The output therefore also reports the *realised* share under the chosen weights computed from the data
with covariance included (Euler allocation, which sums to 1 and may be negative):

    share_k = sum_g w_k Cov_g(r_k, R) / sum_g Var_g(R)

with R built as ``compute_advantages`` builds it for ``aggregation="sum_then_normalize"``: NaN terms
skipped in the weighted sum, rows with every function NaN left out of their group.
The rule targets ``sum_then_normalize``; under ``normalize_then_sum`` each reward is standardised per
group first and the shares follow the weights directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo_core.common.files import finite_or_none
from grpo_core.common.options import Options, option

#: A completion "passes" when its correctness reward is at least this (binary 0/1 correctness).
DEFAULT_PASS_THRESHOLD = 1.0 - 1e-9
#: Group std at or below this counts as zero variance (exact ties in float arithmetic are not exact).
ZERO_STD_ATOL = 1e-8

RULE_TEXT = (
    "w_k = c * sqrt(s_k / v_k) for live functions, where v_k is the mean over groups of the within-group "
    "variance (Bessel, NaN ignored) of reward k and s_k its target share renormalised to sum 1 over live "
    "functions, so that w_k^2 v_k / sum_j w_j^2 v_j = s_k (covariance between functions ignored); c makes "
    "the live weights sum to the sum of the configured target shares. Dead functions (mean within-group "
    "std < dead_std_threshold) get weight 0 and their share is redistributed."
)


@dataclass
class CalibrateConfig(Options):
    enabled: bool = option(True, "sample the base policy and derive reward weights; off = equal weights")
    num_prompts: int = option(64, "training prompts sampled for calibration", ge=1)
    num_generations: int = option(8, "completions per calibration prompt", ge=2)
    temperature: float | None = option(None, "override of generation.temperature for calibration "
                                   "(None = sample as training samples); shown in reports/calibration.md",
                                   gt=0)
    dead_std_threshold: float = option(1e-6, "mean within-group std below this marks a reward dead", ge=0)
    dominant_share: float = option(0.9, "flag a reward above this share of advantage variance", gt=0, le=1)
    drop_always_solved: bool = option(False, "drop prompts the base policy always solves (zero advantage)")
    drop_never_solved: bool = option(False, "drop prompts the base policy never solves (zero advantage)")
    seed: int = option(0, "seed for prompt choice and sampling")


# --------------------------------------------------------------------------------------------------
# input checks


def _check_matrix(rewards: Any, group_size: int, names: Sequence[str]) -> np.ndarray:
    """Return ``rewards`` as a float64 (N, K) array; raise ValueError naming the mismatch."""
    arr = np.asarray(rewards, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"rewards must be a 2-D (N, K) matrix, got shape {arr.shape}")
    n, k = arr.shape
    if k != len(names):
        raise ValueError(f"rewards has {k} columns but {len(names)} names were given: {list(names)}")
    if not isinstance(group_size, int | np.integer) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if n == 0 or n % group_size:
        raise ValueError(f"rewards has {n} rows, not a positive multiple of group_size={group_size}")
    if np.isinf(arr).any():
        raise ValueError("rewards contains +/-inf; use NaN for 'does not apply'")
    return arr


def _check_index(correctness_index: int | None, k: int) -> None:
    if correctness_index is not None and not 0 <= correctness_index < k:
        raise ValueError(f"correctness_index={correctness_index} out of range for {k} reward functions")


def _groups(arr: np.ndarray, group_size: int) -> np.ndarray:
    """(N, K) -> (P, G, K) view, one slice per prompt."""
    return arr.reshape(-1, group_size, arr.shape[1])


# --------------------------------------------------------------------------------------------------
# statistics


def within_group_variance(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per-group, per-function variance (Bessel, ddof=1), NaN ignored.

    rewards (N, K) -> (P, K); NaN where a group has fewer than two valid values for that function.
    Bessel's correction matches the group std ``compute_advantages`` divides by.
    """
    g = _groups(rewards, group_size)
    valid = ~np.isnan(g)
    count = valid.sum(axis=1)  # (P, K)
    total = np.where(valid, g, 0.0).sum(axis=1)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    sq = np.where(valid, (g - mean[:, None, :]) ** 2, 0.0).sum(axis=1)
    return np.divide(sq, count - 1, out=np.full_like(sq, np.nan), where=count > 1)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r on rows where both are non-NaN; NaN with < 2 such rows or zero variance."""
    ok = ~(np.isnan(x) | np.isnan(y))
    if ok.sum() < 2:
        return math.nan
    xs, ys = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    denom = math.sqrt(float((xs * xs).sum()) * float((ys * ys).sum()))
    # a constant column has no defined correlation; tiny denominators are float noise around zero
    return float((xs * ys).sum()) / denom if denom > 1e-300 else math.nan


def correlation_matrix(rewards: np.ndarray) -> np.ndarray:
    """(N, K) -> (K, K) pairwise Pearson correlations (pairwise-complete rows, NaN if undefined)."""
    k = rewards.shape[1]
    out = np.full((k, k), np.nan)
    for a in range(k):
        for b in range(a, k):
            out[a, b] = out[b, a] = _pearson(rewards[:, a], rewards[:, b])
    return out


def pass_rates(correct_rewards: np.ndarray, group_size: int,
               threshold: float = DEFAULT_PASS_THRESHOLD) -> np.ndarray:
    """Per-prompt pass rate: (N,) correctness rewards -> (P,) fraction of valid samples with r >= threshold.

    NaN for a prompt whose correctness reward is NaN for every sample.
    """
    g = np.asarray(correct_rewards, dtype=np.float64).reshape(-1, group_size)
    valid = ~np.isnan(g)
    passed = (np.where(valid, g, -np.inf) >= threshold).sum(axis=1)
    n_valid = valid.sum(axis=1)
    return np.divide(passed, n_valid, out=np.full(g.shape[0], np.nan), where=n_valid > 0)


def difficulty_profile(rates: np.ndarray, group_size: int) -> dict[str, Any]:
    """Summary of per-prompt pass rates (P,): counts of always/never solved and a histogram.

    Histogram bins are centred on the attainable rates j/G (j = 0..G), edges halfway between them, so a
    full group lands exactly in its bin; rates from groups with NaNs land in the nearest one.
    """
    known = rates[~np.isnan(rates)]
    centres = np.arange(group_size + 1) / group_size
    edges = np.concatenate([[-0.5 / group_size], (np.arange(group_size) + 0.5) / group_size,
                            [1.0 + 0.5 / group_size]])
    counts, _ = np.histogram(known, bins=edges)
    return {
        "pass_rate_per_prompt": [finite_or_none(r) for r in rates],
        "mean_pass_rate": finite_or_none(known.mean()) if known.size else None,
        "always_solved": int((known >= 1.0 - 1e-12).sum()),
        "never_solved": int((known <= 1e-12).sum()),
        "unknown": int(np.isnan(rates).sum()),
        "histogram": {"pass_rate": [float(c) for c in centres], "count": [int(c) for c in counts]},
    }


def reward_statistics(rewards: Any, group_size: int, names: Sequence[str],
                      correctness_index: int | None = None, *,
                      pass_threshold: float = DEFAULT_PASS_THRESHOLD) -> dict[str, Any]:
    """Statistics of a reward matrix (N, K), JSON-serialisable (undefined values are None).

    Per function (``per_function[name]``):
      mean, std (ddof=1) over valid entries; ``mean_within_group_std`` = mean over groups of the group
      std (groups with < 2 valid values skipped); ``mean_within_group_var`` = v_k of the weight rule;
      ``none_fraction`` = share of NaN entries; ``zero_variance_group_fraction`` = share of groups (with
      a defined std) whose std <= ZERO_STD_ATOL - such groups give that function no learning signal.
    ``correlation``: K x K Pearson matrix (rows where both are non-NaN). ``correlation_with_correctness``
    and ``difficulty`` (per-prompt pass rate, pass = reward >= ``pass_threshold``) when
    ``correctness_index`` is given.
    """
    arr = _check_matrix(rewards, group_size, names)
    _check_index(correctness_index, arr.shape[1])
    var_g = within_group_variance(arr, group_size)  # (P, K)
    std_g = np.sqrt(var_g)
    per_function: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(names):
        col = arr[:, k]
        valid = col[~np.isnan(col)]
        defined = std_g[:, k][~np.isnan(std_g[:, k])]
        per_function[name] = {
            "mean": finite_or_none(valid.mean()) if valid.size else None,
            "std": finite_or_none(valid.std(ddof=1)) if valid.size > 1 else None,
            "mean_within_group_std": finite_or_none(defined.mean()) if defined.size else None,
            "mean_within_group_var": finite_or_none(var_g[:, k][~np.isnan(var_g[:, k])].mean())
            if defined.size else None,
            "none_fraction": float(np.isnan(col).mean()),
            "zero_variance_group_fraction": finite_or_none((defined <= ZERO_STD_ATOL).mean())
            if defined.size else None,
            "num_groups_with_variance": int(defined.size),
        }
    corr = correlation_matrix(arr)
    out: dict[str, Any] = {
        "num_completions": int(arr.shape[0]),
        "num_prompts": int(arr.shape[0] // group_size),
        "group_size": int(group_size),
        "names": list(names),
        "per_function": per_function,
        "correlation": {a: {b: finite_or_none(corr[i, j]) for j, b in enumerate(names)}
                        for i, a in enumerate(names)},
        "correlation_with_correctness": None,
        "difficulty": None,
    }
    if correctness_index is not None:
        out["correlation_with_correctness"] = {
            b: finite_or_none(corr[correctness_index, j]) for j, b in enumerate(names)}
        rates = pass_rates(arr[:, correctness_index], group_size, pass_threshold)
        out["difficulty"] = {"correctness_function": names[correctness_index],
                             "pass_threshold": pass_threshold, **difficulty_profile(rates, group_size)}
    return out


# --------------------------------------------------------------------------------------------------
# the weight rule


def diagonal_shares(weights: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Approximate shares of within-group variance, covariance ignored: w_k^2 v_k / sum_j w_j^2 v_j.

    weights (K,), v (K,) -> (K,); all NaN when the total is zero.
    """
    contrib = weights**2 * np.nan_to_num(v)
    total = contrib.sum()
    return contrib / total if total > 0 else np.full_like(contrib, np.nan)


def realised_shares(rewards: np.ndarray, group_size: int, weights: np.ndarray) -> np.ndarray:
    """Shares of within-group variance of R = sum_k w_k r_k with covariance included (Euler allocation).

    share_k = sum_g w_k Cov_g(r_k, R) / sum_g Var_g(R), where, as in ``compute_advantages``
    (sum_then_normalize), NaN terms are skipped in the sum (count as 0) and a row with every function
    NaN is unscorable: left out of its group's statistics. Sums to 1; a share is negative when reward k
    moves against the rest within groups. (K,), all NaN when R never varies within a group.
    """
    g = _groups(np.asarray(rewards, dtype=np.float64), group_size)  # (P, G, K)
    scorable = ~np.isnan(g).all(axis=2)  # (P, G)
    x = np.nan_to_num(g, nan=0.0)
    n = scorable.sum(axis=1)[:, None]  # (P, 1)
    mean = np.divide((x * scorable[..., None]).sum(axis=1), n, out=np.zeros(x.shape[::2]), where=n > 0)
    centred = (x - mean[:, None, :]) * scorable[..., None]  # unscorable rows contribute nothing
    r_c = centred @ weights  # (P, G): centred combined reward
    total = float((r_c**2).sum())
    if total <= 0:
        return np.full(len(weights), np.nan)
    # sum over groups and samples of w_k (r_k - mean)(R - mean); the 1/(n_g - 1) factors are dropped,
    # so groups weigh by their scorable count - equal for full groups, which is the usual case
    return weights * np.einsum("pgk,pg->k", centred, r_c) / total


def calibrate_weights(rewards: Any, group_size: int, names: Sequence[str],
                      target_shares: Sequence[float], *, dead_std_threshold: float = 1e-6,
                      dominant_share: float = 0.9, correctness_index: int | None = None,
                      pass_threshold: float = DEFAULT_PASS_THRESHOLD) -> dict[str, Any]:
    """Reward weights from a reward matrix (N, K) by the rule in the module docstring.

    Returns a JSON-serialisable dict: ``weights`` {name: w}, ``weights_list`` (in ``names`` order),
    ``rule`` (text), ``target_shares`` {configured, effective}, ``shares`` {approx_chosen (the rule's
    diagonal share, = effective targets), realised_chosen (with covariance), approx_uniform,
    realised_uniform}, ``stats`` (``reward_statistics``), ``flags`` {name: ["dead" | "dominant"]},
    ``difficulty`` (None without a correctness function), ``warnings`` (list of str).
    """
    arr = _check_matrix(rewards, group_size, names)
    k = arr.shape[1]
    targets = np.asarray(target_shares, dtype=np.float64)
    if targets.shape != (k,):
        raise ValueError(f"target_shares has {targets.size} entries, expected one per reward ({k}): "
                         f"{list(names)}")
    if not np.isfinite(targets).all() or (targets < 0).any():
        raise ValueError(f"target_shares must be finite and >= 0, got {targets.tolist()}")
    if targets.sum() <= 0:
        raise ValueError(f"target_shares must not all be zero: {targets.tolist()}")
    if not 0 < dominant_share <= 1:
        raise ValueError(f"dominant_share must be in (0, 1], got {dominant_share}")
    stats = reward_statistics(arr, group_size, names, correctness_index, pass_threshold=pass_threshold)
    per = stats["per_function"]

    v = np.array([per[n]["mean_within_group_var"] or 0.0 for n in names])
    mean_std = np.array([per[n]["mean_within_group_std"] or 0.0 for n in names])
    # v > 0 guards a threshold of 0: a function with no within-group variance can get no finite weight
    live = (mean_std >= dead_std_threshold) & (v > 0)

    flags: dict[str, list[str]] = {n: [] for n in names}
    warnings: list[str] = []
    for i, n in enumerate(names):
        if not live[i]:
            flags[n].append("dead")

    uniform = np.ones(k)
    approx_uniform = diagonal_shares(uniform, v)
    # a lone live reward carries all the variance by definition: nothing to flag
    for i, n in enumerate(names):
        if live.sum() > 1 and np.isfinite(approx_uniform[i]) and approx_uniform[i] > dominant_share:
            flags[n].append("dominant")

    weights, effective = _rule_weights(live, targets, v, warnings)
    if correctness_index is not None and not live[correctness_index]:
        warnings.append(f"the correctness function '{names[correctness_index]}' is dead on the calibration "
                        "sample (no group has both passes and failures): its weight is 0, so training will "
                        "not reward correctness; check the base model, prompts or num_generations")
    for i, n in enumerate(names):
        if "dominant" in flags[n]:
            warnings.append(f"'{n}' carries {approx_uniform[i]:.1%} of the within-group variance under "
                            f"uniform weights (> dominant_share={dominant_share})")

    realised = realised_shares(arr, group_size, weights)
    as_dict = lambda a: {n: finite_or_none(x) for n, x in zip(names, a)}  # noqa: E731
    return {
        "names": list(names),
        "weights": {n: float(w) for n, w in zip(names, weights)},
        "weights_list": [float(w) for w in weights],
        "rule": RULE_TEXT,
        "target_shares": {"configured": as_dict(targets), "effective": as_dict(effective)},
        "shares": {
            "approx_chosen": as_dict(diagonal_shares(weights, v)),
            "realised_chosen": as_dict(realised),
            "approx_uniform": as_dict(approx_uniform),
            "realised_uniform": as_dict(realised_shares(arr, group_size, uniform)),
        },
        "params": {"group_size": int(group_size), "dead_std_threshold": dead_std_threshold,
                   "dominant_share": dominant_share, "pass_threshold": pass_threshold},
        "stats": stats,
        "flags": flags,
        "difficulty": stats["difficulty"],
        "warnings": warnings,
    }


def _rule_weights(live: np.ndarray, targets: np.ndarray, v: np.ndarray,
                  warnings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(weights, effective target shares) by the module docstring's rule; a warning where it cannot apply."""
    live_targets = np.where(live, targets, 0.0)
    if live_targets.sum() > 0:
        effective = live_targets / live_targets.sum()  # dead shares redistributed pro rata
        raw = np.zeros(len(targets))
        raw[live] = np.sqrt(effective[live] / v[live])
        return raw * (targets.sum() / raw.sum()), effective  # live weights sum to the configured total
    if live.any():
        warnings.append("every live reward function has target_share 0: all weights are 0")
        return np.zeros(len(targets)), np.zeros(len(targets))
    # nothing to weigh by: zeros would make training a no-op, so the configured shares stand
    warnings.append("no reward function varies within groups on the calibration sample (every one is dead): "
                    "nothing to weigh them by, so the weights are the configured target shares; calibrate "
                    "more prompts or samples (calibrate.num_prompts, num_generations), or check that the "
                    "base model ever solves them")
    return targets.copy(), targets / targets.sum()


def select_training_prompts(pass_rates: Sequence[float | None], drop_always_solved: bool,
                            drop_never_solved: bool) -> list[int]:
    """Indices of prompts to keep. Always solved (rate 1) and never solved (rate 0) groups give zero
    correctness advantage; dropping them saves generation. Unknown rates (None/NaN) are kept."""
    kept: list[int] = []
    for i, r in enumerate(pass_rates):
        if r is None or (isinstance(r, float) and math.isnan(r)):
            kept.append(i)
            continue
        if drop_always_solved and r >= 1.0 - 1e-12:
            continue
        if drop_never_solved and r <= 1e-12:
            continue
        kept.append(i)
    return kept
