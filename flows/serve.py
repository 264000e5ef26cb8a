"""``python -m flows.serve --model DIR [--host 127.0.0.1] [--port 8000] [--dtype auto] [--max-model-len N]
[--seed S]``: a vLLM engine on this process's device(s), behind HTTP, for ``generation.vllm_mode: server``.

The client and the protocol are grpo_core/rollout/vllm_server.py's. Endpoints (JSON):

    GET  /health               {"status", "model", "dtype", "device", "max_model_len", "weights_version",
                                "pushes"}
    POST /generate             {"prompts": [[ids]], "sampling": vllm.SamplingParams kwargs, "weights_version",
                                "wait_s"} -> {"outputs": [[{"token_ids", "finish_reason", "stop_reason",
                                "logprobs"}]], "weights_version", "session"} (one list per prompt; logprobs:
                                each sampled token's, or None; the version and group session generated from)
    POST /init_weight_group    {"port", "timeout_s", "session"}: host the weight-sync group's rendezvous,
                               join it
    POST /update_weights       {"params": [[name, dtype, shape]]}: receive the weights version (an int64 over
                               the group, from the trainer), then each weight, one at a time
    POST /close_weight_group   leave the group (the engine keeps serving)

Every endpoint but /health requires ``Authorization: Bearer <token>`` when ``GRPO_SERVER_TOKEN`` is set in
the server's environment (401 otherwise, nothing done); without it the server starts only on a loopback
address. The HTTP port, the group's rendezvous store and the group's gloo socket listen on ``--host`` (the
gloo socket on the address the trainer reached the server at, when ``--host`` is every interface); the
engine's own one-process group on loopback (grpo_core/rollout/vllm.py). docs/security.md lists every
listening socket.

The engine runs in this process (vLLM's ``external_launcher`` executor, as the colocated backend's does: one
engine set-up, ``grpo_core.rollout.vllm.engine_options``). Why in-process rather than a worker extension in
vLLM's worker process (TRL's choice): the weights arriving over the group go straight into the colocated
backend's loading path (``load_policy_weights``: the worker's ``reload_weights`` over a generator, which
re-runs each layer's post-load processing, needed on CPU) without a second process to reach; a generator
cannot cross a process boundary. The cost: the engine scheduler shares this process with the HTTP loop, so
requests are served one at a time (a lock), and one device per server (no tensor parallelism).
"""

import argparse
import hmac
import logging
import sys
import threading
import time
from typing import Annotated

from grpo_core.common.errors import EXIT_CONFIG, ConfigurationError
from grpo_core.rollout.sockets import TOKEN_VARIABLE, is_loopback, server_token

log = logging.getLogger("flows.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.serve",
                                description="Serve a vLLM engine to the GRPO trainer (generation.vllm_mode: "
                                            "server).")
    p.add_argument("--model", required=True,
                   help="the model folder the engine starts from (model.name_or_path)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (generation.vllm_server_host)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (generation.vllm_server_port)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the engine's dtype (auto: the checkpoint's; "
                        "the trainer sends its weights in this dtype)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion (default: the model's; "
                        "on CPU the KV cache is sized for it)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the server's GPU for weights and KV cache (its own device: most of "
                        "it)")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    return p


class EngineServer:
    """The engine and what the endpoints share: a lock (one engine call at a time), the weights version (the
    one the current trainer sent with its last push; 0: the model folder's), the weight-sync group and the
    session that formed it."""

    def __init__(self, llm, model: str, device: str):
        self.llm, self.model, self.device = llm, model, device
        self.lock = threading.Lock()
        self.version_changed = threading.Condition()
        self.version = 0  # the trainer's version of the weights served (0: the model folder's)
        self.pushes = 0   # pushes over the server's life
        self.group = None
        self.session: str | None = None  # the client whose group pushed the weights served
        # group port -> the rendezvous store this server hosts there, kept for its life
        self.stores: dict = {}

    def health(self) -> dict:
        from grpo_core.rollout.vllm import engine_dtype

        config = self.llm.llm_engine.vllm_config.model_config
        return {"status": "ok", "model": self.model, "device": self.device,
                "max_model_len": config.max_model_len,
                "dtype": str(engine_dtype(self.llm)).removeprefix("torch."), "weights_version": self.version,
                "pushes": self.pushes}

    def init_group(self, host: str, port: int, timeout_s: float, session: str, address: str) -> None:
        """Host the group's store on ``host:port`` and join the group, this side's gloo socket on
        ``address``."""
        from grpo_core.rollout.vllm_server import SERVER_RANK, WeightGroup, rendezvous_store

        self.group = None  # a new trainer: the last one's group goes (its store stays, see rendezvous_store)
        if port not in self.stores:
            self.stores[port] = rendezvous_store(host, port, SERVER_RANK, timeout_s)
        self.group = WeightGroup(host, port, SERVER_RANK, timeout_s, session, device=self.device,
                                 store=self.stores[port], address=address)
        with self.version_changed:
            self.version, self.session = 0, session

    def receive_version(self) -> int:
        """The version of the weights that follow, as the trainer broadcasts it before them."""
        import torch

        version = torch.zeros(1, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(version)
        return int(version.item())

    def update_weights(self, params: list) -> int:
        """Receive the weights' version, then each announced tensor over the group and load it, one at a time;
        the count loaded. When loading fails (weights this engine's model does not have) or the version is
        not newer than the one held, the rest are still received, so the trainer's broadcasts finish and it
        gets this reason at once instead of a group timeout."""
        import torch

        from grpo_core.rollout.vllm import load_policy_weights

        if self.group is None:
            raise RuntimeError("no weight-sync group: POST /init_weight_group first")
        received, group_failed = 0, False

        def receive(name: str, dtype: str, shape: list):
            nonlocal received, group_failed
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.group.device)
            try:
                self.group.broadcast(tensor)
            except Exception:
                group_failed = True  # the trainer left: nothing more will come
                raise
            received += 1
            return name, tensor

        with self.lock, torch.no_grad():
            version = self.receive_version()
            if version <= self.version:
                for spec in params:
                    receive(*spec)
                raise RuntimeError(f"weights version {version} is not newer than the {self.version} held")
            try:
                load_policy_weights(self.llm, (receive(*spec) for spec in params))
            except Exception:
                if not group_failed:
                    for spec in params[received:]:
                        receive(*spec)
                raise
            if received < len(params):  # the engine stopped reading early: take the rest, then say so
                taken = received
                for spec in params[received:]:
                    receive(*spec)
                raise RuntimeError(f"the engine took {taken} of the {len(params)} weights sent")
            self.group.finish()
            self.llm.reset_prefix_cache()  # cached prompt K/V were computed with the old weights
            with self.version_changed:  # under the engine's lock: a round reports the version it used
                self.version, self.pushes = version, self.pushes + 1
                self.version_changed.notify_all()
        return received

    def generate(self, prompts: list[list[int]], sampling: dict, version: int, wait_s: float) -> dict:
        from vllm import SamplingParams

        with self.version_changed:  # another training process's push (rank 0) may still be on its way
            if not self.version_changed.wait_for(lambda: self.version >= version, timeout=wait_s):
                raise TimeoutError(f"weights version {version} was not pushed within {wait_s:g} s (the "
                                   f"server holds version {self.version}; rank 0 of the trainers pushes "
                                   "them)")
        params = SamplingParams(**sampling)
        with self.lock:
            results = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                        sampling_params=params, use_tqdm=False)
            served, session = self.version, self.session
        logprobs = sampling.get("logprobs") is not None
        outputs = [[completion_record(out, logprobs) for out in result.outputs] for result in results]
        return {"outputs": outputs, "weights_version": served, "session": session}


def completion_record(out, logprobs: bool) -> dict:
    """One vLLM completion as /generate answers it."""
    from grpo_core.rollout.vllm import sampled_logprobs

    return {"token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason if isinstance(out.stop_reason, (int, str)) else None,
            "logprobs": sampled_logprobs(out) if logprobs else None}


def build_app(server: EngineServer, host: str, token: str | None = None):
    """The FastAPI app; ``token``: the bearer token every endpoint but /health requires (None: none).
    Endpoints are plain functions: FastAPI runs them in its thread pool, so a weight push or a round blocks
    neither /health nor a request waiting for a weights version."""
    from fastapi import Body, FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="grpo-pipeline vLLM server", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {token}".encode() if token else None

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        # checked before the body is read or any endpoint runs: a refused request changes nothing
        if expected is not None and request.url.path != "/health":
            sent = request.headers.get("authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(sent, expected):
                return JSONResponse({"detail": f"missing or wrong bearer token ({TOKEN_VARIABLE})"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    def answer(work):
        try:
            return work()
        except TimeoutError as err:
            raise HTTPException(status_code=409, detail=str(err)) from err
        except Exception as err:  # the engine's or the group's reason, to the trainer's error message
            log.exception("request failed")
            raise HTTPException(status_code=500, detail=f"{type(err).__name__}: {err}") from err

    @app.get("/health")
    def health():
        return server.health()

    @app.post("/generate")
    def generate(body: Annotated[dict, Body()]):
        return answer(lambda: server.generate(body["prompts"], body["sampling"],
                                              int(body.get("weights_version", 0)),
                                              float(body.get("wait_s", 60.0))))

    @app.post("/init_weight_group")
    def init_weight_group(body: Annotated[dict, Body()], request: Request):
        # the group's gloo socket goes where this trainer reached the server: --host, or with --host on every
        # interface, the one address of them the trainer can reach
        address = request.scope["server"][0] if request.scope.get("server") else host
        answer(lambda: server.init_group(host, int(body["port"]), float(body["timeout_s"]),
                                         str(body["session"]), address))
        return {"status": "ok"}

    @app.post("/update_weights")
    def update_weights(body: Annotated[dict, Body()]):
        start = time.perf_counter()
        loaded = answer(lambda: server.update_weights(body["params"]))
        return {"loaded": loaded, "version": server.version, "seconds": time.perf_counter() - start}

    @app.post("/close_weight_group")
    def close_weight_group():
        server.group = None
        return {"status": "ok"}

    return app


def start_engine_for(args: argparse.Namespace):
    """The engine as the colocated backend builds it (grpo_core.rollout.vllm.engine_options), on this
    process's device, for the model folder; sleep mode off: the device is the server's alone."""
    import torch
    from transformers import AutoConfig

    from grpo_core.rollout.vllm import engine_device, engine_options, start_engine

    config = AutoConfig.from_pretrained(args.model)
    dtype = (getattr(torch, args.dtype) if args.dtype != "auto"
             else (getattr(config, "dtype", None) or torch.float32))
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    options = engine_options(args.model, dtype, config, gpu_memory_utilization=args.gpu_memory_utilization,
                             enable_sleep_mode=False, max_model_length=args.max_model_len, seed=args.seed)
    return start_engine(options), engine_device()


def checked_token(host: str) -> str | None:
    """``GRPO_SERVER_TOKEN``; ConfigurationError naming the host and the variable when it is unset and
    ``host`` reaches beyond this machine (anyone there could push weights or stall the trainer)."""
    token = server_token()
    if token is None and not is_loopback(host):
        raise ConfigurationError(f"flows.serve: --host {host} is not a loopback address and {TOKEN_VARIABLE} "
                                 "is not set: anyone who can reach it could push weights or stall training; "
                                 f"set {TOKEN_VARIABLE} (the same value in the trainer's environment) or "
                                 "serve on 127.0.0.1")
    return token


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        token = checked_token(args.host)
    except ConfigurationError as err:
        print(err, file=sys.stderr)
        return EXIT_CONFIG
    if token is None:
        log.warning("%s is not set: any local user can call /generate and push weights; set it on a shared "
                    "machine", TOKEN_VARIABLE)
    import uvicorn

    from grpo_core.rollout.vllm import shutdown_engine

    start = time.perf_counter()
    llm, device = start_engine_for(args)
    server = EngineServer(llm, args.model, device)
    log.info("engine for %s ready on %s in %.1f s; serving http://%s:%d", args.model, device,
             time.perf_counter() - start, args.host, args.port)
    try:
        uvicorn.run(build_app(server, args.host, token), host=args.host, port=args.port, log_level="warning")
    finally:
        shutdown_engine(llm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
