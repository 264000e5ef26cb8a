"""``train.async_rollouts``: a sampler worker process samples the next generation round while the trainer
trains on the current one: one-step off-policy GRPO (verl's one-step-off-policy, AReaL, prime-rl).

    trainer (grpo_core/train/loop.py)                  sampler worker (spawned; its own copy of the policy in
                                                       shared memory, as many torch threads as the trainer)
    round r starts: round r is in hand (sampled ahead, or sampled now)
      the policy's weights -> the worker's copy
      submit round r+1 (prompts, RNG state)  ------->  sample G completions per prompt, score them; when the
      train on round r (its steps), update             round will be trained by later weights: the log-probs
                                                       of its tokens under the sampling weights (old_logps,
                                                       from the decode loop itself where it reports them) and
                                                       under the reference (ref_logps, beta > 0)
    round r+1 starts: receive it  <------------------  round r+1 and the RNG state after sampling it

A step then costs about the larger of sampling and training instead of their sum; the reference pass moves to
the worker too, so that the two sides carry about equal work. The trainer writes the new
weights into the worker's copy only while the worker is idle (between receiving a round and submitting the
next), so the copy needs no lock.

Determinism: each request carries the trainer's torch RNG state and the trainer continues from the state the
worker reports after sampling, so the random stream does not depend on timing. With ``max_staleness`` 0 the
trainer submits and waits: the run is the synchronous one, token for token. With 1 a checkpoint first receives
the round in flight and saves it (``TrainState.ahead``), so a resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.common.errors import TrainingFailure, TransientFailure
from grpo_core.data.loading import PromptEncoder
from grpo_core.model.loading import AdapterDisabledReference
from grpo_core.rewards import build_reward_functions
from grpo_core.rollout import GenerationConfig
from grpo_core.train.forward import LogprobOptions, frozen_logprobs
from grpo_core.train.round import Round, RoundSpec, Scoring, sample_round

ADAPTERS_OFF = "adapters-off"  # the reference a LoRA worker builds from its own copy
_START_TIMEOUT_S = 300.0  # a spawned worker imports torch and transformers before it answers
_POLL_S = 1.0             # how often a waiting trainer checks that the worker is still alive
_BEAT_S = 1.0             # how often the worker's heartbeat thread stamps the shared clock
SILENT_LIMIT_S = 120.0    # a worker whose heartbeat is older than this is stopped or starved: the trainer
                          # gives up
LOST_HINT = ("the run resumes from its last checkpoint when the stage runs again; if it recurs, check memory "
             "(an OOM kill shows in `dmesg`) and what else runs on the machine")


class SamplerWorkerError(TrainingFailure, RuntimeError):
    """The sampler worker was used out of order, or (with the worker's traceback as the cause) raised."""


class SamplerWorkerLost(TransientFailure):
    """The sampler worker died, did not start in time, or went silent (no heartbeat): a retry resumes."""


@dataclass(frozen=True)
class WorkerRecipe:
    """What the worker samples, scores and computes log-probs with (the trainer's own, sent once)."""

    round: RoundSpec
    logprobs: LogprobOptions
    generation: GenerationConfig   # the backend it builds when the trainer gives no make_backend
    encoder: PromptEncoder         # prompts -> ids, as the trainer encodes them


@dataclass
class SampleRequest:
    """One round for the worker to sample."""

    row_ids: list[int]          # dataset indices of the round's prompts (named in errors)
    rows: list[dict]            # those dataset rows
    rng_state: torch.Tensor     # the trainer's torch CPU RNG state: sampling starts from it
    old_logps: bool             # the round will be trained by later weights: score its tokens under these
    ref_logps: bool             # ... and under the reference (beta > 0; the trainer computes them otherwise)
    training: bool              # the policy's train/eval mode (HF generate and the forward follow it)
    policy_step: int            # optimizer steps behind the weights it samples with (echoed back)


@dataclass
class SampledRound:
    round: Round                # advantages still zero; old_logps / ref_logps (N, C) when the request asked
    rng_state: torch.Tensor     # the RNG state after sampling: the trainer continues from it
    policy_step: int            # optimizer steps behind the weights that sampled it


class _OneProcess:
    """What ``sample_round`` asks of an accelerator, for a worker that serves one training process."""

    num_processes = 1
    process_index = 0


def _pack(sampled: SampledRound) -> dict[str, Any]:
    """Numpy arrays and plain values: pickled by value (torch's own reductions would pass each small tensor
    through a shared-memory file of its own)."""
    buffer = {k: v.numpy() for k, v in sampled.round.to_buffer().items()}
    return {"round": buffer, "rng_state": sampled.rng_state.numpy(), "policy_step": sampled.policy_step}


def _unpack(packed: dict[str, Any]) -> SampledRound:
    buffer = {k: torch.from_numpy(v) for k, v in packed["round"].items()}
    return SampledRound(Round.from_buffer(buffer), torch.from_numpy(packed["rng_state"]),
                        packed["policy_step"])


def _heartbeat(beat) -> None:
    """Stamp ``beat`` with the (system-wide) monotonic clock every second, for the life of the process: a
    worker that is stopped (SIGSTOP) or starved stops stamping, however long its rounds take."""
    while True:
        beat.value = time.monotonic()
        time.sleep(_BEAT_S)


def _serve(conn, beat) -> None:
    """The worker's life: import what unpickling a model needs while the trainer sets up, take the set-up (the
    policy copy, the reference, tokenizer, config, rewards), build the backend and rewards, then answer
    requests until the trainer says stop (None) or goes away (EOF)."""
    threading.Thread(target=_heartbeat, args=(beat,), name="grpo-sampler-heartbeat", daemon=True).start()
    import transformers.modeling_utils  # noqa: F401 - the bulk of a model class's import, done ahead
    try:
        setup = conn.recv()
    except EOFError:
        return
    if setup is None:
        return
    try:
        (model, reference, tokenizer, recipe, reward_specs, reward_names, weights, threads,
         make_backend) = setup
        torch.set_num_threads(threads)
        if reference == ADAPTERS_OFF:  # LoRA: the reference is this copy with its adapters switched off
            reference = AdapterDisabledReference(model)
        if make_backend is None:
            from grpo_core.rollout import backend_for

            # generation.backend auto / hf / manual (vllm is refused with async rollouts): no engine seed or
            # size
            backend = backend_for(model, tokenizer, recipe.generation, seed=0, max_prompt_length=None)
        else:
            backend = make_backend(model, tokenizer)
        scoring = Scoring(build_reward_functions(reward_specs), reward_names, weights)
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        _send_error(conn, exc)
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer closed its end (or was killed): done
            return
        if request is None:
            return
        try:
            round_ = _sample(request, model, reference, backend, tokenizer, scoring, recipe)
            answer = _pack(SampledRound(round_, torch.get_rng_state(), request.policy_step))
        except BaseException as exc:  # noqa: BLE001 - a failing round is the trainer's to raise
            _send_error(conn, exc)
            continue
        try:
            conn.send(("ok", answer))
        except (BrokenPipeError, OSError):  # the trainer is gone
            return


def _sample(request: SampleRequest, model, reference, backend, tokenizer, scoring: Scoring,
            recipe: WorkerRecipe) -> Round:
    """One round: sampled and scored, with the sampling weights' and the reference's log-probs when asked."""
    model.train(request.training)
    torch.set_rng_state(request.rng_state)
    # the decode loop scores its tokens as it samples them
    reports_logps = hasattr(backend, "return_logprobs")
    if reports_logps:
        backend.return_logprobs = request.old_logps
    round_ = sample_round(backend=backend, tokenizer=tokenizer, rows=request.rows, row_ids=request.row_ids,
                          encoder=recipe.encoder, scoring=scoring, spec=recipe.round,
                          accelerator=_OneProcess())
    if request.old_logps:  # the sampler's own log-probs: the importance ratio's denominator
        reported = round_.sampling_logps
        round_.old_logps = (reported if reported is not None
                            else frozen_logprobs(model, round_, recipe.logprobs))
    round_.sampling_logps = None  # not an engine's to correct for (train.vllm_importance_sampling_correction)
    if request.ref_logps:
        round_.ref_logps = frozen_logprobs(reference, round_, recipe.logprobs)
    return round_


def _send_error(conn, exc: BaseException) -> None:
    """The exception itself when it pickles (so the trainer raises the same type),
    and the worker's traceback."""
    text = "".join(traceback.format_exception(exc))
    try:
        conn.send(("error", (exc, text)))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text alone
        conn.send(("error", (None, text)))


class SamplerWorker:
    """The trainer's handle on the sampler worker: ``start``, ``copy_weights``, ``submit``, ``receive``,
    ``close``.

    ``start``'s policy: the unwrapped policy (CPU); its copy lives in shared memory, so ``copy_weights``
    copies the trainable tensors, no transfer. reference: the frozen reference the worker scores rounds
    sampled ahead with (shared in place), ``ADAPTERS_OFF`` under LoRA, or None (the trainer scores them).
    make_backend: ``(model, tokenizer) -> RolloutBackend`` (a module-level callable: the worker is spawned),
    else ``generation.backend``'s. The constructor spawns the process and ``start`` sets it up, so its imports
    (seconds) overlap whatever the caller does in between. On GPUs the same calls would front a second device
    or an inference engine; only the CPU worker exists so far.
    """

    def __init__(self, silent_limit_s: float = SILENT_LIMIT_S):
        """Spawn the worker now: it imports torch, transformers and this package while the caller sets up.
        silent_limit_s: how old its heartbeat may get while the trainer waits for it (seconds)."""
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # monotonic seconds of its last heartbeat; 0 before the first
        self._beat = ctx.Value("d", 0.0, lock=False)
        self.silent_limit_s = silent_limit_s
        self._process = ctx.Process(target=_serve, args=(child, self._beat), name="grpo-sampler",
                                    # not daemonic: isolated rewards start processes of their own
                                    daemon=False)
        self._process.start()
        child.close()
        self.copy, self._trained, self.scores_reference = None, {}, False
        self._ready = False
        self.in_flight = False

    def start(self, policy: torch.nn.Module, tokenizer, recipe: WorkerRecipe, reward_specs,
              reward_names: list[str], weights: torch.Tensor, make_backend: Callable | None = None,
              reference: torch.nn.Module | str | None = None) -> None:
        """Hand the worker its copy of ``policy`` (in shared memory) and what it samples and scores with."""
        device = next(policy.parameters()).device
        if device.type != "cpu":
            raise SamplerWorkerError("train.async_rollouts: the sampler worker samples on the CPU; the "
                                     f"policy is on {device} (a second device or an engine behind the same "
                                     "interface is not built)")
        self.copy = copy.deepcopy(policy).share_memory()
        # frozen: shared in place, never written while the worker runs
        if isinstance(reference, torch.nn.Module):
            reference.share_memory()
        self.scores_reference = reference is not None
        trained = {name for name, p in policy.named_parameters() if p.requires_grad}
        self._trained = {name: p for name, p in self.copy.named_parameters()
                         if name in trained}  # name -> copy's
        self._conn.send((self.copy, reference, tokenizer, recipe, reward_specs, list(reward_names), weights,
                         torch.get_num_threads(), make_backend))

    @torch.no_grad()
    def copy_weights(self, policy: torch.nn.Module) -> None:
        """The policy's trainable tensors into the worker's copy (frozen ones never change)."""
        if self.in_flight:
            raise SamplerWorkerError("the sampler worker's weights were about to change while it samples")
        for name, p in policy.named_parameters():
            if name in self._trained:
                self._trained[name].copy_(p.detach())

    def submit(self, request: SampleRequest) -> None:
        if self.in_flight:
            raise SamplerWorkerError("a round was submitted while the sampler worker still samples one")
        if not self._ready:
            self._await(_START_TIMEOUT_S)
            self._ready = self._answer()[0] == "ready"
        try:
            self._conn.send(request)
        except (BrokenPipeError, ConnectionResetError) as err:  # it died between rounds
            raise self._died(" before it took the next round") from err
        self.in_flight = True

    def receive(self) -> SampledRound:
        """The round in flight (waiting for it); raises the worker's exception,
        or SamplerWorkerError if it died."""
        if not self.in_flight:
            raise SamplerWorkerError("no round is in flight to receive")
        self._await(None)
        self.in_flight = False
        return _unpack(self._answer()[1])

    def __enter__(self) -> SamplerWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker (a round in flight is dropped)."""
        if self._process is None:
            return
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = None
        self.in_flight = False

    def _lost(self, what: str) -> SamplerWorkerLost:
        return SamplerWorkerLost(f"the sampler worker (pid {self._process.pid}) {what}; {LOST_HINT}")

    def _died(self, when: str = "") -> SamplerWorkerLost:
        """Its end of the pipe closed: wait for the exit code the message names."""
        self._process.join(timeout=5)
        return self._lost(f"died (exit code {self._process.exitcode}){when}")

    def _await(self, timeout_s: float | None) -> None:
        """Until the worker answers; SamplerWorkerLost when it dies first, takes longer than ``timeout_s``, or
        its heartbeat is older than ``silent_limit_s``."""
        waited = 0.0
        while not self._conn.poll(_POLL_S):
            waited += _POLL_S
            if not self._process.is_alive():
                raise self._died()
            if timeout_s is not None and waited >= timeout_s:
                raise self._lost(f"did not start within {timeout_s:g} s")
            silent = time.monotonic() - self._beat.value
            if self._beat.value and silent > self.silent_limit_s:
                raise self._lost(f"has sent no heartbeat for {silent:.0f} s (train.async_rollouts; the limit "
                                 f"is {self.silent_limit_s:g} s): it is stopped (SIGSTOP, "
                                 "a debugger) or starved")

    def _answer(self) -> tuple[str, Any]:
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError) as err:  # its end closed as it died
            raise self._died() from err
        if status == "error":
            exc, text = value
            cause = SamplerWorkerError(f"in the sampler worker:\n{text}")
            if exc is None:
                raise cause
            raise exc from cause
        return status, value
