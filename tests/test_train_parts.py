"""The training loop's parts on their own: the typed round, the padding trim, the state a checkpoint holds,
the public switches benchmarks turn (train.* keys, ``train(export=...)``), all against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.levers import train_overrides
from grpo_core.train.batching import trim_padding
from grpo_core.train.checkpoint import list_checkpoints
from grpo_core.train.loop import train
from grpo_core.train.optim import build_optimizer_and_scheduler
from grpo_core.train.options import train_key_owner
from grpo_core.train.round import Round
from tests.tiny import make_prompts, make_tiny_model, tiny_config, train_options

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def a_round() -> Round:
    # 4 rows, prompts of 1, 2, 2, 3 tokens (left-padded to 3), completions of 2, 1, 0, 2 tokens (padded to 3)
    return Round(
        prompt_ids=torch.tensor([[0, 0, 5], [0, 6, 7], [0, 6, 7], [8, 9, 5]]),
        prompt_mask=torch.tensor([[0, 0, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[11, 12, 0], [13, 0, 0], [0, 0, 0], [14, 15, 0]]),
        completion_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 0]]),
        is_truncated=torch.tensor([False, True, False, False]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        metrics={"reward": 0.25, "rewards/digits/mean": float("nan")},
    )


def test_round_rows_keep_every_row_field_and_share_the_metrics():
    r = a_round()
    r.old_logps = torch.arange(12.0).view(4, 3)
    picked = r.rows(torch.tensor([3, 0]))
    assert picked.prompt_ids.tolist() == [[8, 9, 5], [0, 0, 5]]
    assert picked.advantages.tolist() == [-0.5, 1.0]
    assert picked.old_logps.tolist() == [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
    assert picked.ref_logps is None and picked.metrics is r.metrics
    assert len(r.rows(slice(1, 3))) == 2


def test_round_loss_mask_drops_truncated_rows_only_when_asked():
    r = a_round()
    assert r.loss_mask(False).tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert r.loss_mask(True).tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert r.completion_mask[1].tolist() == [1, 0, 0]  # the round itself is untouched


def test_round_buffer_round_trips_tensors_and_metrics():
    r = a_round()
    r.ref_logps = torch.full((4, 3), -0.5)
    buffer = r.to_buffer()
    assert all(isinstance(v, torch.Tensor) for v in buffer.values())  # torch.load(weights_only=True) reads it
    assert list(buffer) == ["prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated",
                            "advantages", "ref_logps", "metrics_json"]
    back = Round.from_buffer(buffer)
    for name in r.row_fields():
        assert torch.equal(getattr(back, name), getattr(r, name)), name
    assert back.old_logps is None
    assert (back.metrics["reward"] == 0.25
            and back.metrics["rewards/digits/mean"] != back.metrics["rewards/digits/mean"])


def test_trim_padding_drops_all_padding_columns_on_both_sides():
    r = a_round()
    ids, attention, mask = trim_padding(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    # prompt column 0 is real in row 3 only: kept; completion width = the longest completion, 2
    assert ids.tolist() == [[0, 0, 5, 11, 12], [0, 6, 7, 13, 0], [0, 6, 7, 0, 0], [8, 9, 5, 14, 15]]
    assert attention.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert mask.tolist() == [[1, 1], [1, 0], [0, 0], [1, 1]]
    rows = r.rows(slice(1, 3))  # prompts of 2 tokens, completions of at most 1
    ids, attention, mask = trim_padding(rows.prompt_ids, rows.prompt_mask, rows.completion_ids,
                                        rows.completion_mask)
    assert ids.tolist() == [[6, 7, 13], [6, 7, 0]] and mask.tolist() == [[1], [0]]
    empty = torch.zeros(2, 3, dtype=torch.long)
    _, _, mask = trim_padding(rows.prompt_ids, rows.prompt_mask, empty, empty)
    assert mask.shape == (2, 1)  # no completion token at all: one column, so a forward still has a target


def test_fused_adamw_is_a_train_key():
    model = torch.nn.Linear(3, 2)
    fused, _ = build_optimizer_and_scheduler(model, train_options().optim, max_steps=10)
    plain, _ = build_optimizer_and_scheduler(model, train_options(fused_adamw=False).optim, max_steps=10)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]


def test_benchmark_levers_are_train_keys_and_unknown_levers_are_refused():
    assert train_overrides({"fused_head": False, "trim": False, "padding_free": False, "fused_adamw": False,
                            "forward": "hf", "generation": "hf"}) == {
        "fused_lm_head": False, "trim_padding": False, "padding_free": False, "fused_adamw": False,
        "forward_backend": "hf"}
    fields = set(train_key_owner())
    assert set(
        train_overrides({"fused_head": 1, "trim": 1, "padding_free": 1, "fused_adamw": 1,
                         "forward": 1})) <= fields
    with pytest.raises(ValueError, match=r"unknown lever\(s\) \['fused_heads'\]"):
        train_overrides({"fused_heads": False})


def test_untrimmed_and_unfused_training_gives_the_same_steps(assets, tmp_path):
    """trim_padding / fused_lm_head / padding_free off change the work, not the numbers."""
    model_dir, data = assets
    logs = {}
    for name, keys in {"default": {}, "off": {"trim_padding": False, "fused_lm_head": False,
                                              "padding_free": False}}.items():
        cfg = tiny_config(model_dir, data, DIGITS, max_steps=2, forward_backend="hf", **keys)
        res = train(cfg, root=tmp_path / name, progress=False, export=False)
        logs[name] = res.last_metrics
        assert not res.model_dir.exists()  # export=False
    for key in ("loss", "grad_norm", "reward", "kl", "entropy"):
        assert logs["off"][key] == pytest.approx(logs["default"][key], rel=1e-4, abs=1e-6), key


def test_save_strategy_no_writes_no_checkpoint(assets, tmp_path):
    model_dir, data = assets
    res = train(tiny_config(model_dir, data, DIGITS, max_steps=2, save_steps=1, save_strategy="no"),
                root=tmp_path, progress=False)
    assert list_checkpoints(res.checkpoint_dir) == [] and (res.model_dir / "model.safetensors").is_file()


def test_a_synced_reference_stays_in_checkpoints_after_a_resume(assets, tmp_path):
    """TR-DPO: the reference synced at step 3 is saved at step 4; resumed there, the step-5 checkpoint must
    carry the same reference (it has not been synced again), not drop it and fall back to the base."""
    model_dir, data = assets
    keys = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=0.5,
                save_steps=2, save_total_limit=3)
    train(tiny_config(model_dir, data, DIGITS, max_steps=4, **keys), root=tmp_path, progress=False)
    res = train(tiny_config(model_dir, data, DIGITS, max_steps=5, **keys), root=tmp_path, progress=False)
    assert res.resumed_from.name == "checkpoint-4"
    ckpts = {p.name: p for p in list_checkpoints(res.checkpoint_dir)}
    assert not (ckpts["checkpoint-2"] / "reference.safetensors").exists()  # not synced yet at step 2
    at4, at5 = (load_file(ckpts[n] / "reference.safetensors") for n in ("checkpoint-4", "checkpoint-5"))
    base = load_file(model_dir / "model.safetensors")
    assert at4.keys() == at5.keys()
    assert all(torch.equal(at4[k], at5[k]) for k in at4)
    assert any(not torch.equal(at4[k], base[k]) for k in at4 if k in base)  # it did move off the base
