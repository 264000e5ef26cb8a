"""reasoning-gym's procedural tasks as a data source: params.yaml's ``reasoning_gym:`` section, and the train
and held-out splits the prepare stage writes from it.

    tasks (name, generator config, weight) -> each split's share per task (largest remainder of the weights)
      -> held-out first: entries drawn from each task's generator under eval_seed, duplicates skipped
      -> train: drawn under seed, duplicates and every held-out prompt skipped; a task with levels draws its
         share at each level (its own stream per level), each row tagged with its ``level``
      -> each split shuffled -> <data_dir>/{train,eval}.jsonl + summary.json (what each task yielded)

A task's levels (``levels``: config overlays; or ``curriculum_levels``: reasoning-gym's own curriculum) are
easier configs to train on first; ``train.curriculum`` (grpo_core/train/curriculum.py) moves each task up
them. The held-out split is always drawn at the task's ``config``, the target.

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
#: a train row's level (int, 0 = the easiest) when some task has levels; what train.curriculum reads
LEVEL_COLUMN = "level"
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
    levels: list[dict] = option([], "training levels, easiest first: each a config overlay merged over "
                                "config, e.g. [{min_digits: 1, max_digits: 1}, {}] ({} = config itself); the "
                                "train split draws the task's share at each level, the held-out split at "
                                "config")
    curriculum_levels: int = option(0, "instead of levels: levels 0..n-1 of reasoning-gym's own curriculum "
                                    "for the task (config's keys the curriculum does not set pass through)",
                                    ge=0)

    def check(self) -> None:
        if not self.name:
            raise ConfigError("name: required: a reasoning-gym dataset name, e.g. chain_sum")
        if self.levels and self.curriculum_levels:
            raise ConfigError(f"curriculum_levels: {self.curriculum_levels}, set together with levels; say a "
                              "task's levels one way: your own overlays (levels) or reasoning-gym's "
                              "curriculum (curriculum_levels)")


@dataclass
class ReasoningGymConfig(Options):
    """params.yaml `reasoning_gym:` (the prepare stage): train and held-out prompts from reasoning-gym's
    generators, scored by the ``reasoning_gym`` reward; null = not used."""

    tasks: list[ReasoningGymTask] = option([], "the tasks mixed into both splits: {name, config, weight}")
    train_size: int = option(1000, "training prompts (fewer when the tasks yield fewer distinct ones); a "
                             "task with levels draws its share at each level", ge=1)
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


def check_task(task: ReasoningGymTask, key: str) -> list[dict]:
    """A task reasoning-gym has, with config keys its generator takes and values it accepts, and so each of
    its levels; errors name ``key`` (``reasoning_gym.tasks[i]``), the level and the reason. Returns the task's
    levels as whole generator configs, level 0 first ([] = none)."""
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
    _check_keys(task.name, task.config, f"{key}.config", fields)
    _generator(task.name, task.config, f"{key}.config", seed=0, size=1)
    if task.curriculum_levels:
        configs = _curriculum_configs(task, key, fields)
        where = [f"{key}.curriculum_levels (level {j})" for j in range(len(configs))]
    else:
        for j, overlay in enumerate(task.levels):
            _check_keys(task.name, overlay, f"{key}.levels[{j}]", fields)
        configs = [{**task.config, **overlay} for overlay in task.levels]
        where = [f"{key}.levels[{j}]" for j in range(len(configs))]
    for j, (config, at) in enumerate(zip(configs, where)):
        _generator(task.name, config, at, seed=0, size=1)
        if config in configs[:j]:
            raise ConfigError(f"{at}: the same generator config as level {configs.index(config)} ({config}); "
                              "each level needs a config of its own")
    return configs


def _check_keys(name: str, config: dict, where: str, fields: list[str]) -> None:
    """Every key of ``config`` (at ``where``) one that task ``name``'s generator takes and this section
    leaves to the task."""
    for key in config:
        if key in RESERVED_KEYS:
            raise ConfigError(f"{where}.{key}: set for every task by {RESERVED_KEYS[key]}")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(fields)}"
            raise ConfigError(f"{where}.{key}: {name}'s generator takes no such key; {hint}")


def _curriculum_configs(task: ReasoningGymTask, key: str, fields: list[str]) -> list[dict]:
    """Levels 0..curriculum_levels-1 of reasoning-gym's curriculum for the task: the keys the curriculum sets
    at each level, over the task's config (its other keys pass through)."""
    from reasoning_gym.factory import create_curriculum

    try:
        curriculum = create_curriculum(task.name)
    except ValueError as err:
        raise ConfigError(f"{key}.curriculum_levels: reasoning-gym has no curriculum for {task.name}; list "
                          f"its levels yourself ({key}.levels)") from err
    # the generator config fields the curriculum sets (a range attribute sets two)
    governed = {getattr(a, n) for a in curriculum.attributes.values()
                for n in ("lower_field_name", "upper_field_name", "field_name") if getattr(a, n, None)}
    configs = []
    for level in range(task.curriculum_levels):
        curriculum.set_global_level(level)
        try:
            generated = dataclasses.asdict(curriculum.generate_configuration(dict(task.config)))
        except (AssertionError, TypeError, ValueError) as err:
            raise ConfigError(f"{key}.curriculum_levels: {task.name}'s curriculum refuses level {level} over "
                              f"config {task.config}: {err or type(err).__name__}") from err
        config = {k: generated[k] for k in fields if k in task.config or k in governed}
        if json.loads(json.dumps(config)) != config:  # the task_config column, read back by the scorer
            raise ConfigError(f"{key}.curriculum_levels: {task.name}'s level {level} config {config} has no "
                              f"JSON form; list its levels yourself ({key}.levels)")
        configs.append(config)
    return configs


def _generator(name: str, config: dict, where: str, seed: int, size: int):
    """Task ``name``'s dataset under ``config``; a value it refuses (reasoning-gym asserts) is an error naming
    ``where`` (the config's key)."""
    rg = require_reasoning_gym()
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {name} refuses {config}: {err or type(err).__name__}") from err


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


def task_row(task: ReasoningGymTask, entry: dict[str, Any], key: str, level: int | None = None
             ) -> dict[str, Any]:
    """A data row: the question as the prompt, the reference answer, and what the scorer reads (the task's
    config: a level's when the task has levels); with ``level``, the row's level too."""
    if entry.get("answer") is None:
        raise ConfigError(f"{key}.name: {task.name}'s entries have no reference answer (its scorer checks a "
                          "solution itself), which validate's gold check and evaluate's accuracy need")
    try:
        metadata = json.dumps(encode_value(entry.get("metadata", {})))
    except TypeError as err:
        raise ConfigError(f"{key}.name: {task.name}'s entry metadata cannot be stored: {err}") from err
    row = {"prompt": entry["question"], "answer": str(entry["answer"]), TASK_COLUMN: task.name,
           CONFIG_COLUMN: json.dumps(task.config, sort_keys=True), METADATA_COLUMN: metadata}
    return row if level is None else {**row, LEVEL_COLUMN: level}


def draw_task(task: ReasoningGymTask, key: str, share: int, seed: int, max_draws: int, seen: set[str],
              held_out: frozenset[str], level: int | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Up to ``share`` rows of distinct prompts from one stream of ``task`` (at its config), none in ``seen``
    (this split's, which it extends) or ``held_out``; and what the draws gave. ``level``: the rows' level
    column (None: no column)."""
    stats = {"asked": share, "rows": 0, "drawn": 0, "duplicates": 0, "held_out": 0}
    rows: list[dict] = []
    dataset = _generator(task.name, task.config, f"{key}.config", seed, max(1, max_draws)) if share else None
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
            rows.append(task_row(task, entry, key, level))
            if len(rows) == share:
                break
    stats["rows"] = len(rows)
    stats["ran_out"] = len(rows) < share
    return rows, stats


def draw_levels(task: ReasoningGymTask, key: str, configs: list[dict], share: int, seeds: list[int],
                max_draws: int, seen: set[str], held_out: frozenset[str]
                ) -> tuple[list[dict], dict[str, Any]]:
    """``share`` rows at each level (``configs``, level 0 first; ``seeds`` one stream each), levels drawn in
    order and deduplicated against each other; the draws' statistics summed, and per level."""
    rows, per_level = [], []
    for level, (config, seed) in enumerate(zip(configs, seeds)):
        got, drawn = draw_task(dataclasses.replace(task, config=config), key, share, seed, max_draws, seen,
                               held_out, level)
        rows += got
        per_level.append({"level": level, "config": config, **drawn})
    counts = ("asked", "rows", "drawn", "duplicates", "held_out")
    stats = {k: sum(s[k] for s in per_level) for k in counts}
    return rows, {**stats, "ran_out": any(s["ran_out"] for s in per_level), "levels": per_level}


def build_split(cfg: ReasoningGymConfig, split: str, held_out: frozenset[str] = frozenset(),
                levels: Sequence[list[dict]] = ()) -> tuple[list[dict], dict[str, dict]]:
    """One split's rows, shuffled, and each task's draw statistics (keyed by task name, ``name#i`` for a task
    listed twice). levels (train): each task's level configs (``check_task``); when any task has some, every
    row gets a level column (0 for a task without)."""
    seed, size = (cfg.seed, cfg.train_size) if split == "train" else (cfg.eval_seed, cfg.eval_size)
    levels = list(levels) if split == "train" and any(levels) else [[] for _ in cfg.tasks]
    tagged = any(levels)
    names = [t.name for t in cfg.tasks]
    rows, stats, seen = [], {}, set()
    for i, (task, share) in enumerate(zip(cfg.tasks, shares(size, [t.weight for t in cfg.tasks]))):
        key, max_draws = f"reasoning_gym.tasks[{i}]", share * cfg.draws_per_prompt
        if levels[i]:
            got, drawn = draw_levels(task, key, levels[i], share,
                                     [stream_seed(split, seed, f"{i}:{j}") for j in range(len(levels[i]))],
                                     max_draws, seen, held_out)
        else:
            got, drawn = draw_task(task, key, share, stream_seed(split, seed, i), max_draws, seen, held_out,
                                   0 if tagged else None)
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
    ran out of distinct prompts; for a task with levels the same per level, with its config, under
    ``levels``). Returns the summary."""
    levels = [check_task(task, f"reasoning_gym.tasks[{i}]") for i, task in enumerate(cfg.tasks)]
    evaluation, eval_stats = build_split(cfg, "eval")
    held_out = frozenset(text_key(r["prompt"]) for r in evaluation)
    train, train_stats = build_split(cfg, "train", held_out, levels)
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
