"""The embedded agentic recipe's parts (configs/embedded-tools.yaml): the calculator task, the calculator
tool, the tool-calling chat template and the warm start's multi-turn transcripts."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.utils import get_json_schema

from grpo_core.embedded.tasks import NAMES, OBJECTS, template_noise
from grpo_core.embedded.tokenizer import (
    RESPONSE_TEMPLATE,
    ROLES,
    TAGS,
    TOOL_TAGS,
    build_tool_tokenizer,
    text_pieces,
)
from grpo_core.embedded.tool_tasks import (
    CALL_BREAKS,
    TEMPLATES,
    CalculatorProblem,
    generate_splits,
    scaffold_conversations,
    vocabulary_words,
)
from grpo_core.embedded.tools import INVALID, calculator
from grpo_core.embedded.warm_start import (
    IGNORE_INDEX,
    build_demonstrations,
    demonstration_tokens,
    sample_batch,
)
from grpo_core.rewards import correctness
from tests.tiny import undo_recipe_changes

TOOLS = [calculator]
REPO = Path(__file__).resolve().parents[1]
PROMPT = "<|system|>tools: calculator(expression: string)<|user|>What is 123 times 45?<|assistant|>"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call><|eos|>'
RESULT = "<|user|><tool_response>\n5535\n</tool_response><|assistant|>"
ANSWER = "<answer>\n5535\n</answer><|eos|>"


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer(vocabulary_words(), scaffold_conversations(), TOOLS)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def problem(template: int = 0, operands=(123, 45), guess: int = 5600) -> CalculatorProblem:
    return CalculatorProblem(template, "Mia", "pens", operands, guess)


# --- the tool -----------------------------------------------------------------------------------------------


def test_calculator_schema_is_what_get_json_schema_reads_from_its_hints_and_docstring():
    assert get_json_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression over integers.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {
                    "type": "string",
                    "description": 'integers joined by +, - or * (parentheses allowed), '
                                   'e.g. "123*45" or "120+305+998".',
                }},
                "required": ["expression"],
            },
            "return": {"type": "string", "description": "The value of the expression, as a decimal integer."},
        },
    }


@pytest.mark.parametrize("expression, value", [
    ("123*45", "5535"), ("120+305+998", "1423"), (" -(3-5)*2 ", "4"), ("7", "7"), ("10-20", "-10"),
    ("1_000*3", "3000"), ("+2*(3+4)*-1", "-14"), ("999*99+1", "98902"),
])
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("2**10", "not Pow"),
    ("10**100000", "not Pow"),  # a huge exponent: refused before anything is computed
    ("7/2", "not Div"), ("7//2", "not FloorDiv"), ("7%2", "not Mod"), ("1<<3", "not LShift"),
    ("~1", "not Invert"), ("x", "not Name"), ("x*2", "not Name"),
    ("__import__('os').system('true')", "not Call"), ("abs(-1)", "not Call"),
    ("(1).real", "not Attribute"), ("[1][0]", "not Subscript"), ("lambda: 1", "not Lambda"),
    ("1 if 1 else 2", "not IfExp"), ("1<2", "not Compare"), ("(1, 2)", "not Tuple"),
    ("1.5", "a float literal"), ("1e3", "a float literal"), ("2j", "a complex literal"),
    ("True", "a bool literal"), ("'a'*3", "a str literal"),
    ("123 times 45", INVALID), ("", INVALID), ("import os", INVALID), ("1;2", INVALID), ("1=1", INVALID),
    ("(" * 150 + "1" + ")" * 50, "longer than 200 characters"),
])
def test_calculator_refuses_everything_but_integers_and_plus_minus_times(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        calculator(expression)


def test_calculator_refuses_a_non_string_argument():
    with pytest.raises(ValueError, match="expression must be a string, got int"):
        calculator(123)  # type: ignore[arg-type]


# --- the task -----------------------------------------------------------------------------------------------


def test_splits_are_deterministic_disjoint_chat_rows_with_independently_computed_answers():
    train, evaluation = generate_splits(400, 100, 999, seed=0)
    assert [p.row() for p in train] == [p.row() for p in generate_splits(400, 100, 999, seed=0)[0]]
    texts = [p.text for p in train], [p.text for p in evaluation]
    assert len(set(texts[0])) == 400 and len(set(texts[1])) == 100 and not set(texts[0]) & set(texts[1])
    seen_templates = set()
    for p in train + evaluation:
        row = p.row()
        assert set(row) == {"prompt", "answer", "task"} and row["task"] == "calculator"
        [message] = row["prompt"]
        assert message == {"role": "user", "content": p.text}
        numbers = [int(n) for n in re.findall(r"\d+", message["content"])]
        if len(numbers) == 2:  # a product of 10..999 by 2..99
            a, b = numbers
            assert 10 <= a <= 999 and 2 <= b <= 99 and row["answer"] == str(a * b)
            assert p.expression == f"{a}*{b}"  # the call writes the numbers in the prompt's order
        else:  # a sum of three 10..999
            assert len(numbers) == 3 and all(10 <= n <= 999 for n in numbers)
            assert row["answer"] == str(sum(numbers)) and p.expression == "+".join(map(str, numbers))
        assert calculator(p.expression) == row["answer"]  # the tool gives the gold answer
        assert p.guess != p.result and len(str(p.guess)) == len(row["answer"])
        seen_templates.add(p.template)
    assert seen_templates == set(range(len(TEMPLATES)))
    assert json.loads(json.dumps(train[0].row())) == train[0].row()  # jsonl-safe


def test_a_guess_is_as_long_as_the_result_and_never_equal_to_it():
    from grpo_core.embedded.tool_tasks import _guess

    rng = random.Random(0)
    for result in (1, 7, 10, 55, 99, 100, 1368, 9801):
        guesses = [_guess(rng, result) for _ in range(300)]
        assert all(g != result and len(str(g)) == len(str(result)) for g in guesses)
        assert len(set(guesses)) > min(5, 10 ** len(str(result)) // 2)  # drawn, not fixed


def test_max_operand_below_10_is_refused():
    with pytest.raises(ValueError, match="embedded.max_operand: 9; the calculator task needs >= 10"):
        generate_splits(10, 5, 9, seed=0)


def test_correctness_scores_the_tool_path_one_and_the_guesses_zero():
    p = problem()
    prompts, gold = [p.prompt] * 3, [p.answer] * 3
    tool_path, guess, bad_call = p.completion(), p.completion(guess=True), p.completion(format_break=1)
    assert [m["role"] for m in tool_path] == ["assistant", "tool", "assistant"]
    assert tool_path[1]["content"] == "5535" and tool_path[2]["content"] == "<answer>\n5535\n</answer>"
    assert guess == [{"role": "assistant", "content": "<answer>\n5600\n</answer>"}]
    assert bad_call[0]["tool_calls"][0]["function"]["arguments"] == {"expression": "123 times 45"}
    assert bad_call[1]["content"] == "{'error': 'invalid expression'}"  # TRL's str({"error": str(exc)})
    assert bad_call[2]["content"] == "<answer>\n5600\n</answer>"
    assert correctness()(prompts, [tool_path, guess, bad_call], answer=gold) == [1.0, 0.0, 0.0]
    assert CALL_BREAKS == ("none", "bad_call")
    sums = problem(template=1, operands=(123, 456, 789))
    assert sums.text == "What is 123 plus 456 plus 789?" and sums.completion()[1]["content"] == "1368"
    assert sums.completion(format_break=1)[0]["tool_calls"][0]["function"]["arguments"] == {
        "expression": "123 plus 456 plus 789"}


# --- the chat template --------------------------------------------------------------------------------------


def conversation(p: CalculatorProblem | None = None) -> list[dict]:
    p = p or problem()
    return p.prompt + p.completion()


def test_template_renders_the_hermes_layout_with_compact_markers(tok):
    assert (tok.apply_chat_template(conversation(), tools=TOOLS, tokenize=False)
            == PROMPT + CALL + RESULT + ANSWER)
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False) == (
        "<|system|>tools: calculator(expression: string)<|user|>hi<|assistant|>")
    assert tok.apply_chat_template(user, tokenize=False) == "<|user|>hi"  # no tools: no tools line
    system = [{"role": "system", "content": "Be exact."}, *user]
    assert tok.apply_chat_template(system, tools=TOOLS, tokenize=False) == (
        "<|system|>Be exact.\ntools: calculator(expression: string)<|user|>hi")
    assert tok.apply_chat_template(system, tokenize=False) == "<|system|>Be exact.<|user|>hi"
    two_calls = [*user, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]},
        {"role": "tool", "name": "calculator", "content": "2"},
        {"role": "tool", "name": "calculator", "content": "6"}]
    assert tok.apply_chat_template(two_calls, tokenize=False) == (
        '<|user|>hi<|assistant|><tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
        '</tool_call><tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
        '</tool_call><|eos|>' "<|user|><tool_response>\n2\n</tool_response><tool_response>\n6\n"
                              "</tool_response>")
    with pytest.raises(Exception, match="unknown chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_markers_are_single_tokens_and_tokenizing_equals_rendering(tok):
    for marker in (*ROLES, *TOOL_TAGS, *TAGS, tok.eos_token):
        assert len(ids(tok, marker)) == 1, marker
    assert set(ROLES) <= set(tok.all_special_tokens) and not set(TOOL_TAGS) & set(tok.all_special_tokens)
    text = PROMPT + CALL + RESULT + ANSWER
    rendered = tok.apply_chat_template(conversation(), tools=TOOLS, tokenize=True, return_dict=False)
    assert rendered == ids(tok, text) and tok.decode(rendered) == text
    assert tok.decode(rendered, skip_special_tokens=True) == text.replace("<|system|>", "").replace(
        "<|user|>", "").replace("<|assistant|>", "").replace("<|eos|>", "")
    # the scaffolding's pre-tokens are one token each: a transcript is as many tokens as markers plus pieces
    markers = (*ROLES, *TOOL_TAGS, *TAGS, tok.eos_token)
    for c in [conversation(p) for p in generate_splits(40, 0, 999, seed=1)[0]] + [
            problem().prompt + problem().completion(format_break=1)]:
        text = tok.apply_chat_template(c, tools=TOOLS, tokenize=False)
        num_markers = len(re.findall("|".join(re.escape(m) for m in markers), text))
        assert len(ids(tok, text)) == num_markers + len(text_pieces([text], markers)), text


def test_template_is_prefix_preserving_and_trl_appends_the_tool_result_tokens(tok):
    from trl.chat_template_utils import is_chat_template_prefix_preserving
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert is_chat_template_prefix_preserving(tok)
    trainer = SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template=None,
                              chat_template_kwargs={},
                              _is_vlm=False)  # what TRL 1.16's _get_tool_suffix_ids reads of the trainer
    suffix = GRPOTrainer._get_tool_suffix_ids(trainer,
                                              [{"role": "tool", "name": "calculator", "content": "5535"}])
    assert suffix == ids(tok, RESULT)


def test_the_models_turns_parse_back_into_messages(tok):
    from trl.chat_template_utils import parse_response

    prefix = ids(tok, PROMPT)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123*45"}}}
    assert tok.parse_response(ids(tok, CALL), prefix=prefix, tools=TOOLS) == {"role": "assistant",
                                                                               "tool_calls": [call]}
    assert parse_response(tok, ids(tok, CALL), prefix=prefix, tools=TOOLS) == {"role": "assistant",
                                                                              "content": "",
                                                                              "tool_calls": [call]}
    after_result = ids(tok, PROMPT + CALL + RESULT)
    assert parse_response(tok, ids(tok, ANSWER), prefix=after_result, tools=TOOLS) == {
        "role": "assistant", "content": "<answer>\n5535\n</answer>"}
    # the regex fallback of tool parsers finds the same call
    [body] = re.findall(r"<tool_call>(.*?)</tool_call>", tok.decode(ids(tok, CALL)), re.DOTALL)
    assert json.loads(body) == call["function"]
    # broken JSON does not parse: TRL takes the turn for plain text
    broken = ids(tok,
                 '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12\n3"}}\n'
                 '</tool_call><|eos|>')
    assert "tool_calls" not in parse_response(tok, broken, prefix=prefix, tools=TOOLS)


def test_the_rollout_core_parses_with_the_tokenizers_response_template(tok):
    """grpo_core/tools/chat.py (what calibrate, train and evaluate sample with) reads the model's turns and
    appends the tool result as the template writes it."""
    from grpo_core.tools import ToolCall, ToolChat

    chat = ToolChat.for_tokenizer(tok)
    assert chat.source == "tokenizer"  # our response_template, not the probe's recognition
    turn = chat.parse(ids(tok, CALL), ids(tok, PROMPT), TOOLS)
    assert turn.calls == [ToolCall("calculator", {"expression": "123*45"})] and turn.message["content"] == ""
    assert chat.suffix_ids([{"role": "tool", "name": "calculator", "content": "5535"}]) == ids(tok, RESULT)
    answer = chat.parse(ids(tok, ANSWER), ids(tok, PROMPT + CALL + RESULT), TOOLS)
    assert answer.calls == [] and answer.message["content"] == "<answer>\n5535\n</answer>"


def test_saved_tokenizer_keeps_its_template_parser_and_ids(tok, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.response_template == RESPONSE_TEMPLATE and loaded.chat_template == tok.chat_template
    text = PROMPT + CALL + RESULT + ANSWER
    assert ids(loaded, text) == ids(tok, text) and len(loaded) == len(tok)
    assert set(ROLES) <= set(loaded.all_special_tokens)


# --- the warm start -----------------------------------------------------------------------------------------


def test_transcript_tokens_and_masks_are_the_rollouts_concatenation(tok):
    """The warm start sees what a rollout builds: prompt, the model's call, the template's result tokens (not
    learnt), the model's answer - each assistant turn learnt up to and including its EOS."""
    p = problem()
    prompt_ids, completion_ids, mask = demonstration_tokens(tok, p.prompt, p.completion(), TOOLS)
    call, result, answer = ids(tok, CALL), ids(tok, RESULT), ids(tok, ANSWER)
    assert prompt_ids == ids(tok, PROMPT)
    assert completion_ids == call + result + answer
    assert mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)

    _, completion_ids, mask = demonstration_tokens(tok, p.prompt, p.completion(guess=True), TOOLS)
    assert (completion_ids == ids(tok, "<answer>\n5600\n</answer><|eos|>")
            and mask == [1] * len(completion_ids))

    _, completion_ids, mask = demonstration_tokens(tok, p.prompt, p.completion(format_break=1), TOOLS)
    error = ids(tok,
                "<|user|><tool_response>\n{'error': 'invalid expression'}\n</tool_response><|assistant|>")
    bad_call = ids(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 times 45"}}\n'
                        "</tool_call><|eos|>")
    assert completion_ids == bad_call + error + ids(tok, "<answer>\n5600\n</answer><|eos|>")
    assert (mask == [1] * len(bad_call) + [0] * len(error) + [1]
            * (len(completion_ids) - len(bad_call) - len(error)))

    # text prompts (the word problems) learn every completion token
    assert demonstration_tokens(tok, "Add 1 and 2.", "<answer>\n3\n</answer>") == (
        ids(tok, "Add 1 and 2."), ids(tok, ANSWER.replace("5535", "3")),
        [1] * len(ids(tok, ANSWER.replace("5535", "3"))))


def test_warm_start_batches_learn_the_assistant_tokens_only(tok):
    train, _ = generate_splits(30, 0, 999, seed=0)
    demos = build_demonstrations(train, tok, template_noise(0.5, 0.3, len(TEMPLATES)), TOOLS)
    assert demos.num_breaks == len(CALL_BREAKS) and len(demos.variant_ids[0]) == 2 * len(CALL_BREAKS)
    input_ids, attention_mask, labels = sample_batch(demos, 64, 0.5, torch.Generator().manual_seed(0))
    eos, user, assistant = tok.eos_token_id, *tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    kinds = set()
    for row, lab, att in zip(input_ids.tolist(), labels.tolist(), attention_mask.tolist()):
        n = sum(att)
        assert all(lab[i] == row[i] for i in range(n) if lab[i] != IGNORE_INDEX)  # labels are the tokens
        assert all(lab[i] == IGNORE_INDEX for i in range(n, len(row)))  # padding
        start = row.index(assistant) + 1  # the completion, after the prompt (not learnt)
        assert all(lab[i] == IGNORE_INDEX for i in range(start))
        unlearnt = [i for i in range(start, n) if lab[i] == IGNORE_INDEX]
        text = tok.decode(row[start:n])
        # call <|eos|> | <|user|><tool_response>...</tool_response><|assistant|> | answer
        if "<tool_call>" in text:
            end_of_call = start + row[start:].index(eos)
            answer = end_of_call + 1 + row[end_of_call + 1:].index(assistant) + 1
            assert row[end_of_call + 1] == user and unlearnt == list(range(end_of_call + 1, answer))
            assert row[n - 1] == eos and lab[n - 1] == eos
            kinds.add("error" if "{'error'" in text else "tool")
        else:
            assert unlearnt == [] and text.startswith("<answer>")
            kinds.add("guess")
    assert kinds == {"tool", "guess", "error"}


# --- prepare ------------------------------------------------------------------------------------------------


def test_prepare_builds_the_calculator_task(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.embedded import EmbeddedConfig, prepare

    cfg = EmbeddedConfig(seed=1, num_train=40, num_eval=10, tasks=["calculator"], max_operand=999,
                         data_dir=str(tmp_path / "data"), model_dir=str(tmp_path / "model"), hidden_size=32,
                         num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, warm_start_steps=3,
                         warm_start_batch_size=8, label_noise=0.6)
    summary = prepare(cfg, log=None)
    assert (summary["template_wrong_op_rates"]
            == [round(r, 4) for r in template_noise(0.6, 0.3, len(TEMPLATES))])
    rows = [json.loads(line) for line in Path(cfg.data_dir, "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and all(r["task"] == "calculator" and r["prompt"][0]["role"] == "user"
                                   for r in rows)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = AutoTokenizer.from_pretrained(cfg.model_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir)
    assert model.config.vocab_size == len(loaded) and loaded.response_template == RESPONSE_TEMPLATE
    prompt = loaded.apply_chat_template(rows[0]["prompt"], tools=TOOLS, add_generation_prompt=True,
                                        tokenize=False)
    assert (
        prompt == f"<|system|>tools: calculator(expression: string)<|user|>{rows[0]['prompt'][0]['content']}"
        "<|assistant|>"
    )
    assert set(vocabulary_words()) >= set(NAMES) | set(OBJECTS) | {"times", "plus", "What", "Multiply"}
    with pytest.raises(ValueError, match="cannot be mixed"):
        prepare(EmbeddedConfig(tasks=["calculator", "arithmetic"], max_operand=999,
                               data_dir=str(tmp_path / "d2"), model_dir=str(tmp_path / "m2")), log=None)


# --- the recipe ---------------------------------------------------------------------------------------------

# What configs/embedded-tools.yaml changes of params.yaml (its header says why), besides the rewards and the
# reward-hacking guard's format reward; nothing else may differ.
RECIPE_CHANGES = {
    ("embedded", "tasks"): ["calculator"], ("embedded", "max_operand"): 99,
    ("embedded", "warm_start_steps"): 1500, ("embedded", "label_noise"): 0.6,
    ("generation", "max_completion_length"): 64, ("train", "max_steps"): 200,
    ("train", "tools"): ["grpo_core.embedded.tools:calculator"], ("train", "max_tool_calling_iterations"): 1,
    ("train", "async_rollouts"): False,
}


def test_recipe_is_params_yaml_with_the_calculator_task():
    import importlib

    import yaml

    from grpo_core.config import load_config

    default = yaml.safe_load((REPO / "params.yaml").read_text())
    recipe = yaml.safe_load((REPO / "configs/embedded-tools.yaml").read_text())
    cfg = load_config(REPO / "configs/embedded-tools.yaml")
    assert cfg.embedded.tasks == ["calculator"] and cfg.train.tool_use.enabled
    module, _, name = cfg.train.tool_use.tools[0].partition(":")
    assert getattr(importlib.import_module(module), name) is calculator
    undo_recipe_changes(recipe, default, RECIPE_CHANGES)
    assert (recipe["rewards"]
            == [{"name": "correctness", "function": "correctness", "kwargs": {}, "target_share": 1.0}])
    assert recipe["guards"]["reward_hacking"]["format_reward"] is None  # no format reward to watch
    recipe["rewards"], recipe["guards"]["reward_hacking"]["format_reward"] = default["rewards"], "format"
    assert recipe == default
