"""Reward functions that tests name by import path (``tests.reward_helpers:<name>``)."""

import os
import signal
import threading

_calls = {"n": 0}


def digit_fraction(prompts, completions, **kwargs):
    """Share of a completion's characters that are digits: a graded signal even for a random model."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def starts_with_digit(prompts, completions, **kwargs):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def digit_fraction_then_die(prompts, completions, **kwargs):
    """digit_fraction, but SIGKILLs its own process on call number $GRPO_TEST_DIE_AT (fault injection)."""
    _calls["n"] += 1
    if os.environ.get("GRPO_TEST_DIE_AT") and _calls["n"] == int(os.environ["GRPO_TEST_DIE_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_fraction(prompts, completions)


def digit_fraction_then_die_after(prompts, completions, **kwargs):
    """digit_fraction; on call number $GRPO_TEST_DIE_AT it SIGKILLs its own process half a second later, once
    the round it scores has been answered: the worker dies between rounds."""
    _calls["n"] += 1
    if os.environ.get("GRPO_TEST_DIE_AT") and _calls["n"] == int(os.environ["GRPO_TEST_DIE_AT"]):
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return digit_fraction(prompts, completions)


def digit_fraction_then_stop(prompts, completions, **kwargs):
    """digit_fraction, but SIGSTOPs its own process on call number $GRPO_TEST_STOP_AT: alive,
    silent for good."""
    _calls["n"] += 1
    if os.environ.get("GRPO_TEST_STOP_AT") and _calls["n"] == int(os.environ["GRPO_TEST_STOP_AT"]):
        os.kill(os.getpid(), signal.SIGSTOP)
    return digit_fraction(prompts, completions)


def raises_on_long(prompts, completions, **kwargs):
    """Raises on completions longer than 4 characters (a buggy user reward)."""
    out = []
    for c in completions:
        if len(c) > 4:
            raise ValueError(f"cannot score {c!r}")
        out.append(1.0)
    return out


_hang_calls = {"n": 0}


def digit_fraction_hangs_on_second_call(prompts, completions, **kwargs):
    """digit_fraction, except that its 2nd call blocks for 60 s (a reward stuck on a dead service)."""
    import threading

    _hang_calls["n"] += 1
    if _hang_calls["n"] == 2:
        threading.Event().wait(60)
    return digit_fraction(prompts, completions)


_hack_calls = {"format": 0, "correctness": 0}


def format_rising(prompts, completions, **kwargs):
    """A format reward that climbs 0.1 per call, whatever the completions (a policy gaming the format)."""
    _hack_calls["format"] += 1
    return [min(1.0, 0.1 * _hack_calls["format"])] * len(completions)


def correctness_falling(prompts, completions, **kwargs):
    """A correctness reward that drops 0.1 per call (answers getting worse meanwhile)."""
    _hack_calls["correctness"] += 1
    return [max(0.0, 1.0 - 0.1 * _hack_calls["correctness"])] * len(completions)


def always_raises(prompts, completions, **kwargs):
    """A reward with a bug every call hits (e.g. a typo in a column name)."""
    return [float(kwargs["solution"]) for _ in completions]


def length_on_odd_prompts(prompts, completions, **kwargs):
    """The completion's length / 10 for prompts "Q<odd>: ..." (G samples rarely all tie), a constant 0.5 for
    "Q<even>: ...": those groups always tie."""
    def index(prompt) -> int:
        text = prompt if isinstance(prompt, str) else str(prompt)
        return int(text[text.index("Q") + 1:text.index(":")])

    return [0.5 if index(p) % 2 == 0 else len(c) / 10 for p, c in zip(prompts, completions)]


def sleeps_then_marks(prompts, completions, marker, seconds, **kwargs):
    """Sleeps ``seconds`` (a reward stuck on a slow service), then touches ``marker``: whether the work went
    on."""
    import pathlib
    import time

    time.sleep(seconds)
    pathlib.Path(marker).touch()
    return [1.0] * len(completions)


def raises_value_error(prompts, completions, **kwargs):
    raise ValueError("a bug in the reward")


_meetings: dict = {}


def _meeting():
    import asyncio

    return _meetings.setdefault(id(asyncio.get_running_loop()), asyncio.Event())


async def waits_for_partner(prompts, completions, **kwargs):
    """Returns only once `frees_partner` ran in the same event loop: it cannot finish when called alone
    first."""
    await _meeting().wait()
    return [1.0] * len(completions)


async def frees_partner(prompts, completions, **kwargs):
    _meeting().set()
    return [0.5] * len(completions)


async def sleeps_then_marks_async(prompts, completions, marker, seconds, **kwargs):
    import asyncio
    import pathlib

    await asyncio.sleep(seconds)
    pathlib.Path(marker).touch()
    return [1.0] * len(completions)


def hostile_programs(prompts, completions, **kwargs):
    """Whatever the policy wrote, runs hostile programs through the code reward (a policy gone bad, on
    demand): one kills the parent, one reads its environment, one opens a socket, one loops until killed."""
    from grpo_core.rewards.code import code_execution

    programs = ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
                "while True:\n    pass"]
    fence = "`" * 3
    reward = code_execution(timeout_s=1.0, max_workers=4)
    chosen = [f"{fence}python\n{programs[i % len(programs)]}\n{fence}" for i in range(len(completions))]
    return reward(prompts, chosen, tests=[[{"input": "", "output": "ok"}]] * len(completions))


def all_nan(prompts, completions, **kwargs):
    """A broken reward: NaN for every completion (it scores nothing)."""
    return [float("nan")] * len(completions)


def judged_by_url(prompts, completions, url, **kwargs):
    """A judge reward: POSTs each completion to ``url`` and reads its score (urllib; an isolated worker can
    import it)."""
    import json
    import urllib.request

    scores = []
    for text in completions:
        request = urllib.request.Request(url, data=json.dumps({"text": text}).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=2) as answer:
            scores.append(float(json.loads(answer.read())["score"]))
    return scores
