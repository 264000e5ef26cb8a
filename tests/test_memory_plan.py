"""benchmarks/memory_plan.py: its parameter counts and bytes per parameter against real models and the
trainer's own optimizer (measured on CPU), and the docs table against what the script prints."""

from __future__ import annotations

import pytest
import torch

from benchmarks import memory_plan as mp
from grpo_core.model.loading import LoraConfig, ModelConfig, load_policy
from grpo_core.train.optim import build_optimizer_and_scheduler
from grpo_core.train.options import TrainConfig
from tests.tiny import make_tiny_model


def small_qwen2(tied: bool):
    """A Qwen2ForCausalLM of the Qwen2.5 structure (GQA, q/k/v biases), small enough to build in a blink."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def one_training_step(model, trainable) -> torch.optim.Optimizer:
    """One forward, backward and AdamW step with the trainer's optimizer over ``trainable``'s parameters."""
    optimizer, _ = build_optimizer_and_scheduler(trainable, TrainConfig().optim, max_steps=100)
    ids = torch.randint(5, 200, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_transformers(tied):
    model = small_qwen2(tied)
    shape = mp.ModelShape.from_hf_config(model.config)
    assert mp.parameter_count(shape) == sum(p.numel() for p in model.parameters())
    assert mp.parameter_tensor_count(shape) == len(list(model.parameters()))
    assert mp.root_parameter_count(shape) + shape.layers * mp.layer_parameter_count(shape) == \
        mp.parameter_count(shape)


def test_qwen25_counts_are_the_published_ones():
    # the totals the hub's model cards state: a check on the hard-coded shapes
    assert [mp.parameter_count(s) for s in mp.QWEN25] == [494_032_768, 1_543_714_304, 7_615_616_512]


@pytest.mark.parametrize("tied", [True, False])
def test_full_fine_tuning_bytes_measured(tied):
    model = small_qwen2(tied)
    shape = mp.ModelShape.from_hf_config(model.config)
    params, tensors = mp.parameter_count(shape), mp.parameter_tensor_count(shape)
    optimizer = one_training_step(model, model)

    assert tensor_bytes(model.parameters()) == mp.MASTER_BYTES * params
    assert tensor_bytes(p.grad for p in model.parameters()) == mp.GRADIENT_BYTES * params
    assert optimizer_state_bytes(optimizer) == mp.ADAMW_BYTES * params + mp.ADAMW_STEP_BYTES * tensors
    measured = (tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in model.parameters())
                + optimizer_state_bytes(optimizer))
    assert measured == mp.training_state_bytes(params, tensors)


def test_lora_bytes_measured(tmp_path):
    rank = 4
    cfg = ModelConfig(name_or_path=str(make_tiny_model(tmp_path / "model")), dtype="bfloat16",
                      lora=LoraConfig(r=rank))
    model, _ = load_policy(cfg)
    shape = mp.ModelShape.from_hf_config(model.get_base_model().config)
    adapters = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    optimizer = one_training_step(model, model)

    adapter_params = mp.lora_parameter_count(shape, rank)
    # the base, model.dtype
    assert tensor_bytes(frozen) == mp.DTYPE_BYTES["bfloat16"] * mp.parameter_count(shape)
    assert len(adapters) == mp.lora_tensor_count(shape)
    assert tensor_bytes(adapters) == mp.MASTER_BYTES * adapter_params
    assert tensor_bytes(p.grad for p in adapters) == mp.GRADIENT_BYTES * adapter_params
    assert optimizer_state_bytes(optimizer) == mp.ADAMW_BYTES * adapter_params + \
        mp.ADAMW_STEP_BYTES * mp.lora_tensor_count(shape)


def test_plan_reads_the_recipe_and_the_terms_add_up():
    recipe = mp.Recipe.from_config(mp.load_config(mp.REPO_ROOT / mp.DEFAULT_CONFIG))
    assert (recipe.rows, recipe.steps_per_generation, recipe.prompt_tokens, recipe.completion_tokens) == \
        (32, 4, 256, 512)
    rows = {(r.model, r.strategy): r for r in mp.plan(recipe)}
    ddp, one_gpu = rows["Qwen2.5-0.5B", "DDP"], rows["Qwen2.5-0.5B", "1 GPU"]
    # the recipe's bf16 compute copy is not DDP-wrapped: no DDP buckets, the float32 all-reduce bucket instead
    assert ddp.training_state == one_gpu.training_state
    assert ddp.transient_weights == 4 * min(ddp.parameters, 2 ** 27) and one_gpu.transient_weights == 0
    fp16 = mp.Recipe(**{**recipe.__dict__, "mixed_precision": "fp16"})  # autocast over DDP-wrapped masters
    ddp16, one16 = (mp.memory_row(mp.QWEN25[0], fp16, s) for s in mp.STRATEGIES[1::-1])
    assert ddp16.training_state - one16.training_state == mp.DDP_BUCKET_BYTES * ddp16.parameters
    fsdp2, fsdp8 = rows["Qwen2.5-7B", "FSDP2 N=2"], rows["Qwen2.5-7B", "FSDP2 N=8"]
    assert fsdp2.replica == fsdp8.replica == 2 * fsdp2.parameters  # a whole bf16 replica whatever N
    assert fsdp8.training_state < fsdp2.training_state / 3
    assert rows["Qwen2.5-7B", "LoRA, DDP"].reference == 0
    # one GPU and DDP train and sample on the bf16 compute copy, LoRA samples from the policy itself
    assert one_gpu.replica == ddp.replica == 2 * one_gpu.parameters
    assert rows["Qwen2.5-0.5B", "LoRA, DDP"].replica == 0
    # the compute copy is bf16 all the same
    float32 = mp.Recipe(**{**recipe.__dict__, "model_dtype": "float32"})
    assert mp.replica_bytes(mp.QWEN25[0], float32, mp.STRATEGIES[0]) == 2 * one_gpu.parameters
    plain = mp.Recipe(**{**float32.__dict__, "mixed_precision": "no"})
    assert mp.replica_bytes(mp.QWEN25[0], plain, mp.STRATEGIES[0]) == 0  # samples from the float32 policy


def test_docs_table_is_what_the_script_prints(capsys):
    assert mp.main([]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == mp.rendering_for(mp.REPO_ROOT / mp.DEFAULT_CONFIG)
    assert mp.docs_region(mp.DOCS_PATH.read_text(encoding="utf-8")) == printed, \
        "docs/scaling.md is stale: run python -m benchmarks.memory_plan --write-docs"


def test_replacing_the_docs_region_keeps_the_rest():
    text = f"before\n{mp.DOCS_START}\nold\n{mp.DOCS_END}\nafter\n"
    new = mp.replace_docs_region(text, "table")
    assert new == f"before\n{mp.DOCS_START}\ntable\n{mp.DOCS_END}\nafter\n"
    assert mp.docs_region(new) == "table"


def test_a_missing_config_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-recipe.yaml"
    with pytest.raises(SystemExit) as exit_info:
        mp.main(["--config", str(missing)])
    assert exit_info.value.code == 2
    assert str(missing) in capsys.readouterr().err


# (hidden, layers, heads, kv_heads, intermediate, rows, tokens, gradient checkpointing): Qwen2.5's GQA
# structure at sizes a CPU measures in seconds; 2,048 tokens each, so the activations dwarf the allocator's
# noise
MEASURED_SHAPES = [(256, 4, 4, 2, 1024, 4, 512, False), (512, 2, 8, 2, 1536, 2, 1024, False),
                   (384, 6, 6, 2, 1024, 8, 256, False), (384, 6, 6, 2, 1024, 8, 256, True)]


@pytest.mark.parametrize("shape", MEASURED_SHAPES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_activation_estimate_within_a_quarter_of_the_measured_step(shape):
    """The plan's activation term (float32 compute, as measured here) against what one forward and backward of
    that micro-batch adds to a fresh process's peak RSS (benchmarks/activation_measure.py)."""
    from benchmarks.activation_measure import measure

    hidden, layers, heads, kv_heads, intermediate, rows, tokens, checkpointing = shape
    model = mp.ModelShape("probe", hidden, layers, heads, kv_heads, intermediate, vocab=512, tied=True)
    recipe = mp.Recipe(rows=rows, steps_per_generation=1, prompt_tokens=tokens, completion_tokens=0, beta=0.0,
                       gradient_checkpointing=checkpointing, mixed_precision="no", model_dtype="float32",
                       fused_lm_head=True, lora_rank=16)
    planned = mp.activation_bytes(model, recipe, mp.STRATEGIES[0])
    measured = measure(*shape)
    assert 0.75 <= planned / measured <= 1.25, (planned, measured)


def test_a_child_measures_its_own_peak_not_its_parents():
    """benchmarks/rss.py: a subprocess started from a process holding 512 MiB reports its own small peak
    (Linux folds the replaced image's peak into ru_maxrss across vfork + exec, so ru_maxrss would report the
    parent's)."""
    import subprocess
    import sys

    held = torch.ones(128, 1024, 1024)  # 512 MiB in this process
    code = "from benchmarks.rss import peak_rss_bytes; print(peak_rss_bytes())"
    child_peak = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=mp.REPO_ROOT).stdout)
    assert held.sum() > 0 and child_peak < 256 * 2**20
