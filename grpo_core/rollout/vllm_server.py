"""Rollouts from a vLLM engine in its own process (``generation.backend: vllm``,
``generation.vllm_mode: server``; TRL's vllm_mode 'server'): ``python -m flows.serve --model DIR`` runs the
engine on its own device(s), the trainer samples from it over HTTP and pushes its weights to it over a
torch.distributed group of two.

    trainer (rank 1)                                   flows.serve (rank 0)
    GET  /health           until it answers, or vllm_server_timeout
    POST /init_weight_group  -------------------------> hosts the group's rendezvous (TCPStore) on group_port
         join the group (gloo on CPU, NCCL on CUDA)     joins it
    -- a round after a sync (rank 0 of the trainers) --
    POST /update_weights: names, dtypes, shapes ------> receives each tensor, loads it (load_policy_weights,
         broadcast each parameter, one at a time        the colocated path), resets the prefix cache,
                                                        version += 1
    -- every round, every training process --
    POST /generate: prompt ids, sampling, version ----> waits for that weights version, generates
         <- completion ids, finish reasons, sampled-token log-probs (the sampler correction's)

Several training processes: each samples its own prompts over HTTP; rank 0 alone pushes weights. The others do
not wait at a barrier: every request carries the weights version its sender expects (one more per
``sync_weights``, which every process calls at the same points), and the server answers only once it holds
that version. That keeps ``generate`` free of collectives, so rank 0 may sample alone (evaluation during
training).

Nothing waits unbounded: every HTTP request, the group's forming and each weight sent are bounded by
``vllm_server_timeout``; past it, or when the server's connection is refused or reset, ``VLLMServerError``
(transient: the stage exits 1 and a retry resumes once the server is back) names host:port and what was waited
for. An error the server answers with (weights of another model) is ``VLLMServerRefused``, permanent. The HTTP
side needs torch and the standard library only (no vllm on the trainer's side); the NCCL group (CUDA) uses
vLLM's communicator, as TRL does.
"""

from __future__ import annotations

import datetime
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace

import torch

from grpo_core.common.errors import TransientFailure
from grpo_core.rollout.types import Placement, RolloutBatch, SamplingParams, pad_and_eos_ids
from grpo_core.rollout.vllm import (
    VLLMUnavailable,
    engine_entries,
    engine_weights,
    min_new_tokens,
    rollout_batch,
    round_outputs,
    round_requests,
    vllm_sampling_kwargs,
)

log = logging.getLogger(__name__)

SERVER_RANK, TRAINER_RANK = 0, 1  # the server hosts the rendezvous; the trainer broadcasts
START_HINT = "start it with `python -m flows.serve --model DIR --host HOST --port PORT` (README: Server mode)"


class VLLMServerError(TransientFailure):
    """The vLLM server (``generation.vllm_mode: server``) did not answer within ``vllm_server_timeout``,
    refused or dropped the connection (not started, or died), or the weight-sync group did not form:
    transient, a retry resumes once it is back. The message names host:port and what was waited for."""


class VLLMServerRefused(VLLMUnavailable):
    """The vLLM server answered with an error of its own (weights it cannot load, a weights version never
    pushed, a count of loaded weights that differs): a retry gets the same answer."""


class ServerConnection:
    """JSON over HTTP to flows.serve, every request bounded by ``timeout`` seconds."""

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.url = f"http://{host}:{port}"

    def request(self, path: str, body: dict | None = None, waiting_for: str = "",
                timeout: float | None = None):
        """The server's JSON answer; VLLMServerError naming host:port and ``waiting_for`` on any failure."""
        timeout = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:  # the server answered, with its own reason
            detail = err.read().decode(errors="replace")[:2000]
            raise VLLMServerRefused(f"the vLLM server at {self.host}:{self.port} refused {path} "
                                    f"({waiting_for}): HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            raise VLLMServerError(f"the vLLM server at {self.host}:{self.port} did not answer {path} "
                                  f"({waiting_for}; timeout {timeout:g} s): {type(reason).__name__}: "
                                  f"{reason}; is it running? {START_HINT}") from err

    def wait_until_healthy(self) -> dict:
        """/health's answer, polled until the server is up (it may still be loading its model) or
        ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.request("/health", waiting_for="its health at start-up",
                                    timeout=max(0.5, min(5.0, deadline - time.monotonic())))
            except VLLMServerError as err:
                if time.monotonic() + 0.5 >= deadline:
                    raise VLLMServerError(f"no vLLM server answered at {self.host}:{self.port} within "
                                          f"generation.vllm_server_timeout = {self.timeout:g} s (waited for "
                                          f"its /health); {START_HINT}; last error: {err}") from err
                time.sleep(0.5)


def rendezvous_store(host: str, port: int, rank: int, timeout: float) -> torch.distributed.TCPStore:
    """The weight-sync group's key-value store: its master (the server, rank 0) listens on ``port``. The
    server keeps one per port for its life and every client session uses its own prefix in it: a master
    store's port is not reliably free again once the store is dropped, and a fresh prefix leaves no stale keys
    of a last session."""
    return torch.distributed.TCPStore(host, port, 2, is_master=rank == SERVER_RANK,
                                      timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


class WeightGroup:
    """One side of the weight-sync group: two members, the server (rank 0, whose host keeps the rendezvous
    store on ``port``) and the trainer (rank 1, which broadcasts). Standalone: the trainer's own
    torch.distributed group (DDP, FSDP2) is neither used nor touched.

    CPU: a gloo group built directly on the store. CUDA: vLLM's PyNcclCommunicator over a
    StatelessProcessGroup on the same store, as TRL does (untested here: no GPU in CI). session: the key
    prefix both sides use (the client picks it); store: an existing store to use (the server's, kept per
    port), else one is made."""

    def __init__(self, host: str, port: int, rank: int, timeout: float, session: str,
                 device: torch.device | str = "cpu", store: torch.distributed.Store | None = None):
        self.host, self.port, self.rank, self.timeout = host, port, rank, timeout
        self.device = torch.device(device)
        self.nccl = self.gloo = None
        failed = (f"the weight-sync group with the vLLM server did not form on {host}:{port} "
                  f"(generation.vllm_group_port) within {timeout:g} s")

        def form():
            shared = store if store is not None else rendezvous_store(host, port, rank, timeout)
            prefixed = torch.distributed.PrefixStore(f"weights/{session}/", shared)
            if self.device.type == "cuda":
                self.nccl = _nccl_communicator(prefixed, rank, self.device)
            else:
                self.gloo = torch.distributed.ProcessGroupGloo(prefixed, rank, 2,
                                                               datetime.timedelta(seconds=timeout))

        try:  # bounded from outside: a TCPStore client whose peer accepts and never answers waits for good
            _Background(form).result(timeout + 2, failed)
        except VLLMServerError:
            raise
        except Exception as err:  # torch's own DistError / RuntimeError kinds: one message naming the port
            raise VLLMServerError(f"{failed}: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}") from err

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From the trainer to the server, in place on the receiving side (a collective: both call it)."""
        if self.nccl is not None:
            self.nccl.broadcast(tensor, src=TRAINER_RANK, stream=torch.cuda.current_stream())
            return
        options = torch.distributed.BroadcastOptions()
        options.rootRank = TRAINER_RANK
        self.gloo.broadcast([tensor], options).wait()

    def finish(self) -> None:
        """After the last tensor of a push: NCCL's broadcasts are queued on a stream, so wait for them."""
        if self.nccl is not None:
            torch.cuda.current_stream().synchronize()


def _nccl_communicator(store: torch.distributed.Store, rank: int, device: torch.device):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    return PyNcclCommunicator(StatelessProcessGroup(rank=rank, world_size=2, store=store), device=device)


class _Background(threading.Thread):
    """``work()`` in a daemon thread, so that waiting for it can be bounded (some of torch's waits have no
    bound of their own) or overlap work here (a request the server answers once this side has broadcast)."""

    def __init__(self, work):
        super().__init__(daemon=True)
        self.work, self.value, self.error = work, None, None
        self.start()

    def run(self):
        try:
            self.value = self.work()
        except Exception as err:  # re-raised by result(), in the caller's thread
            self.error = err

    def result(self, timeout: float, on_timeout: str):
        """work()'s value or error; VLLMServerError(on_timeout) when it has not finished within
        ``timeout``."""
        self.join(timeout)
        if self.is_alive():
            raise VLLMServerError(on_timeout)
        if self.error is not None:
            raise self.error
        return self.value


class VLLMServerBackend:
    """``RolloutBackend`` over flows.serve (see the module docstring): ``sync_weights`` marks the weights
    stale, the next ``generate`` (on rank 0) pushes them first, once however many syncs came before."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, host: str = "127.0.0.1", port: int = 8000,
                 group_port: int = 51216, timeout: float = 240.0, place: Placement = Placement(),
                 return_logprobs: bool = False):
        """host, port: flows.serve's HTTP address; group_port: the weight-sync group's rendezvous on that
        host; timeout: seconds any wait on the server may take; place: this training process (rank 0 pushes
        weights); return_logprobs: batches carry the engine's sampled-token log-probs."""
        rank = place.rank
        self.model, self.rank, self.return_logprobs = model, rank, return_logprobs
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer)
        self.server = ServerConnection(host, port, timeout)
        info = self.server.wait_until_healthy()
        self.dtype = getattr(torch, info["dtype"])  # weights go out in the engine's dtype
        self.group = self._join_group(group_port, info) if rank == 0 else None
        if place.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()  # the server's version count restarts at rank 0's join,
                                         # before any request
        self.version = 1  # the weights the next round needs: the policy's, which may differ from the files'
        self.pushed = 0  # the version the server holds (rank 0's knowledge)
        self.weights_pushed = 0  # pushes made, for tests and logs
        self.push_seconds: list[float] = []

    def _join_group(self, group_port: int, info: dict) -> WeightGroup:
        s = self.server
        device = "cuda" if info.get("device") == "cuda" else "cpu"
        waiting_for = f"the weight-sync group on port {group_port}"
        # this client's keys in the server's store, apart from any earlier client's
        session = uuid.uuid4().hex
        call = _Background(lambda: s.request("/init_weight_group",
                                             {"port": group_port, "timeout_s": s.timeout,
                                              "session": session}, waiting_for))
        group = WeightGroup(s.host, group_port, TRAINER_RANK, s.timeout, session, device=device)
        call.result(s.timeout, f"the vLLM server at {s.host}:{s.port} did not answer /init_weight_group "
                               f"({waiting_for}) within {s.timeout:g} s")
        return group

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        self.version += 1

    @torch.no_grad()
    def push_weights(self) -> None:
        """The policy's weights to the server, one parameter at a time (rank 0)."""
        start, s = time.perf_counter(), self.server
        specs = [[name, str(self.dtype).removeprefix("torch."), list(param.shape)]
                 for name, param, _ in engine_entries(self.model)]
        waiting_for = f"receiving {len(specs)} weights over the group on port {self.group.port}"
        call = _Background(lambda: s.request("/update_weights", {"params": specs, "version": self.version},
                                             waiting_for))
        name = None
        try:
            for name, tensor in engine_weights(self.model, self.dtype):  # noqa: B007 (the error names it)
                self.group.broadcast(tensor.to(self.group.device).contiguous())
            self.group.finish()
        except VLLMServerError:
            raise
        except Exception as err:  # gloo's error for a peer that left or went silent
            raise VLLMServerError(f"sending the weights to the vLLM server at {s.host}:{s.port} (group port "
                                  f"{self.group.port}) failed at {name!r}: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}") from err
        reply = call.result(s.timeout, f"the vLLM server at {s.host}:{s.port} did not answer /update_weights "
                                       f"({waiting_for}) within {s.timeout:g} s")
        if reply.get("loaded") != len(specs):
            raise VLLMServerRefused(f"the vLLM server at {s.host}:{s.port} loaded {reply.get('loaded')} of "
                                    f"{len(specs)} weights")
        self.pushed, self.weights_pushed = self.version, self.weights_pushed + 1
        self.push_seconds.append(time.perf_counter() - start)
        log.debug("vLLM server: weights version %d pushed in %.3f s", self.version, self.push_seconds[-1])

    def generate(self, prompt_ids: list[list[int]], num_generations: int,
                 sampling: SamplingParams) -> RolloutBatch:
        if self.group is not None and self.pushed < self.version:
            self.push_weights()
        requests, per_request = round_requests(prompt_ids, num_generations, sampling)
        kwargs = vllm_sampling_kwargs(sampling, per_request, self.eos_ids, min_new_tokens(self.model),
                                      logprobs=self.return_logprobs)
        # the server waits for the version (rank 0's push) within the request's own bound
        reply = self.server.request("/generate", {"prompts": requests, "sampling": kwargs,
                                                  "weights_version": self.version,
                                                  "wait_s": 0.9 * self.server.timeout},
                                    waiting_for=f"{len(requests)} completions with weights version "
                                                f"{self.version}")
        completions = [[SimpleNamespace(**out) for out in outs] for outs in reply["outputs"]]
        outputs = round_outputs(completions, prompt_ids, num_generations, per_request)
        logps = [out.logprobs for out in outputs] if self.return_logprobs else None
        return rollout_batch(prompt_ids, num_generations, outputs, logps, self.pad_id, self.eos_ids)

    def close(self) -> None:
        """Leave the weight-sync group (the server keeps running for the next trainer or stage)."""
        if self.group is not None:
            try:
                self.server.request("/close_weight_group", {}, waiting_for="leaving the weight-sync group",
                                    timeout=min(self.server.timeout, 10.0))
            except (VLLMServerError, VLLMServerRefused) as err:
                # a server already gone has nothing to release
                log.warning("%s", err)
            self.group = None
