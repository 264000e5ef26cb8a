"""params.yaml loading: the shipped file validates; every kind of mistake is an error naming the key."""

import copy
from pathlib import Path

import pytest
import yaml

from grpo_core.common.options import describe
from grpo_core.config import (
    ConfigError,
    check_across_sections,
    config_from_dict,
    describe_train,
    load_config,
)
from grpo_core.data.loading import DataConfig
from grpo_core.rollout import GenerationConfig
from grpo_core.train.options import train_key_owner, training_params_hash

ROOT = Path(__file__).resolve().parents[1]


def base() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_validate():
    cfg = load_config(ROOT / "params.yaml")
    assert cfg.train.batch.num_generations >= 2
    assert [r.name for r in cfg.rewards] == ["correctness", "format"]
    # 64 completions per generation round = 8 whole groups of 8
    assert cfg.train.batch_plan.generation_batch_size % cfg.train.batch.num_generations == 0


@pytest.mark.parametrize("path",
                         sorted((ROOT / "configs").glob("*.yaml")) if (ROOT / "configs").exists() else [])
def test_example_configs_validate(path):
    load_config(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["train"].update(learnig_rate=1e-4),
         "train.learnig_rate: unknown key; did you mean 'learning_rate'?"),
        (lambda d: d.update(trian={}), "unknown section 'trian'; did you mean 'train'?"),
        (lambda d: d["train"].update(num_generations="eight"), "train.num_generations: expected an integer"),
        (lambda d: d["train"].update(num_generations=1),
         "train.num_generations: 1 is out of range; allowed: >= 2"),
        (lambda d: d["train"].update(loss_type="ppo"),
         "train.loss_type: 'ppo' is not allowed; choose one of 'grpo'"),
        (lambda d: d["train"].update(learning_rate=0),
         "train.learning_rate: 0.0 is out of range; allowed: > 0"),
        (lambda d: d["train"].update(mask_truncated_completions="yes"),
         "train.mask_truncated_completions: expected true or false"),
        (lambda d: d["train"].update(per_device_train_batch_size=12),
         "must be divisible by train.num_generations (8)"),
        (lambda d: d["train"].update(reward_weights=[1.0]),
         "train.reward_weights: 1 weights for 2 reward functions"),
        (lambda d: d["train"].update(epsilon_high=0.1), "train.epsilon_high: 0.1 is below epsilon (0.2)"),
        (lambda d: d["model"].update(lora={"r": 0}), "model.lora.r: 0 is out of range; allowed: >= 1"),
        (lambda d: d["rewards"][0].update(weight=2.0), "rewards[0].weight: unknown key"),
        (lambda d: d["rewards"][1].update(name="correctness"), "rewards: names must be unique"),
        (lambda d: d["evaluate"].update(pass_k=[16]), "evaluate.pass_k: k=16 must be between 1 and"),
        (lambda d: d["embedded"].update(label_noise=1.5), "embedded.label_noise: 1.5 is out of range"),
        (lambda d: d["embedded"].update(tasks=["calculator", "arithmetic"], max_operand=999),
         "embedded.tasks: ['calculator', 'arithmetic']; calculator has chat prompts and a tool, the word "
         "problems neither: it cannot be mixed with them"),
        (lambda d: d["embedded"].update(tasks=["calculator"]), "embedded.max_operand: 9; the calculator "
                                                                "task's numbers are 10..max_operand, so it "
                                                                "needs >= 10"),
        (lambda d: d["embedded"].update(tasks=["abacus"]), "embedded.tasks"),
        (lambda d: d.update(rewards=[]), "rewards: at least one reward function is required"),
        # the data-file keys name their accepted forms (grpo_core.config.DATA_FILES_FORMS) on a wrong type or
        # value
        (lambda d: d["data"].update(train_files=5), "data.train_files: 5 is not a path or a list of paths, "
                                                     "each a file, a folder (its jsonl"),
        (lambda d: d["data"].update(train_files={"a": "b"}),
         "data.train_files: {'a': 'b'} is not a path or a list"),
        (lambda d: d["data"].update(eval_files=["e.jsonl", 3]), "data.eval_files: ['e.jsonl', 3] is not a "
                                                                 "path or a list of paths, each a file, a "
                                                                 "folder"),
        (lambda d: d["data"].update(train_files=""),
         "data.train_files: '' is not a path; expected a path or a list"),
        (lambda d: d["data"].update(train_files=["t.jsonl", " "]), "data.train_files[1]: ' ' is not a path; "
                                                                    "expected a path or a list of paths, "
                                                                    "each a file, a folder (its "
                                                                    "jsonl / json / parquet / csv files, "
                                                                    "recursively, in name order) or a glob "
                                                                    "such as"),
        (lambda d: d["data"].update(train_files=[]),
         "data.train_files: empty; name local files (a path or a list"),
            (lambda d: d["embedded"].update(model_dir="elsewhere"),
             "embedded.model_dir: 'elsewhere'; dvc.yaml names"),
            (lambda d: d["model"].update(lora={"r": 4}) or d["train"].update(sync_ref_model=True),
             "train.sync_ref_model: not with model.lora"),
    ],
)
def test_bad_params_name_the_key(mutate, message):
    raw = base()
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert message in str(err.value)


def test_overrides_apply_and_are_checked():
    cfg = config_from_dict(base(), {"train.learning_rate": 1e-4, "train.max_steps": 3})
    assert cfg.train.optim.learning_rate == 1e-4 and cfg.train.max_steps == 3
    with pytest.raises(ConfigError, match="train.max_stepz: unknown key; did you mean 'max_steps'"):
        config_from_dict(base(), {"train.max_stepz": 3})
    with pytest.raises(ConfigError, match="train.max_steps.x: cannot override inside a non-mapping value"):
        config_from_dict(base(), {"train.max_steps.x": 3})
    cfg = config_from_dict({**base(), "tracking": None}, {"tracking.experiment_name": "e"})  # a null section
    assert cfg.tracking.experiment_name == "e"


def test_the_checks_across_sections_read_the_config_and_never_change_it():
    """async_rollouts "auto" is resolved when the config is built (what the trainer reads is a bool); the
    checks that run after it leave a config as they found it."""
    cfg = config_from_dict(base(), {"train.async_rollouts": "auto"})
    assert isinstance(cfg.train.rollouts.async_rollouts, bool)
    before = copy.deepcopy(cfg)
    cfg.train.rollouts.async_rollouts = "auto"
    check_across_sections(cfg)
    assert cfg.train.rollouts.async_rollouts == "auto"
    cfg.train.rollouts.async_rollouts = before.train.rollouts.async_rollouts
    check_across_sections(cfg)
    assert cfg == before


def test_ints_are_accepted_for_floats_but_not_bools():
    cfg = config_from_dict(base(), {"train.beta": 0})
    assert cfg.train.loss.beta == 0.0 and isinstance(cfg.train.loss.beta, float)
    with pytest.raises(ConfigError, match="train.beta: expected a number"):
        config_from_dict(base(), {"train.beta": True})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such parameters file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_params_hash_ignores_bookkeeping_but_not_training_keys():
    a = config_from_dict(base())
    same = config_from_dict(base(), {"train.save_steps": 7, "train.max_steps": 999, "train.logging_steps": 5})
    other = config_from_dict(base(), {"train.learning_rate": 1e-3})
    assert training_params_hash(a) == training_params_hash(same)
    assert training_params_hash(a) != training_params_hash(other)
    assert training_params_hash(a, [1.0, 0.5]) != training_params_hash(a, [1.0, 1.0])


def test_params_hash_sees_the_global_batch_not_its_split_over_processes():
    sync = {"train.async_rollouts": False}  # auto would differ: on for one process, off for two
    one = config_from_dict(base(),
                           {"train.per_device_train_batch_size": 16, "train.num_generations": 4, **sync})
    two = config_from_dict(base(), {"train.per_device_train_batch_size": 8, "train.num_processes": 2,
                                    "train.num_generations": 4, **sync})
    half = config_from_dict(base(),
                            {"train.per_device_train_batch_size": 8, "train.num_generations": 4, **sync})
    assert training_params_hash(one) == training_params_hash(two)  # a resume on another world size
    assert training_params_hash(one) != training_params_hash(half)  # half the global batch: another run


def test_every_train_field_is_documented():
    rows = describe_train()
    assert all(meaning for _, _, _, meaning in rows)
    names = {r[0] for r in rows}
    # TRL GRPOConfig names the contract promises
    for trl_name in ["learning_rate", "num_generations", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "beta", "epsilon",
                     "epsilon_high", "delta", "loss_type", "scale_rewards", "num_iterations",
                     "reward_weights", "multi_objective_aggregation", "mask_truncated_completions",
                     "max_steps", "save_steps", "logging_steps", "seed", "warmup_ratio", "lr_scheduler_type",
                     "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "sapo_temperature_pos",
                     "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                     "vespo_lambda_neg", "off_policy_mask_threshold"]:
        assert trl_name in names
    generation = {r[0] for r in describe(GenerationConfig) if r[3]}
    assert {"max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "generation_kwargs", "generation_batch_size", "cache_implementation",
            "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_mode", "vllm_server_host",
            "vllm_server_port", "vllm_group_port",
            "vllm_server_timeout"} <= generation   # GRPOConfig's names, each documented
    assert "max_prompt_length" in {r[0] for r in describe(DataConfig) if r[3]}
    import typing

    from grpo_core.loss import LossOptions

    assert set(typing.get_args(typing.get_type_hints(LossOptions)["loss_type"])) == {
        "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}  # TRL 1.16's loss types


@pytest.mark.parametrize("epsilon_high", [None, 0.28, 1.0])
def test_cispo_needs_its_cap_above_one(epsilon_high):
    with pytest.raises(ConfigError, match="train.epsilon_high: cispo caps the importance weight"):
        config_from_dict(base(), {"train.loss_type": "cispo", "train.epsilon_high": epsilon_high})
    assert config_from_dict(base(),
                            {"train.loss_type": "cispo",
                             "train.epsilon_high": 5.0}).train.loss.epsilon_high == 5.0


@pytest.mark.parametrize(("key", "value"), [("sapo_temperature_pos", 0.0), ("vespo_k_neg", -1.0),
                                            ("off_policy_mask_threshold", -0.5)])
def test_loss_shape_options_out_of_range_are_named(key, value):
    with pytest.raises(ConfigError, match=f"train.{key}"):
        config_from_dict(base(), {f"train.{key}": value})


def test_params_are_read_as_yaml_1_2_like_dvc_writes_them(tmp_path):
    # `dvc exp run -S` rewrites params.yaml without the quotes of "no"; YAML 1.1 would read it as false
    text = (ROOT / "params.yaml").read_text().replace('mixed_precision: "no"', "mixed_precision: no")
    text = text.replace("learning_rate: 5.0e-4", "learning_rate: 5e-4")
    (tmp_path / "params.yaml").write_text(text)
    cfg = load_config(tmp_path / "params.yaml")
    assert cfg.train.forward.mixed_precision == "no"


def test_generation_options_reach_sampling_and_bad_generation_kwargs_name_the_key():
    from grpo_core.rollout import sampling_params

    base = {"rewards": [{"name": "c", "function": "correctness"}], "data": {"train_files": ["t.jsonl"]}}
    cfg = config_from_dict({**base, "generation": {"min_p": 0.05, "repetition_penalty": 1.2, "top_k": 5,
                                                   "generation_kwargs": {"suppress_tokens": [7]}}})
    sampling = sampling_params(cfg.generation)
    assert (sampling.min_p, sampling.repetition_penalty, sampling.top_k, sampling.generation_kwargs) == (
        0.05, 1.2, 5, {"suppress_tokens": [7]})
    assert sampling_params(config_from_dict(base).generation).min_p == 0.0
    # a stage's own overrides replace only what they name; greedy decoding turns sampling off
    calib = sampling_params(cfg.generation, temperature=0.7, max_completion_length=99, greedy=True)
    assert (calib.temperature, calib.max_new_tokens, calib.do_sample, calib.min_p) == (0.7, 99, False, 0.05)
    for generation, match in [
            ({"generation_kwargs": {"max_new_tokens": 9}}, r"\['max_new_tokens'\] are set by the pipeline"),
            ({"generation_kwargs": {"n": 2}, "backend": "vllm"}, r"\['n'\]"),
            ({"generation_kwargs": {"suppress_tokens": [1]}, "backend": "manual"},
             "generation.generation_kwargs: the hand-written decode loop"),
            ({"min_p": 1.5}, "generation.min_p"),
            ({"repetition_penalty": 0}, "generation.repetition_penalty")]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, "generation": generation})


@pytest.mark.parametrize("old,new", [("train.temperature", "generation.temperature"),
                                     ("train.generation_backend", "generation.backend"),
                                     ("train.min_p", "generation.min_p"),
                                     ("train.vllm_gpu_memory_utilization",
                                      "generation.vllm_gpu_memory_utilization"),
                                     ("train.max_prompt_length", "data.max_prompt_length")])
def test_a_moved_key_is_an_error_naming_its_new_place(old, new):
    base = {"rewards": [{"name": "c", "function": "correctness"}], "data": {"train_files": ["t.jsonl"]}}
    section, leaf = old.split(".")
    with pytest.raises(ConfigError, match=rf"^{old}: moved to {new} "):
        config_from_dict({**base, section: {leaf: 1}})
    with pytest.raises(ConfigError, match=rf"^{old}: moved to {new} "):   # as `dvc exp run -S` would set it
        config_from_dict(base, {old: 1})


def test_generation_batch_size_sets_steps_per_generation_as_in_trl():
    base = {"rewards": [{"name": "c", "function": "correctness"}], "data": {"train_files": ["t.jsonl"]},
            "train": {"per_device_train_batch_size": 8, "num_generations": 4}}
    cfg = config_from_dict({**base, "generation": {"generation_batch_size": 32}})
    assert (cfg.train.batch.steps_per_generation == 4
            and cfg.train.batch_plan.generation_batch_size == 32)  # 32 / (8 x 1 process)
    # null: per_device x processes x ga
    assert config_from_dict(base).train.batch_plan.generation_batch_size == 8
    with pytest.raises(ConfigError, match="generation.generation_batch_size: 20 is not a multiple of"):
        config_from_dict({**base, "generation": {"generation_batch_size": 20}})
    with pytest.raises(ConfigError, match="set together with train.steps_per_generation"):
        config_from_dict({**base, "generation": {"generation_batch_size": 32},
                          "train": {**base["train"], "steps_per_generation": 2}})


def test_train_keys_are_grouped_by_owner_and_every_key_has_one_group():
    """params.yaml's flat `train:` keys each live in one group (t.loss, t.optim, ...) or on TrainConfig
    itself, with TRL's names; a key set flat lands in its group and nowhere else."""
    owner = train_key_owner()
    assert len(owner) == 89 and owner["epsilon"] == "loss" and owner["learning_rate"] == "optim"
    assert owner["use_bias_correction_kl"] == "loss"
    assert owner["seed"] is None and owner["reward_weights"] == "advantage"
    assert owner["collective_timeout_s"] == "parallel"
    cfg = config_from_dict(base(), {"train.epsilon": 0.3, "train.steps_per_generation": 2})
    assert cfg.train.loss.epsilon == 0.3 and cfg.train.batch_plan.micro_batches_per_round == 2
    assert not hasattr(cfg.train, "epsilon")  # one place: the group, not a copy on the train config
    assert {row[0] for row in describe_train()} == set(owner)


def test_a_pipeline_config_is_the_sections_a_training_run_reads():
    """The trainer takes ``RunSections`` (it never imports config.py): PipelineConfig must hold each of its
    sections, with the same type."""
    import typing

    from grpo_core.config import PipelineConfig
    from grpo_core.train.options import RunSections

    wanted = typing.get_type_hints(RunSections)
    held = typing.get_type_hints(PipelineConfig)
    assert set(wanted) == {"data", "model", "generation", "rewards", "train", "guards"}
    assert {name: held.get(name) for name in wanted} == wanted
