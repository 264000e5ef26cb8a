"""reasoning-gym's procedural tasks as a data source: params.yaml's ``reasoning_gym:`` section, and the train
and held-out splits the prepare stage writes from it.

    tasks (name, generator config, weight) -> each split's share per task (largest remainder of the weights)
      -> held-out first: entries drawn from each task's generator under eval_seed, duplicates skipped
      -> train: drawn under seed, duplicates and every held-out prompt skipped
      -> each split shuffled -> <data_dir>/{train,eval}.jsonl + summary.json (what each task yielded)

A task's generator gives entry ``i`` of seed ``s`` from ``Random(s + i)``, so two nearby seeds share almost
every entry; each (split, seed, task) stream is therefore seeded with a hash of the three, never with the seed
itself. Generators repeat themselves at easy levels: a task is drawn until its share holds that many distinct
prompts (the key validate's duplicate and overlap checks use), at most ``draws_per_prompt`` times its share; a
task that runs out gives fewer rows, and the summary says how many distinct prompts its config yielded in how
many draws. Rows carry what the scorer reads (``grpo_core/rewards/reasoning_gym.py``). Deterministic: the same
config writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.common.files import write_json_atomic, write_jsonl_atomic
from grpo_core.common.options import ConfigError, Options, option
from grpo_core.common.text import text_key

#: the columns a reasoning-gym row adds to prompt and answer, what its task's scorer reads
#: (grpo_core/rewards/reasoning_gym.py): the dataset name, its generator config (JSON), the entry's metadata
TASK_COLUMN, CONFIG_COLUMN, METADATA_COLUMN = "task", "task_config", "metadata"
# plain JSON turns tuples into lists and int keys into strings; some scorers compare against either
_TUPLE, _ITEMS = "__tuple__", "__items__"

#: generator keys this section sets for every task, and where
RESERVED_KEYS = {"seed": "reasoning_gym.seed / eval_seed", "size": "reasoning_gym.train_size / eval_size"}
SUMMARY_FILE = "summary.json"


def require_reasoning_gym():
    """The reasoning_gym package, or an ImportError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError("reasoning-gym tasks need the reasoning-gym package: pip install -e "
                          "'.[reasoning-gym]' (make setup installs it)") from err
    return reasoning_gym


def encode_value(value: Any) -> Any:
    """``value`` as plain JSON data that ``decode_value`` turns back into what it was: tuples and mappings
    with keys other than strings are tagged. Raises TypeError on anything JSON cannot hold (sets, objects)."""
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TUPLE, _ITEMS} & value.keys():
            return {k: encode_value(v) for k, v in value.items()}
        return {_ITEMS: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"{type(value).__name__} {str(value)[:60]!r} has no JSON form")


def decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if value.keys() == {_TUPLE}:
            return tuple(decode_value(v) for v in value[_TUPLE])
        if value.keys() == {_ITEMS}:
            return {decode_value(k): decode_value(v) for k, v in value[_ITEMS]}
        return {k: decode_value(v) for k, v in value.items()}
    return value


@dataclass
class ReasoningGymTask(Options):
    """One task of the mix: a reasoning-gym generator, its config and its share of each split."""

    name: str = option("", "a reasoning-gym dataset name, e.g. chain_sum (reasoning_gym.factory.DATASETS)")
    config: dict = option({}, "the generator's config keys, e.g. {min_terms: 2, max_terms: 4} (its config "
                          "dataclass's fields; seed and size are this section's)")
    weight: float = option(1.0, "the task's share of each split: weight / the sum of the weights", gt=0)

    def check(self) -> None:
        if not self.name:
            raise ConfigError("name: required: a reasoning-gym dataset name, e.g. chain_sum")


@dataclass
class ReasoningGymConfig(Options):
    """params.yaml `reasoning_gym:` (the prepare stage): train and held-out prompts from reasoning-gym's
    generators, scored by the ``reasoning_gym`` reward; null = not used."""

    tasks: list[ReasoningGymTask] = option([], "the tasks mixed into both splits: {name, config, weight}")
    train_size: int = option(1000, "training prompts (fewer when the tasks yield fewer distinct ones)", ge=1)
    eval_size: int = option(200, "held-out prompts, none of them a training prompt", ge=1)
    seed: int = option(0, "seed of the training prompts' generators")
    eval_seed: int = option(1, "seed of the held-out prompts' generators; differs from seed")
    draws_per_prompt: int = option(10, "entries a task may draw per prompt of its share before it counts as "
                                   "run out of distinct prompts", ge=1)

    def check(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks: empty; name at least one reasoning-gym task, e.g. [{name: chain_sum}]")
        if self.seed == self.eval_seed:
            raise ConfigError(f"eval_seed: {self.eval_seed}, the same as seed; the held-out prompts need "
                              "generators of their own")


def _datasets() -> dict[str, tuple[type, type]]:
    try:
        require_reasoning_gym()
    except ImportError as err:
        raise ConfigError(f"reasoning_gym: {err}") from err
    from reasoning_gym.factory import DATASETS

    return DATASETS


def check_task(task: ReasoningGymTask, key: str) -> None:
    """A task reasoning-gym has, with config keys its generator takes and values it accepts; errors name
    ``key`` (``reasoning_gym.tasks[i]``) and the reason."""
    datasets = _datasets()
    if task.name == "composite":
        raise ConfigError(f"{key}.name: 'composite' mixes tasks itself; list each of them here with its "
                          "weight instead")
    if task.name not in datasets:
        close = difflib.get_close_matches(task.name, list(datasets), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"it has {len(datasets)}"
        raise ConfigError(f"{key}.name: reasoning-gym has no task {task.name!r}; {hint} "
                          "(reasoning_gym.factory.DATASETS lists them)")
    fields = [f.name for f in dataclasses.fields(datasets[task.name][1]) if f.name not in RESERVED_KEYS]
    for name in task.config:
        if name in RESERVED_KEYS:
            raise ConfigError(f"{key}.config.{name}: set for every task by {RESERVED_KEYS[name]}")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(fields)}"
            raise ConfigError(f"{key}.config.{name}: {task.name}'s generator takes no such key; {hint}")
    _generator(task, key, seed=0, size=1)


def _generator(task: ReasoningGymTask, key: str, seed: int, size: int):
    """The task's dataset; a value its config refuses (reasoning-gym asserts) is an error naming the key."""
    rg = require_reasoning_gym()
    try:
        return rg.create_dataset(task.name, size=size, seed=seed, **task.config)
    except (AssertionError, TypeError, ValueError) as err:
        raise ConfigError(f"{key}.config: {task.name} refuses {task.config}: {err or type(err).__name__}") \
            from err


def shares(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: floors, then the remainder one each to the largest
    fractions (ties to the earlier task), so the shares sum to ``total`` exactly."""
    exact = [total * w / sum(weights) for w in weights]
    out = [int(x) for x in exact]
    by_fraction = sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_fraction[:total - sum(out)]:
        out[i] += 1
    return out


def stream_seed(split: str, seed: int, index: int | str) -> int:
    """A generator seed for one (split, seed, task) stream, far from every other stream's entries."""
    digest = hashlib.sha256(f"reasoning_gym:{split}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def task_row(task: ReasoningGymTask, entry: dict[str, Any], key: str) -> dict[str, Any]:
    """A data row: the question as the prompt, the reference answer, and what the scorer reads."""
    if entry.get("answer") is None:
        raise ConfigError(f"{key}.name: {task.name}'s entries have no reference answer (its scorer checks a "
                          "solution itself), which validate's gold check and evaluate's accuracy need")
    try:
        metadata = json.dumps(encode_value(entry.get("metadata", {})))
    except TypeError as err:
        raise ConfigError(f"{key}.name: {task.name}'s entry metadata cannot be stored: {err}") from err
    return {"prompt": entry["question"], "answer": str(entry["answer"]), TASK_COLUMN: task.name,
            CONFIG_COLUMN: json.dumps(task.config, sort_keys=True), METADATA_COLUMN: metadata}


def draw_task(task: ReasoningGymTask, key: str, share: int, seed: int, max_draws: int, seen: set[str],
              held_out: frozenset[str]) -> tuple[list[dict], dict[str, Any]]:
    """Up to ``share`` rows of distinct prompts from one task's stream, none in ``seen`` (this split's, which
    it extends) or ``held_out``; and what the draws gave."""
    stats = {"asked": share, "rows": 0, "drawn": 0, "duplicates": 0, "held_out": 0}
    rows: list[dict] = []
    dataset = _generator(task, key, seed, max(1, max_draws)) if share else None
    for index in range(max_draws if share else 0):
        entry = dataset[index]
        stats["drawn"] += 1
        prompt = text_key(entry["question"])
        if prompt in held_out:
            stats["held_out"] += 1
        elif prompt in seen:
            stats["duplicates"] += 1
        else:
            seen.add(prompt)
            rows.append(task_row(task, entry, key))
            if len(rows) == share:
                break
    stats["rows"] = len(rows)
    stats["ran_out"] = len(rows) < share
    return rows, stats


def build_split(cfg: ReasoningGymConfig, split: str, held_out: frozenset[str] = frozenset()
                ) -> tuple[list[dict], dict[str, dict]]:
    """One split's rows, shuffled, and each task's draw statistics (keyed by task name, ``name#i`` for a task
    listed twice)."""
    seed, size = (cfg.seed, cfg.train_size) if split == "train" else (cfg.eval_seed, cfg.eval_size)
    names = [t.name for t in cfg.tasks]
    rows, stats, seen = [], {}, set()
    for i, (task, share) in enumerate(zip(cfg.tasks, shares(size, [t.weight for t in cfg.tasks]))):
        got, drawn = draw_task(task, f"reasoning_gym.tasks[{i}]", share, stream_seed(split, seed, i),
                               share * cfg.draws_per_prompt, seen, held_out)
        rows += got
        stats[task.name if names.count(task.name) == 1 else f"{task.name}#{i}"] = drawn
    random.Random(stream_seed(split, seed, "order")).shuffle(rows)  # tasks interleaved: eval's first N mix
    if not rows:
        raise ConfigError(f"reasoning_gym: the {split} split is empty: {_shortfall(stats)}")
    return rows, stats


def _shortfall(stats: dict[str, dict]) -> str:
    return "; ".join(f"{name} gave {s['rows']} of {s['asked']} ({s['drawn']} drawn: {s['duplicates']} "
                     f"repeats, {s['held_out']} held-out prompts)" for name, s in stats.items())


def prepare_reasoning_gym(cfg: ReasoningGymConfig, data_dir: str | Path,
                          log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Check every task, then write ``<data_dir>/train.jsonl``, ``eval.jsonl`` and ``summary.json`` (per split
    and task: rows asked and written, entries drawn, repeats and held-out prompts skipped, whether the task
    ran out of distinct prompts). Returns the summary."""
    for i, task in enumerate(cfg.tasks):
        check_task(task, f"reasoning_gym.tasks[{i}]")
    evaluation, eval_stats = build_split(cfg, "eval")
    held_out = frozenset(text_key(r["prompt"]) for r in evaluation)
    train, train_stats = build_split(cfg, "train", held_out)
    data_dir = Path(data_dir)
    write_jsonl_atomic(data_dir / "train.jsonl", train)
    write_jsonl_atomic(data_dir / "eval.jsonl", evaluation)
    summary = {"num_train": len(train), "num_eval": len(evaluation),
               "tasks": {"train": train_stats, "eval": eval_stats}}
    write_json_atomic(data_dir / SUMMARY_FILE, summary)
    if log is not None:
        for split, stats in (("eval", eval_stats), ("train", train_stats)):
            short = {n: s for n, s in stats.items() if s["ran_out"]}
            if short:
                log(f"prepare: warning: {split} split short of distinct prompts: {_shortfall(short)}")
        log(f"prepare: reasoning-gym {len(train)} train / {len(evaluation)} eval prompts from "
            f"{', '.join(t.name for t in cfg.tasks)} ({data_dir / SUMMARY_FILE})")
    return summary
