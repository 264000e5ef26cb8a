"""The vLLM server mode (``generation.vllm_mode: server``): ``python -m flows.serve`` as a real second process
on CPU, the trainer's client (grpo_core/rollout/vllm_server.py) sampling from it over HTTP and pushing weights
to it over a gloo group.

One server serves the module (an engine start costs ~8 s here); the test that kills a server starts its own.
Expected values are worked out without the server: HF generate and a plain forward of the same policy.
Tolerance: float32 policy, float32 engine; the engine's kernels sum in another order than torch's (~1e-6 on
this model, as tests/test_vllm_engine.py measures), 1e-4 leaves room for other CPUs.

Not tested here: the NCCL group (CUDA), FSDP2 (whose replica pushes as one process does).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.common.errors import EXIT_CONFIG, EXIT_ERROR, exit_code_for
from grpo_core.config import ConfigError, config_from_dict
from grpo_core.rollout import HFGenerateBackend, Placement, SamplingParams, backend_for
from grpo_core.rollout.vllm_server import (
    ServerConnection,
    VLLMServerBackend,
    VLLMServerError,
    VLLMServerRefused,
)
from grpo_core.train.loop import TrainHooks, train
from tests.tiny import make_prompts, make_tiny_model, read_log, require_vllm, tiny_config

TOLERANCE = 1e-4  # float32 engine vs float32 policy (see the module docstring)
MAX_MODEL_LENGTH = 64  # tiny_config: prompts <= 48 tokens, completions <= 8
PROMPTS = [[5, 9, 11, 14], [7, 3, 22, 8, 30, 2, 14], [12, 4, 25]]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)
DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m flows.serve`` for a model folder, as a child process; its log in a file."""

    def __init__(self, model_dir: Path, log_path: Path, max_model_length: int = MAX_MODEL_LENGTH,
                 port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flows.serve", "--model", str(model_dir), "--port", str(self.port),
                 "--max-model-len", str(max_model_length), "--seed", "3"],
                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1], env=env)
        self.started = time.perf_counter()
        try:
            ServerConnection("127.0.0.1", self.port, timeout=120).wait_until_healthy()
        except VLLMServerError:
            self.stop()
            pytest.fail(f"flows.serve did not start:\n{log_path.read_text()[-4000:]}")
        self.start_seconds = time.perf_counter() - self.started

    def health(self) -> dict:
        return ServerConnection("127.0.0.1", self.port, timeout=10).request("/health", waiting_for="a test")

    def backend(self, policy, tokenizer, **options) -> VLLMServerBackend:
        options = {"timeout": 30.0, "group_port": free_port(), **options}
        return VLLMServerBackend(policy, tokenizer, port=self.port, **options)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-server")
    # hidden 64 over 2 heads: head size 32, the smallest vLLM's CPU attention takes
    return make_tiny_model(d / "model", hidden_size=64, heads=2), make_prompts(d / "train.jsonl"), d


@pytest.fixture(scope="module")
def server(assets):
    require_vllm()
    model_dir, _, d = assets
    served = Server(model_dir, d / "server.log")
    print(f"flows.serve answered /health {served.start_seconds:.1f} s after its start")
    yield served
    served.stop()


def perturbed(model_dir: Path, seed: int = 0, scale: float = 0.5):
    """The base policy with every weight moved: a policy the server's model folder does not hold."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=scale)
    return policy


@torch.no_grad()
def policy_logps(model, batch) -> torch.Tensor:
    """(N, C) log-probs (T = 1) of the batch's completion tokens under ``model``, from a plain forward of each
    row's real tokens: independent of the server and of the trainer's log-prob code."""
    out = torch.zeros(batch.completion_ids.shape)
    for row in range(batch.completion_ids.shape[0]):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        completion = batch.completion_ids[row][batch.completion_mask[row].bool()].tolist()
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
        out[row, :len(completion)] = torch.log_softmax(logits, -1).gather(1,
                                                                          torch.tensor(completion)[:, None])[
                                                                              :, 0]
    return out


def test_pushed_weights_reach_the_server_greedy_and_sampled_logprobs(server, assets):
    """After a push the server's greedy completions are HF generate's on the pushed policy (not the base's),
    and its sampled-token log-probs are the policy's log-probs of those tokens."""
    model_dir = assets[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = perturbed(model_dir)
    backend = server.backend(policy, tok, return_logprobs=True)
    try:
        got = backend.generate(PROMPTS, 2, GREEDY)
        expected = HFGenerateBackend(policy, tok).generate(PROMPTS, 2, GREEDY)
        for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field
        assert not torch.equal(got.completion_ids, HFGenerateBackend(base, tok).generate(PROMPTS, 2, GREEDY)
                               .completion_ids)  # the pushed weights, not the folder's, made these
        sampled = backend.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, temperature=1.0))
        mask = sampled.completion_mask.bool()
        expected_logps = policy_logps(policy, sampled)
        gap = (sampled.sampling_logps - expected_logps)[mask].abs().max().item()
        # float32 on both sides, summed in other orders: the perturbed policy's logits are large, and the gap
        # of an unlikely token grows with them (measured 2e-5 to 1.3e-4 over runs); weights not pushed give
        # gaps ~1
        assert gap < TOLERANCE * (1 + expected_logps[mask].abs().max().item()), gap
        assert sampled.sampling_logps[mask].isfinite().all()
        print(f"pushes of the tiny model ({sum(p.numel() for p in policy.parameters())} parameters): "
              f"{[round(s, 4) for s in backend.push_seconds]} s; max sampled log-prob gap {gap:.2e}")
    finally:
        backend.close()


def test_weights_are_pushed_once_after_each_sync_and_only_then(server, assets):
    model_dir = assets[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    backend = server.backend(policy, tok)
    try:
        before = server.health()["pushes"]
        first = backend.generate(PROMPTS, 1, GREEDY)  # the policy may differ from the folder: pushed first
        backend.generate(PROMPTS, 1, GREEDY)
        assert (backend.weights_pushed, server.health()["pushes"] - before) == (1, 1)
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.5)
        backend.sync_weights(policy)
        backend.sync_weights(policy)  # several optimizer steps in one round: one push
        after = backend.generate(PROMPTS, 1, GREEDY)
        assert (backend.weights_pushed, server.health()["pushes"] - before) == (2, 2)
        assert server.health()["weights_version"] == 3  # versions: folder 0 -> policy 1 -> two syncs later 3
        assert torch.equal(after.completion_ids, HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY)
                           .completion_ids)
        assert not torch.equal(after.completion_ids, first.completion_ids)
    finally:
        backend.close()


def test_clients_one_after_another_reuse_the_group_port(server, assets):
    """evaluate samples the base, closes, then samples the trained policy; a crashed trainer never closes:
    either way the next client forms its group on the same (configured) port and its weights are the ones
    served."""
    model_dir = assets[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    port = free_port()
    for seed, close in ((2, True), (3, False), (4, True)):
        policy = perturbed(model_dir, seed=seed)
        backend = server.backend(policy, tok, group_port=port)
        got = backend.generate(PROMPTS, 1, GREEDY)
        assert torch.equal(got.completion_ids, HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY)
                           .completion_ids)
        if close:
            backend.close()


def test_other_ranks_sample_only_once_rank_0_pushed_the_weights_they_expect(server, assets):
    """Two training processes, as two clients in this process: rank 1 never pushes; its rounds wait at the
    server until rank 0 has pushed the weights version rank 1 expects (one per sync on every rank), then
    sample them."""
    model_dir = assets[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    # joins the group: the server's version restarts
    rank0 = server.backend(policy, tok, place=Placement(0, 0, 2))
    rank1 = server.backend(policy, tok, place=Placement(1, 1, 2))
    rank1_thread = ThreadPoolExecutor(1)
    try:
        for round_ in range(2):
            if round_:
                policy = perturbed(model_dir, seed=1)
                rank0.sync_weights(policy)
                rank1.sync_weights(policy)
            waiting = rank1_thread.submit(rank1.generate, PROMPTS, 1, GREEDY)
            time.sleep(1.0)
            assert not waiting.done()  # rank 0 has not pushed this round's weights yet
            rank0.generate(PROMPTS, 1, GREEDY)
            got = waiting.result(timeout=20)
            assert torch.equal(got.completion_ids, HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY)
                               .completion_ids)
        assert (rank0.weights_pushed, rank1.weights_pushed) == (2, 0)
        rank1.sync_weights(policy)  # a version rank 0 never pushes: an error within the timeout, not a hang
        rank1.server.timeout = 3.0
        start = time.perf_counter()
        with pytest.raises(VLLMServerRefused, match=r"HTTP 409: .*weights version 3 was not pushed"):
            rank1.generate(PROMPTS, 1, GREEDY)
        assert time.perf_counter() - start < 10
    finally:
        rank1_thread.shutdown(wait=False)
        rank0.close()


def test_weights_of_another_model_are_refused_with_the_engines_reason_at_once(server, assets, tmp_path):
    """A policy with a layer the served model lacks: the server receives every tensor anyway (so the trainer's
    broadcasts finish) and answers the engine's reason, well within the timeout; it serves on afterwards."""
    model_dir = assets[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    other = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "deeper", hidden_size=64, heads=2,
                                                                 layers=3))
    backend = server.backend(other, tok, timeout=30.0)
    start = time.perf_counter()
    try:
        with pytest.raises(VLLMServerRefused,
                           match=rf"127\.0\.0\.1:{server.port} refused /update_weights .*HTTP 500") \
                as info:
            backend.generate(PROMPTS, 1, GREEDY)
        assert exit_code_for(info.value) == EXIT_CONFIG  # the same answer on every retry: permanent
        assert time.perf_counter() - start < 15
    finally:
        backend.close()
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    fine = server.backend(policy, tok)
    try:
        assert torch.equal(fine.generate(PROMPTS, 1, GREEDY).completion_ids,
                           HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY).completion_ids)
    finally:
        fine.close()


def test_an_unreachable_server_is_an_error_naming_it_within_the_timeout(assets):
    port = free_port()  # nothing listens there
    tok = AutoTokenizer.from_pretrained(assets[0])
    start = time.perf_counter()
    with pytest.raises(VLLMServerError, match=rf"127\.0\.0\.1:{port} within generation\.vllm_server_timeout "
                                              r"= 3 s \(waited for its /health\)"):
        VLLMServerBackend(torch.nn.Linear(1, 1), tok, port=port, group_port=free_port(), timeout=3)
    assert time.perf_counter() - start < 10


def test_a_weight_group_that_cannot_form_is_an_error_naming_its_port(server, assets):
    """The group port is taken by a socket that never answers: the trainer's side gives up within the
    timeout."""
    tok = AutoTokenizer.from_pretrained(assets[0])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        start = time.perf_counter()
        with pytest.raises(VLLMServerError, match=r"weight-sync group .* did not form on "
                                                  rf"127\.0\.0\.1:{port} \(generation\.vllm_group_port\) "
                                                  r"within 3 s"):
            VLLMServerBackend(torch.nn.Linear(1, 1), tok, port=server.port, group_port=port, timeout=3)
        assert time.perf_counter() - start < 15
    assert server.health()["status"] == "ok"  # the server lives on for the next trainer


def test_a_server_killed_mid_run_is_a_clear_error_not_a_hang(assets):
    require_vllm()
    model_dir, _, d = assets
    doomed = Server(model_dir, d / "doomed.log")
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    try:
        backend = doomed.backend(policy, tok, timeout=5)
        backend.generate(PROMPTS, 1, GREEDY)
        doomed.process.kill()
        doomed.process.wait()
        for sync_first in (False, True):  # a round, then a round that must push weights first
            if sync_first:
                backend.sync_weights(policy)
            start = time.perf_counter()
            with pytest.raises(VLLMServerError, match=rf"127\.0\.0\.1:{doomed.port}") as info:
                backend.generate(PROMPTS, 1, GREEDY)
            assert time.perf_counter() - start < 15
            assert exit_code_for(info.value) == EXIT_ERROR  # transient: the flow retries it
    finally:
        doomed.stop()


class KillServerAfter:
    """A tracker that kills ``server`` once step ``step`` is logged
    (its checkpoint is written right after)."""

    def __init__(self, server: Server, step: int):
        self.server, self.step, self.steps = server, step, []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.steps.append(step)
        if step == self.step:
            self.server.process.kill()
            self.server.process.wait()


def test_a_server_killed_mid_training_and_started_again_resumes_with_every_step_once(assets, tmp_path):
    """The server dies after step 2: training stops with the transient error (exit 1) naming it; started again
    on the same ports, the re-run resumes from checkpoint-2 and train_log.csv holds steps 1-4 once each."""
    require_vllm()
    model_dir, data, d = assets
    doomed = Server(model_dir, d / "killed.log")
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=4, save_steps=1, learning_rate=2e-2,
                      generation_backend="vllm", temperature=0.7, vllm_mode="server",
                      vllm_server_port=doomed.port, vllm_group_port=free_port(), vllm_server_timeout=30.0)
    # a dead server refuses at once: the timeout only bounds slow answers
    tracker = KillServerAfter(doomed, step=2)
    try:
        with pytest.raises(VLLMServerError, match=rf"127\.0\.0\.1:{doomed.port}") as info:
            train(cfg, root=tmp_path, progress=False, hooks=TrainHooks(tracker=tracker))
        assert exit_code_for(info.value) == EXIT_ERROR
        assert tracker.steps == [1, 2]
    finally:
        doomed.stop()
    again = Server(model_dir, d / "again.log", port=doomed.port)
    try:
        tracker = KillServerAfter(again, step=0)
        result = train(cfg, root=tmp_path, progress=False, hooks=TrainHooks(tracker=tracker))
    finally:
        again.stop()
    assert tracker.steps == [3, 4]  # resumed from checkpoint-2
    assert [row["step"] for row in read_log(result.log_path)] == ["1", "2", "3", "4"]


def test_training_samples_from_the_server_and_pushes_after_each_step(server, assets, tmp_path):
    """Two optimizer steps through train(): the server got the weights before each round (twice), and the
    server's sampled-token log-probs fed the sampler correction, equal to the trainer's recomputation."""
    model_dir, data, _ = assets
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=2, learning_rate=2e-2, generation_backend="vllm",
                      temperature=0.7, vllm_mode="server", vllm_server_port=server.port,
                      vllm_group_port=free_port(), vllm_server_timeout=30.0)
    before = server.health()["pushes"]
    result = train(cfg, root=tmp_path, progress=False)
    assert server.health()["pushes"] - before == 2
    log = read_log(result.log_path)
    assert len(log) == 2
    assert all(0 <= float(row["sampling/sampling_logp_difference/max"]) < TOLERANCE for row in log)
    assert all(float(row["sampling/importance_sampling_ratio/mean"]) == pytest.approx(1.0, abs=1e-3)
               for row in log)
    assert all(torch.isfinite(torch.tensor(float(row["loss"]))) for row in log)


def test_evaluate_samples_base_and_trained_through_the_one_server(server, assets, tmp_path):
    """The evaluate stage in server mode: both policies are sampled by the running server, each after its
    weights were pushed (greedy completions equal HF generate's from each folder), and the pushes are counted
    there."""
    import dataclasses
    import json
    from types import SimpleNamespace

    import flows.stages.evaluate as evaluate
    from grpo_core.data.loading import PromptEncoder
    from grpo_core.rollout.types import decode_completions

    base = assets[0]
    # other weights, same shape
    trained = make_tiny_model(tmp_path / "trained", hidden_size=64, heads=2, seed=1)
    data = make_prompts(tmp_path / "eval.jsonl", n=4)
    raw = tiny_config(base, data, DIGITS, generation_backend="vllm", vllm_mode="server",
                      vllm_server_port=server.port, vllm_group_port=free_port(),
                      vllm_server_timeout=30.0).to_dict()
    raw.pop("embedded")
    raw["evaluate"].update(num_generations=2, pass_k=[1, 2])
    inp = evaluate.stage_inputs(config_from_dict(raw))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    before = server.health()["pushes"]
    for policy, folder in (("base", base), ("trained", trained)):
        model_cfg = dataclasses.replace(inp.model, name_or_path=str(folder))
        records = evaluate.sample_policy(policy, model_cfg, inp, SimpleNamespace(root=tmp_path), rows,
                                         [0, 1, 2, 3])
        greedy = [r["completion"] for r in records if r["mode"] == "greedy"]
        model, tok = (AutoModelForCausalLM.from_pretrained(folder).eval(),
                      AutoTokenizer.from_pretrained(folder))
        encoder = PromptEncoder.from_config(tok, inp.data)
        batch = HFGenerateBackend(model, tok).generate(
            [encoder.encode(row["prompt"]) for row in rows], 1,
            SamplingParams(max_new_tokens=inp.generation.max_completion_length, do_sample=False))
        assert greedy == decode_completions(tok, batch), policy
    assert server.health()["pushes"] - before == 2  # one push per policy, however many modes sampled it


def test_two_training_processes_sample_from_one_server_and_rank_0_alone_pushes(server, assets, tmp_path):
    """DDP on two CPU processes (the train stage's launcher, gloo): both sample their own prompts from the
    server, rank 0 pushes before each round (two steps: two pushes, not four), rank 1 waits for them at the
    server."""
    from tests.distributed_worker import launch

    model_dir, data, _ = assets
    before = server.health()["pushes"]
    launch(tmp_path, model_dir, data, 2, {
        "sampled": True, "train": {"per_device_train_batch_size": 8, "beta": 0.0},
        "generation": {"backend": "vllm", "vllm_mode": "server", "vllm_server_port": server.port,
                       "vllm_group_port": free_port(), "vllm_server_timeout": 60, "temperature": 0.7}})
    assert server.health()["pushes"] - before == 2
    log = read_log(tmp_path / "metrics/train_log.csv")
    assert len(log) == 2
    assert all(0 <= float(row["sampling/sampling_logp_difference/max"]) < TOLERANCE for row in log)


def test_backend_for_picks_the_server_client_in_server_mode(server, assets):
    tok = AutoTokenizer.from_pretrained(assets[0])
    policy = AutoModelForCausalLM.from_pretrained(assets[0]).eval()
    raw = tiny_config(assets[0], assets[1], DIGITS, generation_backend="vllm").to_dict()
    raw["generation"].update(vllm_mode="server", vllm_server_port=server.port, vllm_group_port=free_port(),
                             vllm_server_timeout=30)
    backend = backend_for(policy, tok, config_from_dict(raw).generation, seed=0, max_prompt_length=48)
    try:
        assert isinstance(backend, VLLMServerBackend)
    finally:
        backend.close()


@pytest.mark.parametrize("generation,message", [
    ({"vllm_mode": "remote"}, "generation.vllm_mode"),
    ({"vllm_mode": "server", "vllm_server_port": 0}, r"generation.vllm_server_port: 0 is out of range"),
    ({"vllm_mode": "server", "vllm_group_port": 70000}, r"generation.vllm_group_port: 70000 is out of range"),
    ({"vllm_mode": "server", "vllm_server_port": 9000, "vllm_group_port": 9000}, "need two ports"),
    ({"vllm_mode": "server", "vllm_server_timeout": 0},
     r"generation.vllm_server_timeout: 0(\.0)? is out of range"),
])
def test_server_keys_are_validated(assets, generation, message):
    raw = tiny_config(assets[0], assets[1], DIGITS, generation_backend="vllm").to_dict()
    raw["generation"].update(generation)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_server_keys_defaults(assets):
    g = tiny_config(assets[0], assets[1], DIGITS).generation
    assert (g.vllm_mode, g.vllm_server_host, g.vllm_server_port, g.vllm_group_port,
            g.vllm_server_timeout) == (
                "colocate", "127.0.0.1", 8000, 51216, 240.0)
