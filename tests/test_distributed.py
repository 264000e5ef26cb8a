"""Scale-out: two CPU processes (gloo, the train stage's CPU launcher) train with DDP exactly as one process
does on the same global batch — the same loss, metrics and weights after each update. FSDP2:
tests/test_fsdp.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.stages.common import StageConfigError
from flows.stages.launch import Machine, launch_command, launch_plan
from grpo_core.train.parallel import ParallelConfigError, read_parallelism
from tests.distributed_worker import launch
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,mixed_precision", [("dapo", "no"), ("grpo", "no"), ("dapo", "bf16")])
def test_two_gloo_processes_match_one_process_on_the_same_global_batch(assets, tmp_path, loss_type,
                                                                       mixed_precision):
    """bf16: the bf16 compute copy (grpo_core/train/compute_weights.py) is not DDP-wrapped; its float32 master
    gradients are all-reduced by the trainer. The two sides then differ only by bf16 rounding (one process
    sums 16 rows per weight gradient, two processes 8 each), so the bounds are bf16's; a missing all-reduce
    (each process stepping on its own half) is far outside them."""
    model, data = assets
    one, two = tmp_path / "one", tmp_path / "two"
    knobs = {"loss_type": loss_type, "mixed_precision": mixed_precision}
    launch(one, model, data, 1, {"train": {"per_device_train_batch_size": 16, **knobs}})
    # the launcher the train stage uses without GPUs (accelerate's own multi-CPU launch needs mpirun)
    launch(two, model, data, 2, {"train": {"per_device_train_batch_size": 8, **knobs}})
    rel = 1e-4 if mixed_precision == "no" else 2e-2

    log1, log2 = read_log(one / "metrics/train_log.csv"), read_log(two / "metrics/train_log.csv")
    assert [r["step"] for r in log1] == [r["step"] for r in log2] == ["1", "2"]
    for r1, r2 in zip(log1, log2):
        for key in ("loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "completions/mean_length",
                    "num_tokens"):
            assert float(r2[key]) == pytest.approx(float(r1[key]), rel=rel, abs=1e-7), (r1["step"], key)
    assert float(log1[-1]["kl"]) > 0  # the updates moved the policy: the comparison is not of no-ops

    w1, w2 = load_file(one / "out/model/model.safetensors"), load_file(two / "out/model/model.safetensors")
    base = load_file(model / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        moved, diff = (w1[k].float() - base[k]).abs(), (w2[k].float() - w1[k].float()).abs()
        if mixed_precision == "no":
            assert diff.max().item() <= 1e-5 + 1e-3 * moved.max().item(), k
        else:  # AdamW turns a bf16-sized gradient difference on a near-zero gradient into a sign flip: on
               # average
            assert diff.mean().item() <= 0.05 * moved.mean().item(), k  # measured 0.0004-0.025 (k_proj.bias)


def test_one_machine_launches_torchrun_on_loopback_on_any_device():
    assert launch_command(4)[1:] == ["-m", "flows.stages.torchrun", "--nproc_per_node", "4", "--nnodes", "1",
                                     "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", "0"]


TWO_NODES = {"MACHINE_RANK": "1", "MAIN_PROCESS_IP": "10.0.0.1", "MAIN_PROCESS_PORT": "29501"}


def stage_context(tmp_path, **train):
    from flows.stages.common import StageContext
    from grpo_core.config import config_from_dict

    cfg = config_from_dict({"data": {"train_files": ["train.jsonl"]},
                            "rewards": [{"name": "r", "function": "tests.reward_helpers:digit_fraction"}],
                            "train": {"num_generations": 4, "per_device_train_batch_size": 8, **train}})
    return StageContext(stage="train", root=REPO, store_root=tmp_path, params_path=tmp_path / "params.yaml",
                        cfg=cfg)


def test_two_nodes_of_eight_gpus_render_one_torchrun_per_node(tmp_path):
    """What machine 1 of 2 runs for train.num_processes 16 with FSDP2, checked by torchrun's own parser: eight
    processes here, machine 0's address; the FSDP2 config is the trainer's to read, not the launcher's."""
    from torch.distributed.run import get_args_parser

    ctx = stage_context(tmp_path, num_processes=16, num_machines=2,
                        accelerate_config="infra/accelerate/fsdp2.yaml")
    cmd = launch_plan(ctx, ctx.cfg, environ=TWO_NODES)
    assert cmd[:3] == [sys.executable, "-m", "flows.stages.torchrun"]
    assert cmd[-5:] == ["-m", "flows.stages", "train", "--params", str(tmp_path / "params.yaml")]
    args = get_args_parser().parse_args(cmd[3:-5] + ["x.py"])
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "2", 1)
    assert (args.master_addr, args.master_port, args.rdzv_backend) == ("10.0.0.1", 29501, "static")


def test_two_cpu_nodes_render_torchrun_per_node(tmp_path):
    from torch.distributed.run import get_args_parser

    cmd = launch_command(4, machines=2, machine=Machine(1, "10.0.0.1", 29501))
    args = get_args_parser().parse_args(cmd[3:] + ["x.py"])
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "2")
    assert (args.master_addr, args.master_port, args.standalone) == ("10.0.0.1", 29501, False)


def test_a_machine_without_its_rank_or_the_main_address_is_told_which_variable(tmp_path):
    ctx = stage_context(tmp_path, num_processes=16, num_machines=2)
    with pytest.raises(StageConfigError, match="MAIN_PROCESS_IP not set"):
        launch_plan(ctx, ctx.cfg, environ={"MACHINE_RANK": "1"})
    with pytest.raises(StageConfigError, match=r"MACHINE_RANK=2: must be in 0..1"):
        launch_plan(ctx, ctx.cfg, environ={**TWO_NODES, "MACHINE_RANK": "2"})


def test_the_launch_refuses_what_the_trainer_would_before_any_process_starts(tmp_path):
    zero3 = tmp_path / "zero3.yaml"
    zero3.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3}\n")
    ctx = stage_context(tmp_path, num_processes=2, accelerate_config=str(zero3))
    with pytest.raises(ParallelConfigError, match="DeepSpeed is not supported"):
        launch_plan(ctx, ctx.cfg)
    ctx = stage_context(tmp_path, num_processes=2, accelerate_config="infra/accelerate/missing.yaml")
    with pytest.raises(StageConfigError, match="missing.yaml is not a file"):
        launch_plan(ctx, ctx.cfg)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_infra_accelerate_configs_load_as_accelerate_configs_and_as_ours(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / f"infra/accelerate/{name}.yaml"))
    assert cfg.distributed_type.value == "MULTI_GPU"  # accelerate starts the processes; the trainer shards
    assert read_parallelism(REPO / f"infra/accelerate/{name}.yaml").name == name
    assert sorted(p.name for p in (REPO / "infra/accelerate").glob("*.yaml")) == ["ddp.yaml", "fsdp2.yaml"]


def test_machines_started_with_machine_0_wait_for_its_launch_and_no_longer(tmp_path):
    """One Indexed Job starts every machine at once: machine 1 waits until machine 0's train stage announces
    the job's launch; a marker from another launch does not count, and the wait ends with an error naming
    both."""
    import threading

    from flows.stages.launch import announce_launch, wait_for_machine_zero

    ctx = stage_context(tmp_path, num_processes=16, num_machines=2, output_dir=str(tmp_path / "out"))
    # no LAUNCH_ID: started by hand, no wait
    wait_for_machine_zero(ctx, ctx.cfg, environ={"MACHINE_RANK": "1"})
    announce_launch(ctx, ctx.cfg, environ={"LAUNCH_ID": "job-old"})
    with pytest.raises(StageConfigError, match=r"did not launch job-new within MACHINE_WAIT_S=0.3 s"):
        wait_for_machine_zero(ctx, ctx.cfg, environ={"LAUNCH_ID": "job-new", "MACHINE_WAIT_S": "0.3"},
                              poll_s=0.05)
    later = threading.Timer(0.3, announce_launch, args=(ctx, ctx.cfg),
                            kwargs={"environ": {"LAUNCH_ID": "job-new"}})
    later.start()
    wait_for_machine_zero(ctx, ctx.cfg, environ={"LAUNCH_ID": "job-new", "MACHINE_WAIT_S": "30"}, poll_s=0.05)
    later.join()
    marker = json.loads((tmp_path / "out/checkpoints/launch.json").read_text())
    assert marker["launch_id"] == "job-new" and marker["machines"] == 2


# ---------------------------------------------------------------------------------------------------
# resuming when every process samples with its own RNG streams (the hand-written decode, seeded per rank)

SAMPLED = {"sampled": True, "train": {"per_device_train_batch_size": 8, "num_processes": 2, "max_steps": 4,
                                      "save_steps": 2}}
LOGGED = ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length", "num_tokens")


@pytest.fixture(scope="module")
def sampled_two(assets, tmp_path_factory):
    """4 steps on two processes that sample (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("sampled")
    launch(root / "two", *assets, 2, SAMPLED)
    return root


def resumed_from_step_2(root: Path, name: str, run: str = "two") -> Path:
    import shutil

    shutil.copytree(root / run / "out/checkpoints/checkpoint-2", root / name / "out/checkpoints/checkpoint-2")
    return root / name


@pytest.mark.slow
def test_two_sampling_processes_resume_bit_for_bit_on_two(assets, sampled_two):
    """Each process restores its own streams: a resume samples what the uninterrupted run sampled (were rank
    1 handed rank 0's states, it would sample other completions and end on other weights)."""
    import hashlib

    root = resumed_from_step_2(sampled_two, "resume-two")
    launch(root, *assets, 2, SAMPLED)
    digest = [hashlib.sha256((r / "out/checkpoints/checkpoint-4/model.safetensors").read_bytes()).hexdigest()
              for r in (sampled_two / "two", root)]
    assert digest[0] == digest[1]
    uninterrupted = read_log(sampled_two / "two/metrics/train_log.csv")
    resumed = read_log(root / "metrics/train_log.csv")
    assert [r["step"] for r in resumed] == ["3", "4"]
    assert [[r[k] for k in LOGGED] for r in resumed] == [[r[k] for k in LOGGED] for r in uninterrupted[2:]]
    states = json.loads((root / "out/checkpoints/checkpoint-4/trainer_state.json").read_text())["rng"]
    assert len(states) == 2 and states[0]["torch"] != states[1]["torch"]  # one stream per process


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(assets, sampled_two):
    """Fewer processes: rank 0 takes its own saved streams (the states are per process:
    tests/test_checkpoint.py)."""
    root = resumed_from_step_2(sampled_two, "resume-one")
    launch(root, *assets, 1, {**SAMPLED, "train": {**SAMPLED["train"], "per_device_train_batch_size": 16,
                                                         "num_processes": 1}})
    assert [r["step"] for r in read_log(root / "metrics/train_log.csv")] == ["3", "4"]


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_processes(assets, tmp_path):
    """More processes: rank 0 takes the saved streams, rank 1 a stream seeded from (seed, step, rank); both
    then save their own."""
    one = {**SAMPLED, "train": {**SAMPLED["train"], "per_device_train_batch_size": 16, "num_processes": 1,
                                "max_steps": 2}}
    launch(tmp_path / "one", *assets, 1, one)
    root = resumed_from_step_2(tmp_path, "resume-two", run="one")
    launch(root, *assets, 2, {**SAMPLED, "train": {**SAMPLED["train"], "max_steps": 3}})
    assert [r["step"] for r in read_log(root / "metrics/train_log.csv")] == ["3"]
    states = json.loads((root / "out/checkpoints/checkpoint-3/trainer_state.json").read_text())["rng"]
    assert len(states) == 2 and states[0]["torch"] != states[1]["torch"]
