"""Ollama's Modelfile for an exported GGUF (``grpo_core/model/gguf_export.py``): ``FROM`` the file, the
chat ``TEMPLATE`` (a Go template derived by rendering the model's own chat template on probe chats),
``SYSTEM`` (the system prompt the policy was trained under, else the template's default), stop tokens and the
sampling parameters.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from grpo_core.model.gguf_export import Sampling

MODELFILE = "Modelfile"

PROBES = {"system": "\u2063SYSTEM\u2063", "user": "\u2063USER\u2063", "assistant": "\u2063ASSISTANT\u2063"}


@dataclass(frozen=True)
class ChatLayout:
    """A chat template as fixed text around each message's content: what an Ollama Go template can say."""

    around: dict[str, tuple[str, str]]   # role -> (text before the content, text after it)
    generation: str                      # what opens the assistant's reply
    default_system: str | None           # the system prompt the template adds when a chat has none


def render(tokenizer, messages: list[dict], generation: bool = False) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception:  # noqa: BLE001 - a template may refuse a probe (a role it lacks): no layout then
        return None


def chat_layout(tokenizer) -> ChatLayout | None:
    """The template's layout, found by rendering probe chats, or None when it is not fixed text around each
    message (the template then stays the GGUF's own, which Ollama and llama.cpp read themselves)."""
    if not tokenizer.chat_template:
        return None
    turns = [{"role": r, "content": PROBES[r]} for r in ("system", "user", "assistant")]
    renders = [render(tokenizer, turns[:n]) for n in (1, 2, 3)]
    prompt = render(tokenizer, turns[:2], generation=True)
    if None in renders or prompt is None:
        return None
    previous, around = "", {}
    for turn, text in zip(turns, renders):
        segment = text[len(previous):] if text.startswith(previous) else ""
        if segment.count(turn["content"]) != 1:
            return None
        around[turn["role"]] = tuple(segment.split(turn["content"]))
        previous = text
    if not prompt.startswith(renders[1]):
        return None
    layout = ChatLayout(around, prompt[len(renders[1]):], None)
    return with_default_system(tokenizer, layout) if layout_holds(tokenizer, layout) else None


def layout_holds(tokenizer, layout: ChatLayout) -> bool:
    """The layout rebuilds a longer chat exactly as the template renders it (more turns of each role, then the
    generation prompt)."""
    roles = ("system", "user", "assistant", "user", "assistant", "user")
    chat = [{"role": r, "content": f"{PROBES[r]}{i}"} for i, r in enumerate(roles)]
    expected = "".join(layout.around[m["role"]][0] + m["content"] + layout.around[m["role"]][1] for m in chat)
    return render(tokenizer, chat, generation=True) == expected + layout.generation


def with_default_system(tokenizer, layout: ChatLayout) -> ChatLayout | None:
    """The layout plus the system prompt the template adds to a chat without one (None: it adds none)."""
    before, after = layout.around["user"]
    alone = render(tokenizer, [{"role": "user", "content": PROBES["user"]}])
    user = before + PROBES["user"] + after
    if alone == user:
        return layout
    head = alone[:-len(user)] if alone is not None and alone.endswith(user) else ""
    sys_before, sys_after = layout.around["system"]
    framed = head.startswith(sys_before) and head.endswith(sys_after)
    if not framed or len(head) <= len(sys_before + sys_after):
        return None
    return dataclasses.replace(layout, default_system=head[len(sys_before):len(head) - len(sys_after)])


def go_text(text: str) -> str:
    """Literal text inside a Go template ("{{" opens an action)."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(layout: ChatLayout) -> str:
    """Ollama's TEMPLATE for the layout: each message of .Messages between its role's texts, then the
    assistant's opening. One line of actions: a trimming {{- would eat the texts' newlines."""
    branches = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{go_text(before)}'
                       f"{{{{ .Content }}}}{go_text(after)}"
                       for i, (role, (before, after)) in enumerate(layout.around.items()))
    return f"{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{go_text(layout.generation)}"


def stop_tokens(tokenizer, layout: ChatLayout | None) -> list[str]:
    """EOS, then each special token the chat layout writes (Ollama's convention: <|im_start|>, <|im_end|>)."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if layout is not None:
        specials = [t for t in tokenizer.all_special_tokens] + [
            a.content for a in tokenizer.added_tokens_decoder.values() if a.special]
        texts = "".join(b + a for b, a in layout.around.values()) + layout.generation
        found = sorted({t for t in specials if t in texts}, key=texts.index)
        stops += [t for t in found if t not in stops]
    return stops


def modelfile_text(gguf_file: str, tokenizer, sampling: Sampling, system: str | None = None) -> str:
    """Ollama's Modelfile for ``gguf_file`` (a name beside the Modelfile): ``ollama create <name> -f
    Modelfile``. system: the system prompt the policy was trained under (params.yaml data.system_prompt), the
    chat's default, as training rendered it; None = the template's own default, if it has one."""
    layout = chat_layout(tokenizer)
    texts = [] if layout is None else [*(t for pair in layout.around.values() for t in pair),
                                       layout.generation, layout.default_system or ""]
    if any('"""' in t for t in texts):
        layout = None  # the Modelfile's quoting cannot hold it
    system = system or (layout.default_system if layout is not None else None)
    lines = [f"# Ollama: ollama create <name> -f {MODELFILE} && ollama run <name>", f"FROM ./{gguf_file}"]
    if layout is not None:
        lines.append(f'TEMPLATE """{go_template(layout)}"""')
    elif tokenizer.chat_template:
        lines.append("# TEMPLATE: the chat template is not fixed text around each message; Ollama takes it "
                     "from the GGUF's tokenizer.chat_template")
    elif system:  # no chat template: plain completion, the system prompt on a line of its own (as trained)
        lines.append('TEMPLATE """{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}"""')
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    if system and '"""' in system:
        lines.append('# SYSTEM: the system prompt holds """, which a Modelfile cannot quote: send it as the '
                     "chat's system message")
    elif system:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f"PARAMETER stop {json.dumps(t)}" for t in stop_tokens(tokenizer, layout)]
    lines += [f"PARAMETER temperature {sampling.temperature}", f"PARAMETER top_p {sampling.top_p}",
              f"PARAMETER top_k {sampling.top_k}", f"PARAMETER min_p {sampling.min_p}",
              f"PARAMETER repeat_penalty {sampling.repeat_penalty}"]
    return "\n".join(lines) + "\n"
