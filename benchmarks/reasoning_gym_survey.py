"""How a base model does on reasoning-gym tasks and levels, before choosing what to train it on.

    python -m benchmarks.reasoning_gym_survey --model artifacts/converted_model \
        --out benchmarks/results/reasoning-gym-survey-smollm2 [--candidates chain_sum:2t1d ...]

For each candidate (a task and a generator config: one difficulty level), held-out prompts drawn the way
the prepare stage draws them (``build_split``, eval seed) are answered greedily and sampled ``--samples``
times at ``--temperature``, under the chat template and ``--system-prompt``; the task's own scorer scores
the answer the reasoning_gym reward extracts. Per candidate it reports:

    greedy          greedy accuracy (score 1.0), extracting answer_is then last_number
    parsed          share of greedy replies with a stated answer ("The answer is ...", boxed, <answer>)
    acc_parsed      greedy accuracy among those
    wrong_parsed    share of wrong greedy replies that stated an answer: wrong, not unformatted
    truncated       share of greedy replies that hit the token budget
    pass@1 / pass@k sampled, unbiased estimator; mixed = share of prompts whose samples are neither all right
                    nor all wrong (the groups GRPO learns from)

What to look for (issue: pick tasks where the base answers in the right form but often wrongly): a high
``parsed`` and ``wrong_parsed``, a greedy accuracy well below 1 and a large ``mixed`` share.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_core.data.reasoning_gym import ReasoningGymConfig, ReasoningGymTask, build_split
from grpo_core.evaluation import pass_at_k
from grpo_core.rewards.reasoning_gym import extract_answer, score_row

STATED = ("answer_is", "boxed", "answer_tag")
SCORED = (*STATED, "last_number")
SYSTEM_PROMPT = "Solve the problem. End your reply with: The answer is N."


@dataclass(frozen=True)
class Candidate:
    label: str
    task: str
    config: dict


def _terms(task: str, terms: int, digits: tuple[int, int], label: str) -> Candidate:
    """An arithmetic generator's level: ``terms`` terms of min..max ``digits`` digits."""
    return Candidate(f"{task}:{label}", task, {"min_terms": terms, "max_terms": terms,
                                                "min_digits": digits[0], "max_digits": digits[1]})


#: tasks a 135M chat model might answer in the right form, each at a few levels (label: task, config)
CANDIDATES = [
    _terms("chain_sum", 2, (1, 1), "2t1d"),
    _terms("chain_sum", 2, (1, 2), "2t2d"),
    _terms("chain_sum", 3, (1, 1), "3t1d"),
    Candidate("chain_sum:2-4t1-2d", "chain_sum", {"min_terms": 2, "max_terms": 4, "min_digits": 1,
                                                  "max_digits": 2}),
    _terms("basic_arithmetic", 2, (1, 1), "2t1d"),
    _terms("basic_arithmetic", 3, (1, 1), "3t1d"),
    _terms("products", 2, (1, 1), "2t1d"),
    _terms("products", 2, (1, 2), "2t1-2d"),
    Candidate("leg_counting:1-2a", "leg_counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1,
                                                    "max_instances": 3}),
    Candidate("simple_equations:2t", "simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1,
                                                          "max_value": 10}),
    Candidate("gcd:2n<50", "gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 50}),
    Candidate("count_bits:<64", "count_bits", {"min_n": 1, "max_n": 63}),
    Candidate("letter_counting:1-3w", "letter_counting", {"min_words": 1, "max_words": 3}),
    Candidate("number_sorting:3n", "number_sorting", {"min_numbers": 3, "max_numbers": 3, "min_decimals": 0,
                                                      "max_decimals": 0, "min_value": 1, "max_value": 99}),
]


def load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def generate(tok, model, prompts: list[str], system: str, max_new: int, *, samples: int = 1,
             temperature: float | None = None, batch: int = 64) -> tuple[list[str], list[bool]]:
    """Each prompt's ``samples`` completions (greedy when temperature is None), prompt-major; and whether each
    hit ``max_new`` tokens."""
    chats = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}],
                                     tokenize=False, add_generation_prompt=True) for p in prompts]
    chats = [c for c in chats for _ in range(samples)]
    texts, cut = [], []
    for start in range(0, len(chats), batch):
        enc = tok(chats[start:start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        kw = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature,
                                                               "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, **kw)
        new = out[:, enc["input_ids"].shape[1]:]
        for row in new:
            ids = row.tolist()
            ended = tok.eos_token_id in ids or tok.pad_token_id in ids
            texts.append(tok.decode(row, skip_special_tokens=True))
            cut.append(not ended)
    return texts, cut


def score(texts: list[str], rows: list[dict], per_row: int, extract) -> np.ndarray:
    return np.array([score_row(a, rows[i // per_row], rows[i // per_row]["prompt"]) if a is not None else 0.0
                     for i, a in enumerate(extract_answer(t, extract) for t in texts)])


def survey(cand: Candidate, tok, model, args) -> dict:
    cfg = ReasoningGymConfig(tasks=[ReasoningGymTask(name=cand.task, config=cand.config)],
                             eval_size=args.prompts, seed=0, eval_seed=1)
    rows, stats = build_split(cfg, "eval")
    prompts = [r["prompt"] for r in rows]
    t0 = time.perf_counter()
    texts, cut = generate(tok, model, prompts, args.system_prompt, args.max_new_tokens)
    g_score = score(texts, rows, 1, SCORED)
    stated = np.array([extract_answer(t, STATED) is not None for t in texts])
    right = g_score == 1.0
    n_s = min(args.sample_prompts, len(rows))
    s_texts, _ = generate(tok, model, prompts[:n_s], args.system_prompt, args.max_new_tokens,
                          samples=args.samples, temperature=args.temperature)
    s_right = (score(s_texts, rows[:n_s], args.samples, SCORED) == 1.0).reshape(n_s, args.samples)
    c = s_right.sum(1)
    k = args.samples
    return {"label": cand.label, "task": cand.task, "config": cand.config, "prompts": len(rows),
            "distinct_of_drawn": f"{stats[cand.task]['rows']}/{stats[cand.task]['drawn']}",
            "greedy": float(right.mean()), "mean_score": float(g_score.mean()),
            "parsed": float(stated.mean()),
            "acc_parsed": float(right[stated].mean()) if stated.any() else None,
            "wrong_parsed": float(stated[~right].mean()) if (~right).any() else None,
            "truncated": float(np.mean(cut)),
            "mean_words": float(np.mean([len(t.split()) for t in texts])),
            "pass@1": float(np.mean([pass_at_k(k, int(n), 1) for n in c])),
            f"pass@{k}": float(np.mean([pass_at_k(k, int(n), k) for n in c])),
            "mixed": float(np.mean((c > 0) & (c < k))),
            "sample_prompts": n_s, "seconds": round(time.perf_counter() - t0, 1),
            "examples": [{"prompt": prompts[i], "answer": rows[i]["answer"], "reply": texts[i]}
                         for i in range(3)]}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(results: list[dict], args) -> str:
    k = f"pass@{args.samples}"
    columns = ["greedy", "mean_score", "parsed", "acc_parsed", "wrong_parsed", "truncated", "pass@1", k,
               "mixed"]
    head = (f"Base model `{args.model}`: {args.prompts} held-out prompts greedy, {args.sample_prompts} x "
            f"{args.samples} samples at T={args.temperature}, {args.max_new_tokens} new tokens, system "
            f"prompt {args.system_prompt!r}.\n\n| candidate | {' | '.join(columns)} | words |\n"
            f"|---|{'---|' * len(columns)}---|\n")
    return head + "".join(f"| {r['label']} | {' | '.join(_fmt(r[c]) for c in columns)} | "
                          f"{r['mean_words']:.0f} |\n" for r in results)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="a model folder (the convert stage's artifacts/converted_model)")
    ap.add_argument("--out", required=True, help="writes <out>.json and <out>.md")
    ap.add_argument("--candidates", nargs="*", help="labels of CANDIDATES to run (default: all)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--sample-prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--system-prompt", default=SYSTEM_PROMPT)
    args = ap.parse_args(argv)
    known = {c.label: c for c in CANDIDATES}
    unknown = sorted(set(args.candidates or []) - known.keys())
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; choose from {sorted(known)}")
    chosen = [known[c] for c in args.candidates] if args.candidates else CANDIDATES
    torch.manual_seed(0)
    tok, model = load(args.model)
    results = []
    for cand in chosen:
        results.append(survey(cand, tok, model, args))
        r = results[-1]
        print(f"{r['label']}: greedy {r['greedy']:.3f} parsed {r['parsed']:.3f} wrong_parsed "
              f"{_fmt(r['wrong_parsed'])} pass@{args.samples} {r[f'pass@{args.samples}']:.3f} "
              f"mixed {r['mixed']:.3f} ({r['seconds']} s)", flush=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        out.with_suffix(".md").write_text(markdown(results, args))


if __name__ == "__main__":
    main()
