"""Tools and environments (grpo_core/tools/): import and checks, parsing the tool-call formats (against TRL
1.16's own parser on the same tokens), the tokens of tool results (against TRL's ``_get_tool_suffix_ids``),
running calls (concurrency, order, timeouts, errors), and bad input named where it is."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from grpo_core.config import ConfigError, config_from_dict
from grpo_core.tools import (
    EnvironmentFailure,
    RolloutTools,
    ToolCall,
    ToolChat,
    ToolConfigError,
    build_toolbox,
    close_all,
    run_calls,
)
from grpo_core.tools import ToolUseOptions as ToolUseConfig
from tests.tool_fixtures import Counter, add, hermes_call, llama_tokenizer, multiply, qwen_tokenizer

trl = pytest.importorskip("trl")


def tool_use(tools=(), environment_factory=None, max_iterations=None, timeout=10.0) -> ToolUseConfig:
    return ToolUseConfig(list(tools), environment_factory, max_iterations, timeout, None)


# -- tools and environments imported and checked ------------------------------------------------------------


def no_hints(a, b):
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b


def no_docstring(a: int) -> str:
    return str(a)


def undocumented_argument(a: int, b: int) -> str:
    """Add, with b undocumented.

    Args:
        a: one
    """
    return str(a + b)


def returns_bytes(a: int) -> bytes:
    """Bytes.

    Args:
        a: a number
    """
    return bytes(a)


class NoReset:
    def tool(self, a: int) -> str:
        """A tool.

        Args:
            a: a number
        """
        return str(a)


class BrokenInit:
    def __init__(self):
        raise RuntimeError("no database")

    def reset(self, **row):
        return None


class UndocumentedMethod:
    def reset(self, **row):
        return None

    def step(self, a: int) -> str:
        return str(a)


class ClashingMethod:
    def reset(self, **row):
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply.

        Args:
            a: one
            b: two
        """
        return a * b


class BadObservation(Counter):
    def reset(self, **row):
        return 7


class SleepingReset(Counter):
    """reset() hangs on the row that asks it to (the probe's build and close are quick)."""

    def reset(self, sleep: float = 0.0, **row):
        time.sleep(sleep)
        return None


class SleepingClose(Counter):
    closes = 0

    def close(self) -> None:
        SleepingClose.closes += 1
        if SleepingClose.closes > 1:  # the probe's close is quick; the rollouts' hang
            time.sleep(SLEEP_S)


class SleepingInit(Counter):
    built = 0

    def __init__(self):
        SleepingInit.built += 1
        if SleepingInit.built > 1:  # the probe builds it quickly; the rollouts' builds hang
            time.sleep(SLEEP_S)


SLEEP_S = 30.0  # far past the tests' 0.5 s bound: only the bound can end the wait


def test_tools_import_with_their_schemas():
    box = build_toolbox(tool_use(["tests.tool_fixtures:multiply", "tests.tool_fixtures:add"]))
    assert box.tools == [multiply, add] and box.factories is None
    (rollout,) = box.open([{"prompt": "p"}])
    assert list(rollout.functions) == ["multiply", "add"] and rollout.environment is None
    assert build_toolbox(tool_use()) is None


@pytest.mark.parametrize("path, words", [
    ("tests.nowhere:multiply", ["train.tools[0]", "cannot import module 'tests.nowhere'"]),
    ("tests.tool_fixtures:nothing", ["train.tools[0]", "has no attribute 'nothing'"]),
    ("tests.test_tools:no_hints", ["train.tools[0]", "missing a type hint", "no_hints"]),
    ("tests.test_tools:no_docstring", ["no docstring"]),
    ("tests.test_tools:undocumented_argument", ["no description for the argument 'b'"]),
    ("tests.test_tools:returns_bytes", ["returns <class 'bytes'>", "returns a string"]),
])
def test_a_tool_that_cannot_be_used_is_refused_naming_it(path, words):
    with pytest.raises(ToolConfigError) as err:
        build_toolbox(tool_use([path]))
    assert all(w in str(err.value) for w in words), str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize("factory, words", [
    ("tests.test_tools:NoReset", ["train.environment_factory", "no reset() method"]),
    ("tests.test_tools:BrokenInit", ["RuntimeError: no database", "built with no arguments"]),
    ("tests.test_tools:UndocumentedMethod", ["method step", "no docstring"]),
    ("tests.test_tools:ClashingMethod", ["multiply()", "must be unique"]),
    ({"counter": "tests.tool_fixtures:Counter", "broken": "tests.test_tools:NoReset"},
     ["train.environment_factory.broken"]),
])
def test_an_environment_that_cannot_be_used_is_refused_naming_it(factory, words):
    with pytest.raises(ToolConfigError) as err:
        build_toolbox(tool_use(["tests.tool_fixtures:multiply"], factory))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_environments_are_built_per_rollout_reset_with_their_row_and_closed():
    Counter.closed.clear()
    box = build_toolbox(tool_use(environment_factory="tests.tool_fixtures:Counter"))
    assert len(Counter.closed) == 1  # the probe, closed
    opened = box.open([{"prompt": "p", "start": 3}, {"prompt": "p", "start": 3}])
    assert opened[0].environment is not opened[1].environment
    assert list(opened[0].functions) == ["increment"]  # reset, get_reward and close are not tools
    assert opened[0].observation == " The counter starts at 3." and opened[0].environment.count == 3
    opened[0].functions["increment"](by=2)
    assert opened[0].environment.count == 5 and opened[1].environment.count == 3  # state is the rollout's
    from grpo_core.tools import close_all

    close_all(opened)
    assert Counter.closed[1:] == [id(t.environment) for t in opened]


def test_a_mapping_picks_each_rows_environment_and_refuses_unknown_names():
    box = build_toolbox(tool_use(["tests.tool_fixtures:multiply"],
                                 {"counter": "tests.tool_fixtures:Counter"}))
    (tools,) = box.open([{"prompt": "p", "environment": "counter", "start": 1}])
    assert set(tools.functions) == {"multiply", "increment"} and tools.environment.count == 1
    with pytest.raises(EnvironmentFailure, match=r"row 7: environment 'count' .* not one of .*\['counter'\]"):
        box.open([{"prompt": "p", "environment": "count"}], ["row 7"])


def test_a_reset_that_returns_neither_none_nor_text_is_an_error_and_closes_the_environment():
    Counter.closed.clear()
    box = build_toolbox(tool_use(environment_factory="tests.test_tools:BadObservation"))
    with pytest.raises(EnvironmentFailure, match="row 0: BadObservation.reset\\(\\) returned int"):
        box.open([{"prompt": "p"}])
    assert len(Counter.closed) == 2  # the probe and the failed rollout's


@pytest.mark.parametrize("factory, rows, what", [
    ("SleepingReset", [{"prompt": "p", "sleep": SLEEP_S}], r"row 0: SleepingReset.reset\(\)"),
    ("SleepingClose", [{"prompt": "p"}], r"SleepingClose.close\(\)"),
    ("SleepingInit", [{"prompt": "p"}], r"row 0: SleepingInit\(\)"),
])
def test_an_environment_that_hangs_fails_within_the_bound_naming_what_hung(factory, rows, what):
    """A sleeping constructor, reset or close: EnvironmentFailure within train.tool_timeout_s, not a hang."""
    SleepingInit.built = SleepingClose.closes = 0
    box = build_toolbox(tool_use(environment_factory=f"tests.test_tools:{factory}", timeout=0.5))
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure,
                       match=rf"{what} did not return within train.tool_timeout_s = 0.5 s"):
        close_all(box.open(rows, ["row 0"]))
    assert time.monotonic() - start < 5


def test_a_probe_that_hangs_on_building_the_environment_is_bounded():
    SleepingInit.built = 1  # every build hangs, the probe's too
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"train.environment_factory "
                                                 r"\(tests.test_tools:SleepingInit\): building the "
                                                 r"environment did not return within"):
        build_toolbox(tool_use(environment_factory="tests.test_tools:SleepingInit", timeout=0.5))
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("train, words", [
    ({"tools": ["tests.tool_fixtures.multiply"]}, ["train.tools[0]", "'package.module:name'"]),
    ({"tools": ["a:b", "a:b"]}, ["named twice"]),
    ({"environment_factory": {}}, ["empty mapping"]),
    ({"environment_factory": {"x": "nocolon"}}, ["train.environment_factory.x"]),
    ({"tools": ["a:b"], "rollout_func": "m:f"}, ["train.rollout_func", "not with train.tools"]),
    ({"max_tool_calling_iterations": -1}, ["train.max_tool_calling_iterations"]),
])
def test_config_refuses_malformed_tool_keys(train, words):
    raw = {"data": {"train_files": ["x.jsonl"]}, "rewards": [{"name": "c", "function": "correctness"}],
           "train": train}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_environment_reward_needs_environments():
    raw = {"data": {"train_files": ["x.jsonl"]},
           "rewards": [{"name": "env", "function": "environment_reward"}]}
    with pytest.raises(ConfigError,
                       match="rewards\\[0\\]: environment_reward .* set train.environment_factory"):
        config_from_dict(raw)
    raw["train"] = {"environment_factory": "tests.tool_fixtures:Counter"}
    assert config_from_dict(raw).train.tool_use.enabled


# -- parsing: the formats, against TRL's parser --------------------------------------------------------------


def _trl_parse(tok, ids, prefix, tools):
    """TRL 1.16: the response template it sets for a recognised chat template, and its parse_response."""
    import copy

    from trl.chat_template_utils import add_response_schema, parse_response

    theirs = add_response_schema(copy.deepcopy(tok))
    return parse_response(theirs, ids, prefix=prefix, tools=tools)


def _prompt(tok, question="what is 12 times 34"):
    return tok.apply_chat_template([{"role": "user", "content": question}], tools=[multiply, add],
                                   tokenize=False, add_generation_prompt=True)


LLAMA_CALL = '{"name": "multiply", "parameters": {"a": 12, "b": "34"}}'


@pytest.mark.parametrize("make, template, replies", [
    (qwen_tokenizer, "qwen2_5", [hermes_call("multiply", a=12, b=34) + "<|im_end|>",
                                 "Let me see.\n" + hermes_call("multiply", a="12", b=34) + "\n"
                                 + hermes_call("add", a=1, b=2) + "<|im_end|>",
                                 "The answer is 408<|im_end|>", "The answer is 4"]),
    (qwen_tokenizer, "qwen3",
     ["<think>\nneed a tool\n</think>\n\n" + hermes_call("add", a=1, b=2) + "<|im_end|>",
      "<think>\n\n</think>\n\nThe answer is 3<|im_end|>"]),
    (llama_tokenizer, "llama3_1", [LLAMA_CALL + "<|eot_id|>", "The answer is 408<|eot_id|>"]),
])
def test_tool_calls_parse_as_trls_parser_parses_them(make, template, replies):
    tok = make(template)
    chat = ToolChat.for_tokenizer(tok)
    assert chat.source == ("llama3" if template.startswith("llama") else "hermes")
    prefix = tok(_prompt(tok), add_special_tokens=False)["input_ids"]
    for reply in replies:
        ids = tok(reply, add_special_tokens=False)["input_ids"]
        turn = chat.parse(ids, prefix, [multiply, add])
        assert turn.message == _trl_parse(tok, ids, prefix, [multiply, add]), reply
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in turn.message.get("tool_calls", [])]
        assert ([(c.name, c.arguments) for c in turn.calls] == calls
                and all(c.error is None for c in turn.calls))
    assert turn.calls == [] and turn.message["content"].startswith("The answer is")


def test_a_call_typed_by_its_tools_schema():
    tok = llama_tokenizer()
    chat = ToolChat.for_tokenizer(tok)
    turn = chat.parse(tok(LLAMA_CALL + "<|eot_id|>", add_special_tokens=False)["input_ids"], [], [multiply])
    assert turn.calls == [ToolCall("multiply", {"a": 12, "b": 34})]  # "34" -> 34: b is an integer


@pytest.mark.parametrize("reply, reason", [
    ('<tool_call>\n{"name": "multiply", "arguments": {"a": 12\n</tool_call><|im_end|>', "could not parse"),
    ('<tool_call>\n{"nam": "multiply"}\n</tool_call><|im_end|>', "has no function name"),
    ('<tool_call>\n{"name": "multiply", "arguments": [1, 2]}\n</tool_call><|im_end|>',
     "arguments are not a JSON"),
])
def test_a_malformed_call_becomes_a_failed_call_with_its_reason(reply, reason):
    tok = qwen_tokenizer()
    chat = ToolChat.for_tokenizer(tok)
    turn = chat.parse(tok(reply, add_special_tokens=False)["input_ids"], [], [multiply])
    assert turn.message == {"role": "assistant",
                            "content": reply.removesuffix("<|im_end|>")}  # TRL's fallback
    (call,) = turn.calls
    assert call.error.startswith("malformed tool call") and reason in call.error


def test_a_tokenizers_own_response_template_is_used():
    from trl.chat_template_utils import qwen3_template

    tok = qwen_tokenizer()
    tok.response_template = qwen3_template
    assert ToolChat.for_tokenizer(tok).source == "tokenizer"


def test_templates_that_cannot_carry_tool_calls_are_refused():
    tok = qwen_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ToolConfigError, match="does not show the call's name, its arguments"):
        ToolChat.for_tokenizer(tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% for c in m.get('tool_calls', []) %}[CALL {{ c.function.name }}"
                         "({{ c.function.arguments | tojson }})]{% endfor %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ToolConfigError,
                       match=r"writes a tool call as '\[CALL probe_tool.*set a response_template"):
        ToolChat.for_tokenizer(tok)
    tok.chat_template = None
    with pytest.raises(ToolConfigError, match="need a chat template"):
        ToolChat.for_tokenizer(tok)


# -- the tokens of tool results, against TRL's ---------------------------------------------------------------


def _trl_suffix(tok, messages, chat_template=None):
    from trl.trainer.grpo_trainer import GRPOTrainer

    stand_in = object.__new__(GRPOTrainer)
    stand_in.processing_class, stand_in._tokenizer, stand_in._is_vlm = tok, tok, False
    stand_in.chat_template, stand_in.chat_template_kwargs = chat_template, {}
    return GRPOTrainer._get_tool_suffix_ids(stand_in, messages)


@pytest.mark.parametrize("make, template", [(qwen_tokenizer, "qwen2_5"), (llama_tokenizer, "llama3_1"),
                                            (qwen_tokenizer, "qwen3")])
def test_tool_result_tokens_are_trls(make, template):
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    tok = make(template)
    messages = [{"role": "tool", "name": "multiply", "content": "408"},
                {"role": "tool", "name": "add", "content": "{'error': 'boom'}"}]
    # Qwen3's template re-renders the call once a result follows: TRL swaps in its training template for it,
    # we count end-of-turn tokens instead; the tokens must be the same
    training = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    assert (training is not None) == (template == "qwen3")
    ours = ToolChat.for_tokenizer(tok).suffix_ids(messages)
    assert ours == _trl_suffix(tok, messages, training)
    assert "408" in tok.decode(ours) and tok.decode(ours).endswith(
        "<|im_start|>assistant\n" if template.startswith("qwen")
        else "<|start_header_id|>assistant<|end_header_id|>\n\n")


# -- running calls -------------------------------------------------------------------------------------------


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def boom(a: int) -> str:
    """Raise.

    Args:
        a: anything
    """
    raise ValueError(f"bad a={a}")


def gives_object(a: int) -> str:
    """Return an object.

    Args:
        a: anything
    """
    return object()


def gives_none(a: int) -> None:
    """Return nothing.

    Args:
        a: anything
    """


async def later(a: int) -> str:
    """Await, then answer.

    Args:
        a: anything
    """
    await asyncio.sleep(0.01)
    return f"later {a}"


TOOLS = {f.__name__: f for f in (slow, boom, gives_object, gives_none, later, multiply)}


def test_calls_of_different_rollouts_run_concurrently():
    t0 = time.perf_counter()
    results = run_calls([(TOOLS, [ToolCall("slow", {"seconds": 0.4})]) for _ in range(4)], timeout_s=5)
    assert time.perf_counter() - t0 < 1.0  # 4 x 0.4 s one after the other would be 1.6 s
    assert [r[0].content for r in results] == ["slept 0.4"] * 4 and not any(r[0].failed for r in results)


def test_one_rollouts_calls_run_in_order_on_its_environment():
    counter = Counter()
    counter.reset(start=0)
    tools = RolloutTools({"increment": counter.increment}, counter)
    calls = [ToolCall("increment", {"by": 1}), ToolCall("increment", {"by": 10}),
             ToolCall("increment", {"by": 100})]
    (results,) = run_calls([(tools.functions, calls)], timeout_s=5)
    assert [r.content for r in results] == ["1", "11", "111"]


def test_errors_are_answered_as_trl_writes_them_and_counted():
    calls = [ToolCall("boom", {"a": 3}), ToolCall("nope", {}), ToolCall("multiply", {"a": 2}),
             ToolCall("gives_object", {"a": 1}), ToolCall("unknown", {}, "malformed tool call: broken JSON"),
             ToolCall("multiply", {"a": 2, "b": 5}), ToolCall("gives_none", {"a": 1}),
             ToolCall("later", {"a": 4})]
    (results,) = run_calls([(TOOLS, calls)], timeout_s=5)
    assert [(r.content, r.failed) for r in results] == [
        ("{'error': 'bad a=3'}", True),
        ("{'error': 'Tool nope not found.'}", True),
        ("{'error': \"multiply() missing 1 required positional argument: 'b'\"}", True),
        ("{'error': 'Tool gives_object returned object; a tool returns a string (numbers, lists, dicts and "
         "None are shown with str())'}", True),
        ("{'error': 'malformed tool call: broken JSON'}", True),
        ("10", False), ("None", False), ("later 4", False)]
    assert results[0].message == {"role": "tool", "name": "boom", "content": "{'error': 'bad a=3'}"}


def test_a_call_past_its_time_is_answered_and_the_rollouts_later_calls_are_not_run():
    t0 = time.perf_counter()
    results = run_calls([(TOOLS, [ToolCall("slow", {"seconds": 3}), ToolCall("multiply", {"a": 1, "b": 2})]),
                         (TOOLS,
                          [ToolCall("multiply", {"a": 2, "b": 3}), ToolCall("multiply", {"a": 3, "b": 4})])],
                        timeout_s=0.3)
    assert time.perf_counter() - t0 < 1.5
    assert [(r.content, r.failed) for r in results[0]] == [
        ("{'error': 'Tool slow timed out after 0.3 s'}", True),
        ("{'error': 'Tool multiply not run: an earlier call of this turn timed out'}", True)]
    assert [r.content for r in results[1]] == ["6", "12"]


# -- rollout_func: what it must return -----------------------------------------------------------------------


def one_arg(prompts):
    return {}


@pytest.mark.parametrize("out, message", [
    ([], "returned list; it returns a dict"),
    ({"prompt_ids": [[1]], "completion_ids": [[2]]}, "must return keys ['logprobs']"),
    ({"prompt_ids": [[1]], "completion_ids": [[2], [3]], "logprobs": None}, "list of 1 token-id lists"),
    ({"prompt_ids": [[1]], "completion_ids": [[]], "logprobs": None}, "an empty completion"),
    ({"prompt_ids": [[1]], "completion_ids": [[2.5]], "logprobs": None}, "other than int token ids"),
    ({"prompt_ids": [[1]], "completion_ids": [[2, 3]], "logprobs": [[0.1]]},
     "'logprobs' must have one value"),
    ({"prompt_ids": [[1]], "completion_ids": [[2, 3]], "logprobs": None, "env_mask": [[1, 2]]},
     "other than 0 and 1"),
    ({"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": None, "score": [1, 2]},
     "'score' has 2 values"),
])
def test_a_rollout_func_returning_the_wrong_thing_is_named(out, message):
    from grpo_core.rollout.custom import RolloutContext, RolloutFuncError, run_rollout_func
    from grpo_core.rollout.types import SamplingParams

    context = RolloutContext(None, qwen_tokenizer(), SamplingParams(max_new_tokens=4), 1)
    with pytest.raises(RolloutFuncError, match=re.escape(message)):
        run_rollout_func(lambda prompts, trainer: out, ["p"], context, pad_id=0, eos_ids=[9])


def test_a_rollout_func_batch_masks_what_it_inserted_and_broadcasts_scalars():
    from grpo_core.rollout.custom import RolloutContext, run_rollout_func
    from grpo_core.rollout.types import SamplingParams

    out = {"prompt_ids": [[5, 6], [7]], "completion_ids": [[1, 2, 9], [3, 4]],
           "logprobs": [[-0.1, None, -0.3], [-0.4, -0.5]], "env_mask": [[1, 0, 1], [1, 1]], "tag": "x"}
    context = RolloutContext(None, qwen_tokenizer(), SamplingParams(max_new_tokens=4), 2)
    batch, extra = run_rollout_func(lambda prompts, trainer: out, ["a", "a"], context, pad_id=0, eos_ids=[9])
    assert batch.model_mask.tolist() == [[1, 0, 1], [1, 1, 0]] and batch.completion_lengths.tolist() == [2, 2]
    assert batch.is_truncated.tolist() == [False, True] and extra == {"tag": ["x", "x"]}
    assert torch.isnan(batch.sampling_logps[0, 1]) and batch.prompt_ids.tolist() == [[5, 6], [0, 7]]


def test_a_rollout_func_that_cannot_take_prompts_and_trainer_is_refused():
    from grpo_core.tools import load_rollout_func

    with pytest.raises(ToolConfigError,
                       match=r"train.rollout_func \(tests.test_tools:one_arg\): cannot be called"):
        load_rollout_func(ToolUseConfig([], None, None, 1.0, "tests.test_tools:one_arg"))
    with pytest.raises(ToolConfigError, match="cannot import module"):
        load_rollout_func(ToolUseConfig([], None, None, 1.0, "tests.none:f"))
    assert load_rollout_func(ToolUseConfig([], None, None, 1.0, None)) is None


def test_the_docs_tool_and_environment_work_as_shown():
    """docs/agentic.md's ten-line tool and environment pass the checks and do what the page says."""
    import re
    from pathlib import Path

    from grpo_core.tools import tool_schema
    from grpo_core.tools.registry import environment_tools, probe_environment

    page = (Path(__file__).resolve().parents[1] / "docs/agentic.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    namespace: dict = {}
    for block in blocks:
        assert len([ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]) <= 10, block
        exec(block, namespace)  # noqa: S102 - the page's own code
    assert tool_schema(namespace["multiply"], "docs")["function"]["parameters"]["required"] == ["a", "b"]
    probe_environment(namespace["Counter"], "docs", [])
    counter = namespace["Counter"]()
    counter.reset(start=3, prompt="p")
    assert list(environment_tools(counter)) == ["increment"] and counter.increment(by=2) == "5"


def test_a_transformers_without_response_templates_is_named(monkeypatch):
    tok = qwen_tokenizer()
    monkeypatch.setattr(type(tok), "parse_response", lambda self, response, schema=None: {}, raising=True)
    with pytest.raises(ToolConfigError, match="tools need transformers >= 5.15"):
        ToolChat.for_tokenizer(tok)
