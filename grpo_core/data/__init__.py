"""Prompts: loading them from files or the hub, and checking them before anything samples.

    loading.py      data: (DataConfig), local files or a hub dataset -> rows; PromptEncoder renders a prompt
    validation.py   validate: (ValidateConfig), pandera schemas and the validation report
"""
