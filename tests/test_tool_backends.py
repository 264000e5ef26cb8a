"""The multi-turn loop on real backends, greedy: HF generate and the hand-written decode loop give the tokens,
tool masks and messages TRL 1.16's own tool loop gives (its real HF generate, not a script), on a tiny model
warm-started to call a tool; the vLLM engine, colocated and behind ``python -m flows.serve`` (server mode),
gives HF generate's.

The model is a Qwen2 (hidden 64 over 2 heads: vLLM's CPU attention takes head size 32) behind a short ChatML
chat template that writes Hermes tool calls (``<tool_call>{json}</tool_call>``) and lists the tools in one
line, so a context is tens of tokens and warm-starting it to call ``multiply`` and answer with the result
takes seconds.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from grpo_core.data.loading import PromptEncoder
from grpo_core.rollout import HFGenerateBackend, ManualDecodeBackend, SamplingParams
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from grpo_core.tools import ToolChat, build_toolbox
from tests.tiny import require_vllm
from tests.tool_fixtures import WORDS, _bpe_tokenizer, hermes_call, multiply

trl = pytest.importorskip("trl")

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor "
    "%}<|im_end|>\n{% endif %}" "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = [(12, 34), (5, 6), (7, 8)]
BUDGET, G = 80, 2


def question(a, b):
    return [{"role": "user", "content": f"what is {a} times {b}"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model warm-started to call multiply on the question, then answer with the result (greedy)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tool-backends")
    texts = [hermes_call("multiply", a=a, b=b) + f" The answer is {a * b}" for a, b in QUESTIONS]
    tok = _bpe_tokenizer([*WORDS, *texts, "Tools: multiply what times"], ["<|im_start|>", "<|im_end|>",
                         "<|endoftext|>"], bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    chat = ToolChat.for_tokenizer(tok)
    examples = []
    for a, b in QUESTIONS:
        prompt = PromptEncoder(tok, None).encode(question(a, b), tools=[multiply])
        call = tok(hermes_call("multiply", a=a, b=b),
                   add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        block = chat.suffix_ids([{"role": "tool", "name": "multiply", "content": str(a * b)}])
        answer = tok(f"The answer is {a * b}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples += [(prompt, call), (prompt + call + block, answer)]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), tok.pad_token_id)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (p, t) in enumerate(examples):
        ids[i, :len(p) + len(t)], mask[i, :len(p) + len(t)] = torch.tensor(p + t), 1
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(100):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    rows = [{"prompt": question(a, b), "answer": str(a * b)} for a, b in QUESTIONS]
    (path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path,
                                                dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
                                                    path)


def ours(path, rows, make_backend):
    model, tok = _load(path)
    toolbox = build_toolbox(_tool_use())
    plan = SamplePlan(G, SamplingParams(max_new_tokens=BUDGET, do_sample=False), batch_size=len(rows),
                      keep_batches=True, tools=toolbox)
    res = sample_and_score(None, tok, rows, PromptEncoder(tok, None), [], plan,
                           backend=make_backend(model, tok))
    (batch,) = res.batches
    real = batch.completion_mask.bool()
    return ([batch.completion_ids[i][real[i]].tolist() for i in range(len(real))],
            [batch.tool_mask[i][real[i]].tolist() for i in range(len(real))], res.completions, res)


def _tool_use():
    from grpo_core.tools import ToolUseOptions as ToolUseConfig

    return ToolUseConfig(["tests.tool_fixtures:multiply"], None, None, 10.0, None)


def right(prompts, completions, answer, **columns):
    return [float(c[-1]["content"].endswith(a)) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def trl_loop(model_dir):
    """TRL's first batch through its own tool loop and HF generate, greedy: (rows in its order,
    its outputs)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    model, tok = _load(model_dir)
    # TRL knows no response template for this chat template: set Qwen's
    tok.response_template = qwen3_template
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    rows = [json.loads(line) for line in open(model_dir / "rows.jsonl")]
    args = GRPOConfig(output_dir=str(model_dir / "trl"), num_generations=G,
                      per_device_train_batch_size=G * len(rows), max_completion_length=BUDGET, max_steps=1,
                      bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                      generation_kwargs={"do_sample": False}, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[right], args=args, processing_class=tok,
                          tools=[multiply], train_dataset=datasets.Dataset.from_list(rows))
    recorded = []
    generate = trainer._generate
    trainer._generate = lambda prompts: recorded.append((prompts, generate(prompts))) or recorded[-1][1]
    trainer.train()
    prompts, (_, completion_ids, tool_mask, completions, *_) = recorded[0]
    order = [{"prompt": prompts[i], "answer": next(r["answer"] for r in rows if r["prompt"] == prompts[i])}
             for i in range(0, len(prompts), G)]
    return order, [list(c) for c in completion_ids], [list(m) for m in tool_mask], completions


@pytest.mark.parametrize("make_backend", [HFGenerateBackend, ManualDecodeBackend], ids=["hf", "manual"])
def test_greedy_conversations_equal_trls_tool_loop(model_dir, trl_loop, make_backend):
    rows, trl_ids, trl_masks, trl_completions = trl_loop
    ids, masks, completions, res = ours(model_dir, rows, make_backend)
    assert ids == trl_ids and masks == trl_masks and completions == trl_completions
    assert res.tool_calls.sum() >= len(rows)  # the warm-started model does call the tool, and is answered
    assert any(0 in m for m in masks)
    # a conversation ends with the model's turn, or with a tool result that used up the budget to its last
    # token
    assert all(c[-1]["role"] == "assistant" or len(i) == BUDGET for c, i in zip(completions, ids))


def test_the_vllm_engine_holds_the_same_conversations(model_dir, trl_loop):
    require_vllm()
    from grpo_core.rollout.vllm import EngineSettings, VLLMBackend, build_engine, shutdown_engine

    rows, trl_ids, trl_masks, _ = trl_loop
    model, _ = _load(model_dir)
    llm = build_engine(model, EngineSettings(enable_sleep_mode=False, max_model_length=256, seed=0))
    try:
        ids, masks, _, _ = ours(model_dir, rows, lambda m, tok: VLLMBackend(m, tok, engine=llm))
    finally:
        shutdown_engine(llm)
    assert ids == trl_ids and masks == trl_masks


def test_the_vllm_server_holds_the_same_conversations(model_dir, trl_loop, tmp_path):
    """Server mode: every turn's context goes to ``flows.serve`` as token ids,
    the loop stays in the trainer."""
    require_vllm()
    from tests.test_vllm_server import Server

    rows, trl_ids, trl_masks, _ = trl_loop
    served = Server(model_dir, tmp_path / "server.log", max_model_length=256)
    try:
        ids, masks, _, res = ours(model_dir, rows, lambda m, tok: served.backend(m, tok))
    finally:
        served.stop()
    assert ids == trl_ids and masks == trl_masks and res.tool_calls.sum() >= len(rows)
