"""Our trainer and TRL 1.16's GRPOTrainer, given the same completions, take the same optimizer steps.

Both trainers run on one tiny model, one set of prompts (every step takes all of them, so the order in which
each side draws them does not matter), two reward functions with weights, dapo, a sampling temperature that
scales the training log-probs too, and beta > 0 (a reference model, its KL with and without the importance
ratio) or beta = 0. Their rollouts are scripted: the completion of prompt p, sample g, round r is a seeded
function of (p, g, r), so the sampler's random stream is out of the comparison and everything after it is
in - rewards, weighting, advantages, the completion mask, the log-prob forward (ours: the hand-written
padding-free one and HF's), the KL term, loss normalisation, clipping, AdamW and the schedule. In one round
every sample of a prompt is the same: all advantages are zero, and with beta = 0 the gradient too, yet AdamW's
momentum still moves the weights (TRL steps the optimizer on a zero gradient). After 4 steps the weights, and
every step's logged loss, reward and KL, must agree to float32 rounding.

Sampling itself is held to HF's distribution by tests/test_decode.py (chi-square against softmax, warpers
against HF's). Together the two say: on the same recipe the trainers differ only in their random streams.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from grpo_core.rollout.types import assemble_batch, left_pad, pad_and_eos_ids
from tests.tiny import make_prompts, make_tiny_model, tiny_config

trl = pytest.importorskip("trl")

G, PROMPTS, STEPS, COMPLETION = 4, 4, 4, 8
LR, TEMPERATURE = 5e-3, 0.7
TIED_ROUND = 1  # the second step's round: every sample of a prompt the same, every group's rewards tied
MAX_GRAD_NORM = 0.5  # below the steps' gradient norms (0.4 to 0.9 here): clipping acts
WEIGHTS = [0.7, 0.3]


def digit_count(prompts, completions, **columns) -> list[float]:
    """How many digits a completion holds, over 4 (varies within a group: advantages are not all zero)."""
    return [sum(ch.isdigit() for ch in c) / 4.0 for c in completions]


def even_length(prompts, completions, **columns) -> list[float]:
    return [float(len(c) % 2 == 0) for c in completions]


class Script:
    """Completion g of a prompt in round r: seeded random ids (no special token), an EOS at a seeded place or
    none (truncated). Both trainers ask it for the same (prompt, g, round) and get the same ids."""

    def __init__(self, vocab_size: int, eos_id: int, specials: set[int]):
        self.vocab_size, self.eos_id, self.specials = vocab_size, eos_id, specials
        self.round = -1

    def next_round(self) -> None:
        self.round += 1

    def completion(self, prompt_ids: list[int], g: int) -> list[int]:
        if self.round == TIED_ROUND:
            g = 0
        key = zlib.crc32(json.dumps([prompt_ids, g, self.round]).encode())
        gen = torch.Generator().manual_seed(key)
        allowed = [i for i in range(self.vocab_size) if i not in self.specials]
        ids = [allowed[int(i)] for i in torch.randint(0, len(allowed), (COMPLETION,), generator=gen)]
        stop = int(torch.randint(1, COMPLETION + 2, (1,), generator=gen))  # COMPLETION + 1: truncated, no EOS
        return ids[:stop - 1] + [self.eos_id] if stop <= COMPLETION else ids


class ScriptedBackend:
    """Our RolloutBackend, answering from the script."""

    def __init__(self, script: Script, tokenizer):
        self.script = script
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer)

    def generate(self, prompt_ids, num_generations, sampling):
        self.script.next_round()
        rows = [self.script.completion(p, g) for p in prompt_ids for g in range(num_generations)]
        ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], self.pad_id)
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r)
        return assemble_batch(ids, mask, [out], self.pad_id, self.eos_ids)

    def sync_weights(self, model) -> None:
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("parity")
    model_dir = make_tiny_model(root / "model", hidden_size=32, layers=2)
    data = make_prompts(root / "prompts.jsonl", n=PROMPTS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    script_args = (len(tokenizer), tokenizer.eos_token_id, set(tokenizer.all_special_ids))
    return root, model_dir, data, tokenizer, script_args


def run_ours(setup, forward_backend: str, beta: float, bias_correction: bool):
    from transformers import AutoModelForCausalLM

    from grpo_core.train.loop import TrainHooks, train

    root, model_dir, data, tokenizer, script_args = setup
    script = Script(*script_args)
    rewards = [{"name": "digits", "function": "tests.test_trl_training_parity:digit_count"},
               {"name": "even", "function": "tests.test_trl_training_parity:even_length"}]
    cfg = tiny_config(model_dir, data, rewards, num_generations=G, per_device_train_batch_size=G * PROMPTS,
                      max_completion_length=COMPLETION, learning_rate=LR, beta=beta, loss_type="dapo",
                      temperature=TEMPERATURE, max_steps=STEPS, adam_beta2=0.99, lr_scheduler_type="constant",
                      resume="never", max_grad_norm=MAX_GRAD_NORM, use_bias_correction_kl=bias_correction,
                      output_dir=f"ours-{forward_backend}-{beta}-{bias_correction}",
                      forward_backend=forward_backend)
    logged: list[dict] = []

    class Tracker:
        def log_metrics(self, metrics, step):
            logged.append(dict(metrics))

    hooks = TrainHooks(tracker=Tracker(), backend_factory=lambda m, tok: ScriptedBackend(script, tok))
    result = train(cfg, reward_weights=WEIGHTS, root=root, progress=False,
                   log_path=f"ours-{forward_backend}-{beta}-{bias_correction}.csv", hooks=hooks)
    model = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32)
    return dict(model.named_parameters()), logged


@pytest.fixture(scope="module", params=[(0.04, True), (0.04, False), (0.0, True)],
                ids=["kl-bias-corrected", "kl-plain", "no-reference"])
def trl_run(setup, request):
    """TRL's steps with beta > 0 and its use_bias_correction_kl (the KL times the importance ratio) on and
    off, and with beta = 0: ((beta, the setting), the weights, the log)."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    root, model_dir, data, tokenizer, script_args = setup
    beta, bias_correction = request.param
    script = Script(*script_args)
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(root / f"trl-{beta}-{bias_correction}"), num_generations=G,
                      per_device_train_batch_size=G * PROMPTS, max_completion_length=COMPLETION,
                      learning_rate=LR, beta=beta, loss_type="dapo", temperature=TEMPERATURE,
                      max_steps=STEPS, adam_beta2=0.99, lr_scheduler_type="constant", reward_weights=WEIGHTS,
                      max_grad_norm=MAX_GRAD_NORM, use_bias_correction_kl=bias_correction,
                      bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none",
                      save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    rows = [json.loads(line) for line in open(data)]
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=[digit_count, even_length], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)

    def scripted(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        script.next_round()  # TRL's batch holds each prompt G times in a row: row i is sample i % G
        return [script.completion(list(p), i % num_generations) for i, p in enumerate(prompt_ids)], None

    trainer._generate_single_turn = scripted
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return request.param, dict(trainer.model.named_parameters()), logged


@pytest.mark.parametrize("forward_backend", ["manual", "hf"])
def test_four_steps_on_the_same_completions_end_on_trls_weights(setup, trl_run, forward_backend):
    (beta, bias_correction), theirs, their_log = trl_run
    ours, our_log = run_ours(setup, forward_backend, beta, bias_correction)
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(setup[1]).named_parameters())
    assert ours.keys() == theirs.keys()
    moved = max(float((theirs[n] - base[n]).detach().abs().max()) for n in theirs)
    assert moved > LR  # the steps did move the weights (4 AdamW steps of ~lr each)
    for name in theirs:
        # float32 rounding (another summation order) amplified by Adam's 1/sqrt(v) stays under 2e-5 here; a
        # real difference (a pad token trained on, a term dropped) moves weights by a share of lr:
        # 1e-4 ... 1e-2
        gap = (ours[name] - theirs[name]).abs().max().item()
        assert gap < 5e-3 * moved, f"{name}: ours and TRL's weights differ by {gap:.2e} after {STEPS} steps"
    assert len(our_log) == len(their_log) == STEPS
    tied = their_log[TIED_ROUND]
    assert tied["reward_std"] < 1e-6 and (beta > 0 or tied["grad_norm"] == 0)  # the round the script ties
    kl = ("kl",) if beta > 0 else ()  # TRL logs no KL without a reference
    for step, (mine, trls) in enumerate(zip(our_log, their_log), start=1):
        for key in ("reward", "reward_std", *kl, "completions/mean_length", "rewards/digits/mean",
                    "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                    "clip_ratio/high_max", "clip_ratio/region_mean"):
            trl_key = key.replace("rewards/digits", "rewards/digit_count")
            assert mine[key] == pytest.approx(trls[trl_key], rel=1e-4, abs=1e-6), f"step {step}: {key}"
        assert mine["loss"] == pytest.approx(trls["loss"], rel=1e-3, abs=1e-6), f"step {step}: loss"
        assert mine["grad_norm"] == pytest.approx(trls["grad_norm"], rel=1e-3), f"step {step}: grad_norm"
