"""flows/comparison.py: the parent's summary from the outputs, run names from the params diff, the saved view."""

from __future__ import annotations

import json
import statistics

from flows.comparison import VIEW_TAG, diff_name, params_diff, pipeline_summary, view_state


def write_outputs(root, rows):
    (root / "metrics").mkdir()
    (root / "metrics/eval.json").write_text(json.dumps({
        "base": {"accuracy": 0.5, "pass@4": 0.7}, "trained": {"accuracy": 0.75, "pass@4": 0.9},
        "delta": {"accuracy": 0.25, "pass@4": 0.2}}))
    lines = ["step,reward,kl,step_time"] + [",".join(map(str, r)) for r in rows]
    (root / "metrics/train_log.csv").write_text("\n".join(lines) + "\n")


def test_summary_is_read_from_eval_json_and_the_train_log(tmp_path):
    write_outputs(tmp_path, [(1, 0.1, 0.0, 2.0), (2, 0.3, 0.01, 1.0), (3, 0.6, 0.02, 5.0)])
    assert pipeline_summary(tmp_path) == {
        "summary/accuracy_base": 0.5, "summary/accuracy_trained": 0.75, "summary/accuracy_delta": 0.25,
        "summary/pass_at_4": 0.9, "summary/pass_at_4_delta": 0.2, "summary/final_reward": 0.6,
        "summary/final_kl": 0.02, "summary/median_step_time": statistics.median([2.0, 1.0, 5.0]), "summary/steps": 3.0}
    only_train = pipeline_summary(tmp_path, eval_path=None)
    assert set(only_train) == {"summary/final_reward", "summary/final_kl", "summary/median_step_time", "summary/steps"}
    assert pipeline_summary(tmp_path / "missing") == {}  # no outputs yet: nothing, no error


def test_params_diff_names_changed_added_and_removed_keys():
    base = {"train": {"learning_rate": 1e-3, "max_steps": 150, "beta": 0.0}, "data": {"train_files": "a"}}
    now = {"train": {"learning_rate": 2e-3, "max_steps": 150, "seed": 7}, "data": {"train_files": "a"}}
    assert params_diff(now, base) == {"train.beta": None, "train.learning_rate": 2e-3, "train.seed": 7}
    assert params_diff(now, now) == {} and params_diff(now, None) == {}


def test_diff_name_is_short_and_keeps_ambiguous_keys_whole():
    assert diff_name({"train.learning_rate": 0.002, "train.max_steps": 50}) == "learning_rate=0.002 max_steps=50"
    assert diff_name({"train.seed": 1, "evaluate.seed": 2}) == "train.seed=1 evaluate.seed=2"
    long = {f"train.key_{i}": i for i in range(20)}
    name = diff_name(long, limit=40)
    assert len(name) <= 40 + 4 and name.endswith(f"+{20 - name.count('=')}")


def test_saved_view_leads_with_the_summary_and_lists_the_differing_params():
    state = view_state(["train.learning_rate"])
    cols = state["selectedColumns"]
    assert cols.index("metrics.`summary/accuracy_trained`") < cols.index("params.`train.learning_rate`")
    assert [s["name"] for s in state["compareRunSections"]][0] == "summary" and state["isAccordionReordered"]
    assert VIEW_TAG == "mlflow.sharedViewState.grpo"
