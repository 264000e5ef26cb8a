"""``python -m flows.serve --model DIR [--host 127.0.0.1] [--port 8000] [--dtype auto] [--max-model-len N]
[--seed S]``: a vLLM engine on this process's device(s), behind HTTP, for ``generation.vllm_mode: server``.

The client and the protocol are grpo_core/rollout/vllm_server.py's. Endpoints (JSON):

    GET  /health               {"status", "model", "dtype", "device", "max_model_len", "weights_version",
                                "pushes"}
    POST /generate             {"prompts": [[ids]], "sampling": vllm.SamplingParams kwargs, "weights_version",
                                "wait_s"} -> {"outputs": [[{"token_ids", "finish_reason", "stop_reason",
                                "logprobs"}]]} (one list per prompt; logprobs: each sampled token's, or None)
    POST /init_weight_group    {"port", "timeout_s", "session"}: host the weight-sync group's rendezvous,
                               join it
    POST /update_weights       {"params": [[name, dtype, shape]], "version"}: receive them one at a time
    POST /close_weight_group   leave the group (the engine keeps serving)

The engine runs in this process (vLLM's ``external_launcher`` executor, as the colocated backend's does: one
engine set-up, ``grpo_core.rollout.vllm.engine_options``). Why in-process rather than a worker extension in
vLLM's worker process (TRL's choice): the weights arriving over the group go straight into the colocated
backend's loading path (``load_policy_weights``: the worker's ``reload_weights`` over a generator, which
re-runs each layer's post-load processing, needed on CPU) without a second process to reach; a generator
cannot cross a process boundary. The cost: the engine scheduler shares this process with the HTTP loop, so
requests are served one at a time (a lock), and one device per server (no tensor parallelism).
"""

import argparse
import logging
import threading
import time
from typing import Annotated

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
    """The engine and what the endpoints share: a lock (one engine call at a time), the weights version
    (pushes so far, counted from the current trainer's join) and the weight-sync group."""

    def __init__(self, llm, model: str, device: str):
        self.llm, self.model, self.device = llm, model, device
        self.lock = threading.Lock()
        self.version_changed = threading.Condition()
        self.version = 0  # the policy weights pushed since the trainer joined (0: the model folder's)
        self.pushes = 0   # pushes over the server's life
        self.group = None
        # group port -> the rendezvous store this server hosts there, kept for its life
        self.stores: dict = {}

    def health(self) -> dict:
        from grpo_core.rollout.vllm import engine_dtype

        config = self.llm.llm_engine.vllm_config.model_config
        return {"status": "ok", "model": self.model, "device": self.device,
                "max_model_len": config.max_model_len,
                "dtype": str(engine_dtype(self.llm)).removeprefix("torch."), "weights_version": self.version,
                "pushes": self.pushes}

    def init_group(self, host: str, port: int, timeout_s: float, session: str) -> None:
        from grpo_core.rollout.vllm_server import SERVER_RANK, WeightGroup, rendezvous_store

        self.group = None  # a new trainer: the last one's group goes (its store stays, see rendezvous_store)
        if port not in self.stores:
            self.stores[port] = rendezvous_store(host, port, SERVER_RANK, timeout_s)
        self.group = WeightGroup(host, port, SERVER_RANK, timeout_s, session, device=self.device,
                                 store=self.stores[port])
        with self.version_changed:
            self.version = 0

    def update_weights(self, params: list, version: int) -> int:
        """Receive each announced tensor over the group and load it, one at a time; the count loaded. When
        loading fails (weights this engine's model does not have), the rest are still received, so the
        trainer's broadcasts finish and it gets this reason at once instead of a group timeout."""
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
        with self.version_changed:
            self.version, self.pushes = version, self.pushes + 1
            self.version_changed.notify_all()
        return received

    def generate(self, prompts: list[list[int]], sampling: dict, version: int, wait_s: float) -> list:
        from vllm import SamplingParams

        from grpo_core.rollout.vllm import sampled_logprobs

        with self.version_changed:  # another training process's push (rank 0) may still be on its way
            if not self.version_changed.wait_for(lambda: self.version >= version, timeout=wait_s):
                raise TimeoutError(f"weights version {version} was not pushed within {wait_s:g} s (the "
                                   f"server holds version {self.version}; rank 0 of the trainers pushes "
                                   "them)")
        params = SamplingParams(**sampling)
        with self.lock:
            results = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                        sampling_params=params, use_tqdm=False)
        return [[{"token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason if isinstance(out.stop_reason, (int, str)) else None,
                  "logprobs": sampled_logprobs(out) if sampling.get("logprobs") is not None else None}
                 for out in result.outputs] for result in results]


def build_app(server: EngineServer, host: str):
    """The FastAPI app. Endpoints are plain functions: FastAPI runs them in its thread pool, so a weight push
    or a round blocks neither /health nor a request waiting for a weights version."""
    from fastapi import Body, FastAPI, HTTPException

    app = FastAPI(title="grpo-pipeline vLLM server")

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
        return {"outputs": answer(lambda: server.generate(body["prompts"], body["sampling"],
                                                          int(body.get("weights_version", 0)),
                                                          float(body.get("wait_s", 60.0))))}

    @app.post("/init_weight_group")
    def init_weight_group(body: Annotated[dict, Body()]):
        answer(lambda: server.init_group(host, int(body["port"]), float(body["timeout_s"]),
                                         str(body["session"])))
        return {"status": "ok"}

    @app.post("/update_weights")
    def update_weights(body: Annotated[dict, Body()]):
        start = time.perf_counter()
        loaded = answer(lambda: server.update_weights(body["params"], int(body["version"])))
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from grpo_core.rollout.vllm import shutdown_engine

    start = time.perf_counter()
    llm, device = start_engine_for(args)
    server = EngineServer(llm, args.model, device)
    log.info("engine for %s ready on %s in %.1f s; serving http://%s:%d", args.model, device,
             time.perf_counter() - start, args.host, args.port)
    try:
        uvicorn.run(build_app(server, args.host), host=args.host, port=args.port, log_level="warning")
    finally:
        shutdown_engine(llm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
