"""`prepare`: the embedded default's data, tokenizer, tiny base model and warm start, written atomically."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_core.common.files import write_dir_atomic, write_jsonl_atomic
from grpo_core.embedded import tool_tasks
from grpo_core.embedded.config import EmbeddedConfig
from grpo_core.embedded.model import build_model
from grpo_core.embedded.tasks import TEMPLATES, generate_splits, template_noise, vocabulary_words
from grpo_core.embedded.tokenizer import build_tokenizer, build_tool_tokenizer
from grpo_core.embedded.tool_tasks import TASK as TOOL_TASK
from grpo_core.embedded.tools import calculator
from grpo_core.embedded.warm_start import build_demonstrations, warm_start

METADATA_FILE = "embedded.json"


# Where the outputs go is not what they are: kept out of the metadata, so the folder's bytes (and DVC's hash
# of it) are the same in every clone, wherever it lives.
_LOCATION_KEYS = ("data_dir", "model_dir")


def _config_dict(cfg: Any) -> dict[str, Any]:
    values = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(EmbeddedConfig)}
    return {k: v for k, v in values.items() if k not in _LOCATION_KEYS}


def prepare(cfg: EmbeddedConfig, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Write `<data_dir>/{train,eval}.jsonl` and `<model_dir>/` (safetensors model + tokenizer).

    Rows are `{"prompt", "answer", "task"}` (prompt: text for the word problems, chat messages for the
    calculator task). Deterministic in `cfg.seed`: the data byte for byte, the weights bit for bit on CPU with
    the same thread count. Returns a summary: sizes, warm-start losses, seconds.
    """
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        return _prepare(cfg, log)
    finally:
        torch.set_num_threads(threads)  # leave the caller's process as it was


@dataclass
class TaskSuite:
    """What `prepare` builds for `cfg.tasks`: the problems, the tokenizer that writes them, the tools the chat
    template shows (empty for the word problems) and the number of templates (one wrong-variant rate each)."""

    train: list[Any]
    evaluation: list[Any]
    tokenizer: PreTrainedTokenizerBase
    tools: list[Callable]
    num_templates: int


def task_suite(cfg: EmbeddedConfig) -> TaskSuite:
    """The word problems (arithmetic, multiple_choice; text prompts), or the calculator task (chat prompts and
    a tool-calling chat template)."""
    if TOOL_TASK in cfg.tasks:
        if len(cfg.tasks) > 1:
            raise ValueError(f"embedded.tasks: {cfg.tasks}; {TOOL_TASK} has chat prompts and a tool, the "
                             "word problems neither: it cannot be mixed with them")
        train, evaluation = tool_tasks.generate_splits(cfg.num_train, cfg.num_eval, cfg.max_operand, cfg.seed)
        tools: list[Callable] = [calculator]
        tokenizer = build_tool_tokenizer(tool_tasks.vocabulary_words(), tool_tasks.scaffold_conversations(),
                                         tools)
        return TaskSuite(train, evaluation, tokenizer, tools, len(tool_tasks.TEMPLATES))
    train, evaluation = generate_splits(
        cfg.num_train, cfg.num_eval, cfg.tasks, cfg.max_operand, cfg.seed, cfg.shuffle_options
    )
    return TaskSuite(train, evaluation, build_tokenizer(vocabulary_words()), [], len(TEMPLATES))


def _prepare(cfg: EmbeddedConfig, log: Callable[[str], None] | None) -> dict[str, Any]:
    start = time.perf_counter()
    suite = task_suite(cfg)
    train, evaluation, tokenizer = suite.train, suite.evaluation, suite.tokenizer
    data_dir = Path(cfg.data_dir)
    write_jsonl_atomic(data_dir / "train.jsonl", (p.row() for p in train))
    write_jsonl_atomic(data_dir / "eval.jsonl", (p.row() for p in evaluation))

    model = build_model(
        tokenizer,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        seed=cfg.seed,
    )
    rates = template_noise(cfg.label_noise, cfg.label_noise_spread, suite.num_templates)
    demos = build_demonstrations(train, tokenizer, rates, suite.tools)
    stats = warm_start(
        model,
        demos,
        steps=cfg.warm_start_steps,
        batch_size=cfg.warm_start_batch_size,
        learning_rate=cfg.warm_start_learning_rate,
        format_noise=cfg.format_noise,
        seed=cfg.seed,
        log=log,
    )
    summary: dict[str, Any] = {
        "num_train": len(train),
        "num_eval": len(evaluation),
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "template_wrong_op_rates": [round(r, 4) for r in rates],
        "warm_start_steps": cfg.warm_start_steps,
        "warm_start_first_loss": stats["first_loss"],
        "warm_start_final_loss": stats["final_loss"],
        "warm_start_seconds": stats["seconds"],
    }

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Timings stay out of the saved metadata, so the folder's bytes depend only on the config.
        meta = {
            "config": _config_dict(cfg),
            "summary": {k: v for k, v in summary.items() if "seconds" not in k},
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    write_dir_atomic(cfg.model_dir, fill)
    summary["seconds"] = time.perf_counter() - start
    if log is not None:
        log(
            f"prepare: {len(train)} train / {len(evaluation)} eval prompts, {summary['num_parameters']:,} "
            f"parameters, warm-start loss {stats['final_loss']:.4f}, {summary['seconds']:.1f}s"
        )
    return summary
