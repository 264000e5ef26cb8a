"""benchmarks/llama_cpp_check.py's side of ours: our decode loop on the rendered prompts, one at a time and in
batches, gives HF generate's greedy replies and counts the tokens it generated."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.llama_cpp_check import our_replies
from grpo_core.config import config_from_dict
from tests.tiny import make_tiny_model

PROMPTS = ["3 plus 4 is", "The answer to 12 - 5 is", "Seven and two make"]


def test_our_replies_are_hf_generates_greedy_replies_in_any_batch(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", hidden_size=64, layers=2)
    cfg = config_from_dict({"data": {"train_files": ["t.jsonl"]}, "model": {"name_or_path": str(model_dir)},
                            "rewards": [{"name": "c", "function": "correctness"}],
                            "generation": {"max_completion_length": 12}})
    cfg = dataclasses.replace(cfg, evaluate=dataclasses.replace(cfg.evaluate, max_completion_length=None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected, generated = [], 0
    for prompt in PROMPTS:  # one at a time: no padding; a reply ends at its EOS, which counts
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
        reply = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
        expected.append(tokenizer.decode(reply, skip_special_tokens=True))
        generated += len(reply)
    threads = torch.get_num_threads()
    for batch_size in (1, 2):
        got = our_replies(cfg, model_dir, PROMPTS, batch_size, threads=1)
        assert got["replies"] == expected, batch_size
        assert got["generated_tokens"] == generated > len(PROMPTS)
        assert got["tokens_per_s"] == generated / got["seconds"]
        assert got["backend"] == "ManualDecodeBackend"
    torch.set_num_threads(threads)
