"""Tool calling for agentic rollouts (TRL 1.16's ``tools`` / ``environment_factory``), below the rollout loop
(``grpo_core/rollout/multiturn.py``) that uses it:

    registry.py  params.yaml import paths -> checked tools and environment factories (Toolbox);
                 per-rollout tools
    chat.py      the chat template's side: a completion's tool calls parsed (transformers' response parsing),
                 the tokens of tool results
    calls.py     one turn's calls run: rollouts concurrently, in order within one, each with a timeout; errors
                 answered and counted

docs/agentic.md shows a tool and an environment.
"""

from grpo_core.tools.calls import CallResult, run_calls
from grpo_core.tools.chat import ToolCall, ToolChat, Turn
from grpo_core.tools.registry import (
    ENVIRONMENT_COLUMN,
    EnvironmentFailure,
    RolloutTools,
    Toolbox,
    ToolConfigError,
    ToolUseOptions,
    build_toolbox,
    close_all,
    environment_tools,
    load_rollout_func,
    tool_schema,
)

__all__ = ["CallResult", "ENVIRONMENT_COLUMN", "EnvironmentFailure", "RolloutTools", "ToolCall", "ToolChat",
           "ToolConfigError", "ToolUseOptions", "Toolbox", "Turn", "build_toolbox", "close_all",
           "environment_tools", "load_rollout_func", "run_calls", "tool_schema"]
