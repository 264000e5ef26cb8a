"""Parity with TRL 1.16, using TRL's own code as the oracle (float64 values and gradients to 1e-6).

* loss: ``GRPOTrainer._compute_loss`` runs on a stand-in ``self`` (``object.__new__``, no model, no
  accelerator) whose log-prob method returns our tensors, so every line of TRL's loss runs as shipped.
* advantages: TRL computes them inline in ``_generate_and_score_completions`` (not separable), so
  ``trl_advantages`` below is a line-by-line copy of that block (trl/trainer/grpo_trainer.py, 1.16.0,
  from ``unscorable_mask = ...`` to ``advantages = torch.nan_to_num(...)``) using TRL's real ``nanstd``.
* log-probs: ``trl.trainer.utils.selective_log_softmax`` / ``entropy_from_logits``, and
  ``_get_per_token_logps_and_entropies`` on a tiny Qwen2 given TRL's fused LM head.

TRL is imported once here (it takes seconds); no other test module imports it.
"""

import contextlib
import copy
import itertools
import math
import types
from collections import defaultdict

import pytest
import torch

trl = pytest.importorskip("trl")
from trl.trainer import utils as trl_utils  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from grpo_core.advantages import compute_advantages  # noqa: E402
from grpo_core.loss import entropy_mean, grpo_loss, sampler_correction  # noqa: E402
from grpo_core.model.logprobs import (  # noqa: E402
    ScoringPath,
    entropy_from_logits,
    selective_log_softmax,
    token_logprobs_and_entropy,
)
from grpo_core.train.entropy import applied_entropy_coef, high_entropy_mask, next_entropy_coef  # noqa: E402

F64 = torch.float64
TOL = 1e-6


def test_the_oracle_is_trl_1_16():
    assert trl.__version__ == "1.16.0"


# --- loss ---------------------------------------------------------------------------------------------------


# GRPOConfig 1.16's defaults for the SAPO and VESPO options
SHAPE_DEFAULTS = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
                  "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}


def test_the_shape_defaults_are_grpo_configs():
    import dataclasses

    from trl import GRPOConfig

    assert ({f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in SHAPE_DEFAULTS}
            == SHAPE_DEFAULTS)


class SingleProcessAccelerator:
    """What _compute_loss asks of the accelerator, for one process: reductions are identities."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    gather_for_metrics = gather


def trl_grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    loss_type,
    beta,
    epsilon_low,
    epsilon_high,
    delta,
    importance_sampling_level,
    kl_ratio_correction,
    max_completion_length,
    num_items,
    off_policy_mask_threshold=None,
    entropies=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    trainer=None,
    sampler_ratio=None,
    sampling_logps=None,
    **shape,
):
    """TRL's _compute_loss on a stand-in trainer; returns (loss, logged metrics). ``shape``: the SAPO / VESPO
    options (GRPOConfig's names; its defaults when absent). ``entropies`` (B, T): what the log-prob pass
    returns (zeros by default); ``trainer``: a stand-in from an earlier call, to carry the adaptive entropy
    state."""
    if trainer is not None:
        return _trl_call(trainer, logps, old_logps, ref_logps, advantages, mask, num_items, entropies)
    extra_inputs = {}
    if sampler_ratio is not None:
        extra_inputs["importance_sampling_ratio"] = sampler_ratio
    if sampling_logps is not None:
        extra_inputs["sampling_per_token_logps"] = sampling_logps
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_low if epsilon_high is None else epsilon_high,  # as GRPOTrainer.__init__
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        args=types.SimpleNamespace(
            use_bias_correction_kl=kl_ratio_correction, delta=delta, steps_per_generation=1,
            **{**SHAPE_DEFAULTS, **shape},
        ),
        off_policy_mask_threshold=off_policy_mask_threshold,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=shape.get("use_adaptive_entropy", False),
        _entropy_bonus_enabled=entropy_coef != 0.0 or shape.get("use_adaptive_entropy", False),
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        use_vllm=sampler_ratio is not None,
        vllm_importance_sampling_correction=sampler_ratio is not None,
        _extra_inputs=extra_inputs,
        # features outside this function's scope, switched off
        aux_loss_enabled=False,
        # one process, no gradient accumulation (our function leaves accumulation to the caller)
        current_gradient_accumulation_steps=1,
        accelerator=SingleProcessAccelerator(),
        model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    return _trl_call(trainer, logps, old_logps, ref_logps, advantages, mask, num_items, entropies)


def _trl_call(trainer, logps, old_logps, ref_logps, advantages, mask, num_items, entropies):
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (
        logps,
        torch.zeros_like(logps) if entropies is None else entropies,
        None,
    )
    batch, length = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "ref_per_token_logps": ref_logps,
        "num_items_in_batch": torch.as_tensor(mask.sum() if num_items is None else num_items, dtype=F64),
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    inputs.update(trainer.__dict__.get("_extra_inputs", {}))
    loss = trainer._compute_loss(None, inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}, trainer


def random_loss_inputs(seed, batch=6, length=7):
    generator = torch.Generator().manual_seed(seed)
    base = -torch.rand(batch, length, dtype=F64, generator=generator) * 3
    # per-token log-ratios ~ N(0, 0.4^2) plus a per-sequence drift, so that token and sequence ratios
    # both cross the clip bounds [0.8, 1.28] and delta = 1.5
    drift = 0.5 * torch.randn(batch, 1, dtype=F64, generator=generator)
    drift[4], drift[5] = 0.8, -0.7  # sequence ratios ~ e^0.8 = 2.2 (above delta) and ~ e^-0.7 = 0.5
    old = base - drift + 0.4 * torch.randn(batch, length, dtype=F64, generator=generator)
    ref = base + 0.3 * torch.randn(batch, length, dtype=F64, generator=generator)
    advantages = torch.randn(batch, dtype=F64, generator=generator)
    advantages[1] = 0.0  # a zero-advantage sequence
    advantages[4], advantages[5] = -1.0, -0.5  # A < 0: where delta and the low clip bind
    mask = (torch.rand(batch, length, generator=generator) > 0.3).to(F64)
    mask[2] = 0.0  # an empty row
    mask[3] = 1.0  # a full row
    return base, old, ref, advantages, mask


LOSS_GRID = [
    (loss_type, level, beta, delta, old_given, kl_ratio_correction)
    for loss_type, level, beta, delta, old_given in itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo"],  # loss_type
        ["token", "sequence"],  # importance_sampling_level
        [0.0, 0.05],  # beta
        [None, 1.5],  # delta
        [True, False],  # old_logps given (off-policy) / None (on-policy)
    )
    for kl_ratio_correction in ([True, False] if beta else [True])  # the correction only acts on the KL
]


def assert_matches_trl(base, old_logps, ref, advantages, mask, options, **inputs):
    """grpo_loss and TRL's _compute_loss on the same inputs: value, gradient and every metric TRL logs
    (to 1e-6). Returns our gradient."""
    ours_logps = base.clone().requires_grad_(True)
    trl_logps = base.clone().requires_grad_(True)
    ours, stats = grpo_loss(ours_logps, old_logps, ref, advantages, mask, **options, **inputs)
    theirs, trl_stats, _ = trl_grpo_loss(trl_logps, old_logps, ref, advantages, mask, **options, **inputs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, atol=TOL, rtol=0)
    assert set(stats) - {"ratio_mean"} == set(trl_stats) - {"entropy"}  # entropy: not computed by grpo_loss
    for name, value in trl_stats.items():
        if name != "entropy":
            assert float(stats[name]) == pytest.approx(value, abs=TOL, nan_ok=True), name
    return ours_logps.grad


# The loss types with their own policy term, and OPSM over every family: levels, KL, on/off-policy,
# mask on/off.
NEW_LOSS_GRID = [
    (loss_type, level, beta, old_given, opsm)
    for loss_type, level, beta, old_given, opsm in itertools.product(
        ["cispo", "sapo", "luspo", "vespo", "grpo", "dapo"],
        ["token", "sequence"],
        [0.0, 0.05],
        [True, False],
        [None, 0.1],
    )
    if loss_type in ("cispo", "sapo", "luspo", "vespo") or opsm is not None
]
SHAPES = {"sapo_temperature_pos": 1.3, "sapo_temperature_neg": 0.7, "vespo_k_pos": 1.5,
          "vespo_lambda_pos": 2.5,
          "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5}  # off TRL's defaults, so a dropped option shows


@pytest.mark.parametrize(("loss_type", "level", "beta", "old_given", "opsm"), NEW_LOSS_GRID)
def test_cispo_sapo_luspo_vespo_and_opsm_match_trl(loss_type, level, beta, old_given, opsm):
    seed = 1000 + NEW_LOSS_GRID.index((loss_type, level, beta, old_given, opsm))
    base, old, ref, advantages, mask = random_loss_inputs(seed)
    options = {
        "loss_type": loss_type, "beta": beta, "epsilon_low": 0.2,
        "epsilon_high": 1.5 if loss_type == "cispo" else 0.28,  # cispo's cap on the weight itself; binds here
        "delta": None, "importance_sampling_level": level, "kl_ratio_correction": True,
        "max_completion_length": base.shape[1] + 3,
        "num_items": mask.sum() + 11 if loss_type in ("dapo", "cispo", "vespo") else None,
        "off_policy_mask_threshold": opsm, **SHAPES,
    }
    grad = assert_matches_trl(base, old if old_given else None, ref, advantages, mask, options)
    assert grad.abs().sum() > 0  # a loss that trains


def test_opsm_drops_exactly_the_negative_far_off_policy_sequences():
    """By hand: rows 0/1 drifted (mean KL 0.5), row 2 barely (0.01); A = -1, -1, +1
    (row 2 kept by A > 0 too)."""
    logps = torch.full((3, 4), -1.0, dtype=F64)
    sampling = logps + torch.tensor([[0.5], [0.5], [0.01]], dtype=F64)
    mask = torch.ones(3, 4, dtype=F64)
    advantages = torch.tensor([-1.0, -1.0, 1.0], dtype=F64)
    advantages_far_pos = torch.tensor([-1.0, 1.0, -1.0], dtype=F64)
    from grpo_core.loss import off_policy_mask

    assert (off_policy_mask(advantages.unsqueeze(1), logps, sampling, mask, 0.1).squeeze(1).tolist()
            == [0, 0, 1])
    assert (off_policy_mask(advantages_far_pos.unsqueeze(1), logps, sampling, mask, 0.1).squeeze(1).tolist()
            == [0, 1, 1])
    assert (off_policy_mask(advantages.unsqueeze(1), logps, sampling, mask, 0.6).squeeze(1).tolist()
            == [1, 1, 1])


def trl_sampler_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, the vLLM importance-sampling block, copied
    verbatim (from ``per_token_logps_diff = ...`` to the mode branches; self.* turned into arguments)."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio, min=clip_min,
                                                     max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = ((vllm_importance_sampling_ratio < min_val)
                            | (vllm_importance_sampling_ratio > max_val))
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask,
                                                                                    value=0.0)
    return vllm_importance_sampling_ratio


def sampler_logps_for(old, mask, seed):
    """What a sampling engine reports: the trainer's log-probs off by kernel noise, some sequences far off, a
    NaN where it could not score a token."""
    generator = torch.Generator().manual_seed(seed)
    sampling = old + 0.05 * torch.randn(old.shape, dtype=F64, generator=generator)
    sampling[0] -= 1.2  # a sequence the engine found much less likely: ratio e^1.2 > 3 per token
    sampling[1, 0] = math.nan
    return sampling


SAMPLER_GRID = list(itertools.product(["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
                                      [(None, 3.0), (0.5, 2.0)]))


@pytest.mark.parametrize(("mode", "clip"), SAMPLER_GRID)
def test_the_sampler_correction_ratio_is_trls(mode, clip):
    base, old, ref, advantages, mask = random_loss_inputs(5000 + SAMPLER_GRID.index((mode, clip)))
    sampling = sampler_logps_for(old, mask, 1)
    ours = sampler_correction(old, sampling, mask, mode, *clip)
    theirs = trl_sampler_ratio(old, sampling, mask, mode, *clip)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert ours.shape == ((base.shape[0], 1) if mode.startswith("sequence") else base.shape)
    if mode.endswith("mask"):
        assert (ours == 0).any()  # the far-off sequence (or its tokens) is masked
    else:
        assert ours.max() <= clip[1]


CORRECTED_GRID = list(itertools.product(["grpo", "dapo", "cispo", "sapo", "luspo", "vespo"],
                                        ["token_mask", "token_truncate", "sequence_mask"], [None, 0.1]))


@pytest.mark.parametrize(("loss_type", "mode", "opsm"), CORRECTED_GRID)
def test_the_corrected_loss_and_opsm_on_sampler_logps_match_trl(loss_type, mode, opsm):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses vespo with a sequence-level correction; so does grpo_loss (tested below)")
    base, old, ref, advantages, mask = random_loss_inputs(
        6000 + CORRECTED_GRID.index((loss_type, mode, opsm)))
    sampling = sampler_logps_for(old, mask, 2)
    ratio = sampler_correction(old, sampling, mask, mode, 0.5, 2.0)
    options = {"loss_type": loss_type, "beta": 0.05, "epsilon_low": 0.2,
               "epsilon_high": 1.5 if loss_type == "cispo" else 0.28, "delta": None,
               "importance_sampling_level": "token", "kl_ratio_correction": True,
               "max_completion_length": base.shape[1] + 3,
               "num_items": mask.sum() + 11 if loss_type in ("dapo", "cispo", "vespo") else None,
               "off_policy_mask_threshold": opsm, **SHAPES}
    assert_matches_trl(base, old, ref, advantages, mask, options, sampler_ratio=ratio,
                       sampling_logps=sampling)
    corrected, _ = grpo_loss(base, old, ref, advantages, mask, sampler_ratio=ratio, sampling_logps=sampling,
                             **options)
    uncorrected, _ = grpo_loss(base, old, ref, advantages, mask, **options)
    assert abs(float(uncorrected) - float(corrected)) > 1e-6  # the correction moved the loss


def test_vespo_refuses_a_sequence_level_correction():
    base, old, ref, advantages, mask = random_loss_inputs(7)
    with pytest.raises(ValueError, match="vespo takes a token-level correction"):
        grpo_loss(base, old, ref, advantages, mask, loss_type="vespo",
                  sampler_ratio=torch.ones(base.shape[0], 1, dtype=F64))


def our_loss_with_entropy(logps, old, ref, advantages, mask, entropies, quantile, coef, **options):
    """grpo_loss on the high-entropy tokens, minus the entropy bonus: what the trainer computes per
    micro-batch."""
    trained = high_entropy_mask(entropies.detach(), mask, quantile) if quantile < 1 else mask.bool()
    loss, stats = grpo_loss(logps, old, ref, advantages, mask, entropy_mask=trained if quantile < 1 else None,
                            **options)
    return loss - coef * entropy_mean(entropies, trained), stats


ENTROPY_GRID = list(itertools.product(["grpo", "dapo", "cispo", "sapo", "luspo"], [1.0, 0.5, 0.2],
                                      [0.0, 0.01]))


@pytest.mark.parametrize(("loss_type", "quantile", "coef"), ENTROPY_GRID)
def test_top_entropy_quantile_and_the_entropy_bonus_match_trl(loss_type, quantile, coef):
    seed = 3000 + ENTROPY_GRID.index((loss_type, quantile, coef))
    base, old, ref, advantages, mask = random_loss_inputs(seed)
    entropies = torch.rand(base.shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 4
    options = {"loss_type": loss_type, "beta": 0.05, "epsilon_low": 0.2,
               "epsilon_high": 1.5 if loss_type == "cispo" else 0.28, "delta": None,
               "importance_sampling_level": "token", "kl_ratio_correction": True,
               "max_completion_length": base.shape[1] + 3,
               "num_items": mask.sum() + 11 if loss_type in ("dapo", "cispo") else None}
    ours_logps, trl_logps = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ours_h, trl_h = entropies.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    ours, _ = our_loss_with_entropy(ours_logps, old, ref, advantages, mask, ours_h, quantile, coef, **options)
    theirs, trl_stats, _ = trl_grpo_loss(trl_logps, old, ref, advantages, mask, entropies=trl_h,
                                         top_entropy_quantile=quantile, entropy_coef=coef, **options)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, atol=TOL, rtol=0)
    if coef:
        torch.testing.assert_close(ours_h.grad, trl_h.grad, atol=TOL, rtol=0)
        assert trl_h.grad.abs().sum() > 0
    if quantile < 1:  # the mask took real tokens away (and kept some)
        trained = high_entropy_mask(entropies, mask, quantile)
        assert ((mask > 0) & ~trained).any() and trained.any()


def test_adaptive_entropy_control_follows_trl_step_by_step():
    """Six optimizer steps (one micro-batch each) with entropies around the target: TRL's controller and ours
    give the same coefficient after every step and the same loss, the bonus gated on the previous step."""
    knobs = {"entropy_target": 1.0, "entropy_coef_delta": 0.02, "entropy_coef_min": 0.0,
             "entropy_coef_max": 0.05}
    coef, last, trainer = 0.01, float("inf"), None
    for step, level in enumerate([0.5, 0.7, 1.5, 0.4, 2.0, 0.9]):
        base, old, ref, advantages, mask = random_loss_inputs(4000 + step)
        entropies = level * (0.5 + torch.rand(base.shape, dtype=F64,
                                              generator=torch.Generator().manual_seed(step)))
        options = {"loss_type": "dapo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": 0.28, "delta": None,
                   "importance_sampling_level": "token", "kl_ratio_correction": True,
                   "max_completion_length": None, "num_items": None}
        theirs, _, trainer = trl_grpo_loss(base, old, ref, advantages, mask, entropies=entropies,
                                           entropy_coef=0.01, use_adaptive_entropy=True, trainer=trainer,
                                           **knobs, **options)
        applied = applied_entropy_coef(coef, last, adaptive=True, target=knobs["entropy_target"])
        ours, _ = our_loss_with_entropy(base, old, ref, advantages, mask, entropies, 1.0, applied, **options)
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
        last = float(entropy_mean(entropies, mask))
        coef = next_entropy_coef(coef, last, target=1.0, delta=0.02, low=0.0, high=0.05)
        assert coef == pytest.approx(trainer.entropy_coef, abs=1e-12), step
    assert 0.0 < coef <= 0.05


@pytest.mark.parametrize(
    ("loss_type", "level", "beta", "delta", "old_given", "kl_ratio_correction"), LOSS_GRID
)
def test_loss_values_gradients_and_stats_match_trl(
    loss_type, level, beta, delta, old_given, kl_ratio_correction
):
    seed = LOSS_GRID.index((loss_type, level, beta, delta, old_given, kl_ratio_correction))
    base, old, ref, advantages, mask = random_loss_inputs(seed)
    options = {
        "loss_type": loss_type,
        "beta": beta,
        "epsilon_low": 0.2,
        "epsilon_high": 0.28,
        "delta": delta,
        "importance_sampling_level": level,
        "kl_ratio_correction": kl_ratio_correction,
        "max_completion_length": base.shape[1] + 3,
        "num_items": mask.sum() + 11 if loss_type == "dapo" else None,  # tokens of the whole generation batch
    }
    assert_matches_trl(base, old if old_given else None, ref, advantages, mask, options)


def test_dapo_default_num_items_is_the_micro_batch_token_count():
    base, old, ref, advantages, mask = random_loss_inputs(123)
    options = {
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon_low": 0.2,
        "epsilon_high": None,
        "delta": None,
        "importance_sampling_level": "token",
        "kl_ratio_correction": True,
        "max_completion_length": None,
    }
    ours, _ = grpo_loss(base, old, ref, advantages, mask, num_items=None, **options)
    theirs, _, _ = trl_grpo_loss(base, old, ref, advantages, mask, num_items=mask.sum(), **options)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


# --- advantages ---------------------------------------------------------------------------------------------


def trl_advantages(
    rewards_per_func, reward_weights, num_generations, scale_rewards, multi_objective_aggregation
):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, the advantage block, copied verbatim
    (self.* turned into arguments, `device` into rewards' device). float64 here, where TRL uses float32
    rewards, so that the comparison can be made to 1e-6."""
    nanstd = trl_utils.nanstd
    device = rewards_per_func.device
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)

    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
        if scale_rewards in ["group", "none"]:
            if num_generations > 1:
                std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
                std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
            else:
                std_rewards = torch.zeros_like(rewards)
        elif scale_rewards == "batch":
            if rewards.numel() > 1:
                std_rewards = nanstd(rewards).expand_as(rewards)
            else:
                std_rewards = torch.zeros_like(rewards)
        advantages = rewards - mean_grouped_rewards
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)

    elif multi_objective_aggregation == "normalize_then_sum":
        num_funcs = rewards_per_func.shape[1]
        grouped = rewards_per_func.view(-1, num_generations, num_funcs)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        reward_k = (grouped - mean_k) / (std_k + 1e-4)
        reward_k = reward_k.view(-1, num_funcs)
        rewards = (reward_k * reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)

    return torch.nan_to_num(advantages, nan=0.0)


def random_rewards(seed, num_groups=5, group_size=4, num_functions=3):
    """Rewards with the cases that matter: None entries, unscorable rows, a group with a single scorable
    row, an all-unscorable group, a group of equal rewards, binary and continuous functions."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_groups * group_size, num_functions, dtype=F64, generator=generator)
    rewards[:, 0] = (rewards[:, 0] > 0).to(F64)  # a 0/1 correctness reward
    none = torch.rand(rewards.shape, generator=generator) < 0.25
    rewards[none] = math.nan
    rewards[1] = math.nan  # an unscorable row
    rewards[group_size : 2 * group_size] = math.nan  # group 1: a single scorable row
    rewards[group_size + 2] = torch.tensor([1.0, 0.5, math.nan])
    rewards[2 * group_size : 3 * group_size] = math.nan  # group 2: nothing scorable
    rewards[3 * group_size : 4 * group_size] = torch.tensor([0.1, 0.3, 0.7])  # group 3: all equal
    weights = torch.rand(num_functions, dtype=F64, generator=generator) * 2
    return rewards, weights, group_size


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_advantages_match_trl(aggregation, scale, seed):
    rewards, weights, group_size = random_rewards(seed)
    ours = compute_advantages(rewards, weights, group_size, scale=scale, aggregation=aggregation)
    theirs = trl_advantages(rewards.clone(), weights, group_size, scale, aggregation)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


# --- log-probs and entropies --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selective_log_softmax_matches_trl(dtype, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 6, 50, generator=generator, dtype=F64)).to(dtype)
    index = torch.randint(0, 50, (3, 6), generator=generator)
    ours = selective_log_softmax(logits, index, temperature=temperature, chunk_size=5)
    theirs = trl_utils.selective_log_softmax(logits, index, temperature=temperature)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_entropy_from_logits_matches_trl():
    logits = 4 * torch.randn(3, 6, 50, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.testing.assert_close(
        entropy_from_logits(logits, 7), trl_utils.entropy_from_logits(logits, 7), atol=1e-12, rtol=0
    )


def test_token_logprobs_and_entropy_match_trl_fused_head():
    from tests.tiny import random_qwen2

    model = random_qwen2()
    trl_model = copy.deepcopy(model)
    temperature, completion_length = 0.7, 5
    trl_utils.add_fused_lm_head(trl_model, temperature=temperature, outputs=("log_probs", "entropy"))

    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 37, (3, 4 + completion_length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left-padded prompt
    attention_mask[1, -2:] = 0  # right-padded completion
    trainer = object.__new__(GRPOTrainer)
    trainer.accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext)
    trl_logps, trl_entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__(
        trainer, trl_model, input_ids, attention_mask, completion_length, compute_entropy=True
    )
    logps, entropies = token_logprobs_and_entropy(
        model, input_ids, attention_mask, completion_length, temperature=temperature,
        path=ScoringPath(chunk_size=4),
    )
    # TRL's fused head accumulates in float32: 1e-5
    torch.testing.assert_close(logps, trl_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropies, trl_entropies, atol=1e-5, rtol=0)

    weights = torch.randn(logps.shape, generator=generator)
    ours_grads = torch.autograd.grad((logps * weights).sum() + entropies.sum(), list(model.parameters()))
    trl_grads = torch.autograd.grad(
        (trl_logps * weights).sum() + trl_entropies.sum(), list(trl_model.parameters())
    )
    for ours, theirs in zip(ours_grads, trl_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


# --- the sampler correction in training, through the stand-in vLLM engine -----------------------------------


def test_training_through_a_mismatched_sampler_corrects_the_loss_as_trl_does(tmp_path, monkeypatch):
    """The stand-in engine reports log-probs off by a row-dependent shift (0 for some rows, large for others).
    The trainer's step-1 loss equals TRL's _compute_loss fed TRL's own correction ratio for the same round,
    and differs from the uncorrected loss."""
    import sys
    from types import ModuleType

    from grpo_core.loss import GRPOLoss
    from grpo_core.rollout import VLLMBackend
    from grpo_core.train.loop import TrainHooks, train
    from tests.test_vllm_backend import StandInLLM, StandInSamplingParams
    from tests.tiny import make_prompts, make_tiny_model, tiny_config

    module = ModuleType("vllm")
    module.LLM, module.SamplingParams = StandInLLM, StandInSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    model_dir, data = make_tiny_model(tmp_path / "model"), make_prompts(tmp_path / "train.jsonl")
    calls = []
    real = GRPOLoss.__call__

    def recording(self, logps, old, ref, advantages, mask, **kw):
        loss, stats = real(self, logps, old, ref, advantages, mask, **kw)
        calls.append((logps.detach().double(), old.double(), advantages.double(), mask.double(), kw,
                      loss.detach()))
        return loss, stats

    monkeypatch.setattr(GRPOLoss, "__call__", recording)
    shift = lambda row, col: -0.3 * (row % 3)  # noqa: E731 - rows 0, 3, ...: exact; others: the engine is off
    cfg = tiny_config(model_dir, data,
                      [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                      max_steps=1, vllm_importance_sampling_mode="token_mask",
                      vllm_importance_sampling_clip_max=1.5)
    engine = TrainHooks(backend_factory=lambda m, tok: VLLMBackend(
        m, tok, engine=StandInLLM(str(model_dir), logprob_shift=shift), return_logprobs=True))
    train(cfg, root=tmp_path / "run", progress=False, hooks=engine)
    (logps, old, advantages, mask, kw, loss), = calls
    sampling = kw["sampling_logps"].double()
    ratio = trl_sampler_ratio(old, sampling, mask, "token_mask", None, 1.5)
    assert (ratio == 0).any() and ((ratio - 1).abs() < 1e-3).any()  # masked tokens and (nearly) exact ones
    torch.testing.assert_close(kw["sampler_ratio"].double(), ratio, atol=1e-5, rtol=0)
    options = {"loss_type": "dapo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": None, "delta": None,
               "importance_sampling_level": "token", "kl_ratio_correction": True,
               "max_completion_length": None, "num_items": kw["num_items"]}
    theirs, _, _ = trl_grpo_loss(logps, old, None, advantages, mask, sampler_ratio=ratio,
                                 sampling_logps=sampling, **options)
    torch.testing.assert_close(loss.double(), theirs, atol=1e-5, rtol=0)
    uncorrected, _, _ = trl_grpo_loss(logps, old, None, advantages, mask, **options)
    assert abs(float(uncorrected) - float(theirs)) > 1e-4
