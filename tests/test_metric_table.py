"""grpo_core/train/metrics.py: the step's metrics declared once. The step log's columns come from it, the
loss's statistics are reduced by it (TRL's clip_ratio/low_min and high_max: min and max across processes per
micro-batch, then the mean over micro-batches), and a metric it does not declare is refused, never dropped."""

from __future__ import annotations

import math
import os
import socket
import types

import pytest
import torch
import torch.multiprocessing as mp

from grpo_core.loss import GRPOLoss
from grpo_core.train.metrics import LOSS_STATS, METRICS, columns, loss_stat_means
from grpo_core.train.step_log import StepLog
from tests.test_loss_object import LOSS_TYPES, loss_config, micro_batch

ONE_PROCESS = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))


def test_the_columns_of_a_plain_run_and_what_each_switch_adds():
    assert columns(set(), ["correct", "format"]) == [
        "step", "loss", "reward", "reward_std", "frac_reward_zero_std",
        "rewards/correct/mean", "rewards/format/mean", "rewards/correct/std", "rewards/format/std",
        "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
        "clip_ratio/high_max", "clip_ratio/region_mean", "ratio_mean",
        "completions/mean_length", "completions/min_length", "completions/max_length",
        "completions/clipped_ratio", "grad_norm", "learning_rate", "reward_errors", "reward_timeouts",
        "num_tokens", "guard/skipped", "step_time", "generation_time"]
    plain = columns(set(), ["r"])
    added = {switch: [c for c in columns({switch}, ["r"]) if c not in plain]
             for switch in ("cispo", "vespo", "entropy_coef", "dynamic_sampling", "async", "tools")}
    assert added == {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"],
                     "entropy_coef": ["entropy_coef"],
                     "dynamic_sampling": ["dynamic/groups_dropped", "dynamic/generation_rounds",
                                          "dynamic/tied_groups_used"],
                     "async": ["async/staleness", "async/wait_time"],
                     "tools": ["tools/call_frequency", "tools/failure_frequency", "tools/mean_turns"]}
    assert len(columns({"sampler_correction"}, ["r"])) == len(plain) + 5
    assert len({m.name for m in METRICS}) == len(METRICS)  # each declared once


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_statistic_the_loss_computes_is_declared(loss_type, level):
    options = loss_config(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                          epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    logps, t, _ = micro_batch()
    _, stats = GRPOLoss(options)(logps, t["old_logps"], t["ref_logps"], t["advantages"], t["mask"])
    assert set(stats) <= {m.name for m in LOSS_STATS}
    assert set(loss_stat_means([stats], ONE_PROCESS)) >= set(stats)


def test_loss_statistics_are_micro_batch_means_and_zero_where_the_loss_type_has_none():
    stats = [{k: torch.tensor(v) for k, v in zip(("kl", "clip_ratio/low_min", "ratio_mean"), values)}
             for values in ((0.1, 0.0, 1.0), (0.3, 0.5, 1.2))]
    means = loss_stat_means(stats, ONE_PROCESS)
    assert means["kl"] == pytest.approx(0.2) and means["clip_ratio/low_min"] == pytest.approx(0.25)
    assert means["ratio_mean"] == pytest.approx(1.1)
    assert means["clip_ratio/high_max"] == 0.0 and means["clip_ratio/region_mean"] == 0.0  # "always" columns
    assert "cispo_clip_ratio" not in means and "vespo/phi_seq_mean" not in means  # their loss types' own
    with pytest.raises(ValueError, match=r"\['clip_ratio/mid_mean'\].*does not declare"):
        loss_stat_means([{"clip_ratio/mid_mean": torch.tensor(0.0)}], ONE_PROCESS)


def test_the_step_log_refuses_a_metric_it_has_no_column_for(tmp_path):
    log = StepLog(tmp_path / "log.csv", ["step", "reward"], 0)
    log.append({"step": 1, "reward": 0.5})
    with pytest.raises(ValueError, match=r"\['clip_ratio/low_min'\] are not columns"):
        log.append({"step": 2, "reward": 0.5, "clip_ratio/low_min": 0.0})
    assert (tmp_path / "log.csv").read_text().splitlines() == ["step,reward", "1,0.5"]


def test_a_column_a_round_turns_out_to_need_widens_the_log_in_the_tables_order(tmp_path):
    """The sampler correction's metrics come with a backend that reports its own log-probs, known once a round
    has them: the file is rewritten with their column where the table puts it, earlier lines blank there."""
    log = StepLog(tmp_path / "log.csv", ["step", "reward", "grad_norm"], 0,
                  possible=["step", "reward", "sampling/importance_sampling_ratio/max", "grad_norm"])
    log.append({"step": 1, "reward": 0.5, "grad_norm": 1.0})
    log.append({"step": 2, "reward": 0.25, "sampling/importance_sampling_ratio/max": 1.5, "grad_norm": 2.0})
    assert (tmp_path / "log.csv").read_text().splitlines() == [
        "step,reward,sampling/importance_sampling_ratio/max,grad_norm", "1,0.5,,1", "2,0.25,1.5,2"]
    with pytest.raises(ValueError, match="not columns"):
        log.append({"step": 3, "reward": 0.0, "grad_norm": 1.0, "dynamic/groups_dropped": 1.0})


# rank -> (micro-batch 1, micro-batch 2) of each extreme; NaN: no sequence with a token there
LOW_MIN = {0: (0.1, math.nan), 1: (0.3, 0.2)}
HIGH_MAX = {0: (0.5, math.nan), 1: (0.4, math.nan)}


def _two_processes(rank: int, port: int, out) -> None:
    from accelerate import Accelerator

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    accelerator = Accelerator(cpu=True)  # gloo over the two processes, as a launched train stage has it
    stats = [{"clip_ratio/low_min": torch.tensor(LOW_MIN[rank][j]),
              "clip_ratio/high_max": torch.tensor(HIGH_MAX[rank][j])} for j in range(2)]
    out[rank] = loss_stat_means(stats, accelerator)
    accelerator.end_training()


def test_low_min_and_high_max_are_taken_across_processes_per_micro_batch():
    """TRL gathers each micro-batch's per-sequence clip shares and takes their nanmin / nanmax, then logs the
    mean over micro-batches: micro-batch 1 min(0.1, 0.3) = 0.1, micro-batch 2 min(NaN, 0.2) = 0.2, mean 0.15;
    high_max's second micro-batch is NaN on both processes, so its mean is NaN (as TRL's would be)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = mp.Manager().dict()
    mp.spawn(_two_processes, args=(port, out), nprocs=2)
    for rank in (0, 1):
        assert out[rank]["clip_ratio/low_min"] == pytest.approx(0.15)
        assert math.isnan(out[rank]["clip_ratio/high_max"])
