"""Rollouts from a vLLM engine in its own process (``generation.backend: vllm``,
``generation.vllm_mode: server``; TRL's vllm_mode 'server'): ``python -m flows.serve --model DIR`` runs the
engine on its own device(s), the trainer samples from it over HTTP and pushes its weights to it over a
torch.distributed group of two.

    trainer (rank 1)                                   flows.serve (rank 0)
    GET  /health           until it answers, or vllm_server_timeout
    POST /init_weight_group  -------------------------> hosts the group's rendezvous (TCPStore) on group_port
         join the group (gloo on CPU, NCCL on CUDA)     joins it
    -- a round after a sync (rank 0 of the trainers) --
    POST /update_weights: names, dtypes, shapes ------> receives the version, then each tensor, loads it
         broadcast the weights version, then each       (load_policy_weights, the colocated path), resets
         parameter, one at a time                       the prefix cache, holds that version
    -- every round, every training process --
    POST /generate: prompt ids, sampling, version ----> waits for that weights version, generates
         <- completion ids, finish reasons, sampled-token log-probs (the sampler correction's), the
            version and group session they came from

Several training processes: each samples its own prompts over HTTP; rank 0 alone pushes weights. The others do
not wait at a barrier: every request carries the weights version its sender expects (one more per
``sync_weights``, which every process calls at the same points), and the server answers only once it holds
that version. That keeps ``generate`` free of collectives, so rank 0 may sample alone (evaluation during
training).

Who may push: every endpoint but /health takes ``Authorization: Bearer $GRPO_SERVER_TOKEN`` when the server
has a token (the client sends the one in its own environment), and the server refuses to start on a
non-loopback address without one. The weights version is the trainer's, sent over the weight-sync group
ahead of the weights it labels, never read from a request body: an HTTP request alone cannot make the server
claim a version. The group's store and both ends' gloo sockets listen on the configured host (or the address
the trainer reaches it from), never on every interface (grpo_core/rollout/sockets.py). Rank 0 checks that
the completions it gets came from its own group's weights (the session it formed): another client that
formed a group since is an error, not a silent switch of policy.

Nothing waits unbounded: every HTTP request, the group's forming and each weight sent are bounded by
``vllm_server_timeout``; past it, or when the server's connection is refused or reset, ``VLLMServerError``
(transient: the stage exits 1 and a retry resumes once the server is back) names host:port and what was waited
for. An error the server answers with (weights of another model, a missing or wrong token) is
``VLLMServerRefused``, permanent; so is an answer that is not the protocol's (``VLLMServerBadAnswer``). The
HTTP side needs torch and the standard library only (no vllm on the trainer's side); the NCCL group (CUDA)
uses vLLM's communicator, as TRL does.
"""

from __future__ import annotations

import datetime
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace

import torch

from grpo_core.common.errors import TransientFailure
from grpo_core.rollout.sockets import (
    TOKEN_VARIABLE,
    bound_master_store,
    gloo_group,
    local_address_towards,
    server_token,
)
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
    pushed, a count of loaded weights that differs, a missing or wrong token): a retry gets the same
    answer."""


class VLLMServerUnauthorized(VLLMServerRefused):
    """The server requires a token (``GRPO_SERVER_TOKEN``) this process lacks or has another value of."""


class VLLMServerBadAnswer(VLLMServerRefused):
    """A whole answer that is not the protocol's: not JSON, no ``outputs``, too few completions, token ids
    outside the policy's vocabulary. Something else listens on the configured port, or a server of another
    model or version does: permanent (exit 2), a retry reads the same answer. (An answer cut short because
    the server died is an HTTP error, transient.)"""


class ServerConnection:
    """JSON over HTTP to flows.serve, every request bounded by ``timeout`` seconds; ``token``: the server's
    shared token (``GRPO_SERVER_TOKEN``), sent as a bearer token when given."""

    def __init__(self, host: str, port: int, timeout: float, token: str | None = None):
        self.host, self.port, self.timeout, self.token = host, port, timeout, token
        self.url = f"http://{host}:{port}"

    def request(self, path: str, body: dict | None = None, waiting_for: str = "",
                timeout: float | None = None):
        """The server's JSON answer; VLLMServerError naming host:port and ``waiting_for`` on any failure."""
        timeout = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:  # the server answered, with its own reason
            detail = err.read().decode(errors="replace")[:2000]
            kind = VLLMServerUnauthorized if err.code in (401, 403) else VLLMServerRefused
            raise kind(f"the vLLM server at {self.host}:{self.port} refused {path} ({waiting_for}): HTTP "
                       f"{err.code}: {detail}{self._token_hint(err.code)}") from err
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            raise VLLMServerError(f"the vLLM server at {self.host}:{self.port} did not answer {path} "
                                  f"({waiting_for}; timeout {timeout:g} s): {type(reason).__name__}: "
                                  f"{reason}; is it running? {START_HINT}") from err
        try:
            return json.loads(raw)
        except ValueError as err:
            raise VLLMServerBadAnswer(f"the vLLM server at {self.host}:{self.port} answered {path} "
                                      f"({waiting_for}) with something that is not JSON: {raw[:200]!r}; is "
                                      f"flows.serve what listens there? {START_HINT}") from err

    def _token_hint(self, status: int) -> str:
        if status not in (401, 403):
            return ""
        if self.token:
            return (f"; {TOKEN_VARIABLE} in this process's environment is not the server's: give both the "
                    "same value")
        return f"; the server requires a token: set {TOKEN_VARIABLE} to the server's in this environment"

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
    """The weight-sync group's key-value store: its master (the server, rank 0) listens on ``host:port``
    only. The server keeps one per port for its life and every client session uses its own prefix in it: a
    master store's port is not reliably free again once the store is dropped, and a fresh prefix leaves no
    stale keys of a last session."""
    if rank == SERVER_RANK:
        return bound_master_store(host, port, timeout, world_size=2)
    return torch.distributed.TCPStore(host, port, 2, is_master=False,
                                      timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


class WeightGroup:
    """One side of the weight-sync group: two members, the server (rank 0, whose host keeps the rendezvous
    store on ``port``) and the trainer (rank 1, which broadcasts). Standalone: the trainer's own
    torch.distributed group (DDP, FSDP2) is neither used nor touched.

    CPU: a gloo group built directly on the store. CUDA: vLLM's PyNcclCommunicator over a
    StatelessProcessGroup on the same store, as TRL does (untested here: no GPU in CI; NCCL's own sockets
    listen on the interface NCCL picks, NCCL_SOCKET_IFNAME). session: the key prefix both sides use (the
    client picks it); store: an existing store to use (the server's, kept per port), else one is made;
    address: where this side's gloo socket listens (the server passes the address the trainer reached it
    at), by default the address this machine reaches ``host`` from."""

    def __init__(self, host: str, port: int, rank: int, timeout: float, session: str,
                 device: torch.device | str = "cpu", store: torch.distributed.Store | None = None,
                 address: str | None = None):
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
                listen_on = address or local_address_towards(host, port)
                self.gloo = gloo_group(prefixed, rank, 2, timeout, listen_on)

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
        weights); return_logprobs: batches carry the engine's sampled-token log-probs. The server's token
        comes from ``GRPO_SERVER_TOKEN`` in the environment."""
        rank = place.rank
        self.model, self.rank, self.return_logprobs = model, rank, return_logprobs
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer)
        self.server = ServerConnection(host, port, timeout, token=server_token())
        info = self.server.wait_until_healthy()
        self.dtype = getattr(torch, info["dtype"])  # weights go out in the engine's dtype
        # rank 0's group: its keys in the server's store, and the mark of the weights it pushed
        self.session = uuid.uuid4().hex if rank == 0 else None
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
        session = self.session
        call = _Background(lambda: s.request("/init_weight_group",
                                             {"port": group_port, "timeout_s": s.timeout,
                                              "session": session}, waiting_for))
        forming = _Background(lambda: WeightGroup(s.host, group_port, TRAINER_RANK, s.timeout, session,
                                                  device=device))
        while forming.is_alive() and not isinstance(call.error, VLLMServerUnauthorized):
            forming.join(0.05)
        if isinstance(call.error, VLLMServerUnauthorized):  # no group will form: say why at once
            raise call.error
        group = forming.result(0, "")
        call.result(s.timeout, f"the vLLM server at {s.host}:{s.port} did not answer /init_weight_group "
                               f"({waiting_for}) within {s.timeout:g} s")
        return group

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        self.version += 1

    @torch.no_grad()
    def push_weights(self) -> None:
        """The policy's weights to the server, one parameter at a time (rank 0), after their version: over the
        group, so the version the server holds is always one this trainer sent with its weights."""
        start, s = time.perf_counter(), self.server
        specs = [[name, str(self.dtype).removeprefix("torch."), list(param.shape)]
                 for name, param, _ in engine_entries(self.model)]
        waiting_for = f"receiving {len(specs)} weights over the group on port {self.group.port}"
        call = _Background(lambda: s.request("/update_weights", {"params": specs}, waiting_for))
        name = "the weights version"
        try:
            self.group.broadcast(torch.tensor([self.version], dtype=torch.int64, device=self.group.device))
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
        if (reply.get("loaded"), reply.get("version")) != (len(specs), self.version):
            raise VLLMServerRefused(f"the vLLM server at {s.host}:{s.port} loaded {reply.get('loaded')} of "
                                    f"{len(specs)} weights and holds version {reply.get('version')}, not "
                                    f"{self.version}")
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
        where = f"the vLLM server at {self.server.host}:{self.server.port}"
        completions = checked_outputs(reply, len(requests), per_request, vocabulary_size(self.model),
                                      self.return_logprobs, where)
        self._check_session(reply, where)
        outputs = round_outputs(completions, prompt_ids, num_generations, per_request)
        logps = [out.logprobs for out in outputs] if self.return_logprobs else None
        return rollout_batch(prompt_ids, num_generations, outputs, logps, self.pad_id, self.eos_ids)

    def _check_session(self, reply: dict, where: str) -> None:
        """Rank 0: the completions came from weights of its own group (another client that formed a group
        since could have pushed any weights under any version)."""
        if self.session is not None and reply.get("session") != self.session:
            raise VLLMServerError(f"{where} generated from weights this trainer did not push: its "
                                  "weight-sync group was formed again by another client since this one "
                                  "joined (two trainers on one server?); the retry joins again")

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


def vocabulary_size(model: torch.nn.Module) -> int:
    """Token ids the policy can read: its input embedding's rows."""
    return int(model.get_input_embeddings().num_embeddings)


def checked_outputs(reply, n_requests: int, per_request: int, vocabulary: int, logprobs: bool,
                    where: str) -> list[list[SimpleNamespace]]:
    """/generate's completions, each request's ``per_request`` of them, after checking the answer is the
    protocol's; VLLMServerBadAnswer naming ``where`` and the first thing that is not."""
    def bad(what: str):
        return VLLMServerBadAnswer(f"{where} answered /generate with {what}; is it flows.serve for this "
                                   f"policy's model? {START_HINT}")

    outputs = reply.get("outputs") if isinstance(reply, dict) else None
    if not isinstance(outputs, list):
        raise bad(f"no 'outputs' list: {str(reply)[:200]}")
    if len(outputs) != n_requests or not all(isinstance(o, list) and len(o) == per_request for o in outputs):
        raise bad(f"{[len(o) if isinstance(o, list) else o for o in outputs][:20]} completions for "
                  f"{n_requests} requests x {per_request}")
    return [[_checked_completion(out, vocabulary, logprobs, bad) for out in outs] for outs in outputs]


def _checked_completion(out, vocabulary: int, logprobs: bool, bad) -> SimpleNamespace:
    if not isinstance(out, dict) or not isinstance(out.get("token_ids"), list):
        raise bad(f"a completion without a 'token_ids' list: {str(out)[:200]}")
    ids, stop = out["token_ids"], out.get("stop_reason")
    for token in [*ids, stop] if isinstance(stop, int) else ids:
        if type(token) is not int or not 0 <= token < vocabulary:
            raise bad(f"token id {token!r}, outside the policy's vocabulary of {vocabulary}")
    logps = out.get("logprobs")
    if logprobs and (not isinstance(logps, list) or len(logps) != len(ids) or not all(
            v is None or (type(v) in (int, float) and math.isfinite(v)) for v in logps)):
        raise bad(f"sampled-token log-probs {str(logps)[:200]} for {len(ids)} tokens")
    return SimpleNamespace(token_ids=ids, finish_reason=out.get("finish_reason"), stop_reason=stop,
                           logprobs=logps)
