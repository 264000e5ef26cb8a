"""The GRPO objective: clipped importance-ratio surrogate + k3 KL penalty + token aggregation + entropy bonus.

Same numbers and gradients as TRL 1.16 ``GRPOTrainer._compute_loss`` for every loss type (grpo, bnpo, dr_grpo,
dapo, luspo: the clipped surrogate; cispo, sapo, vespo: their own policy terms), token- and sequence-level
(GSPO) importance sampling, two-sided clipping (``delta``), the off-policy sequence mask (OPSM) and the
importance-ratio corrected KL (``use_bias_correction_kl``). ``GRPOLoss`` is built once from the run's
``LossOptions`` (TRL's names, declared here) and called per micro-batch; ``grpo_loss`` is its functional form.

Per token t of completion i (shapes: (B, T) per token, (B, 1) per sequence):

    r_it   = exp(logp_it - old_it)                          token level
    r_i    = exp( sum_t m_it (logp_it - old_it) / max(1, sum_t m_it) )   sequence level (GSPO)
    l_it   = -min(min(r, delta) * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i)   clipped family
           = -sg(min(r, eps_high)) * A_i * logp_it                                 cispo
           = -(4 / tau) * sigmoid(tau (r - 1)) * A_i                               sapo
           = -phi(w_i) * A_i * logp_it                                             vespo
    l_it  *= OPSM's keep mask (B, 1) when off_policy_mask_threshold is set
    kl_it  = exp(ref_it - logp_it) - (ref_it - logp_it) - 1   (k3), times r when use_bias_correction_kl
    L      = aggregate(l + beta * kl, mask) / ga  -  coef * H / ga

ga is the step's gradient accumulation (micro-batches per optimizer step; not for dapo, cispo, vespo, whose
normaliser already counts the whole step's tokens) and H the mean entropy of the trained tokens: L summed over
a step's micro-batches is the step's loss. See docs/algorithm.md for the formulas beside each function.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_core.common.options import ConfigError, Options, option

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES = typing.get_args(LossType)
SamplerCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_CORRECTION_MODES = typing.get_args(SamplerCorrectionMode)
# the PPO-clip surrogate; the others have their own term
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Normalised by num_items, the token count of the step's whole batch: never divided again for accumulation.
TOKEN_SUM_LOSS_TYPES = ("dapo", "cispo", "vespo")


@dataclass
class LossOptions(Options):
    """params.yaml `train:` keys of the policy term, its clipping and aggregation, and the KL term."""

    loss_type: LossType = option(
        "dapo", "the policy term and its aggregation, TRL's names (formulas in docs/algorithm.md)")
    beta: float = option(0.0, "KL coefficient against the reference model (0 = no reference model)", ge=0)
    use_bias_correction_kl: bool = option(
        True, "beta > 0: the per-token KL times the importance ratio, so its gradient is the unbiased "
        "reverse KL's, on-policy too (DeepSeek-V3.2; TRL's name and default)")
    epsilon: float = option(0.2, "lower clip range: ratio >= 1 - epsilon", gt=0, lt=1)
    epsilon_high: float | None = option(None, "upper clip range: ratio <= 1 + epsilon_high (None = epsilon); "
                                        "cispo: the cap on the importance weight itself (e.g. 5.0)", gt=0)
    delta: float | None = option(None, "two-sided clipping: cap on the unclipped ratio (None = off)", gt=1)
    importance_sampling_level: Literal["token", "sequence"] = option(
        "token", "token ratios, or GSPO sequence ratios")
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature for positive advantages", gt=0)
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature for non-positive advantages", gt=0)
    vespo_k_pos: float = option(2.0, "vespo: gamma shape k for advantages >= 0", ge=0)
    vespo_lambda_pos: float = option(3.0, "vespo: gamma rate lambda for advantages >= 0", ge=0)
    vespo_k_neg: float = option(3.0, "vespo: gamma shape k for negative advantages", ge=0)
    vespo_lambda_neg: float = option(2.0, "vespo: gamma rate lambda for negative advantages", ge=0)
    off_policy_mask_threshold: float | None = option(
        None, "OPSM (DeepSeek-V3.2): drop negative-advantage sequences whose mean KL(sampler || policy) "
        "exceeds this (None = off)", ge=0)

    def check_meant(self) -> None:
        """What a run refuses beyond the ranges: settings that run but cannot be meant
        (``grpo_loss`` takes them)."""
        if self.loss_type == "cispo" and (self.epsilon_high is None or self.epsilon_high <= 1):
            raise ConfigError("epsilon_high: cispo caps the importance weight at epsilon_high itself "
                              "(ScaleRL's eps_max, e.g. 5.0), so it must be set above 1; "
                              f"got {self.epsilon_high}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(f"epsilon_high: {self.epsilon_high} is below epsilon ({self.epsilon})")


@dataclass
class SamplerCorrectionOptions(Options):
    """params.yaml `train:` keys of the trainer-vs-engine weight of vLLM samples (``sampler_correction``)."""

    vllm_importance_sampling_correction: bool = option(
        True, "generation.backend vllm: weight each token's loss by pi_old / pi_sampler, the trainer's to "
        "the engine's log-probs, which differ by kernels and precision (TRL's name and default)")
    vllm_importance_sampling_mode: SamplerCorrectionMode = option(
        "sequence_mask",
        "that ratio per token or per sequence; truncate = clamp to the clip range, mask = 0 outside")
    vllm_importance_sampling_clip_min: float | None = option(
        None, "lower end of the ratio's range (None = 0 / unbounded)", ge=0)
    vllm_importance_sampling_clip_max: float | None = option(
        3.0, "upper end of the ratio's range (None = unbounded)", gt=0)


@dataclass(frozen=True)
class _OptionalInputs:
    """A call's optional per-token tensors (B, T), each None when the run does not use it."""

    sampling_logps: torch.Tensor | None  # the sampling engine's log-probs: OPSM's reference (None: old_logps)
    entropy_mask: torch.Tensor | None    # bool, the tokens the policy term trains on (top_entropy_quantile)
    sampler_ratio: torch.Tensor | None   # pi_old / pi_sampler, also (B, 1): multiplies the policy term
    entropies: torch.Tensor | None       # with gradient: the entropy bonus's H


class GRPOLoss:
    """The GRPO objective of a run: built once from its options (TRL ``GRPOConfig`` names), called per
    micro-batch with tensors.

        loss_fn = GRPOLoss(options, max_completion_length=generation.max_completion_length,
                           gradient_accumulation_steps=ga)
        loss, stats = loss_fn(logps, old_logps, ref_logps, advantages, mask, num_items=..., entropies=...)

    A call checks its tensors, num_items and, for dr_grpo, max_completion_length against their T.
    A call, phase by phase (B completions, T completion tokens; per-sequence values are (B, 1)):

        inputs      padding neutralised: logp 0 there, old and ref = logp                (B, T)
        logratio    logp - old                                                            (B, T)
        ratio       exp(logratio) per token, or exp(masked mean logratio) per sequence    (B, T) | (B, 1)
        policy      the loss type's term: max(pg_loss1, pg_loss2) for the clipped family  (B, T) | (B, 1)
        weights     OPSM's keep mask (B, 1), the entropy mask (B, T), the sampler ratio
        kl          beta * k3, times the ratio when use_bias_correction_kl               (B, T)
        aggregate   the loss type's normaliser                                            ()
        step share  / gradient_accumulation_steps (not the token-sum types), minus the entropy bonus
        stats       detached 0-dim diagnostics

    max_completion_length: dr_grpo's constant normaliser L (None = the micro-batch's T); the generation
    section's ``max_completion_length`` in a run. The other loss types ignore it.
    """

    def __init__(self, options: LossOptions, max_completion_length: int | None = None, *,
                 gradient_accumulation_steps: int = 1) -> None:
        self.options = options
        self.max_completion_length = max_completion_length
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.epsilon_low = options.epsilon
        self.epsilon_high = options.epsilon if options.epsilon_high is None else options.epsilon_high

    def __repr__(self) -> str:
        return (f"GRPOLoss({self.options!r}, max_completion_length={self.max_completion_length!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")

    def __call__(self, logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, *,
                 num_items: int | float | torch.Tensor | None = None,
                 sampling_logps: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
                 sampler_ratio: torch.Tensor | None = None,
                 entropies: torch.Tensor | None = None, entropy_coef: float = 0.0,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch, its share of the step's loss, and its statistics; the arguments and the
        result are ``grpo_loss``'s. entropies: (B, T) per-token entropies with gradient, for the bonus
        ``entropy_coef * H`` (H their mean over the trained tokens: ``entropy_mask``, else ``mask``)."""
        extra = _OptionalInputs(sampling_logps, entropy_mask, sampler_ratio, entropies)
        self._check_inputs(logps, old_logps, ref_logps, advantages, mask, extra, num_items, entropy_coef)
        present = mask > 0                                                     # (B, T) bool, the real tokens
        mask = mask.to(logps.dtype)                                            # (B, T)
        logps, old_logps, ref_logps = _neutralise_padding(present, logps, old_logps, ref_logps)  # (B, T) each
        advantages = advantages.unsqueeze(1)                                   # (B, 1), broadcast over tokens
        logratio = logps - old_logps                                           # (B, T)
        ratio = ratio_from_logratio(logratio, mask, self.options.importance_sampling_level)  # (B, T) | (B, 1)
        per_token_loss, stats = self.policy_term(ratio, logratio, logps, advantages, mask, sampler_ratio)
        per_token_loss = self.weighted(per_token_loss, advantages, logps, old_logps, present, mask, extra)
        per_token_kl = None
        if self.options.beta != 0.0:
            per_token_kl = self.kl_term(logps, ref_logps, ratio,
                                        self.options.use_bias_correction_kl)  # (B, T)
            per_token_loss = per_token_loss + self.options.beta * per_token_kl
        loss = aggregate(per_token_loss, mask, self.options.loss_type, self.max_completion_length,
                         num_items)  # ()
        ga = self.gradient_accumulation_steps
        # those count the whole step's tokens
        if self.options.loss_type not in TOKEN_SUM_LOSS_TYPES and ga != 1:
            loss = loss / ga
        if entropy_coef != 0.0:  # the same bonus whatever the loss type's normaliser (TRL)
            trained = present if entropy_mask is None else entropy_mask
            loss = loss - entropy_coef * entropy_mean(entropies, trained) / ga
        return loss, self.stats(stats, ratio, per_token_kl, mask)

    def policy_term(self, ratio: torch.Tensor, logratio: torch.Tensor, logps: torch.Tensor,
                    advantages: torch.Tensor, mask: torch.Tensor,
                    sampler_ratio: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The loss type's per-token policy loss, (B, T) or (B, 1) as the ratio, and its own stats
        (TRL's keys).

        ratio (B, T) | (B, 1); logratio, logps, mask (B, T); advantages (B, 1).
        """
        c = self.options
        if c.loss_type in _CLIPPED:
            pg_loss = clipped_surrogate(ratio, advantages, self.epsilon_low, self.epsilon_high, c.delta)
            return pg_loss, clip_stats(_capped(ratio, c.delta), advantages, mask, self.epsilon_low,
                                       self.epsilon_high)
        if c.loss_type == "cispo":
            clipped = ((ratio > self.epsilon_high) & (advantages > 0)).to(mask.dtype)
            return (cispo_term(ratio, logps, advantages, self.epsilon_high),
                    {"cispo_clip_ratio": masked_mean(clipped, mask)})
        if c.loss_type == "sapo":
            return sapo_term(ratio, advantages, c.sapo_temperature_pos, c.sapo_temperature_neg), {}
        phi = vespo_weights(logratio, advantages, mask, c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg,
                            c.vespo_lambda_neg, sampler_ratio=sampler_ratio)  # (B, 1), detached
        return -phi * advantages * logps, {"vespo/phi_seq_mean": masked_mean(phi, mask)}

    def weighted(self, per_token_loss: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor,
                 old_logps: torch.Tensor, present: torch.Tensor, mask: torch.Tensor,
                 extra: _OptionalInputs) -> torch.Tensor:
        """The policy loss times OPSM's keep mask (B, 1), the entropy mask (B, T) and the sampler ratio
        (B, T) | (B, 1) - each only when set; vespo has already folded the sampler ratio into its weight."""
        if self.options.off_policy_mask_threshold is not None:
            sampling_logps = extra.sampling_logps
            sampled = (old_logps if sampling_logps is None
                       else torch.where(present, sampling_logps, logps.detach()))
            keep = off_policy_mask(advantages, logps, sampled, mask, self.options.off_policy_mask_threshold)
            per_token_loss = per_token_loss * keep
        if extra.entropy_mask is not None:
            per_token_loss = per_token_loss * extra.entropy_mask.to(per_token_loss.dtype)
        if extra.sampler_ratio is not None and self.options.loss_type != "vespo":
            per_token_loss = per_token_loss * extra.sampler_ratio.to(per_token_loss.dtype)
        return per_token_loss

    @staticmethod
    def kl_term(logps: torch.Tensor, ref_logps: torch.Tensor, ratio: torch.Tensor,
                bias_correction: bool) -> torch.Tensor:
        """Per-token k3 KL to the reference (B, T), unscaled by beta."""
        per_token_kl = k3_kl(logps, ref_logps)
        if bias_correction:
            # Sampled under pi_old, so E_old[r * k3] is the KL of pi_theta (DeepSeek-V3.2); r is not
            # detached, which changes the KL gradient even on-policy where r == 1.
            per_token_kl = per_token_kl * ratio
        return per_token_kl

    @staticmethod
    def stats(stats: dict[str, torch.Tensor], ratio: torch.Tensor, per_token_kl: torch.Tensor | None,
              mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The policy term's stats, then "ratio_mean" and (beta != 0 only) "kl": detached 0-dim tensors."""
        stats["ratio_mean"] = masked_mean(ratio.detach(), mask)
        if per_token_kl is not None:
            stats["kl"] = masked_mean(per_token_kl.detach(), mask)
        return stats

    def _check_inputs(self, logps, old_logps, ref_logps, advantages, mask, extra: _OptionalInputs, num_items,
                      entropy_coef) -> None:
        """Raise ValueError naming the first tensor (or per-call count) out of contract."""
        _check_tensors(logps, old_logps, ref_logps, advantages, mask)
        shape, sampler_ratio, entropies = tuple(logps.shape), extra.sampler_ratio, extra.entropies
        for name, tensor in (("sampling_logps", extra.sampling_logps), ("entropy_mask", extra.entropy_mask)):
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must have the shape of logps {shape}, got {_describe(tensor)}")
        if sampler_ratio is not None and tuple(sampler_ratio.shape) not in (shape, (logps.shape[0], 1)):
            raise ValueError(f"sampler_ratio must be (B, T) {shape} or (B, 1), "
                             f"got {_describe(sampler_ratio)}")
        if (sampler_ratio is not None and self.options.loss_type == "vespo" and sampler_ratio.shape[1] == 1
                and logps.shape[1] != 1):
            raise ValueError("sampler_ratio: vespo takes a token-level correction (token_truncate or "
                             "token_mask)")
        _check_normalisers(self.options.loss_type, self.max_completion_length, num_items,
                           completion_length=logps.shape[1])
        if entropy_coef != 0.0 and (entropies is None or tuple(entropies.shape) != shape):
            raise ValueError(f"entropies must have the shape of logps {shape} when entropy_coef != 0, "
                             f"got {_describe(entropies)}")
        if self.options.beta != 0.0 and ref_logps is None:
            raise ValueError(f"ref_logps is required when beta != 0 (beta={self.options.beta})")


def _neutralise_padding(present: torch.Tensor, logps: torch.Tensor, old_logps: torch.Tensor | None,
                        ref_logps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor | None]:
    """logps, old_logps, ref_logps (B, T) with the padded positions
    (``present`` False) set to logp 0, ratio 1, KL 0.

    Padding may hold anything (NaN where vLLM could not score a token, -inf from an ignored label). It is
    multiplied by 0 later, but 0 * NaN = NaN, in the value and in the gradient. Real tokens are untouched.
    On-policy (old_logps None): old = logp.detach(), so the ratio is exactly 1 but still carries grad logp.
    """
    logps = torch.where(present, logps, torch.zeros_like(logps))
    old_logps = logps.detach() if old_logps is None else torch.where(present, old_logps, logps.detach())
    if ref_logps is not None:
        ref_logps = torch.where(present, ref_logps, logps.detach())
    return logps, old_logps, ref_logps


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, epsilon_low: float = 0.2,
              kl_ratio_correction: bool = True, max_completion_length: int | None = None,
              num_items: int | float | torch.Tensor | None = None,
              sampling_logps: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
              sampler_ratio: torch.Tensor | None = None,
              **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch and its statistics: ``GRPOLoss`` built from
    ``LossOptions(epsilon=epsilon_low, use_bias_correction_kl=kl_ratio_correction, **options)``, then called.
    ``options`` are LossOptions' other keys (TRL's names; defaults and limits there).

    Args:
        logps: (B, T) log-probs of the sampled completion tokens under the current policy (with grad).
        old_logps: (B, T) log-probs under the policy that sampled them; None = on-policy
            (``logps.detach()``: ratio value 1, ratio gradient = grad logp).
        ref_logps: (B, T) log-probs under the reference model; needed only when beta != 0.
        advantages: (B,) one advantage per completion.
        mask: (B, T) 1 for completion tokens that count, 0 for padding (bool, int or float).
        epsilon_low: TRL's ``epsilon`` (the lower clip range); every other key of ``LossOptions`` (loss_type,
            beta, epsilon_high, delta, importance_sampling_level, the sapo / vespo shapes,
            off_policy_mask_threshold) by its own name, meanings and defaults there.
        kl_ratio_correction: multiply the per-token KL by the importance ratio (LossOptions' and TRL's
            ``use_bias_correction_kl``, default True there too).
        max_completion_length: dr_grpo's constant normaliser L; None = T.
        num_items: dapo's (and cispo's, vespo's) normaliser, the number of completion tokens in the whole
            generation batch; None = mask.sum() (this micro-batch).
        sampling_logps: (B, T) log-probs under the engine that sampled (OPSM's reference); None = old_logps.
        entropy_mask: (B, T) bool, the tokens the policy term trains on (``high_entropy_mask``: TRL's
            ``top_entropy_quantile``); None = all. The KL still counts every token, as in TRL.
        sampler_ratio: (B, T) or (B, 1) pi_old / pi_sampler, truncated or masked (``sampler_correction``): the
            per-token policy loss is multiplied by it (TRL's vLLM importance-sampling correction); vespo folds
            it into its sequence weight instead (token level only). None = no correction.

    Returns:
        (loss, stats): loss a 0-dim tensor in the dtype of ``logps``; stats detached 0-dim tensors, TRL's per
        loss type: "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
        "clip_ratio/region_mean" (the clipped family), "cispo_clip_ratio" (cispo), "vespo/phi_seq_mean"
        (vespo); always "ratio_mean"; "kl" only when beta != 0 (as TRL logs it).
    """
    # with several bad arguments, a tensor is named
    _check_tensors(logps, old_logps, ref_logps, advantages, mask)
    try:
        loss_options = LossOptions(epsilon=epsilon_low, use_bias_correction_kl=kl_ratio_correction, **options)
    except ConfigError as err:
        raise ConfigError(_functional_names(str(err))) from None
    return GRPOLoss(loss_options, max_completion_length)(
        logps, old_logps, ref_logps, advantages, mask, num_items=num_items, sampling_logps=sampling_logps,
        entropy_mask=entropy_mask, sampler_ratio=sampler_ratio)


def _functional_names(message: str) -> str:
    """A LossOptions error as grpo_loss names its keys: ``epsilon_low`` and ``kl_ratio_correction``."""
    for key, name in (("epsilon", "epsilon_low"), ("use_bias_correction_kl", "kl_ratio_correction")):
        if message.startswith(f"{key}:"):
            return name + message[len(key):]
    return message


def ratio_from_logratio(logratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """pi_theta / pi_old from the log-ratio logp - old (B, T): per token (B, T), or per sequence (B, 1) as the
    exp of the masked mean log-ratio (GSPO, length-normalised; TRL 1.16 uses it as is, no stop-gradient
    trick)."""
    if level == "token":
        return torch.exp(logratio)
    mean_logratio = (logratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # empty row -> 0 -> ratio 1
    return torch.exp(mean_logratio).unsqueeze(-1)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                      delta: float | None) -> torch.Tensor:
    """Per-token PPO-clip loss: -min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A).

    ratio (B, T) or (B, 1); advantages (B, 1); result broadcast to ratio's shape. The clipped branch
    has zero gradient outside the range, so min() switches the token off once the ratio has moved
    far enough in the direction A favours. delta (INTELLECT-2) also caps the unclipped branch, which
    bounds the loss of a negative-advantage token whose ratio explodes.
    """
    pg_loss1 = -advantages * _capped(ratio, delta)                               # unclipped (capped at delta)
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # clipped
    return torch.max(pg_loss1, pg_loss2)  # = -min(r A, clip(r) A)


def cispo_term(ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor,
               epsilon_high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(min(r, eps_high)) * A * logp. The importance weight is clipped and detached, so
    every token keeps a gradient A * min(r, eps_high) * grad logp - none is switched off as under PPO-clip.
    eps_high is the cap itself (TRL's ``epsilon_high``, e.g. 5), not 1 + eps."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps


def sapo_term(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """SAPO (Soft Adaptive Policy Optimization): -(4 / tau) * sigmoid(tau * (r - 1)) * A, tau = tau_pos for
    A > 0 else tau_neg. A smooth gate in place of the hard clip: its gradient, A * sigmoid'(tau (r - 1)) * 4 r
    grad logp, is A * r * grad logp at r = 1 and fades as r leaves 1 (faster for the larger tau)."""
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, k_pos: float,
                  lambda_pos: float, k_neg: float, lambda_neg: float,
                  sampler_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's per-sequence weight (B, 1), detached: phi(w) = exp(lambda) * w^k * exp(-lambda * w),
    phi(1) = 1, with w = exp(sum_t m_t clamp(logp_t - old_t, -20, 20)) the sequence's (unnormalised)
    importance ratio, log w clamped to [log 1e-8, 20]; (k, lambda) = (k_pos, lambda_pos) for A >= 0, else the
    neg pair (lambda >= 1e-4). Computed in log space: log phi = lambda + k log w - lambda w; a non-finite phi
    counts 0. sampler_ratio (B, T): pi_old / pi_sampler per token, its clamped log added to log w (the
    sampler-to-policy ratio)."""
    lower = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampler_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(sampler_ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def sampler_correction(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction: the ratio pi_old / pi_sampler of the trainer's log-probs to
    the sampling engine's, which differ by kernels and precision even with the same weights.

    token_*: per token (B, T), exp(old - sampling) over the mask; sequence_*: per sequence (B, 1), the exp of
    the masked sum. *_truncate clamps it to [clip_min, clip_max] (None = unbounded); *_mask sets it to
    0 outside. A token the sampler could not score (NaN) counts ratio 1 (log difference 0).
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"sampler correction mode must be one of {SAMPLER_CORRECTION_MODES}, got {mode!r}")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """OPSM (DeepSeek-V3.2): (B, 1) 1 = keep, 0 = drop. A sequence is dropped when A < 0 and its mean
    per-token KL estimate (sampling_logp - logp) over its tokens exceeds ``threshold``: a negative sample the
    policy has already moved far from teaches instability, not avoidance. A token with no sampler log-prob
    (NaN) counts 0."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def entropy_mean(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropy bonus's H: mean entropy over the tokens in ``mask`` (0 when none), with gradient. The loss
    subtracts coef * H whatever the loss type's normaliser, so ``entropy_coef`` means the same for all
    (TRL)."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0, (B, T).

    Unbiased for samples from pi_theta, zero exactly when logp == ref (Schulman's k3).
    """
    log_ratio_ref = ref_logps - logps
    return torch.exp(log_ratio_ref) - log_ratio_ref - 1


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int | None,
              num_items: int | float | torch.Tensor | None) -> torch.Tensor:
    """Reduce (B, T) or (B, 1) per-token losses to a scalar over the tokens in mask (B, T).

    grpo, sapo:          1/B sum_i [ sum_t m_it l_it / max(1, sum_t m_it) ]
                         (an empty row counts 0 in the mean)
    bnpo:                sum_it m_it l_it / max(1, sum_it m_it)
    dr_grpo:             sum_it m_it l_it / (B * L),  L = max_completion_length (None -> T)
    dapo, cispo, vespo:  sum_it m_it l_it / max(1, num_items),  num_items None -> sum_it m_it
    luspo:               1/B sum_i sum_t m_it l_it   (each sequence weighted by its length)
    """
    masked = per_token_loss * mask  # (B, T) also when per_token_loss is (B, 1)
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = mask.shape[1] if max_completion_length is None else max_completion_length
        return masked.sum() / (mask.shape[0] * length)
    # dapo, cispo, vespo
    normaliser = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=mask.dtype,
                                                                      device=mask.device)
    return masked.sum() / normaliser.clamp(min=1.0)


def clip_stats(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float,
               epsilon_high: float) -> dict[str, torch.Tensor]:
    """TRL's clip metrics. ratio (B, T) or (B, 1) after the delta cap; advantages (B, 1); mask (B, T).

    low:    r < 1 - eps_low  and A < 0   (the clipped branch is active and its gradient is 0)
    high:   r > 1 + eps_high and A > 0
    region: low or high
    *_mean are token means over the batch (sequence level: means over sequences); low_min / high_max
    are the min / max over sequences of the per-sequence means (empty sequences skipped).
    """
    ratio = ratio.detach()
    is_low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype)
    is_high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype)
    is_region = torch.maximum(is_low, is_high)
    return {
        "clip_ratio/low_mean": masked_mean(is_low, mask),
        "clip_ratio/low_min": _nan_extreme(_per_sequence_mean(is_low, mask), torch.min),
        "clip_ratio/high_mean": masked_mean(is_high, mask),
        "clip_ratio/high_max": _nan_extreme(_per_sequence_mean(is_high, mask), torch.max),
        "clip_ratio/region_mean": masked_mean(is_region, mask),
    }


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of (B, T) values over mask (B, T) tokens; of (B, 1) values over all B sequences (TRL's rule).

    0 when no token counts (denominator clamped at 1).
    """
    values = values.detach()
    if values.shape[1] == 1 and mask.shape[1] != 1:  # sequence level: one value per sequence
        return values.sum() / max(values.shape[0], 1)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _per_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) masked mean per sequence (NaN for an empty row); (B, 1) -> (B,)."""
    if values.shape[1] == 1 and mask.shape[1] != 1:
        return values.squeeze(1)
    return (values * mask).sum(-1) / mask.sum(-1)


def _nan_extreme(values: torch.Tensor, reduce) -> torch.Tensor:
    """min or max over the non-NaN entries of a 1-D tensor; NaN if there are none (TRL's nanmin/nanmax).

    Written without boolean indexing, which would make the host wait for the device on every call.
    """
    is_nan = torch.isnan(values)
    neutral = math.inf if reduce is torch.min else -math.inf
    extreme = reduce(values.masked_fill(is_nan, neutral)) if values.numel() else values.new_tensor(neutral)
    return torch.where(is_nan.all(), values.new_tensor(math.nan), extreme)


def _capped(ratio: torch.Tensor, delta: float | None) -> torch.Tensor:
    """min(r, delta) when delta is set (two-sided clipping), else r."""
    return ratio if delta is None else torch.clamp(ratio, max=delta)


def _check_tensors(logps, old_logps, ref_logps, advantages, mask) -> None:
    """Raise ValueError naming the first tensor whose type or shape is out of contract."""
    if not isinstance(logps, torch.Tensor) or logps.ndim != 2:
        raise ValueError(f"logps must be a 2-D (B, T) tensor, got {_describe(logps)}")
    if not logps.is_floating_point():
        raise ValueError(f"logps must be floating point, got dtype {logps.dtype}")
    shape = tuple(logps.shape)
    for name, tensor, optional in (("old_logps", old_logps, True), ("ref_logps", ref_logps, True),
                                   ("mask", mask, False)):
        if tensor is None and optional:
            continue
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have the shape of logps {shape}, got {_describe(tensor)}")
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must have shape (B,) = {shape[:1]}, got {_describe(advantages)}")


def _check_normalisers(loss_type, max_completion_length, num_items, completion_length: int) -> None:
    """dr_grpo needs a length >= T; dapo's num_items must be a scalar count."""
    if loss_type == "dr_grpo":
        if completion_length == 0 and max_completion_length is None:
            raise ValueError("max_completion_length is required for dr_grpo when logps has no token column "
                             "(T=0)")
        length = max_completion_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < max(completion_length, 1)):
            raise ValueError(f"max_completion_length must be an int >= T={completion_length} (the padded "
                             f"completion length), got {length!r}")
    if isinstance(num_items, torch.Tensor):
        # A tensor's value is not read here: that would force a device sync on every micro-batch.
        if num_items.numel() != 1:
            raise ValueError(f"num_items must be a scalar token count, got {_describe(num_items)}")
    elif num_items is not None and (not _is_real(num_items) or num_items < 0):
        raise ValueError(f"num_items must be a token count >= 0 or None, got {num_items!r}")


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
