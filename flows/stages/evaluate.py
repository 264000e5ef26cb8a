"""`evaluate`: the base and the trained policy side by side on held-out prompts; the promotion gate.

Prompts: the first ``evaluate.max_samples`` rows of data/validated/eval.parquet. For each policy
(``model.name_or_path`` and ``<train.output_dir>/model``):
  greedy   one completion per prompt, no sampling -> ``accuracy`` (pass@1), per-reward means,
           ``format_compliance``, ``mean_completion_length``;
  sampled  ``evaluate.num_generations`` completions sampled as training samples (params.yaml ``generation``),
           at ``evaluate.temperature`` when that override is set (seed ``evaluate.seed``) -> unbiased
           ``pass@k`` for ``evaluate.pass_k`` and ``sampled/...`` means.
Both at most ``evaluate.max_completion_length`` new tokens when set, else
``generation.max_completion_length``.
Batching: ``evaluate.batch_size`` prompts per generate call for greedy decoding, and
``batch_size // num_generations`` prompts for sampling, so every call holds about ``batch_size`` sequences.
``correct`` = the first configured correctness reward (correctness / numeric / multiple_choice) scores its
``correct`` value (else the built-in ``correctness`` grader); ``format_ok`` = the first configured
soft/strict format reward is > 0 (else the built-in ``soft_format``).

Outputs: ``metrics/eval.json`` = {"base": {...}, "trained": {...}, "delta": {trained - base}},
``artifacts/eval/completions.parquet`` (one row per completion, both policies), ``plots/evaluation.png``
(reward and KL curves, base vs trained accuracy / pass@k), ``reports/registry.json`` (the registry decision
below, as data: what the Prefect flow reads) and ``reports/evaluation.md`` (rendered from the metrics and that
same decision).

Registry (``tracking.register_model``): the trained model directory is logged as the evaluate run's
LoggedModel ``policy`` (HF files + an ``MLmodel`` with the prompt -> completion signature) and registered as a
new version of ``tracking.registered_model_name``. Promotion gate: the alias ``champion`` moves to it only
when its ``tracking.promotion_metric`` (higher is better) beats the current champion's by more than
``tracking.promotion_margin``; with no champion yet, it must beat the base policy by more than the margin.
Load a version with ``mlflow.artifacts.download_artifacts("models:/grpo-policy@champion")`` then
``from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.comparison import pipeline_summary
from flows.stages.common import (
    TRAIN_LOG,
    VALIDATED_EVAL,
    StageConfigError,
    require_file,
    with_validated_data,
)
from flows.stages.runs import StageRun
from grpo_core.common.files import atomic_path, jsonable, write_json_atomic, write_text_atomic

METRICS = "metrics/eval.json"
COMPLETIONS = "artifacts/eval/completions.parquet"
PLOT = "plots/evaluation.png"
REPORT = "reports/evaluation.md"
REGISTRY = "reports/registry.json"
CHAMPION = "champion"
#: keys every registry decision holds; a registered one also holds REGISTERED_KEYS (and the gate's metric,
#: trained, reference, against, margin, delta when both values exist, previous_champion, note)
REGISTRY_KEYS = ("registered", "promote", "alias", "reason")
REGISTERED_KEYS = ("model_name", "version")


@dataclass(frozen=True)
class EvaluateInputs:
    """Everything evaluate reads of params.yaml: whole sections, groups of `train:`, and single keys (named in
    their field's ``param``); tests/test_dvc_params.py checks dvc.yaml lists each."""

    evaluate: Any
    generation: Any
    model: Any
    rewards: list
    data: Any
    tracking: Any
    reward_calls: Any   # train.reward_errors, reward_timeout_s
    tool_use: Any       # train.tools, environment_factory, ...: both policies sampled with the training tools
    output_dir: str = field(metadata={"param": "train.output_dir"})   # where train wrote the model


def stage_inputs(cfg) -> EvaluateInputs:
    return EvaluateInputs(cfg.evaluate, cfg.generation, cfg.model, cfg.rewards, cfg.data, cfg.tracking,
                          cfg.train.reward_calls, cfg.train.tool_use, cfg.train.checkpoints.output_dir)


def sampling_rows(inp) -> list[tuple[str, Any, str]]:
    """(setting, value, where it comes from) of evaluate's sampled completions, for the report."""
    g, e = inp.generation, inp.evaluate
    own = {"temperature": e.temperature, "max_completion_length": e.max_completion_length}
    rows = [("backend", g.backend, "generation")]
    for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
              "generation_kwargs"):
        rows.append((k, own[k], "evaluate (override)") if own.get(k) is not None
                    else (k, getattr(g, k), "generation"))
    return rows


# --------------------------------------------------------------------------------------------------
# the promotion gate (pure)


def promotion_decision(metric: str, trained: float | None, base: float | None, champion: float | None,
                       margin: float) -> dict[str, Any]:
    """Promote when ``trained - reference > margin``; reference = the champion's value, else the base's."""
    against, reference = ("champion", champion) if champion is not None else ("base", base)
    decision = {"metric": metric, "trained": trained, "reference": reference, "against": against,
                "margin": margin, "promote": False}
    if trained is None or not math.isfinite(trained):
        decision["reason"] = f"the trained policy has no value for {metric}"
    elif reference is None or not math.isfinite(reference):
        decision["promote"] = True
        decision["reason"] = f"no {against} value for {metric} to compare with"
    else:
        delta = trained - reference
        decision["delta"] = delta
        decision["promote"] = delta > margin
        verb = "beats" if decision["promote"] else "does not beat"
        decision["reason"] = (f"{metric} {trained:.4f} {verb} the {against}'s {reference:.4f} by more than "
                              f"{margin} (delta {delta:+.4f})")
    return decision


def known_metric_names(cfg, tools: bool = False) -> list[str]:
    """eval.json's metric keys a gate may compare (tools: with the tool metrics; a reasoning_gym reward
    judging correctness: mean_score; its per-task keys follow the data, not the config)."""
    from grpo_core.evaluation import summary_metric_names

    names = summary_metric_names([r.name for r in cfg.rewards], cfg.evaluate.pass_k, sampled=True,
                                 tools=tools)
    return names + (["mean_score"] if task_scorer(cfg.rewards) is not None else [])


def task_scorer(rewards: list):
    """The reasoning_gym reward when it judges correctness (the first correctness reward), else None."""
    from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS, reward_index

    judge = reward_index(rewards, CORRECTNESS_FUNCTIONS)
    return rewards[judge] if judge is not None and rewards[judge].function == "reasoning_gym" else None


# --------------------------------------------------------------------------------------------------
# sampling both policies


def sample_policy(policy: str, model_cfg, inp: EvaluateInputs, ctx, rows: list[dict], indices: list[int], *,
                  greedy_only: bool = False) -> list[dict]:
    """Greedy and sampled completions of one policy as per-sample records (evaluation's frame layout), sampled
    as training samples (``generation``) but for evaluate's overrides; greedy_only: the greedy ones alone."""
    import torch

    from grpo_core.data.loading import PromptEncoder
    from grpo_core.evaluation import Grading, eval_modes, score_policy
    from grpo_core.model.loading import load_for_inference
    from grpo_core.rewards import build_reward_functions
    from grpo_core.rewards.judges import build_judges
    from grpo_core.rollout import backend_for, sampling_params
    from grpo_core.tools import build_toolbox, load_rollout_func

    e, g = inp.evaluate, inp.generation
    length = e.max_completion_length or g.max_completion_length
    model, tokenizer = load_for_inference(model_cfg, ctx.root)
    encoder = PromptEncoder.from_config(tokenizer, inp.data)
    # the engine holds evaluate's longest completion
    sized = dataclasses.replace(g, max_completion_length=length)
    backend = backend_for(model, tokenizer, sized, seed=e.seed, max_prompt_length=inp.data.max_prompt_length)
    modes = eval_modes(max_new_tokens=length, num_generations=0 if greedy_only else e.num_generations,
                       sampling=sampling_params(g, temperature=e.temperature, max_completion_length=length),
                       sequences_per_call=e.batch_size, seed=e.seed, tools=build_toolbox(inp.tool_use),
                       rollout_func=load_rollout_func(inp.tool_use))
    grading = Grading(build_reward_functions(inp.rewards), [r.name for r in inp.rewards],
                      build_judges(inp.rewards), inp.reward_calls.reward_errors,
                      inp.reward_calls.reward_timeout_s)
    try:
        return score_policy(tokenizer, rows, indices, encoder, grading, modes, backend=backend, policy=policy)
    finally:
        if hasattr(backend, "close"):  # a vLLM engine: stopped before the next policy's starts
            backend.close()
        del model, backend
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def add_task_metrics(summaries: dict, inp: EvaluateInputs, frame, rows: list[dict],
                     indices: list[int]) -> None:
    """With a reasoning_gym reward judging correctness, each policy's summary gains accuracy and mean score
    per task (the rows' ``task``) and the mean score over all (``grpo_core.evaluation.task_metrics``)."""
    from grpo_core.evaluation import task_metrics

    scorer = task_scorer(inp.rewards)
    if scorer is None:
        return
    task_of = {i: row.get("task") for i, row in zip(indices, rows)}
    score = f"reward/{scorer.name}"
    for policy, summary in summaries.items():
        summary.update(task_metrics(frame[frame["policy"] == policy], task_of, score))


# --------------------------------------------------------------------------------------------------
# registry


def policy_signature():
    """What the policy maps: a prompt to a completion (strings)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", "prompt")]),
                          outputs=Schema([ColSpec("string", "completion")]))


def log_policy_model(client, run_id: str, model_dir: Path, trained: dict) -> str:
    """The trained policy as an MLflow LoggedModel of the evaluate run (the runs table's Models column): the
    HF folder as it is (``from_pretrained`` loads a download of ``models:/<name>@champion``) plus an
    ``MLmodel`` with the signature; its metrics are the trained evaluation. Returns the model id."""
    import tempfile

    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name="policy", source_run_id=run_id,
                                        model_type="causal-lm",
                                        tags={"format": "huggingface transformers (safetensors)"})
    client.log_model_artifacts(logged.model_id, str(model_dir))
    with tempfile.TemporaryDirectory(prefix="grpo-mlmodel-") as tmp:
        spec = Model(run_id=run_id, model_id=logged.model_id, signature=policy_signature())
        spec.add_flavor("huggingface", format="transformers",
                        load="AutoModelForCausalLM.from_pretrained(<folder>)")
        spec.save(str(Path(tmp) / "MLmodel"))
        client.log_model_artifacts(logged.model_id, tmp)
    client.finalize_logged_model(logged.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return logged.model_id


def not_registered(reason: str) -> dict[str, Any]:
    """The decision when no version was made: the same REGISTRY_KEYS as a registered one, so readers need no
    special case."""
    return {"registered": False, "promote": False, "alias": None, "reason": reason}


# a registered version's model files, hashed whole: what makes it the same model
MODEL_MD5_TAG = "model.files_md5"


def model_files_md5(model_dir: Path) -> str:
    """md5 over the model folder's files, every byte of each (a re-export writes new mtimes,
    not new bytes)."""
    from flows.stages.common import md5_path

    return md5_path(model_dir, max_full_bytes=1 << 62)


def registered_version_of(client, name: str, files_md5: str) -> int | None:
    """The version of registered model ``name`` made from these very files, if any."""
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except Exception:  # noqa: BLE001 - no such registered model yet
        return None
    same = [int(v.version) for v in versions if (v.tags or {}).get(MODEL_MD5_TAG) == files_md5]
    return min(same) if same else None


# where a registered version's GGUF export sits (flows/stages/export.py): its logged model's gguf/ folder
GGUF_ARTIFACT_PATH = "gguf"
GGUF_FILES_TAG = "gguf.files"


def logged_model_of(model_version) -> str | None:
    """The logged model a version was registered from: register_and_gate's source ``models:/<id>`` (a sqlite
    registry returns no model_id)."""
    if getattr(model_version, "model_id", None):
        return model_version.model_id
    match = re.fullmatch(r"models:/(m-[0-9a-f]+)", model_version.source or "")
    return match.group(1) if match else None


def attach_export(client, name: str, model_dir: Path, export_dir: Path) -> int | None:
    """The export stage's files (GGUFs, Modelfile) put beside the registered version made from these model
    files: into its logged model's artifacts under ``gguf/`` (a download of ``models:/<name>@champion`` holds
    them) and named in its ``gguf.files`` tag. Returns the version, or None when none holds these files."""
    version = registered_version_of(client, name, model_files_md5(model_dir))
    if version is None:
        return None
    model_version = client.get_model_version(name, str(version))
    model_id = logged_model_of(model_version)
    if model_id:
        client.log_model_artifacts(model_id, str(export_dir), artifact_path=GGUF_ARTIFACT_PATH)
    else:  # a version registered from a run's artifacts: the files go into that run
        client.log_artifacts(model_version.run_id, str(export_dir), artifact_path=GGUF_ARTIFACT_PATH)
    files = ",".join(sorted(p.name for p in export_dir.iterdir()))
    client.set_model_version_tag(name, str(version), GGUF_FILES_TAG, files)
    return version


def register_and_gate(run, inp, model_dir, base: dict, trained: dict) -> dict[str, Any]:
    """Register the trained model (new version) and move ``champion`` when the gate passes."""
    from flows.stages.runs import safe_key

    t = inp.tracking
    if not t.register_model:
        return not_registered("tracking.register_model is false")
    if run.client is None or run.run_id is None:
        return not_registered("MLflow tracking is unavailable")
    client, name, metric = run.client, t.registered_model_name, t.promotion_metric
    if not run.flush():
        return not_registered("could not reach MLflow")
    files_md5 = model_files_md5(model_dir)
    existing = registered_version_of(client, name, files_md5)
    if existing is not None:  # evaluate re-run on the same trained model: one model, one version
        return not_registered(f"this trained model (files md5 {files_md5[:12]}) is already version "
                              f"{existing} of {name}; a re-run does not register it twice")
    model_id = log_policy_model(client, run.run_id, model_dir, trained)
    try:
        client.get_registered_model(name)
    except Exception:  # noqa: BLE001 - RESOURCE_DOES_NOT_EXIST
        client.create_registered_model(name, description="GRPO-trained policies (HF format); alias "
                                                          "`champion` = the one that passed the promotion "
                                                          "gate")
    tags = {safe_key(f"metric.{k}"): str(v) for k, v in trained.items() if isinstance(v, int | float)}
    tags.update({"promotion_metric": metric, "promotion_metric_value": str(trained.get(metric)),
                 MODEL_MD5_TAG: files_md5})
    tags.update({k: v for k, v in run.tags.items() if k.startswith(("git.", "prefect.", "dvc."))})
    version = client.create_model_version(name, f"models:/{model_id}", run_id=run.run_id, tags=tags,
                                          description=f"{metric}={trained.get(metric)}", model_id=model_id)
    champion_value, champion_version = None, None
    try:
        champ = client.get_model_version_by_alias(name, CHAMPION)
        champion_version = int(champ.version)  # an int like ``version`` (MLflow gives str or int by release)
        if champ.tags.get("promotion_metric") == metric:
            champion_value = float(champ.tags["promotion_metric_value"])
        else:  # champion chosen on another metric: compare on this one from its tags, if it has it
            raw = champ.tags.get(safe_key(f"metric.{metric}"))
            champion_value = float(raw) if raw not in (None, "None") else None
    except Exception:  # noqa: BLE001 - no champion yet
        pass
    decision = promotion_decision(metric, trained.get(metric), base.get(metric), champion_value,
                                  t.promotion_margin)
    if champion_version is not None and champion_value is None:
        decision["note"] = f"champion v{champion_version} has no {metric}; compared with the base policy"
    if decision["promote"]:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    client.set_model_version_tag(name, version.version, "promotion",
                                 "champion" if decision["promote"] else "not promoted")
    return {"registered": True, "model_name": name, "version": int(version.version),
            "alias": CHAMPION if decision["promote"] else None, "previous_champion": champion_version,
            **decision}


# --------------------------------------------------------------------------------------------------
# report


def _f(x: Any) -> str:
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))


def _cell(text: str, limit: int = 160) -> str:
    """One table cell: newlines shown as ⏎, pipes escaped, long text cut."""
    text = text.replace("\n", "⏎")
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return (text or "(empty)").replace("|", "\\|")


def registry_markdown(registry: dict) -> str:
    """The decision as text: the report's ``## Registry`` section and the Prefect flow's,
    from the same data."""
    if not registry["registered"]:
        return f"Not registered: {registry['reason']}."
    text = (f"Registered `{registry['model_name']}` version {registry['version']}. "
            f"{'Promoted to' if registry['promote'] else 'Not promoted to'} `@{CHAMPION}`: "
            f"{registry['reason']}.")
    return text + (f"\n({registry['note']})" if registry.get("note") else "")


def report_markdown(metrics: dict, registry: dict, inp: EvaluateInputs, n_prompts: int,
                    examples: list[dict]) -> str:
    e = inp.evaluate
    keys = [k for k in metrics["trained"] if k not in ("num_prompts", "num_samples_per_prompt")]
    lines = ["# Evaluation", "",
             f"{n_prompts} held-out prompts; greedy decoding for accuracy, {e.num_generations} samples per "
             f"prompt (seed {e.seed}) for pass@k, sampled with:", "", "| setting | value | from |",
             "| --- | --- | --- |", *(f"| {k} | {v} | {src} |" for k, v, src in sampling_rows(inp)),
             "", "| metric | base | trained | delta |", "| --- | ---: | ---: | ---: |"]
    for k in keys:
        lines.append(f"| {k} | {_f(metrics['base'].get(k))} | {_f(metrics['trained'].get(k))} | "
                     f"{_f(metrics['delta'].get(k))} |")
    lines += ["", "## Registry", "", registry_markdown(registry)]
    if examples:
        lines += ["", "## Examples (greedy)", "", "| prompt | gold | base | trained |",
                  "| --- | --- | --- | --- |"]
        for ex in examples:
            cells = [ex["prompt"], str(ex["answer"]), ex["base"], ex["trained"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------


def run(ctx) -> int:
    import pandas as pd

    from flows.stages.common import quiet_libraries
    from flows.stages.plots import evaluation_figure, read_train_log
    from grpo_core.data.loading import load_split
    from grpo_core.evaluation import eval_report, summarize_evaluation

    quiet_libraries()
    inp = stage_inputs(with_validated_data(ctx.cfg))
    e = inp.evaluate
    if inp.tracking.promotion_metric not in known_metric_names(inp, inp.tool_use.enabled):
        raise StageConfigError(f"tracking.promotion_metric: '{inp.tracking.promotion_metric}' is not an "
                               "evaluation metric; choose one of "
                               f"{', '.join(known_metric_names(inp, inp.tool_use.enabled))}")
    require_file(ctx.path(VALIDATED_EVAL), "validate")
    model_dir = require_file(ctx.path(inp.output_dir) / "model", "train")
    names = [r.name for r in inp.rewards]
    with StageRun(ctx) as run:
        dataset = load_split(inp.data, "eval", ctx.root)
        n = len(dataset) if e.max_samples is None else min(e.max_samples, len(dataset))
        indices = list(range(n))
        rows = [dataset[i] for i in indices]
        run.log_data_hashes([VALIDATED_EVAL])
        run.log_datasets([("eval", VALIDATED_EVAL, "evaluation")])
        records = []
        policies = {"base": dataclasses.replace(inp.model, lora=None),
                    "trained": dataclasses.replace(inp.model, name_or_path=str(model_dir), lora=None)}
        for policy, model_cfg in policies.items():
            print(f"evaluate: {policy} policy ({model_cfg.name_or_path}) on {n} prompts", file=sys.stderr,
                  flush=True)
            records += sample_policy(policy, model_cfg, inp, ctx, rows, indices)
        frame = pd.DataFrame.from_records(records)
        summaries = {p: summarize_evaluation(frame[frame["policy"] == p], e.pass_k, names) for p in policies}
        add_task_metrics(summaries, inp, frame, rows, indices)
        metrics = jsonable(eval_report(summaries["base"], summaries["trained"]))
        for k in [k for k in metrics["delta"] if k.endswith(("num_prompts", "num_samples_per_prompt"))]:
            metrics["delta"].pop(k)  # sizes, not results: no delta

        write_json_atomic(ctx.path(METRICS), metrics)
        with atomic_path(ctx.path(COMPLETIONS)) as tmp:
            frame.to_parquet(tmp, index=False)
        evaluation_figure(read_train_log(ctx.path(TRAIN_LOG)), metrics, list(e.pass_k), ctx.path(PLOT))

        flat = {f"{side}/{k}": v for side in ("base", "trained", "delta") for k, v in metrics[side].items()
                if isinstance(v, int | float) and not isinstance(v, bool)}
        run.log_metrics(flat)
        try:
            registry = register_and_gate(run, inp, model_dir, metrics["base"], metrics["trained"])
        except Exception as exc:  # noqa: BLE001 - the registry is a side effect; the evaluation stands
            registry = not_registered(f"registry error: {type(exc).__name__}: {exc}")
            print(f"evaluate: warning: {registry['reason']}", file=sys.stderr)
        registry = jsonable(registry)  # what the JSON holds is what the report renders
        write_json_atomic(ctx.path(REGISTRY), registry)
        run.set_tags({"registry.registered": str(registry.get("registered")).lower(),
                      "registry.version": str(registry.get("version", "")),
                      "registry.promoted": str(bool(registry.get("promote"))).lower()})

        greedy = frame[frame["mode"] == "greedy"]
        examples = []
        for i in indices[:5]:
            g = greedy[greedy["prompt_index"] == i]
            by = {p: g[g["policy"] == p]["completion"].tolist() for p in policies}
            examples.append({"prompt": g["prompt"].iloc[0], "answer": g["answer"].iloc[0],
                             "base": (by["base"] or [""])[0], "trained": (by["trained"] or [""])[0]})
        write_text_atomic(ctx.path(REPORT), report_markdown(metrics, registry, inp, n, examples))
        for path, where in ((METRICS, "metrics"), (COMPLETIONS, "eval"), (PLOT, "plots"),
                            (REGISTRY, "reports"), (REPORT, "reports")):
            run.log_artifact(ctx.path(path), where)
        run.log_to_parent(pipeline_summary(ctx.root, eval_path=METRICS, train_log=TRAIN_LOG))
        b, t = metrics["base"].get("accuracy"), metrics["trained"].get("accuracy")
        print(
            f"evaluate: accuracy base {_f(b)} -> trained {_f(t)}; "
            f"{'registered v' + str(registry['version']) if registry.get('registered') else 'not registered'}"
            f"{' (champion)' if registry.get('promote') else ''}", file=sys.stderr)
    return 0
