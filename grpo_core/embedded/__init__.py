"""The embedded default: synthetic verifiable tasks, a local tokenizer, a tiny Qwen2 and a supervised
warm start that leaves GRPO measurable headroom. Entry point: `prepare(cfg.embedded)`.

Names are imported lazily: `grpo_core.config` imports `grpo_core.embedded.config`, and every stage
process should not pay for torch and transformers just to read params.yaml.
"""

from importlib import import_module

_EXPORTS = {
    "EmbeddedConfig": "grpo_core.embedded.config",
    "prepare": "grpo_core.embedded.build",
    "Problem": "grpo_core.embedded.tasks",
    "generate_splits": "grpo_core.embedded.tasks",
    "template_noise": "grpo_core.embedded.tasks",
    "vocabulary_words": "grpo_core.embedded.tasks",
    "build_tokenizer": "grpo_core.embedded.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo_core.embedded' has no attribute {name!r}")
