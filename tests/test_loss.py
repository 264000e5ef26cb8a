"""grpo_loss: hand-worked examples, the on-policy REINFORCE identity, invariances, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.loss import grpo_loss

F64 = torch.float64
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LEVELS = ["token", "sequence"]


def policy_with_ratios(ratios, offset=-1.0):
    """logps (leaf, with grad) and old_logps whose per-token ratio exp(logps - old) is `ratios`."""
    ratios = torch.tensor(ratios, dtype=F64)
    old = torch.full_like(ratios, offset)
    logps = (torch.log(ratios) + offset).requires_grad_(True)
    return logps, old


def loss_and_grad(logps, old, advantages, mask=None, ref=None, **kwargs):
    mask = torch.ones_like(logps) if mask is None else torch.tensor(mask, dtype=F64)
    loss, stats = grpo_loss(logps, old, ref, torch.tensor(advantages, dtype=F64), mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.item(), grad, stats


def assert_values(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), atol=tol, rtol=0)


# --- the clipped surrogate, token level ---------------------------------------------------------------------


def test_clip_inactive_is_the_plain_ratio_surrogate():
    # ratios [1.1, 0.9] inside [0.8, 1.2], A = 1: l_t = -min(r, clip(r)) = -r -> [-1.1, -0.9]
    # dapo: (-1.1 - 0.9) / 2 tokens = -1.0;  d l_t / d logp_t = -r_t, / 2 -> [-0.55, -0.45]
    logps, old = policy_with_ratios([[1.1, 0.9]])
    loss, grad, stats = loss_and_grad(logps, old, [1.0])
    assert loss == pytest.approx(-1.0, abs=1e-12)
    assert_values(grad, [[-0.55, -0.45]])
    assert stats["clip_ratio/region_mean"] == 0
    assert stats["ratio_mean"].item() == pytest.approx(1.0)  # (1.1 + 0.9) / 2


def test_clip_active_for_positive_advantage_stops_the_gradient():
    # A = 1, ratios [1.5, 1.0], eps 0.2: token 0 -> -min(1.5, 1.2) = -1.2 (clipped branch: constant),
    # token 1 -> -1.0.  dapo: (-1.2 - 1.0) / 2 = -1.1;  grads [0, -1.0 / 2]
    logps, old = policy_with_ratios([[1.5, 1.0]])
    loss, grad, stats = loss_and_grad(logps, old, [1.0])
    assert loss == pytest.approx(-1.1, abs=1e-12)
    assert_values(grad, [[0.0, -0.5]])
    # token 0 counts as high-clipped (r > 1.2 and A > 0): 1 of 2 tokens
    assert stats["clip_ratio/high_mean"].item() == 0.5 and stats["clip_ratio/low_mean"].item() == 0
    assert stats["clip_ratio/region_mean"].item() == 0.5 and stats["clip_ratio/high_max"].item() == 0.5


def test_clip_for_negative_advantage_is_one_sided():
    # A = -1, ratios [0.5, 1.5], eps 0.2:
    #   token 0: -min(-0.5, -0.8) = 0.8   clipped below (r < 0.8, A < 0): gradient 0
    #   token 1: -min(-1.5, -1.2) = 1.5   NOT clipped: for A < 0 a large ratio keeps its full gradient r = 1.5
    # dapo: (0.8 + 1.5) / 2 = 1.15;  grads [0, 1.5 / 2]
    logps, old = policy_with_ratios([[0.5, 1.5]])
    loss, grad, stats = loss_and_grad(logps, old, [-1.0])
    assert loss == pytest.approx(1.15, abs=1e-12)
    assert_values(grad, [[0.0, 0.75]])
    assert stats["clip_ratio/low_mean"].item() == 0.5 and stats["clip_ratio/high_mean"].item() == 0
    assert stats["clip_ratio/low_min"].item() == 0.5


def test_delta_caps_the_unclipped_ratio():
    # A = -1, ratio 3: without delta l = -min(-3, -1.2) = 3, gradient r = 3.
    # delta = 2: l = -min(min(3, 2) * -1, -1.2) = 2, and the cap is constant: gradient 0.
    logps, old = policy_with_ratios([[3.0]])
    loss, grad, _ = loss_and_grad(logps, old, [-1.0])
    assert loss == pytest.approx(3.0) and grad.item() == pytest.approx(3.0)
    loss, grad, _ = loss_and_grad(logps, old, [-1.0], delta=2.0)
    assert loss == pytest.approx(2.0) and grad.item() == 0.0


def test_epsilon_high_widens_the_upper_clip_only():
    # A = 1, ratio 1.25: eps_high 0.28 -> 1.25 < 1.28, unclipped: l = -1.25, grad -1.25
    #                    eps_high None (= eps_low 0.2) -> clipped at 1.2: l = -1.2, grad 0
    logps, old = policy_with_ratios([[1.25]])
    loss, grad, _ = loss_and_grad(logps, old, [1.0], epsilon_high=0.28)
    assert loss == pytest.approx(-1.25) and grad.item() == pytest.approx(-1.25)
    loss, grad, _ = loss_and_grad(logps, old, [1.0])
    assert loss == pytest.approx(-1.2) and grad.item() == 0.0


# --- aggregation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        # on-policy, ratio 1: l_it = -A_i. A = [-1, -2] -> per-token [[1, 1, 1], [2, 2, pad]], 5 tokens, sum 7
        ("grpo", {}, (3 / 3 + 4 / 2) / 2),  # mean of per-sequence means = 1.5
        ("bnpo", {}, 7 / 5),  # token mean = 1.4
        ("dr_grpo", {"max_completion_length": 4}, 7 / (2 * 4)),  # sum / (B * L) = 0.875
        ("dr_grpo", {}, 7 / (2 * 3)),  # L None -> T = 3
        ("dapo", {}, 7 / 5),  # sum / tokens in this batch
        ("dapo", {"num_items": 10}, 7 / 10),  # sum / tokens in the whole generation batch
    ],
)
def test_aggregations_hand_worked(loss_type, kwargs, expected):
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, _, _ = loss_and_grad(
        logps, None, [-1.0, -2.0], mask=[[1, 1, 1], [1, 1, 0]], loss_type=loss_type, **kwargs
    )
    assert loss == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # A = [-1, -2], row 1 empty: per-token [[1, 1, 1], [-, -, -]]
        ("grpo", (3 / 3 + 0 / 1) / 2),  # the empty row counts as 0 in the mean over B (TRL: clamp(min=1))
        ("bnpo", 3 / 3),
        ("dr_grpo", 3 / (2 * 3)),
        ("dapo", 3 / 3),
    ],
)
def test_empty_rows(loss_type, expected):
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, grad, _ = loss_and_grad(logps, None, [-1.0, -2.0], mask=[[1, 1, 1], [0, 0, 0]], loss_type=loss_type)
    assert loss == pytest.approx(expected, abs=1e-12)
    assert torch.equal(grad[1], torch.zeros(3, dtype=F64))


def test_all_empty_batch_is_zero_not_nan():
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    for loss_type in LOSS_TYPES:
        for level in LEVELS:
            loss, _ = grpo_loss(
                logps,
                None,
                logps.detach(),
                torch.ones(2, dtype=F64),
                torch.zeros(2, 3),
                loss_type=loss_type,
                importance_sampling_level=level,
                beta=0.1,
            )
            assert loss.item() == 0.0


# --- sequence level (GSPO) ---------------------------------------------------------------------------------


def test_sequence_level_uses_the_length_normalised_ratio():
    # log-ratios [0.1, 0.3] (+ a padded 5.0 that must not count): mean 0.2, r = e^0.2 = 1.2214 > 1.2, A = 1:
    #   eps 0.2: every token -min(1.2214, 1.2) = -1.2, clipped -> loss -1.2, gradient 0
    #   eps_high 0.28: unclipped, each of the 2 tokens carries -r, dapo: 2 * (-r) / 2 = -e^0.2;
    #                  d r / d logp_t = r * (1/2 tokens) -> gradient -e^0.2 / 2 = -0.61070 per unmasked token
    # token level for contrast, eps_high 0.28:
    # -(min(e^0.1, ..) + min(e^0.3, 1.28)) / 2 = -(1.10517 + 1.28) / 2
    logps = torch.tensor([[0.1, 0.3, 5.0]], dtype=F64).sub(1.0).requires_grad_(True)
    old = torch.full((1, 3), -1.0, dtype=F64)
    mask = [[1, 1, 0]]
    loss, grad, stats = loss_and_grad(logps, old, [1.0], mask, importance_sampling_level="sequence")
    assert loss == pytest.approx(-1.2, abs=1e-12) and torch.equal(grad, torch.zeros_like(grad))
    assert stats["clip_ratio/high_mean"].item() == 1.0  # one sequence, clipped
    loss, grad, _ = loss_and_grad(
        logps, old, [1.0], mask, importance_sampling_level="sequence", epsilon_high=0.28
    )
    assert loss == pytest.approx(-math.exp(0.2), abs=1e-12)
    assert_values(grad, [[-math.exp(0.2) / 2, -math.exp(0.2) / 2, 0.0]])
    loss, _, _ = loss_and_grad(logps, old, [1.0], mask, importance_sampling_level="token", epsilon_high=0.28)
    assert loss == pytest.approx(-(math.exp(0.1) + 1.28) / 2, abs=1e-12)


# --- KL ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_is_zero_when_policy_equals_reference(loss_type):
    torch.manual_seed(0)
    logps = (-torch.rand(3, 4, dtype=F64)).requires_grad_(True)
    old = logps.detach() + 0.1 * torch.randn(3, 4, dtype=F64)
    advantages = torch.randn(3, dtype=F64)
    mask = torch.ones(3, 4, dtype=F64)
    with_kl, stats = grpo_loss(logps, old, logps.detach(), advantages, mask, beta=0.5, loss_type=loss_type)
    without, _ = grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type=loss_type)
    assert stats["kl"].item() == 0.0
    assert with_kl.item() == pytest.approx(without.item(), abs=1e-15)


def test_k3_kl_hand_worked_and_the_ratio_correction_gradient():
    # ref - logp = ln 2: k3 = e^(ln 2) - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853.  A = 0, beta = 0.1, one
    # token:
    #   loss = 0.1 * 0.306853 (ratio = 1 on-policy, so the correction does not change the value)
    #   d k3 / d logp = -e^(ref - logp) + 1 = -1
    #   without correction: grad = 0.1 * -1 = -0.1
    #   with correction (r * k3, r = exp(logp - logp.detach())): 0.1 * (k3 * dr/dlogp + r * dk3/dlogp)
    #                                                        = 0.1 * (0.306853 - 1) = -0.0693147
    k3 = 2 - math.log(2) - 1
    logps = torch.tensor([[-2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0 + math.log(2)]], dtype=F64)
    for correction, expected_grad in ((False, -0.1), (True, 0.1 * (k3 - 1))):
        loss, grad, stats = loss_and_grad(
            logps, None, [0.0], ref=ref, beta=0.1, kl_ratio_correction=correction
        )
        assert loss == pytest.approx(0.1 * k3, abs=1e-12)
        assert stats["kl"].item() == pytest.approx(k3, abs=1e-12)
        assert grad.item() == pytest.approx(expected_grad, abs=1e-12)


def test_kl_correction_multiplies_by_the_ratio_off_policy():
    # ratio 2 (token level): the logged and penalised KL is r * k3 = 2 * 0.306853
    k3 = 2 - math.log(2) - 1
    logps, old = policy_with_ratios([[2.0]])
    ref = logps.detach() + math.log(2)
    for correction, factor in ((True, 2.0), (False, 1.0)):
        _, _, stats = loss_and_grad(logps, old, [0.0], ref=ref, beta=0.1, kl_ratio_correction=correction)
        assert stats["kl"].item() == pytest.approx(factor * k3, abs=1e-12)


def test_kl_stat_only_when_beta_is_positive():
    logps = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    _, _, stats = loss_and_grad(logps, None, [1.0])
    assert set(stats) == {
        "clip_ratio/low_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_mean",
        "clip_ratio/high_max",
        "clip_ratio/region_mean",
        "ratio_mean",
    }
    _, _, stats = loss_and_grad(logps, None, [1.0], ref=logps.detach(), beta=0.01)
    assert "kl" in stats
    assert all(not value.requires_grad for value in stats.values())


# --- on-policy: the loss value is not a learning signal -----------------------------------------------------


def tiny_linear_policy(seed=0, batch=4, length=5, features=3, vocab=7):
    """A policy with parameters W: logits_t = x_t @ W, tokens sampled from it; returns what the tests need."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, features, dtype=F64, generator=generator)
    weights = torch.randn(features, vocab, dtype=F64, generator=generator).requires_grad_(True)
    probs = torch.softmax(x @ weights, -1).detach()
    tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=generator).view(batch, length)
    mask = torch.ones(batch, length, dtype=F64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    advantages = torch.randn(batch, dtype=F64, generator=generator)
    advantages = advantages - advantages.mean()  # a group baseline: the advantages of one group sum to 0
    return x, weights, tokens, mask, advantages


def token_logps(x, weights, tokens):
    return torch.log_softmax(x @ weights, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def reinforce_gradient(x, weights, tokens, mask, advantages, normaliser):
    """-sum_i A_i sum_t m_it grad_W log p(y_it) / normaliser, from the closed form of a softmax's score:
    grad_W log softmax(x W)[y] = x (onehot(y) - softmax(x W))^T  -- no autograd through grpo_loss."""
    probs = torch.softmax(x @ weights.detach(), -1)  # (B, T, V)
    score = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(F64) - probs  # (B, T, V)
    per_token_weight = (advantages[:, None] * mask / normaliser)[..., None]  # (B, T, 1)
    return -torch.einsum("btd,btv->dv", x, per_token_weight * score)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_gradient_is_reinforce_with_a_group_baseline(loss_type):
    x, weights, tokens, mask, advantages = tiny_linear_policy()
    logps = token_logps(x, weights, tokens)
    loss, _ = grpo_loss(logps, None, None, advantages, mask, loss_type=loss_type, max_completion_length=6,
                        epsilon_high=5.0 if loss_type == "cispo" else None)  # cispo: a cap that does not bind
    (grad,) = torch.autograd.grad(loss, weights)
    lengths = mask.sum(-1)  # [3, 5, 1, 5]
    normaliser = {
        "grpo": lengths[:, None] * len(lengths),  # 1/B sum_i 1/|o_i| sum_t
        "sapo": lengths[:, None] * len(lengths),
        "bnpo": mask.sum(),
        "dr_grpo": torch.tensor(len(lengths) * 6.0, dtype=F64),
        "dapo": mask.sum(),
        "cispo": mask.sum(),
        "vespo": mask.sum(),
        "luspo": torch.tensor(len(lengths), dtype=F64),  # 1/B sum_i sum_t
    }[loss_type]
    torch.testing.assert_close(grad, reinforce_gradient(x, weights, tokens, mask, advantages, normaliser))
    if loss_type in ("cispo", "sapo", "vespo"):  # their values are not the ratio surrogate's
        return
    # The value: every ratio is 1, so the loss is -sum A_i * (weight of sequence i); for grpo that is
    # -mean(A) = 0 because the group's advantages sum to 0. It does not depend on W at all.
    expected_value = -(advantages[:, None] * mask / normaliser).sum()
    assert loss.item() == pytest.approx(expected_value.item(), abs=1e-12)
    if loss_type == "grpo":
        assert abs(loss.item()) < 1e-12


def test_on_policy_loss_value_is_flat_while_the_gradient_moves():
    # Two different policies (W and W + noise) give the same loss value on-policy, with different gradients:
    # the loss curve of on-policy GRPO (beta = 0) says nothing about learning.
    x, weights, tokens, mask, advantages = tiny_linear_policy()
    other = (weights.detach() + 0.5 * torch.randn_like(weights)).requires_grad_(True)
    loss_a, _ = grpo_loss(token_logps(x, weights, tokens), None, None, advantages, mask)
    loss_b, _ = grpo_loss(token_logps(x, other, tokens), None, None, advantages, mask)
    (grad_a,) = torch.autograd.grad(loss_a, weights)
    (grad_b,) = torch.autograd.grad(loss_b, other)
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-12)
    assert not torch.allclose(grad_a, grad_b)


def test_on_policy_loss_value_is_beta_times_kl_plus_the_constant():
    x, weights, tokens, mask, advantages = tiny_linear_policy()
    logps = token_logps(x, weights, tokens)
    ref = logps.detach() + 0.3 * torch.randn_like(logps)
    beta = 0.04
    with_kl, stats = grpo_loss(logps, None, ref, advantages, mask, beta=beta, loss_type="grpo")
    without, _ = grpo_loss(logps, None, None, advantages, mask, beta=0.0, loss_type="grpo")
    k3 = torch.exp(ref - logps) - (ref - logps) - 1
    kl_grpo = ((k3 * mask).sum(-1) / mask.sum(-1)).mean()  # aggregated like the policy term
    assert without.item() == pytest.approx(0.0, abs=1e-12)
    assert with_kl.item() == pytest.approx(beta * kl_grpo.item(), abs=1e-12)
    assert stats["kl"].item() == pytest.approx(((k3 * mask).sum() / mask.sum()).item(), abs=1e-12)


@pytest.mark.parametrize("level", LEVELS)
def test_clipping_is_inert_on_policy(level):
    # ratio == 1 sits inside every clip range, so eps and delta change neither value nor gradient.
    x, weights, tokens, mask, advantages = tiny_linear_policy()
    results = []
    for clip in ({"epsilon_low": 0.2}, {"epsilon_low": 1e-3, "epsilon_high": 1e-3}, {"delta": 1.0 + 1e-6}):
        loss, stats = grpo_loss(
            token_logps(x, weights, tokens),
            None,
            None,
            advantages,
            mask,
            importance_sampling_level=level,
            **clip,
        )
        (grad,) = torch.autograd.grad(loss, weights)
        results.append((loss.item(), grad))
        assert stats["clip_ratio/region_mean"].item() == 0.0 and stats["ratio_mean"].item() == 1.0
    for loss, grad in results[1:]:
        assert loss == results[0][0]
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=1e-15)


# --- the other policy terms (cispo, sapo, vespo) and OPSM ---------------------------------------------------


@pytest.mark.parametrize(("loss_type", "same_as"), [("cispo", "dapo"), ("vespo", "dapo"), ("sapo", "grpo"),
                                                    ("luspo", "luspo")])
def test_on_policy_every_term_is_reinforce(loss_type, same_as):
    """At r = 1: cispo's weight is 1 (under its cap), VESPO's phi(1) = e^l * 1 * e^-l = 1, SAPO's gate has
    slope (4/tau) * tau * sigmoid'(0) = 1: each per-token gradient is -A, aggregated as the named clipped
    loss."""
    torch.manual_seed(5)
    logps = (-torch.rand(3, 4, dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    advantages = torch.tensor([1.0, -0.5, 0.25], dtype=F64)
    loss, _ = grpo_loss(logps, None, None, advantages, mask, loss_type=loss_type, epsilon_high=5.0,
                        num_items=7)
    (grad,) = torch.autograd.grad(loss, logps)
    clipped, _ = grpo_loss(logps, None, None, advantages, mask, loss_type=same_as, epsilon_high=5.0,
                           num_items=7)
    (expected,) = torch.autograd.grad(clipped, logps)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    if same_as == "dapo":  # hand-worked: -A_i / 7 on each real token
        assert_values(grad, (-advantages.unsqueeze(1) * mask / 7).tolist())


def test_cispo_keeps_a_gradient_where_the_clip_would_stop_it():
    # r = 1.5 > 1 + eps_high with A = 1: PPO-clip's gradient is 0; cispo's is -min(r, 5) * A = -1.5
    # (dapo, 1 token)
    logps, old = policy_with_ratios([[1.5]])
    _, clipped_grad, _ = loss_and_grad(logps, old, [1.0], loss_type="dapo", epsilon_high=0.28)
    _, cispo_grad, stats = loss_and_grad(logps, old, [1.0], loss_type="cispo", epsilon_high=5.0)
    assert_values(clipped_grad, [[0.0]])
    assert_values(cispo_grad, [[-1.5]])
    _, capped_grad, stats = loss_and_grad(logps, old, [1.0], loss_type="cispo", epsilon_high=1.2)
    assert_values(capped_grad, [[-1.2]])
    assert float(stats["cispo_clip_ratio"]) == 1.0


def test_sapo_gate_hand_worked():
    # l = -(4 / tau) sigmoid(tau (r - 1)) A: r = 2, A = 1, tau_pos = 1 -> -4 sigmoid(1); r = 0.5, A = -1,
    # tau_neg 2
    logps, old = policy_with_ratios([[2.0], [0.5]])
    loss, grad, _ = loss_and_grad(logps, old, [1.0, -1.0], loss_type="sapo", sapo_temperature_pos=1.0,
                                  sapo_temperature_neg=2.0)
    s1, s2 = (1 / (1 + math.exp(-z)) for z in (1.0, -1.0))
    assert loss == pytest.approx((-4 * s1 + 2 * s2) / 2, abs=1e-12)  # grpo: the mean over the two rows
    # d/dlogp = -(4/tau) sigma'(tau (r-1)) tau r A / 2 = -4 s(1-s) r A / 2
    assert_values(grad, [[-4 * s1 * (1 - s1) * 2.0 / 2], [4 * s2 * (1 - s2) * 0.5 / 2]])


def test_vespo_weight_hand_worked():
    from grpo_core.loss import vespo_weights

    # w = exp(0.2 + 0.3) = e^0.5 for A >= 0 (k 2, l 3): phi = e^3 w^2 e^(-3w);
    # for A < 0 (k 3, l 2): e^2 w^3 e^(-2w)
    log_ratio = torch.tensor([[0.2, 0.3, 9.0], [0.2, 0.3, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    phi = vespo_weights(log_ratio, torch.tensor([[1.0], [-1.0]], dtype=F64), mask, 2.0, 3.0, 3.0, 2.0)
    w = math.exp(0.5)
    assert_values(phi, [[math.exp(3) * w**2 * math.exp(-3 * w)], [math.exp(2) * w**3 * math.exp(-2 * w)]])


# --- properties -------------------------------------------------------------------------------------------


@st.composite
def loss_inputs(draw):
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    size = batch * length
    values = st.floats(-20.0, 0.0, allow_nan=False)
    shift = st.floats(-3.0, 3.0, allow_nan=False)
    logps = torch.tensor(draw(st.lists(values, min_size=size, max_size=size)), dtype=F64).view(batch, length)
    old = logps + torch.tensor(draw(st.lists(shift, min_size=size, max_size=size)), dtype=F64).view(
        batch, length
    )
    ref = logps + torch.tensor(draw(st.lists(shift, min_size=size, max_size=size)), dtype=F64).view(
        batch, length
    )
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size))).view(batch, length)
    advantages = torch.tensor(draw(st.lists(st.floats(-5, 5), min_size=batch, max_size=batch)), dtype=F64)
    return logps, old, ref, advantages, mask


option_sets = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(LOSS_TYPES),
        "importance_sampling_level": st.sampled_from(LEVELS),
        "beta": st.sampled_from([0.0, 0.04]),
        "delta": st.sampled_from([None, 1.5]),
        "epsilon_high": st.sampled_from([None, 0.28]),
        "kl_ratio_correction": st.booleans(),
        "off_policy_mask_threshold": st.sampled_from([None, 0.1]),
    }
)


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs(), options=option_sets, on_policy=st.booleans())
def test_finite_inputs_give_finite_loss_and_gradient(inputs, options, on_policy):
    logps, old, ref, advantages, mask = inputs
    logps = logps.requires_grad_(True)
    loss, stats = grpo_loss(logps, None if on_policy else old, ref, advantages, mask, **options)
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(value) for key, value in stats.items() if not key.endswith(("_min", "_max")))


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs(), options=option_sets, on_policy=st.booleans(), noise_seed=st.integers(0, 2**16))
def test_masked_out_tokens_change_nothing(inputs, options, on_policy, noise_seed):
    logps, old, ref, advantages, mask = inputs
    generator = torch.Generator().manual_seed(noise_seed)
    masked_out = ~mask

    def perturbed(tensor, scale):
        noise = scale * torch.randn(tensor.shape, dtype=F64, generator=generator)
        return torch.where(masked_out, (tensor + noise).clamp(-20, 0), tensor)

    def run(lp, od, rf):
        lp = lp.clone().requires_grad_(True)
        loss, stats = grpo_loss(lp, None if on_policy else od, rf, advantages, mask, **options)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss, grad, stats

    loss_a, grad_a, stats_a = run(logps, old, ref)
    loss_b, grad_b, stats_b = run(perturbed(logps, 5.0), perturbed(old, 5.0), perturbed(ref, 5.0))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-12, atol=1e-12)
    assert (grad_a[masked_out] == 0).all()
    for key in stats_a:
        torch.testing.assert_close(stats_a[key], stats_b[key], rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf])
def test_non_finite_padding_is_ignored(level, junk):
    # vLLM marks tokens it could not score with NaN; a -100 label can give -inf. 0 * NaN would be NaN.
    torch.manual_seed(3)
    logps, old, ref = (-torch.rand(2, 4, dtype=F64) for _ in range(3))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    advantages = torch.tensor([1.0, -0.5], dtype=F64)

    def run(fill):
        def padded(tensor):
            return tensor.masked_fill(mask == 0, fill)

        lp = padded(logps).requires_grad_(True)
        loss, stats = grpo_loss(
            lp, padded(old), padded(ref), advantages, mask, beta=0.1, importance_sampling_level=level
        )
        (grad,) = torch.autograd.grad(loss, lp)
        return loss, grad, stats

    loss, grad, stats = run(junk)
    clean_loss, clean_grad, clean_stats = run(-1.0)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=1e-15)
    for key in stats:
        torch.testing.assert_close(stats[key], clean_stats[key], rtol=0, atol=1e-15)


# --- bad inputs -------------------------------------------------------------------------------------------


def good_arguments():
    logps = torch.zeros(2, 3, dtype=F64)
    return {
        "logps": logps,
        "old_logps": logps,
        "ref_logps": logps,
        "advantages": torch.zeros(2, dtype=F64),
        "mask": torch.ones(2, 3),
    }


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"logps": torch.zeros(2, 3, 1)}, "logps"),
        ({"logps": torch.zeros(2, 3, dtype=torch.long)}, "logps"),
        ({"old_logps": torch.zeros(2, 4)}, "old_logps"),
        ({"ref_logps": torch.zeros(3, 3)}, "ref_logps"),
        ({"mask": torch.ones(2, 2)}, "mask"),
        ({"mask": None}, "mask"),
        ({"advantages": torch.zeros(2, 1)}, "advantages"),
        ({"advantages": torch.zeros(3)}, "advantages"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
        ({"beta": -0.1}, "beta"),
        ({"beta": 0.1, "ref_logps": None}, "ref_logps"),
        ({"epsilon_low": 1.5}, "epsilon_low:"),
        ({"kl_ratio_correction": "yes"}, "kl_ratio_correction:"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"delta": 0.0}, "delta"),
        ({"loss_type": "dr_grpo", "max_completion_length": 2}, "max_completion_length"),
        ({"loss_type": "dr_grpo", "max_completion_length": 4.5}, "max_completion_length"),
        ({"num_items": -1}, "num_items"),
        ({"num_items": torch.ones(2)}, "num_items"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg"),
        ({"vespo_k_neg": -1.0}, "vespo_k_neg"),
        ({"vespo_lambda_pos": math.nan}, "vespo_lambda_pos"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold"),
        ({"off_policy_mask_threshold": 0.1, "sampling_logps": torch.zeros(2, 4)}, "sampling_logps"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(changes, named):
    arguments = good_arguments() | changes
    positional = [arguments.pop(name) for name in ("logps", "old_logps", "ref_logps", "advantages", "mask")]
    with pytest.raises(ValueError, match=f"^{named}"):
        grpo_loss(*positional, **arguments)


def test_dr_grpo_without_any_length_raises():
    empty = torch.zeros(2, 0, dtype=F64)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(empty, None, None, torch.zeros(2, dtype=F64), empty, loss_type="dr_grpo")
