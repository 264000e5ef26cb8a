"""train.accelerate_config read as the trainer reads it: DDP, FSDP2 from fsdp_config, and clear refusals
(DeepSpeed withdrawn, accelerate's own FSDP, FSDP1, settings the trainer does not honour, LoRA or fp16 under
FSDP2)."""

from __future__ import annotations

import pytest

from grpo_core.common.errors import EXIT_CONFIG
from grpo_core.model.sharding import FSDPSettings
from grpo_core.train.parallel import ParallelConfigError, Parallelism, check_parallelism, read_parallelism

FSDP2 = "distributed_type: MULTI_GPU\nfsdp_config: {fsdp_version: 2%s}\n"


def read(tmp_path, text: str) -> Parallelism:
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    return read_parallelism(path)


def test_no_file_and_a_plain_multi_gpu_file_are_ddp(tmp_path):
    assert read_parallelism(None) == Parallelism() and Parallelism().name == "ddp"
    assert read(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 8\n").fsdp is None


def test_fsdp_config_version_2_is_fsdp2_with_its_settings(tmp_path):
    p = read(tmp_path, FSDP2 % ", fsdp_reshard_after_forward: false, fsdp_offload_params: true")
    assert p.name == "fsdp2" and p.fsdp == FSDPSettings(reshard_after_forward=False, offload_params=True)
    assert read(tmp_path, FSDP2 % "").fsdp == FSDPSettings(reshard_after_forward=True, offload_params=False)


@pytest.mark.parametrize("text, message", [
    ("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3}\n", "DeepSpeed is not supported"),
    ("distributed_type: MULTI_GPU\ndeepspeed_config: {zero_stage: 3}\n", "DeepSpeed is not supported"),
    ("distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\n",
     "distributed_type FSDP hands sharding to accelerate"),
    ("distributed_type: MEGATRON_LM\n", "distributed_type MEGATRON_LM is not supported"),
    ("distributed_type: MULTI_GPU\nfsdp_config: {fsdp_version: 1}\n", "fsdp_version must be 2"),
    (FSDP2 % ", fsdp_sharding_strategy: FULL_SHARD", r"keys \['fsdp_sharding_strategy'\] are not read"),
    (FSDP2 % ", fsdp_state_dict_type: SHARDED_STATE_DICT", "must be FULL_STATE_DICT"),
    (FSDP2 % ", fsdp_auto_wrap_policy: SIZE_BASED_WRAP", "must be TRANSFORMER_BASED_WRAP"),
    (FSDP2 % ", fsdp_activation_checkpointing: true", "use train.gradient_checkpointing"),
    (FSDP2 % ", fsdp_cpu_ram_efficient_loading: true", "set it false"),
    ("- a list\n", "not a mapping"),
    ("distributed_type: [unclosed\n", "is not YAML"),
])
def test_what_the_trainer_does_not_run_is_refused_naming_the_file(tmp_path, text, message):
    with pytest.raises(ParallelConfigError, match=message) as err:
        read(tmp_path, text)
    assert "accelerate.yaml" in str(err.value) and err.value.exit_code == EXIT_CONFIG


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ParallelConfigError, match="cannot read .*nope.yaml"):
        read_parallelism(tmp_path / "nope.yaml")


def test_lora_and_fp16_are_refused_under_fsdp2_only():
    fsdp2, ddp = Parallelism(FSDPSettings()), Parallelism()
    with pytest.raises(ParallelConfigError, match="LoRA .* with FSDP2 is not supported"):
        check_parallelism(fsdp2, lora=True)
    with pytest.raises(ParallelConfigError, match="fp16 with FSDP2 is not supported"):
        check_parallelism(fsdp2, lora=False, mixed_precision="fp16")
    check_parallelism(fsdp2, lora=False, mixed_precision="bf16")
    check_parallelism(ddp, lora=True, mixed_precision="fp16")
