"""GPU memory per process on paper: what the trainer holds for Qwen2.5-0.5B/1.5B/7B at a recipe's batch shape.

    python -m benchmarks.memory_plan [--config configs/gsm8k-qwen2.5-0.5b.yaml] [--write-docs]

Prints a Markdown table (model x strategy); ``--write-docs`` also puts it into docs/scaling.md between the
``memory-table`` markers. ``plan()`` returns the same numbers as ``MemoryRow`` dataclasses. Parameter counts
come from the architectures' shapes (``parameter_count`` reproduces transformers' ``sum(p.numel())``); the
batch shape and precisions from the recipe (train.per_device_train_batch_size, steps_per_generation,
max_prompt_length, max_completion_length, beta, gradient_checkpointing, mixed_precision, fused_lm_head;
model.dtype, model.lora.r). Bytes throughout; GiB = 2**30 bytes.

The model of memory (what the code does; where, in parentheses):

Persistent state, per process
    full fine-tuning   float32 master weights 4 B + float32 gradients 4 B + AdamW exp_avg and exp_avg_sq
                       8 B = 16 B per parameter, plus AdamW's float32 ``step`` scalar per parameter tensor
                       (model/loading.py load_policy, train/optim.py). DDP adds its gradient buckets, one more
                       float32 gradient-sized copy (accelerate's default gradient_as_bucket_view=False):
                       20 B/param. One GPU: no DDP, 16. Under mixed_precision bf16 (1 GPU or DDP, full
                       fine-tuning) nothing is DDP-wrapped: the float32 master gradients are all-reduced by
                       the trainer in buckets of at most 2**27 elements (train/compute_weights.py), a
                       transient buffer, so 16 B/param on one GPU and on DDP.
    reference          beta > 0: a frozen copy in model.dtype (load_reference); LoRA: the adapter-off view,
                       0 B.
    FSDP2 over N       masters, gradients and AdamW state sharded, 16/N B/param; the reference sharded,
                       model.dtype/N (model/sharding.py); plus a whole replica of the policy in model.dtype on
                       every process for sampling (train/replica.py). Shards are taken as even (FSDP2 pads dim
                       0 to N).
    compute copy       full fine-tuning under mixed_precision bf16 on 1 GPU or DDP: the bf16 copy of the
                       masters that every training forward and backward and every rollout run on
                       (train/compute_weights.py), 2 B/param. Without mixed precision, a half-precision
                       model.dtype: a copy in model.dtype that rollouts sample from (train/policy.py
                       samples_from_a_cast_copy).
    LoRA (DDP)         the frozen base in model.dtype; adapters r*(in + out) for each of q, k, v, o, gate, up,
                       down in every layer (peft's "all-linear" leaves out lm_head), float32, with gradients,
                       AdamW state and DDP buckets: 20 B per adapter parameter.

Working memory, per micro-batch of per_device_train_batch_size rows x (prompt + completion) tokens
    transient weights  1 GPU / DDP under bf16: none (the compute copy is persistent, above), but DDP's
                       all-reduce bucket of the float32 gradients. Under fp16 (autocast) and for LoRA's
                       float32 adapters: autocast caches the half-precision copy of every weight a linear
                       layer reads until the model's forward returns. FSDP2: the gathered units, the root
                       (embeddings, final norm, untied LM head: gathered through the whole forward and
                       backward; sharding.py passes reshard_after_forward=True explicitly, so the root is
                       resharded only between them) and two decoder layers (the one computing, the next one
                       prefetched), in the compute dtype; plus the unsharded gradients of the root and one
                       layer (compute dtype) and, under bf16, that layer's float32 copy for the
                       reduce-scatter.
    activations        one layer's activations: what a Qwen2 decoder layer saves for its backward, per token
                       9*hidden + 4*intermediate + 2*kv_heads*head_dim elements
                       (``layer_activation_elements``; no attention scores: SDPA never stores them), in the
                       compute dtype. Checked against measurement on CPU (benchmarks/activation_measure.py,
                       tests/test_memory_plan.py): within 25% of the measured step for three shapes, with and
                       without checkpointing. (Korthikanti et al.'s 34*hidden for a GPT layer with a 4h MLP
                       read about 2x low for Qwen2's SwiGLU.) Gradient checkpointing keeps each layer's input
                       (the residual stream, plus the final norm's input) and recomputes one layer at a time;
                       without it every layer's activations are kept. The residual stream is in the compute
                       dtype under bf16 (the compute copy, FSDP2's param_dtype); under fp16 autocast outside
                       FSDP2 it stays float32 (the embedding runs outside autocast on float32 masters, and the
                       residual adds stay float32).
    logits             the fused LM head (train.fused_lm_head, model/logprobs.py) keeps only one chunk of
                       DEFAULT_CHUNK_SIZE rows x vocab in float32 (x3: the upcast logits, their log-softmax,
                       p*log p for the entropy), under every strategy: the head scores chunk by chunk inside
                       the model's own forward, so accelerate's autocast wrapper, DDP and FSDP2 run as they
                       are (``scoring_head``). With train.fused_lm_head false the model's forward returns the
                       (rows, completion + 1, vocab) logits: float32 under accelerate's wrapper
                       (convert_outputs_to_fp32), the compute dtype under FSDP2; they are kept for the
                       backward and their gradient is as large: 2x the logits, plus the chunk.
    KV cache           HF generate samples the round's rows at once on each process:
                       per_device_train_batch_size x steps_per_generation rows x (prompt + completion) tokens
                       x layers x 2 (K, V) x kv_heads x head_dim, in the sampler's dtype: the bf16 compute
                       copy, else model.dtype (the FSDP2 replica, the cast copy, LoRA's base; full float32
                       fine-tuning samples from the float32 policy).

total = weights+grads+AdamW + reference + replica + transient + max(activations + logits, KV cache): the
rollout and the micro-batches take turns. An upper bound: every term at the recipe's longest rows
(trim_padding only shortens them), the forward's autocast copies added to the backward's logit gradient (they
never coexist), and gradients as held through generation (zero_grad frees them after each step).

Not counted: the CUDA context and caching-allocator slack (~0.5-1 GiB), NCCL buffers, generate's prefill
activations, LoRA's per-module dropout copies in the recomputed layer, the no-grad reference and old-policy
passes (smaller than the policy's), and the vLLM backend (it reserves vllm_gpu_memory_utilization of the GPU
for its own weights and KV cache instead).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_core.config import ConfigError, PipelineConfig, load_config
from grpo_core.model.loading import LoraConfig
from grpo_core.model.logprobs import DEFAULT_CHUNK_SIZE
from grpo_core.train.compute_weights import ALL_REDUCE_BUCKET_NUMEL, uses_compute_weights

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = Path("configs/gsm8k-qwen2.5-0.5b.yaml")
DOCS_PATH = REPO_ROOT / "docs" / "scaling.md"
DOCS_START, DOCS_END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"
GIB = 2**30

# Bytes per trainable parameter (full fine-tuning and LoRA adapters alike), and per trainable tensor.
MASTER_BYTES = 4          # float32 master weights
GRADIENT_BYTES = 4        # float32 gradients
ADAMW_BYTES = 8           # exp_avg + exp_avg_sq, float32
ADAMW_STEP_BYTES = 4      # AdamW's float32 ``step`` scalar, one per parameter tensor
DDP_BUCKET_BYTES = 4      # DDP's float32 gradient buckets (gradient_as_bucket_view=False)
FLOAT32_BYTES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

CHUNK_FLOAT32_COPIES = 3          # upcast logits, log-softmax, p*log p of one chunk
FSDP_GATHERED_LAYERS = 2          # the layer computing and the one prefetched
FSDP_WORLD_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 decoder's sizes: enough to count its parameters, activations and KV cache."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf_config(cls, config, name: str = "") -> ModelShape:
        """The shape of a transformers Qwen2Config (for checking against a real model)."""
        return cls(name or config.model_type, config.hidden_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                   config.vocab_size, bool(config.tie_word_embeddings))


QWEN25 = (
    ModelShape("Qwen2.5-0.5B", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
               tied=True),
    ModelShape("Qwen2.5-1.5B", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
               tied=True),
    ModelShape("Qwen2.5-7B", hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
               tied=False),
)


# ---------------------------------------------------------------------------------------------------
# Parameter counts


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer."""
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"q_proj": (shape.hidden, q_width), "k_proj": (shape.hidden, kv_width),
            "v_proj": (shape.hidden, kv_width), "o_proj": (q_width, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate), "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden)}


BIASED = ("q_proj", "k_proj", "v_proj")  # Qwen2: q/k/v have biases, o and the MLP none


def layer_linear_count(shape: ModelShape) -> int:
    """Parameters of one decoder layer's linear layers (weights and biases)."""
    linears = linear_shapes(shape)
    return sum(i * o for i, o in linears.values()) + sum(linears[n][1] for n in BIASED)


def layer_parameter_count(shape: ModelShape) -> int:
    """One decoder layer: its linear layers and its two RMSNorms."""
    return layer_linear_count(shape) + 2 * shape.hidden


def root_parameter_count(shape: ModelShape) -> int:
    """Everything outside the decoder layers: embeddings, final norm, and the LM head unless tied."""
    embedding = shape.vocab * shape.hidden
    return embedding + shape.hidden + (0 if shape.tied else embedding)


def parameter_count(shape: ModelShape) -> int:
    """``sum(p.numel() for p in model.parameters())`` of a transformers Qwen2ForCausalLM of this shape."""
    return root_parameter_count(shape) + shape.layers * layer_parameter_count(shape)


def parameter_tensor_count(shape: ModelShape) -> int:
    """Parameter tensors: 7 weights, 3 biases and 2 norms a layer; embeddings, final norm, untied head."""
    per_layer = len(linear_shapes(shape)) + len(BIASED) + 2
    return shape.layers * per_layer + 2 + (0 if shape.tied else 1)


def autocast_cast_count(shape: ModelShape) -> int:
    """Parameters autocast casts in a forward: every linear layer's, the LM head's
    (the tied embedding too)."""
    return shape.layers * layer_linear_count(shape) + shape.vocab * shape.hidden


def lora_parameter_count(shape: ModelShape, rank: int) -> int:
    """Adapter parameters: A (r x in) and B (out x r) on each linear layer of each decoder layer."""
    return shape.layers * sum(rank * (i + o) for i, o in linear_shapes(shape).values())


def lora_tensor_count(shape: ModelShape) -> int:
    return shape.layers * 2 * len(linear_shapes(shape))


def training_state_bytes(parameters: int, tensors: int) -> int:
    """Trainable float32 weights, gradients and AdamW state (its step scalars included)."""
    return (MASTER_BYTES + GRADIENT_BYTES + ADAMW_BYTES) * parameters + ADAMW_STEP_BYTES * tensors


# ---------------------------------------------------------------------------------------------------
# Recipe and strategies


@dataclass(frozen=True)
class Recipe:
    """What of a training recipe sets memory: the batch shape and the precisions."""

    rows: int                      # per_device_train_batch_size: rows of one micro-batch
    steps_per_generation: int      # micro-batches one round feeds: rows per round = rows x this
    prompt_tokens: int
    completion_tokens: int
    beta: float
    gradient_checkpointing: bool
    mixed_precision: str           # "no", "bf16", "fp16"
    model_dtype: str               # "float32", "bfloat16", "float16"
    fused_lm_head: bool
    lora_rank: int

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> Recipe:
        t, prompt_length = cfg.train, cfg.data.max_prompt_length
        if prompt_length is None:
            raise ConfigError("data.max_prompt_length: null (any length); the plan needs a prompt length")
        # A recipe without LoRA is planned at the LoRA recipe's rank (grpo_core.config.LoraConfig's default).
        lora = cfg.model.lora or LoraConfig()
        return cls(t.batch.per_device_train_batch_size, t.batch_plan.micro_batches_per_round, prompt_length,
                   cfg.generation.max_completion_length, t.loss.beta, t.forward.gradient_checkpointing,
                   t.forward.mixed_precision, cfg.model.dtype, t.forward.fused_lm_head, lora.r)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch at its longest."""
        return self.rows * (self.prompt_tokens + self.completion_tokens)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.model_dtype]


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str         # "single", "ddp", "fsdp2", "lora"
    processes: int

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp2"


# DDP's memory per process is the same for any N > 1 (2 stands for them all); one GPU has no DDP buckets.
STRATEGIES = (Strategy("1 GPU", "single", 1), Strategy("DDP", "ddp", 2),
              *(Strategy(f"FSDP2 N={n}", "fsdp2", n) for n in FSDP_WORLD_SIZES),
              Strategy("LoRA, DDP", "lora", 2))


def has_compute_copy(recipe: Recipe, strategy: Strategy) -> bool:
    """Whether the trainer runs on a bf16 copy of the float32 masters (the trainer's own rule)."""
    return uses_compute_weights(recipe.mixed_precision, lora=strategy.kind == "lora", quantized=False,
                                sharded=strategy.sharded)


def compute_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """Bytes of the dtype the matmuls run in."""
    if recipe.mixed_precision in ("bf16", "fp16"):
        return 2
    return recipe.dtype_bytes if strategy.kind == "lora" else MASTER_BYTES


def residual_bytes(recipe: Recipe, strategy: Strategy) -> int:
    """Bytes of the residual stream (and of the KV cache it feeds): the embedding's dtype as it runs."""
    if strategy.kind == "lora":
        return recipe.dtype_bytes            # the frozen base embedding, model.dtype
    if strategy.sharded or has_compute_copy(recipe, strategy):
        return compute_bytes(recipe, strategy)  # FSDP2's param_dtype casts the embedding too;
                                                # the copy is all bf16
    return MASTER_BYTES                      # autocast leaves the float32 embedding as it is


# ---------------------------------------------------------------------------------------------------
# The terms


@dataclass(frozen=True)
class MemoryRow:
    """One model under one strategy: bytes per process."""

    model: str
    strategy: str
    parameters: int
    training_state: int    # trainable weights, gradients, AdamW (and DDP buckets); LoRA's frozen base too
    reference: int
    replica: int
    transient_weights: int
    activations: int
    logits: int
    kv_cache: int

    @property
    def persistent(self) -> int:
        return self.training_state + self.reference + self.replica

    @property
    def bytes_per_parameter(self) -> float:
        return self.persistent / self.parameters

    @property
    def total(self) -> int:
        # the rollout and the micro-batches take turns: the larger of the two counts
        return self.persistent + self.transient_weights + max(self.activations + self.logits, self.kv_cache)


def state_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    params, tensors = parameter_count(shape), parameter_tensor_count(shape)
    if strategy.kind == "lora":
        adapters = lora_parameter_count(shape, recipe.lora_rank)
        frozen = recipe.dtype_bytes * params
        return frozen + training_state_bytes(adapters, lora_tensor_count(shape)) + DDP_BUCKET_BYTES * adapters
    if strategy.sharded:
        # the step scalars are per tensor, on every process
        sharded = (MASTER_BYTES + GRADIENT_BYTES + ADAMW_BYTES) * params // strategy.processes
        return sharded + ADAMW_STEP_BYTES * tensors
    ddp_wrapped = strategy.processes > 1 and not has_compute_copy(recipe, strategy)
    buckets = DDP_BUCKET_BYTES * params if ddp_wrapped else 0
    return training_state_bytes(params, tensors) + buckets


def reference_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    if recipe.beta == 0 or strategy.kind == "lora":  # LoRA's reference is the adapter-off view
        return 0
    whole = recipe.dtype_bytes * parameter_count(shape)
    return whole // strategy.processes if strategy.sharded else whole


def replica_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    """The whole copy rollouts sample from: FSDP2's, the bf16 compute copy (which training runs on too), and
    full fine-tuning's with a half-precision model.dtype (grpo_core/train/policy.py samples_from_a_cast_copy);
    LoRA and full float32 sample from the policy itself."""
    if has_compute_copy(recipe, strategy):
        return compute_bytes(recipe, strategy) * parameter_count(shape)
    cast_copy = strategy.kind != "lora" and recipe.dtype_bytes != MASTER_BYTES
    return recipe.dtype_bytes * parameter_count(shape) if strategy.sharded or cast_copy else 0


def transient_weight_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    compute = compute_bytes(recipe, strategy)
    if strategy.sharded:
        root, layer = root_parameter_count(shape), layer_parameter_count(shape)
        weights = compute * (root + FSDP_GATHERED_LAYERS * layer)
        gradients = compute * (root + layer)  # unsharded, in the compute dtype, until their reduce-scatter
        # under bf16 a layer's gradient is copied to float32 for the reduce; the root's copy comes after the
        # backward, when the activations and logits are gone
        reduce_copy = FLOAT32_BYTES * layer if compute != FLOAT32_BYTES else 0
        return weights + gradients + reduce_copy
    if recipe.mixed_precision == "no":
        return 0
    if has_compute_copy(recipe, strategy):  # no autocast; DDP: the float32 all-reduce bucket
        bucket = FLOAT32_BYTES * min(parameter_count(shape), ALL_REDUCE_BUCKET_NUMEL)
        return bucket if strategy.processes > 1 else 0
    if strategy.kind == "lora":  # the base is already in model.dtype; only the float32 adapters are cast
        return compute * lora_parameter_count(shape, recipe.lora_rank)
    return compute * autocast_cast_count(shape)


def layer_activation_elements(shape: ModelShape) -> int:
    """Per token, the elements one Qwen2 decoder layer keeps for its backward: 9 of the hidden size (both
    RMSNorms' inputs and outputs, q before and after RoPE, k and v repeated to every head by repeat_kv, the
    attention output), 4 of the MLP's width (the gate and up projections, SiLU(gate), their product) and k and
    v before the repeat."""
    return 9 * shape.hidden + 4 * shape.intermediate + 2 * shape.kv_heads * shape.head_dim


def activation_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    one_layer = layer_activation_elements(shape) * compute_bytes(recipe, strategy)
    if not recipe.gradient_checkpointing:
        return recipe.tokens * shape.layers * one_layer
    # each layer's input, the final norm's input, and one layer recomputed in the backward
    stored = (shape.layers + 1) * shape.hidden * residual_bytes(recipe, strategy)
    return recipe.tokens * (stored + one_layer)


def fused_head_runs(recipe: Recipe, strategy: Strategy) -> bool:
    """Whether the trainer applies the LM head chunk by chunk (``logprobs.scoring_head``): whenever
    train.fused_lm_head asks, on one GPU, DDP, FSDP2 and LoRA alike (the head scores inside the wrapped
    forward)."""
    return recipe.fused_lm_head


def logits_dtype_bytes(recipe: Recipe, strategy: Strategy) -> int:
    if recipe.mixed_precision != "no" and not (strategy.sharded or has_compute_copy(recipe, strategy)):
        return FLOAT32_BYTES  # accelerate's convert_outputs_to_fp32 (autocast); the bf16 copy returns bf16
    return compute_bytes(recipe, strategy)


def logits_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    chunk = CHUNK_FLOAT32_COPIES * DEFAULT_CHUNK_SIZE * shape.vocab * FLOAT32_BYTES
    if fused_head_runs(recipe, strategy):
        return chunk
    # one more position than completion tokens (logits_to_keep = C + 1); kept for backward, and the gradient
    logits = recipe.rows * (recipe.completion_tokens + 1) * shape.vocab * logits_dtype_bytes(recipe, strategy)
    return 2 * logits + chunk


def kv_cache_bytes(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> int:
    rows = recipe.rows * recipe.steps_per_generation
    # the bf16 compute copy samples in bf16; every other sampler runs in model.dtype, outside autocast: the
    # FSDP2 replica, full fine-tuning's cast copy (or the float32 policy itself when model.dtype is float32),
    # LoRA's base
    sampler_bytes = (compute_bytes(recipe, strategy) if has_compute_copy(recipe, strategy)
                     else recipe.dtype_bytes)
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * sampler_bytes
    return rows * (recipe.prompt_tokens + recipe.completion_tokens) * per_token


def memory_row(shape: ModelShape, recipe: Recipe, strategy: Strategy) -> MemoryRow:
    return MemoryRow(
        model=shape.name, strategy=strategy.name, parameters=parameter_count(shape),
        training_state=state_bytes(shape, recipe, strategy),
        reference=reference_bytes(shape, recipe, strategy), replica=replica_bytes(shape, recipe, strategy),
        transient_weights=transient_weight_bytes(shape, recipe, strategy),
        activations=activation_bytes(shape, recipe, strategy), logits=logits_bytes(shape, recipe, strategy),
        kv_cache=kv_cache_bytes(shape, recipe, strategy))


def plan(recipe: Recipe, shapes=QWEN25, strategies=STRATEGIES) -> list[MemoryRow]:
    return [memory_row(shape, recipe, strategy) for shape in shapes for strategy in strategies]


# ---------------------------------------------------------------------------------------------------
# Rendering


COLUMNS = ("model", "strategy", "params (B)", "bytes/param", "weights+grads+AdamW", "reference", "replica",
           "transient weights", "activations", "logits", "KV cache", "total")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def table_row(row: MemoryRow) -> list[str]:
    return [row.model, row.strategy, f"{row.parameters / 1e9:.3f}", f"{row.bytes_per_parameter:.2f}",
            _gib(row.training_state), _gib(row.reference), _gib(row.replica), _gib(row.transient_weights),
            _gib(row.activations), _gib(row.logits), _gib(row.kv_cache), f"**{_gib(row.total)}**"]


def render_table(rows: list[MemoryRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 2 + "--:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(table_row(row)) + " |" for row in rows]
    return "\n".join(lines)


def render(rows: list[MemoryRow], config_name: str) -> str:
    """The table under the one line that says how it was made and how to read it."""
    header = (f"`python -m benchmarks.memory_plan --write-docs` regenerates this table from `{config_name}`: "
              "GiB per process (DDP and LoRA: any N > 1); total = weights+grads+AdamW + reference + replica "
              "+ transient + max(activations + logits, KV cache); "
              "the model of memory is in the script's docstring.")
    return f"{header}\n\n{render_table(rows)}"


def display_name(config: Path) -> str:
    """The recipe's path relative to the repo root when it is inside it (stable whatever the cwd)."""
    try:
        return config.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(config)


def rendering_for(config: Path) -> str:
    """What the script prints (and writes into the docs) for a recipe."""
    cfg = load_config(config)  # its errors name the file
    try:
        recipe = Recipe.from_config(cfg)
    except ConfigError as err:
        raise ConfigError(f"{config}: {err}") from err
    return render(plan(recipe), display_name(config))


# ---------------------------------------------------------------------------------------------------
# The docs region


def docs_region(text: str) -> str:
    """What stands between the markers (stripped)."""
    start, end = _marker_positions(text)
    return text[start + len(DOCS_START):end].strip()


def replace_docs_region(text: str, rendering: str) -> str:
    start, end = _marker_positions(text)
    return f"{text[:start + len(DOCS_START)]}\n{rendering}\n{text[end:]}"


def _marker_positions(text: str) -> tuple[int, int]:
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"{DOCS_PATH}: expected the markers {DOCS_START} ... {DOCS_END} in this order")
    return start, end


def write_docs(rendering: str, path: Path = DOCS_PATH) -> None:
    path.write_text(replace_docs_region(path.read_text(encoding="utf-8"), rendering), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / DEFAULT_CONFIG,
                        help="the recipe whose batch shape and precisions to plan for (default "
                             f"{DEFAULT_CONFIG})")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"also write the table into {DOCS_PATH.relative_to(REPO_ROOT)} between its "
                             "markers")
    args = parser.parse_args(argv)
    try:
        rendering = rendering_for(args.config)
    except ConfigError as err:  # a missing or malformed recipe: the message names the file
        parser.error(str(err))
    print(rendering)
    if args.write_docs:
        write_docs(rendering)
    return 0


if __name__ == "__main__":
    sys.exit(main())
