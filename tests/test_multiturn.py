"""The multi-turn rollout (grpo_core/rollout/multiturn.py) on scripted policies: how a completion's tokens are
put together and masked, the budget, the turn limit; conversations through sample_and_score (environments,
rewards that receive them, closing); and the tool mask through the round into everything that counts model
tokens."""

from __future__ import annotations

import pytest
import torch

from grpo_core.data.loading import DataError, PromptEncoder
from grpo_core.rollout import SamplingParams
from grpo_core.rollout.multiturn import TurnLimits, generate_with_tools
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from grpo_core.tools import RolloutTools, ToolChat, build_toolbox
from tests.tool_fixtures import Counter, Script, ScriptedBackend, hermes_call, multiply, qwen_tokenizer

pytest.importorskip("trl")  # the fixture's chat templates are TRL's copies of the hub's

QUESTION = [{"role": "user", "content": "what is 12 times 34"}]


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def always_calls(text, key):
    return hermes_call("multiply", a=12, b=34)


def call_then_answer(text, key):
    return "The answer is 408" if "<tool_response>" in text else hermes_call("multiply", a=12, b=34)


def rollout(tok, policy, *, budget=200, max_iterations=None, G=2, prompts=None, tools=None):
    chat = ToolChat.for_tokenizer(tok)
    prompts = prompts or [PromptEncoder(tok, None).encode(QUESTION, tools=[multiply])] * G
    tools = tools or [RolloutTools({"multiply": multiply}) for _ in prompts]
    backend = ScriptedBackend(Script(tok, policy, budget))
    out = generate_with_tools(backend, chat, prompts, G, tools, SamplingParams(max_new_tokens=budget),
                              TurnLimits(max_iterations, timeout_s=5))
    return out, backend, chat


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def row(batch, i):
    real = batch.completion_mask[i].bool()
    return batch.completion_ids[i][real].tolist(), batch.tool_mask[i][real].tolist()


def test_a_completion_is_call_then_tool_block_then_answer_masked_where_the_model_did_not_write(tok):
    out, backend, chat = rollout(tok, call_then_answer)
    call = ids(tok, hermes_call("multiply", a=12, b=34)) + [tok.eos_token_id]
    block = ids(tok,
                "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n")
    answer = ids(tok, "The answer is 408") + [tok.eos_token_id]
    for i in range(2):
        completion, mask = row(out.batch, i)
        assert completion == call + block + answer
        assert mask == [1] * len(call) + [0] * len(block) + [1] * len(answer)
    assert out.batch.completion_lengths.tolist() == [len(call) + len(answer)] * 2  # the model's tokens
    assert not out.batch.is_truncated.any()
    assert out.completions[0] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}]},
        {"role": "tool", "name": "multiply", "content": "408"},
        {"role": "assistant", "content": "The answer is 408"}]
    assert (out.tool_calls, out.tool_failures, out.turns) == (2, 0, [2, 2])
    # one grouped first turn (the prompt once, G samples), then one continuation of both rows
    assert backend.requests == [(1, 200), (2, 200 - len(call) - len(block))]


def test_max_tool_calling_iterations_bounds_the_turns(tok):
    for limit, turns in ((0, 1), (1, 2), (3, 4)):
        out, _, _ = rollout(tok, always_calls, max_iterations=limit, budget=400)
        assert out.turns == [turns, turns] and out.tool_calls == 2 * limit
        completion, _ = row(out.batch, 0)
        assert completion[-1] == tok.eos_token_id  # it stops after a finished turn, not truncated
        assert not out.batch.is_truncated.any()


def test_the_budget_counts_tool_blocks_and_drops_a_result_that_does_not_fit(tok):
    call = len(ids(tok, hermes_call("multiply", a=12, b=34))) + 1
    block = len(ids(tok, "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n"))
    # exactly full after the block: kept, and no room left to generate (no generate call for it)
    out, backend, _ = rollout(tok, call_then_answer, budget=call + block)
    completion, mask = row(out.batch, 0)
    assert len(completion) == call + block and mask == [1] * call + [0] * block
    assert len(backend.requests) == 1 and out.turns == [1, 1]
    assert out.completions[0][-1]["role"] == "tool"
    assert out.batch.is_truncated.all()  # ends on the template's tokens, not on an EOS
    # one token short: the result is dropped, the completion ends as the model left it (TRL's rule)
    out, _, _ = rollout(tok, call_then_answer, budget=call + block - 1)
    completion, mask = row(out.batch, 0)
    assert len(completion) == call and mask == [1] * call and out.tool_calls == 2
    assert [m["role"] for m in out.completions[0]] == ["assistant"] and not out.batch.is_truncated.any()
    # room for part of the answer: it is cut to the budget, and the row is truncated
    out, _, _ = rollout(tok, call_then_answer, budget=call + block + 3)
    completion, mask = row(out.batch, 0)
    assert len(completion) == call + block + 3 and mask[-3:] == [1, 1, 1] and out.batch.is_truncated.all()


def test_rows_with_prompts_of_their_own_are_sampled_one_by_one(tok):
    encoder = PromptEncoder(tok, None)
    prompts = [encoder.encode(QUESTION, tools=[multiply]), encoder.encode(
        [{"role": "user", "content": "what is 5 times 6"}], tools=[multiply])]
    out, backend, _ = rollout(tok, call_then_answer, prompts=prompts, G=2)
    assert backend.requests[0] == (2, 200)  # two prompts, one sample each
    assert out.batch.prompt_ids.shape[0] == 2


def test_a_failed_call_is_fed_back_and_the_run_goes_on(tok):
    def unknown_then_real(text, key):
        if "not found" in text:
            return call_then_answer(text, key) if "408" in text else hermes_call("multiply", a=12, b=34)
        return hermes_call("divide", a=1, b=2)

    out, _, _ = rollout(tok, unknown_then_real)
    assert [m["role"] for m in out.completions[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert out.completions[0][1]["content"] == "{'error': 'Tool divide not found.'}"
    assert (out.tool_calls, out.tool_failures) == (4, 2)


def test_a_malformed_call_is_answered_with_why_and_the_model_tries_again(tok):
    def broken_then_right(text, key):
        if "malformed tool call" in text:
            return call_then_answer(text, key) if "408" in text else hermes_call("multiply", a=12, b=34)
        return '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}\n</tool_call>'

    out, _, _ = rollout(tok, broken_then_right)
    roles = [m["role"] for m in out.completions[0]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert out.completions[0][0] == {"role": "assistant", "content": '<tool_call>\n{"name": "multiply", '
                                                                   '"arguments": {"a": 12, "b": 34}\n'
                                                                   '</tool_call>'}
    assert out.completions[0][1]["content"].startswith("{'error': 'malformed tool call: json parser could "
                                                       "not")
    assert out.completions[0][-1]["content"] == "The answer is 408"
    assert (out.tool_calls, out.tool_failures) == (4, 2)


# -- through sample_and_score: environments, rewards, closing ------------------------------------------------


def counted(prompts, completions, environments, **columns):
    return [e.get_reward() for e in environments]


def increments(text, key):
    if text.count("<tool_response>") >= 2:
        return "done"
    return hermes_call("increment", by=2)


def test_environments_reach_the_rewards_and_are_closed(tok):
    from grpo_core.rewards import build_reward_functions

    Counter.closed.clear()
    box = build_toolbox(_tool_use(environment_factory="tests.tool_fixtures:Counter"))
    rows = [{"prompt": QUESTION, "start": 1}, {"prompt": QUESTION, "start": 10}]
    fns = [counted, *build_reward_functions([{"name": "env", "function": "environment_reward"}])]
    plan = SamplePlan(2, SamplingParams(max_new_tokens=300), batch_size=2, keep_batches=True, tools=box)
    res = sample_and_score(None, tok, rows, PromptEncoder(tok, None), fns, plan,
                           backend=ScriptedBackend(Script(tok, increments, 300)))
    # start + 2 + 2, each rollout its own
    assert res.rewards.tolist() == [[5.0, 5.0]] * 2 + [[14.0, 14.0]] * 2
    assert res.tool_calls.tolist() == [2] * 4 and res.turns.tolist() == [3] * 4
    assert len(Counter.closed) == 1 + 4  # the probe, then every rollout's environment after scoring
    prompt_text = tok.decode(res.batches[0].prompt_ids[2][res.batches[0].prompt_mask[2].bool()])
    assert "what is 12 times 34 The counter starts at 10.<|im_end|>" in prompt_text  # reset's observation
    assert '"name": "increment"' in prompt_text  # the environment's method is a tool in the prompt


def test_environments_are_closed_when_a_reward_fails(tok):
    Counter.closed.clear()
    box = build_toolbox(_tool_use(environment_factory="tests.tool_fixtures:Counter"))

    def raising(prompts, completions, **columns):
        raise RuntimeError("reward down")

    with pytest.raises(Exception, match="reward down"):
        sample_and_score(None, tok, [{"prompt": QUESTION}], PromptEncoder(tok, None), [raising],
                         SamplePlan(2, SamplingParams(max_new_tokens=100), batch_size=1, tools=box),
                         backend=ScriptedBackend(Script(tok, increments, 100)))
    assert len(Counter.closed) == 3


def test_tools_need_chat_prompts(tok):
    box = build_toolbox(_tool_use(["tests.tool_fixtures:multiply"]))
    with pytest.raises(DataError, match="need chat prompts.* data.prompt_format: chat"):
        sample_and_score(None, tok, [{"prompt": "what is 2 times 3"}], PromptEncoder(tok, None), [],
                         SamplePlan(2, SamplingParams(max_new_tokens=10), batch_size=1, tools=box),
                         backend=ScriptedBackend(Script(tok, call_then_answer, 10)))


def _tool_use(tools=(), environment_factory=None):
    from grpo_core.tools import ToolUseOptions as ToolUseConfig

    return ToolUseConfig(list(tools), environment_factory, None, 10.0, None)


# -- the tool mask through the round -------------------------------------------------------------------------


def test_the_round_counts_the_models_tokens_only():
    from grpo_core.train.round import Round

    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    tool_mask = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    r = Round(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
              completion_ids=torch.ones(2, 6, dtype=torch.long), completion_mask=completion_mask,
              is_truncated=torch.tensor([False, True]), advantages=torch.zeros(2), tool_mask=tool_mask)
    assert r.loss_mask(False).tolist() == [[1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert r.loss_mask(True).tolist() == [[1, 0, 0, 1, 1, 0], [0] * 6]
    wider = Round.concat([r, r.rows(slice(0, 1))])
    assert torch.equal(wider.tool_mask, torch.cat([tool_mask, tool_mask[:1]]))
    back = Round.from_buffer(r.to_buffer())  # checkpoints and the sampler worker carry it
    assert torch.equal(back.tool_mask, tool_mask)


def test_the_sampler_correction_statistics_leave_tool_tokens_out():
    from grpo_core.train.loop import sampler_metrics
    from grpo_core.train.round import Round

    class One:
        num_processes = 1

    old = torch.zeros(1, 4)
    sampled = torch.tensor([[0.0, -9.0, -9.0, -0.5]])  # tool tokens carry no sampler log-prob worth comparing
    r = Round(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
              completion_ids=torch.ones(1, 4, dtype=torch.long),
              completion_mask=torch.ones(1, 4, dtype=torch.long),
              is_truncated=torch.tensor([False]), advantages=torch.zeros(1), old_logps=old,
              sampling_logps=sampled, tool_mask=torch.tensor([[1, 0, 0, 1]]), sampler_ratio=torch.ones(1, 4))
    m = sampler_metrics(One(), r)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)


# -- training with an environment ----------------------------------------------------------------------------


def test_training_with_an_environment_logs_tool_metrics_and_corrects_on_model_tokens(tmp_path, monkeypatch):
    import json

    import grpo_core.train.loop as loop
    from grpo_core.config import config_from_dict
    from tests.tiny import read_log
    from tests.tool_fixtures import tiny_model

    tok = qwen_tokenizer()
    tiny_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with open(tmp_path / "rows.jsonl", "w") as fh:
        for start in (1, 2):
            fh.write(json.dumps({"prompt": QUESTION, "start": start}) + "\n")
    cfg = config_from_dict({
        "data": {"train_files": [str(tmp_path / "rows.jsonl")], "max_prompt_length": None},
        "model": {"name_or_path": str(tmp_path / "model")},
        "generation": {"max_completion_length": 120},
        "rewards": [{"name": "counter", "function": "environment_reward"}],
        "train": {"num_generations": 2, "per_device_train_batch_size": 4, "max_steps": 2, "save_steps": 100,
                  "resume": "never", "output_dir": "out", "learning_rate": 1e-3,
                  "environment_factory": "tests.tool_fixtures:Counter", "max_tool_calling_iterations": 1},
    })
    masks = []
    real = loop.sampler_correction

    def recording(old, sampling, mask, *args):
        masks.append(mask.clone())
        return real(old, sampling, mask, *args)

    monkeypatch.setattr(loop, "sampler_correction", recording)
    logged = []

    class Tracker:
        def log_metrics(self, metrics, step):
            logged.append(metrics)

    hooks = loop.TrainHooks(tracker=Tracker(), backend_factory=lambda m, t: ScriptedBackend(
        Script(t, increments, 120), sampling_logp=-0.5))
    loop.train(cfg, reward_weights=[1.0], root=tmp_path, progress=False, log_path="log.csv", hooks=hooks)
    call = len(ids(tok, hermes_call("increment", by=2))) + 1
    assert masks and all(m[:, :call].all() and not m[:, call].any() for m in masks)  # the tool block is out
    assert logged[0]["tools/call_frequency"] == 1.0 and logged[0]["tools/failure_frequency"] == 0.0
    assert logged[0]["tools/mean_turns"] == 2.0  # a call, its result, a second call the limit leaves unrun
    assert logged[0]["rewards/counter/mean"] == pytest.approx((3 + 3 + 4 + 4) / 4)
    # the model's two turns, the tool block not counted
    assert logged[0]["completions/mean_length"] == 2 * call
    row = read_log(tmp_path / "log.csv")[0]
    assert float(row["tools/call_frequency"]) == 1.0 and "tools/mean_turns" in row
