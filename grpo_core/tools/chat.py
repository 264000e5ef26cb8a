"""The chat-template side of tool calling: a completion's tool calls parsed back into messages, and the tokens
the template writes around tool results.

Parsing is transformers' response parsing (``tokenizer.parse_response`` with a ``response_template``, the way
TRL 1.16 parses). A tokenizer that ships its own ``response_template`` is parsed with it. Otherwise - today
most hub tokenizers, and TRL then sets one by recognising the exact chat template - the tool-call format is
recognised by rendering a probe call with the model's own chat template:

    <tool_call>{"name": ..., "arguments": {...}}</tool_call>    Hermes: Qwen2.5, Qwen3, and ChatML templates
                                                                like them
    {"name": ..., "parameters": {...}}<|eot_id|>                Llama 3.1 / 3.2 (one call per turn)

and the matching template below parses it (TRL 1.16's ``qwen3_template`` / ``llama3_template``, Apache-2.0,
with the turn markers read from the chat template itself: its generation prompt opens the assistant message,
the text it writes after an assistant message closes it). Any other format is refused before sampling, naming
the fix: set a ``response_template`` on the tokenizer (transformers' response-parsing docs).

Unlike TRL, a tool call that cannot be parsed (broken JSON, no function name) is not taken for plain text that
ends the conversation: the model is answered with the error, and the call counts as a failed one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from grpo_core.tools.registry import ToolConfigError

_PROBE_NAME, _PROBE_KEY, _PROBE_VALUE, _PROBE_RESULT = ("probe_tool_a8f3", "probe_key_b9d4",
                                                        "probe_value_d6e7", "probe_result_c4f9")
_PROBE_REPLY = "probe_reply_e1f2"


def _hermes_template(start: str, end: str) -> dict:
    """``<tool_call>{json}</tool_call>`` calls, ``<think>`` reasoning,
    the rest content up to the end of turn."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": start,
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
            "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": re.escape(end) + r"\s*", "content": "text"},
        },
    }


def _llama3_template(start: str, end: str) -> dict:
    """A turn that is one bare ``{"name": ..., "parameters": {...}}`` object, or content."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": start,
        "fields": {
            "tool_calls": {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
                           "close_pattern": r"\}" + re.escape(end) + r"\s*", "repeats": True,
                           "content": "json",
                           "transform": {"type": "function",
                                         "function": {"name": "{name}", "arguments": "{content}"}}},
            "content": {"close_pattern": re.escape(end) + r"\s*", "content": "text"},
        },
    }


@dataclass
class ToolCall:
    """One call the model wrote. ``error`` set: it is not run, the error is what the model is answered."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class Turn:
    """One assistant turn: its message (for rewards, TRL's shape) and the calls to run, in order."""

    message: dict
    calls: list[ToolCall]


def error_content(message: str) -> str:
    """A failed call's answer to the model, written as TRL writes it (``str({"error": ...})``)."""
    return str({"error": message})


class ToolChat:
    """Parsing of one tokenizer's completions and its tool-result tokens (``for_tokenizer``)."""

    def __init__(self, tokenizer, template: dict, source: str, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.source = source  # "tokenizer", "hermes" or "llama3": which parser is in use
        self.kwargs = dict(chat_template_kwargs or {})

    @classmethod
    def for_tokenizer(cls, tokenizer, chat_template_kwargs: dict | None = None) -> ToolChat:
        """The parser for ``tokenizer``'s chat template; a ToolConfigError when the template cannot show a
        tool call and its result, or writes calls in a format with no parser."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ToolConfigError("tools need a chat template: the tokenizer has none (chat prompts are "
                                  "rendered with it, tool schemas included)")
        _check_response_parsing(tokenizer)
        _check_renders_tool_calls(tokenizer)
        own = getattr(tokenizer, "response_template", None)
        if own is not None:
            chat = cls(tokenizer, own, "tokenizer", chat_template_kwargs)
        else:
            start, call_text, end = _probe_format(tokenizer)
            if "<tool_call>" in call_text:
                chat = cls(tokenizer, _hermes_template(start, end), "hermes", chat_template_kwargs)
            elif re.search(r'\{"name":\s*"' + _PROBE_NAME + r'",\s*"parameters":', call_text):
                chat = cls(tokenizer, _llama3_template(start, end), "llama3", chat_template_kwargs)
            else:
                raise ToolConfigError(
                    f"the chat template writes a tool call as {call_text.strip()[:120]!r}, a format with no "
                    "parser here (known: <tool_call>{json}</tool_call> as Qwen's, and Llama 3's bare JSON); "
                    "set a response_template on the tokenizer (tokenizer_config.json; "
                    "transformers' response parsing)")
        # fails here, not mid-run
        chat.suffix_ids([{"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}])
        return chat

    # -- parsing ---------------------------------------------------------------------------------------

    def parse(self, ids: list[int], prefix: list[int], tools: list | None) -> Turn:
        """The assistant message ``ids`` (model tokens, EOS included when there is one) make after ``prefix``
        (every token before them), tool-call arguments typed by the tools' schemas; its calls.

        As TRL's ``parse_response``: content without a trailing EOS, "" when absent. A call that cannot be
        parsed makes the message the decoded text, and one failed call whose error says why."""
        try:
            parsed = self.tokenizer.parse_response(ids, self.template, prefix=prefix, tools=tools or None)
            if parsed is None:
                raise ValueError("the response parser returned nothing")
            calls = _calls(parsed.get("tool_calls"))
        except (ValueError, TypeError) as exc:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return Turn({"role": "assistant", "content": text},
                        [ToolCall("unknown", {}, f"malformed tool call: {reason}")])
        content = parsed.get("content")
        if isinstance(content, str) and self.tokenizer.eos_token:
            content = content.removesuffix(self.tokenizer.eos_token)
        parsed["content"] = content or ""
        return Turn(parsed, calls)

    # -- tool results ----------------------------------------------------------------------------------

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens after an assistant turn's end-of-turn token up to the next assistant turn's first token:
        the template's tool-result block(s) and the generation prompt (TRL's ``_get_tool_suffix_ids``).

        Rendered on a stand-in conversation (a user message, an assistant message calling the first tool, the
        results). The suffix starts after the end-of-turn token (EOS) that closes the assistant message; a
        template that re-renders that message once results follow (Qwen3 drops its empty <think> block) still
        closes it with that EOS, so its suffix is the same. With no EOS at all in the assistant message the
        template must render it unchanged (prefix-preserving)."""
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function",
                                  "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
        prefix = self._render(dummy, add_generation_prompt=False)
        full = self._render(dummy + list(tool_messages), add_generation_prompt=True)
        eos = self.tokenizer.eos_token_id
        ends = prefix.count(eos) if eos is not None else 0
        if ends:
            positions = [i for i, t in enumerate(full) if t == eos]
            if len(positions) < ends:
                raise ToolConfigError("the chat template writes fewer end-of-turn tokens once a tool result "
                                      "follows; tool results cannot be appended to a completion")
            return full[positions[ends - 1] + 1:]
        if full[:len(prefix)] != prefix:
            raise ToolConfigError("the chat template renders an assistant tool call differently once a tool "
                                  "result follows and closes turns with no EOS, so the tokens of a tool "
                                  "result cannot be appended to a completion (TRL needs a prefix-preserving "
                                  "template too)")
        return full[len(prefix):]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False, **self.kwargs))


def _check_response_parsing(tokenizer) -> None:
    """transformers' response parsing with a prefix and the tools' schemas
    (``parse_response(ids, template, prefix=, tools=)``) arrived in transformers 5.15."""
    import inspect

    import transformers

    parse = getattr(tokenizer, "parse_response", None)
    accepted = inspect.signature(parse).parameters if parse is not None else {}
    if "prefix" not in accepted or "tools" not in accepted:
        raise ToolConfigError("tools need transformers >= 5.15 (response parsing with response templates, "
                              f"typed by the tools' schemas); installed: {transformers.__version__}")


def _calls(tool_calls: Any) -> list[ToolCall]:
    """The parsed ``tool_calls`` as ToolCalls (TRL's checks: a dict with a function name; arguments None ->
    {}); a ValueError for a call that is not one."""
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls is not a list")
    calls = []
    for i, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool call {i} is not a JSON object")
        if call.get("type", "function") != "function":
            calls.append(ToolCall(str(call.get("name", "unknown")), {},
                                  f"Unsupported tool call type: {call.get('type')}"))
            continue
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool call {i} has no function name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = function["arguments"] = {}
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {i}'s arguments are not a JSON object")
        calls.append(ToolCall(function["name"], arguments))
    return calls


def _render_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _probe_format(tokenizer) -> tuple[str, str, str]:
    """(generation prompt, the text of a probe call's assistant turn, end-of-turn text),
    read off the template."""
    user = [{"role": "user", "content": "probe"}]
    bare = _render_text(tokenizer, user, False)
    prompted = _render_text(tokenizer, user, True)
    if not prompted.startswith(bare) or prompted == bare:
        raise ToolConfigError("the chat template writes no generation prompt (add_generation_prompt), so the "
                              "start of an assistant message cannot be found; "
                              "set a response_template on the tokenizer")
    start = prompted[len(bare):]
    call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {_PROBE_KEY: _PROBE_VALUE}}}
    turn = _render_text(tokenizer, user + [{"role": "assistant", "content": "", "tool_calls": [call]}], False)
    call_text = turn[len(bare):]
    call_text = call_text[len(start):] if call_text.startswith(start) else call_text
    replied = _render_text(tokenizer, user + [{"role": "assistant", "content": _PROBE_REPLY}], False)
    end = replied.split(_PROBE_REPLY, 1)[-1].strip() or (tokenizer.eos_token or "")
    if not end:
        raise ToolConfigError("the chat template closes an assistant message with nothing and the tokenizer "
                              "has no EOS, so a turn's end cannot be found; "
                              "set a response_template on the tokenizer")
    return start, call_text, end


def _check_renders_tool_calls(tokenizer) -> None:
    """The template shows a call's name and arguments and a tool result (TRL's ``supports_tool_calling``: the
    plain Llama 3 template drops tool calls, some drop tool messages)."""
    from jinja2 import TemplateError

    call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {_PROBE_KEY: _PROBE_VALUE}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}]
    try:
        rendered = _render_text(tokenizer, messages, False)
    except (TemplateError, TypeError) as exc:
        raise ToolConfigError("the chat template cannot render a tool-calling conversation (user -> "
                              f"assistant with tool_calls -> tool): {exc}") from exc
    missing = [what for what, s in (("the call's name", _PROBE_NAME), ("its arguments", _PROBE_VALUE),
                                    ("the tool's result", _PROBE_RESULT)) if s not in rendered]
    if missing:
        raise ToolConfigError(f"the chat template does not show {', '.join(missing)} in a tool-calling "
                              "conversation, so it cannot be used with tools (use the model's tool-use "
                              "template)")
