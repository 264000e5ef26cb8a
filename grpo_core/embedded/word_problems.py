"""The embedded word problems as plain data files for a chat model:
``python -m grpo_core.embedded.word_problems``.

Writes ``train.jsonl`` and ``eval.jsonl`` ({"prompt", "answer", "task"} rows, no prompt in both) into a
folder, deterministic in its arguments; configs/smollm2-135m-word-problems.yaml trains on the committed
data/word-problems/ this wrote with its defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from grpo_core.common.files import write_jsonl_atomic
from grpo_core.embedded.tasks import generate_splits


def write_word_problems(folder: Path, num_train: int, num_eval: int, max_operand: int, seed: int) -> None:
    train, evaluation = generate_splits(num_train, num_eval, ["arithmetic"], max_operand, seed)
    write_jsonl_atomic(folder / "train.jsonl", (p.row() for p in train))
    write_jsonl_atomic(folder / "eval.jsonl", (p.row() for p in evaluation))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grpo_core.embedded.word_problems", description=__doc__)
    parser.add_argument("folder", nargs="?", default="data/word-problems")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-eval", type=int, default=400)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_word_problems(Path(args.folder), args.num_train, args.num_eval, args.max_operand, args.seed)


if __name__ == "__main__":
    main()
