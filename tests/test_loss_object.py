"""GRPOLoss: built once from LossOptions (TRL names), called per micro-batch; the same numbers as grpo_loss,
bit for bit, for every loss type and importance-sampling level; options checked when they are made; fed by
TrainConfig().loss."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from grpo_core.loss import GRPOLoss, LossOptions, grpo_loss
from grpo_core.train.options import TrainConfig

F64 = torch.float64
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LEVELS = ["token", "sequence"]
REPO = Path(__file__).resolve().parents[1]


def loss_config(**changes) -> LossOptions:
    """The loss section of the default train config (TRL GRPOConfig's defaults), with ``changes``."""
    return dataclasses.replace(TrainConfig().loss, **changes)


def functional_options(config: LossOptions) -> dict:
    """The same options as grpo_loss keywords (TRL's ``epsilon`` and ``use_bias_correction_kl`` are
    grpo_loss's ``epsilon_low`` and ``kl_ratio_correction``)."""
    options = dataclasses.asdict(config)
    options["epsilon_low"] = options.pop("epsilon")
    options["kl_ratio_correction"] = options.pop("use_bias_correction_kl")
    return options


def micro_batch(B=5, T=7, seed=0, dtype=F64):
    """Random tensors off-policy, with padding holding NaN, an empty row, OPSM's sampler log-probs, an entropy
    mask and a token-level sampler ratio."""
    g = torch.Generator().manual_seed(seed)
    logps = torch.randn(B, T, generator=g, dtype=dtype) - 1.5
    mask = (torch.rand(B, T, generator=g) > 0.25).to(dtype)
    mask[0] = 0
    tensors = {
        "old_logps": logps + 0.3 * torch.randn(B, T, generator=g, dtype=dtype),
        "ref_logps": logps + 0.2 * torch.randn(B, T, generator=g, dtype=dtype),
        "advantages": torch.randn(B, generator=g, dtype=dtype),
        "mask": mask,
    }
    extras = {
        "sampling_logps": tensors["old_logps"] + 0.4 * torch.randn(B, T, generator=g, dtype=dtype),
        "entropy_mask": torch.rand(B, T, generator=g) > 0.4,
        "sampler_ratio": torch.rand(B, T, generator=g, dtype=dtype) + 0.5,
        "num_items": 23,
    }
    return logps.masked_fill(mask == 0, float("nan")), tensors, extras


def run(fn, logps, tensors, **keywords):
    """loss, stats and d loss / d logps of one call."""
    leaf = logps.clone().requires_grad_(True)
    loss, stats = fn(leaf, tensors["old_logps"], tensors["ref_logps"], tensors["advantages"], tensors["mask"],
                     **keywords)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), stats, grad


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str):
    """Equal bit for bit: same dtype and shape, same bits (signed zeros and NaN included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    as_int = {8: torch.int64, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int)), f"{what}: {a} != {b}"


def assert_same_results(ours, theirs):
    (loss, stats, grad), (loss_f, stats_f, grad_f) = ours, theirs
    assert_bitwise(loss, loss_f, "loss")
    assert_bitwise(grad, grad_f, "gradient")
    assert list(stats) == list(stats_f)
    for key in stats:
        assert not stats[key].requires_grad, key
        assert_bitwise(stats[key], stats_f[key], key)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_the_object_equals_grpo_loss_bit_for_bit(loss_type, level, dtype):
    config = loss_config(loss_type=loss_type, importance_sampling_level=level, beta=0.04, delta=1.5,
                         epsilon_high=5.0 if loss_type == "cispo" else 0.28, off_policy_mask_threshold=0.05,
                         sapo_temperature_pos=0.9, vespo_k_neg=2.5)
    uncorrected = dataclasses.replace(config, use_bias_correction_kl=False)
    loss_fns = [GRPOLoss(c, max_completion_length=10) for c in (config, uncorrected)]  # built once ...
    for seed, T in ((0, 7), (1, 4)):  # ... called on micro-batches of different widths
        logps, tensors, extras = micro_batch(T=T, seed=seed, dtype=dtype)
        for options, keywords in ((config, {}), (config, extras),
                                  (uncorrected, {**extras, "num_items": torch.tensor(31.0)})):
            ours = run(loss_fns[options is uncorrected], logps, tensors, **keywords)
            theirs = run(grpo_loss, logps, tensors, max_completion_length=10, **functional_options(options),
                         **keywords)
            assert_same_results(ours, theirs)
            assert torch.isfinite(ours[0]) and ours[2].abs().sum() > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_without_kl_equals_grpo_loss(loss_type):
    """old_logps and ref_logps None (ratio 1, no reference), TRL's defaults otherwise."""
    config = loss_config(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None)
    logps, tensors, _ = micro_batch()
    tensors = tensors | {"old_logps": None, "ref_logps": None}
    ours = run(GRPOLoss(config), logps, tensors)
    theirs = run(grpo_loss, logps, tensors, **functional_options(config))
    assert_same_results(ours, theirs)
    assert "kl" not in ours[1] and ours[1]["ratio_mean"] == 1.0


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"loss_type": "x"}, "loss_type"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
        ({"beta": -0.1}, "beta"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"epsilon": "0.2"}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"delta": 0.0}, "delta"),
        ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg"),
        ({"vespo_k_pos": -1.0}, "vespo_k_pos"),
        ({"vespo_lambda_pos": float("nan")}, "vespo_lambda_pos"),
        ({"vespo_k_neg": -1.0}, "vespo_k_neg"),
        ({"vespo_lambda_neg": float("inf")}, "vespo_lambda_neg"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold"),
    ],
)
def test_a_bad_option_raises_at_construction_naming_it(changes, named):
    with pytest.raises(ValueError, match=named):
        GRPOLoss(loss_config(**changes), max_completion_length=32)  # no tensor in sight yet


def test_a_call_checks_only_what_comes_with_it():
    """Tensors and per-call counts are checked per call, with the messages grpo_loss gives."""
    loss_fn = GRPOLoss(loss_config(loss_type="dr_grpo", beta=0.1), max_completion_length=5)
    logps, tensors, _ = micro_batch(T=7)
    with pytest.raises(ValueError, match="max_completion_length must be an int >= T=7"):
        loss_fn(logps, tensors["old_logps"], tensors["ref_logps"], tensors["advantages"], tensors["mask"])
    logps, tensors, _ = micro_batch(T=5)
    with pytest.raises(ValueError, match="ref_logps is required"):
        loss_fn(logps, tensors["old_logps"], None, tensors["advantages"], tensors["mask"])
    with pytest.raises(ValueError, match="num_items"):
        loss_fn(logps, tensors["old_logps"], tensors["ref_logps"], tensors["advantages"], tensors["mask"],
                num_items=-1)
    with pytest.raises(ValueError, match="advantages"):
        loss_fn(logps, tensors["old_logps"], tensors["ref_logps"], tensors["advantages"][:2], tensors["mask"])


def test_train_config_loss_feeds_it_directly():
    t = TrainConfig()
    loss_fn = GRPOLoss(t.loss, max_completion_length=32)
    assert loss_fn.options == t.loss and loss_fn.max_completion_length == 32
    logps, tensors, _ = micro_batch()
    ours = run(loss_fn, logps, tensors)
    theirs = run(grpo_loss, logps, tensors, **functional_options(t.loss))
    assert_same_results(ours, theirs)


def test_max_completion_length_is_dr_grpos_normaliser():
    config = dataclasses.replace(TrainConfig().loss, loss_type="dr_grpo")
    logps, tensors, _ = micro_batch(T=7)
    with_32 = run(GRPOLoss(config, max_completion_length=32), logps, tensors)[0]
    with_t = run(GRPOLoss(config), logps, tensors)[0]  # None: the micro-batch's T
    torch.testing.assert_close(with_32 * 32, with_t * 7, rtol=1e-12, atol=0)


CONTRACT_KEYWORDS = {  # ../shared/CONTRACT.md's grpo_loss keywords, with TRL's names
    "loss_type": "dapo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": None, "delta": None,
    "importance_sampling_level": "token", "kl_ratio_correction": True, "max_completion_length": None,
    "num_items": None, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "off_policy_mask_threshold": None}


def test_grpo_loss_takes_the_contracts_keywords_with_their_defaults_and_nothing_else():
    parameters = inspect.signature(grpo_loss).parameters
    assert list(parameters)[:5] == ["logps", "old_logps", "ref_logps", "advantages", "mask"]
    logps, tensors, extras = micro_batch()
    defaults = run(grpo_loss, logps, tensors)
    assert_same_results(run(grpo_loss, logps, tensors, **CONTRACT_KEYWORDS), defaults)
    assert_same_results(run(grpo_loss, logps, tensors, sampling_logps=extras["sampling_logps"],
                            entropy_mask=extras["entropy_mask"], sampler_ratio=extras["sampler_ratio"]),
                        run(GRPOLoss(TrainConfig().loss), logps, tensors,
                            sampling_logps=extras["sampling_logps"], entropy_mask=extras["entropy_mask"],
                            sampler_ratio=extras["sampler_ratio"]))
    with pytest.raises(TypeError, match="epsilonn"):
        grpo_loss(logps, None, None, tensors["advantages"], tensors["mask"], epsilonn=0.1)


def test_grpo_loss_is_a_thin_call_onto_the_object():
    """Its options are LossOptions' (one list, one set of defaults and limits), not a second list."""
    source = inspect.getsource(grpo_loss)
    assert "GRPOLoss(" in source and "LossOptions(" in source
    body = source[source.index('"""', source.index('"""') + 3) + 3:]
    code = [line for line in body.strip().splitlines() if not line.strip().startswith("#")]
    assert len(code) <= 8


@pytest.mark.parametrize("path", ["grpo_core/loss.py", "grpo_core/model/fastforward.py",
                                  "grpo_core/model/logprobs.py"])
def test_no_function_over_90_lines(path):
    tree = ast.parse((REPO / path).read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 90]
    assert long == []


def test_the_step_share_and_the_entropy_bonus_are_in_the_loss_that_is_trained():
    """B = 2 rows of 2 tokens, on-policy (ratio 1), A = (1, 0.5): every token's policy loss is -A, so grpo's
    loss is (-1 - 0.5) / 2 = -0.75 and dapo's -3 / 4 = -0.75. With 4 micro-batches a step, grpo's share is a
    quarter of it and dapo's stays (its num_items counts the step's tokens); the bonus takes coef * mean
    entropy / 4 off both."""
    logps = torch.full((2, 2), -1.0, dtype=F64)
    mask, advantages = torch.ones(2, 2, dtype=F64), torch.tensor([1.0, 0.5], dtype=F64)
    entropies = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64, requires_grad=True)
    for loss_type, share in (("grpo", -0.75 / 4), ("dapo", -0.75)):
        loss_fn = GRPOLoss(loss_config(loss_type=loss_type), gradient_accumulation_steps=4)
        loss, _ = loss_fn(logps, None, None, advantages, mask, num_items=4)
        assert loss.item() == pytest.approx(share, abs=1e-12)
        loss, _ = loss_fn(logps, None, None, advantages, mask, num_items=4, entropies=entropies,
                          entropy_coef=0.1)
        assert loss.item() == pytest.approx(share - 0.1 * 2.5 / 4, abs=1e-12)
        (grad,) = torch.autograd.grad(loss, entropies)
        torch.testing.assert_close(grad, torch.full((2, 2), -0.1 / 4 / 4, dtype=F64))  # -coef / ga / tokens
    loss_fn = GRPOLoss(loss_config(loss_type="grpo"), gradient_accumulation_steps=4)
    entropy_mask = torch.tensor([[False, True], [False, True]])  # the bonus averages the trained tokens only
    loss, _ = loss_fn(logps, None, None, advantages, mask, entropies=entropies, entropy_coef=0.1,
                      entropy_mask=entropy_mask)
    policy = (-1.0 / 2 + -0.5 / 2) / 2  # one trained token per row, each row still averaged over its 2 tokens
    assert loss.item() == pytest.approx(policy / 4 - 0.1 * 3.0 / 4, abs=1e-12)  # entropies 2 and 4 trained
    with pytest.raises(ValueError, match="entropies must have the shape of logps"):
        loss_fn(logps, None, None, advantages, mask, entropy_coef=0.1)
