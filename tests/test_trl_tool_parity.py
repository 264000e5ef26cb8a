"""Agentic rollouts against TRL 1.16's own tool loop (``GRPOTrainer._tool_call_loop``) on one fixture: a tiny
Qwen2 model, a tokenizer with Qwen2.5's real chat template, two tools (``multiply`` and ``add``), the same
seed.

Sampling is scripted (tests/tool_fixtures.py ``Script``): what the "model" writes is a function of the context
it is given - a tool call, an answer using the tool's result, a call to a tool that does not exist, an answer
without a tool - so both samplers, handed the same contexts, get the same tokens, and everything around the
sampler is compared: the prompts rendered with the tools' schemas, the parsing of tool calls, running them,
the tokens of the tool results (TRL's ``_get_tool_suffix_ids``), the budget, the tool mask, the messages
rewards receive, the tools/* metrics - and then, training on them, the loss, the KL against a reference, and
the optimizer's steps.

Both sides parse with transformers' response parser: TRL with the template it sets for Qwen2.5's chat
template, ours with the one it derives from the chat template itself (a fresh tokenizer, no response_template
set).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from grpo_core.data.loading import PromptEncoder
from grpo_core.rollout import SamplingParams
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from grpo_core.tools import build_toolbox
from tests.tool_fixtures import (
    Script,
    ScriptedBackend,
    add,
    calculator_policy,
    multiply,
    qwen_tokenizer,
    tiny_model,
)

trl = pytest.importorskip("trl")

G, STEPS, BUDGET, LR, BETA = 4, 2, 160, 5e-3, 0.04
QUESTIONS = [(12, 34), (5, 6), (7, 8), (9, 3)]


def right(prompts, completions, answer, **columns) -> list[float]:
    """1 when the last assistant message ends with the product (completions are message lists, as in TRL)."""
    return [float(c[-1]["content"].endswith(a)) for c, a in zip(completions, answer)]


def used_tools(prompts, completions, **columns) -> list[float]:
    return [sum(m["role"] == "tool" for m in c) / 2 for c in completions]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-parity")
    tok = qwen_tokenizer()
    model = tiny_model(tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} times {b}"}], "answer": str(a * b)}
            for a, b in QUESTIONS]
    with open(root / "rows.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return root, rows


def _load(root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32),
            AutoTokenizer.from_pretrained(root / "model"))


@pytest.fixture(scope="module")
def trl_run(fixture):
    """TRL's trainer, its single-turn generation scripted; every ``_generate`` call recorded."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    root, rows = fixture
    model, tok = _load(root)
    script = Script(tok, calculator_policy, BUDGET)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(root / "trl"), num_generations=G,
                      per_device_train_batch_size=G * len(rows), max_completion_length=BUDGET,
                      learning_rate=LR, beta=BETA, loss_type="dapo", max_steps=STEPS,
                      adam_beta2=0.99, lr_scheduler_type="constant", max_grad_norm=1.0, bf16=False,
                      gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
                      logging_steps=1, disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[right, used_tools], args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), tools=[multiply, add])
    trainer._generate_single_turn = (
        lambda prompt_ids, images, fields, num_generations, has_tool_images=False: (
            [script.completion(list(p), i % num_generations) for i, p in enumerate(prompt_ids)],
            None,
        )
    )
    recorded = []
    generate = trainer._generate

    def recording(prompts):
        out = generate(prompts)
        recorded.append((prompts, out))
        return out

    trainer._generate = recording
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return dict(trainer.model.named_parameters()), logged, recorded


def test_the_tokens_masks_and_messages_are_trls(fixture, trl_run):
    root, _ = fixture
    _, logged, recorded = trl_run
    prompts, (trl_prompt_ids, trl_completion_ids, trl_tool_mask, trl_completions, *_) = recorded[0]
    rows = [{"prompt": prompts[i],
             "answer": str(eval(prompts[i][0]["content"].split("is ")[1].replace("times", "*")))}
            for i in range(0, len(prompts), G)]  # TRL's (shuffled) order, each prompt once
    _, tok = _load(root)  # a fresh tokenizer: ours derives its parser, TRL set one on its own copy
    assert getattr(tok, "response_template", None) is None
    toolbox = build_toolbox(_tool_use())
    backend = ScriptedBackend(Script(tok, calculator_policy, BUDGET))
    plan = SamplePlan(G, SamplingParams(max_new_tokens=BUDGET), batch_size=len(rows), keep_batches=True,
                      tools=toolbox)
    res = sample_and_score(None, tok, rows, PromptEncoder(tok, None), [right, used_tools], plan,
                           backend=backend)
    (batch,) = res.batches
    for i in range(len(prompts)):
        assert (batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
                == list(trl_prompt_ids[i])), f"prompt {i}"
        real = batch.completion_mask[i].bool()
        assert batch.completion_ids[i][real].tolist() == list(trl_completion_ids[i]), f"completion {i}"
        assert batch.tool_mask[i][real].tolist() == list(trl_tool_mask[i]), f"tool mask {i}"
        assert res.completions[i] == trl_completions[i], f"messages {i}"
    # the fixture exercises what it claims: tool blocks, a failed call, a turn with no tool, a cut-off row
    assert any(0 in m for m in trl_tool_mask) and not all(0 in m for m in trl_tool_mask)
    calls, failures = res.tool_calls.sum(), res.tool_failures.sum()
    assert failures > 0 and res.truncated.any() and not res.truncated.all()
    assert calls / len(prompts) == pytest.approx(logged[0]["tools/call_frequency"])
    assert failures / calls == pytest.approx(logged[0]["tools/failure_frequency"])
    assert float(res.completion_lengths.mean()) == pytest.approx(logged[0]["completions/mean_length"])


def _tool_use():
    from grpo_core.tools import ToolUseOptions as ToolUseConfig

    return ToolUseConfig(tools=["tests.tool_fixtures:multiply", "tests.tool_fixtures:add"],
                         environment_factory=None, max_tool_calling_iterations=None, tool_timeout_s=10.0,
                         rollout_func=None)


def run_ours(fixture):
    from grpo_core.config import config_from_dict
    from grpo_core.train.loop import TrainHooks, train

    root, rows = fixture
    cfg = config_from_dict({
        "data": {"train_files": [str(root / "rows.jsonl")], "eval_files": [str(root / "rows.jsonl")],
                 "max_prompt_length": None},
        "model": {"name_or_path": str(root / "model")},
        "generation": {"max_completion_length": BUDGET},
        "rewards": [{"name": "right", "function": "tests.test_trl_tool_parity:right"},
                    {"name": "used_tools", "function": "tests.test_trl_tool_parity:used_tools"}],
        "train": {"num_generations": G, "per_device_train_batch_size": G * len(rows), "learning_rate": LR,
                  "beta": BETA, "loss_type": "dapo", "max_steps": STEPS, "adam_beta2": 0.99,
                  "lr_scheduler_type": "constant", "max_grad_norm": 1.0, "resume": "never", "save_steps": 100,
                  "output_dir": "ours", "seed": 0,
                  "tools": ["tests.tool_fixtures:multiply", "tests.tool_fixtures:add"]},
    })
    logged: list[dict] = []

    class Tracker:
        def log_metrics(self, metrics, step):
            logged.append(dict(metrics))

    hooks = TrainHooks(tracker=Tracker(),
                       backend_factory=lambda m, tok: ScriptedBackend(Script(tok, calculator_policy, BUDGET)))
    result = train(cfg, reward_weights=[1.0, 1.0], root=root, progress=False, log_path="ours.csv",
                   hooks=hooks)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32)
    return dict(model.named_parameters()), logged


def test_training_on_them_takes_trls_steps(fixture, trl_run):
    theirs, their_log, _ = trl_run
    ours, our_log = run_ours(fixture)
    base, _ = _load(fixture[0])
    base = dict(base.named_parameters())
    moved = max(float((theirs[n] - base[n]).detach().abs().max()) for n in theirs)
    assert moved > LR
    for name in theirs:
        gap = (ours[name] - theirs[name]).abs().max().item()
        assert gap < 5e-3 * moved, f"{name}: ours and TRL's weights differ by {gap:.2e} after {STEPS} steps"
    assert len(our_log) == len(their_log) == STEPS
    for step, (mine, trls) in enumerate(zip(our_log, their_log), start=1):
        for key in ("reward", "kl", "completions/mean_length", "completions/clipped_ratio",
                    "tools/call_frequency", "tools/failure_frequency", "rewards/right/mean"):
            assert mine[key] == pytest.approx(trls[key], rel=1e-4, abs=1e-6), f"step {step}: {key}"
        assert mine["loss"] == pytest.approx(trls["loss"], rel=1e-3, abs=1e-6), f"step {step}: loss"
        assert mine["entropy"] == pytest.approx(trls["entropy"], rel=1e-4), f"step {step}: entropy"


# -- rollout_func: the user's own rollout, through both trainers ---------------------------------------------

FEEDBACK = "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"


def scripted_rollout(prompts, trainer):
    """A rollout function as TRL documents them, reading only ``processing_class`` and ``args``: an answer, an
    environment's feedback (env_mask 0), a second answer - cut off (no EOS) for the last sample of a
    group - and an extra field for the rewards."""
    tok, G = trainer.processing_class, trainer.args.num_generations
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [], "tries": []}
    for i, prompt in enumerate(prompts):
        g = i % G
        prompt_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        first = tok(f"The answer is {g}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        feedback = tok(FEEDBACK, add_special_tokens=False)["input_ids"]
        second = tok(f"Then it is {g * 7}", add_special_tokens=False)["input_ids"]
        second += [] if g == G - 1 else [tok.eos_token_id]
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(first + feedback + second)
        out["env_mask"].append([1] * len(first) + [0] * len(feedback) + [1] * len(second))
        out["tries"].append(2)
    return out


def said_seven(prompts, completions, tries, **columns) -> list[float]:
    return [float("7" in c[0]["content"]) / t for c, t in zip(completions, tries)]


def test_a_rollout_func_trains_as_in_trl(fixture):
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.config import config_from_dict
    from grpo_core.train.loop import TrainHooks, train

    root, rows = fixture
    model, tok = _load(root)
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(root / "trl-rf"), num_generations=G,
                      per_device_train_batch_size=G * len(rows), max_completion_length=BUDGET,
                      learning_rate=LR, beta=BETA, loss_type="dapo", max_steps=STEPS,
                      adam_beta2=0.99, lr_scheduler_type="constant", bf16=False, use_cpu=True,
                      report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[said_seven], args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), rollout_func=scripted_rollout)
    trainer.train()
    theirs = dict(trainer.model.named_parameters())
    their_log = [e for e in trainer.state.log_history if "loss" in e]

    cfg = config_from_dict({
        "data": {"train_files": [str(root / "rows.jsonl")], "max_prompt_length": None},
        "model": {"name_or_path": str(root / "model")}, "generation": {"max_completion_length": BUDGET},
        "rewards": [{"name": "said_seven", "function": "tests.test_trl_tool_parity:said_seven"}],
        "train": {"num_generations": G, "per_device_train_batch_size": G * len(rows), "learning_rate": LR,
                  "beta": BETA, "max_steps": STEPS, "adam_beta2": 0.99, "resume": "never", "save_steps": 100,
                  "output_dir": "ours-rf", "rollout_func": "tests.test_trl_tool_parity:scripted_rollout"}})
    logged = []

    class Tracker:
        def log_metrics(self, metrics, step):
            logged.append(dict(metrics))

    result = train(cfg, reward_weights=[1.0], root=root, progress=False, log_path="ours-rf.csv",
                   hooks=TrainHooks(tracker=Tracker()))
    ours = dict(AutoModelForCausalLM.from_pretrained(result.model_dir,
                                                     dtype=torch.float32).named_parameters())
    base = dict(_load(root)[0].named_parameters())
    moved = max(float((theirs[n] - base[n]).detach().abs().max()) for n in theirs)
    assert moved > LR
    for name in theirs:
        assert (ours[name] - theirs[name]).abs().max().item() < 5e-3 * moved, name
    for mine, trls in zip(logged, their_log, strict=True):
        for key in ("reward", "kl", "completions/mean_length", "completions/clipped_ratio", "entropy"):
            assert mine[key] == pytest.approx(trls[key], rel=1e-4, abs=1e-6), key
        assert mine["loss"] == pytest.approx(trls["loss"], rel=1e-3, abs=1e-6)
