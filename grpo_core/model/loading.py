"""Loading the policy and the reference model, hub or local, the same way (``from_pretrained``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from grpo_core.common.errors import InputUnreadable
from grpo_core.common.options import ConfigError, Options, option
from grpo_core.model.cpu_kernels import CpuKernels
from grpo_core.model.gguf import converted_model_dir, is_gguf

log = logging.getLogger(__name__)


@dataclass
class LoraConfig(Options):
    r: int = option(16, "LoRA rank", ge=1)
    lora_alpha: float = option(32.0, "LoRA scaling numerator", gt=0)
    lora_dropout: float = option(0.05, "dropout on the LoRA path", ge=0, lt=1)
    target_modules: str | list[str] = option("all-linear", "modules to adapt (peft's target_modules)")


@dataclass
class QuantizationConfig(Options):
    """params.yaml `model.quantization:` - QLoRA: the frozen base loaded in 4 bits through bitsandbytes (the
    `qlora` extra), LoRA adapters trained over it in float32 (docs/precision.md). Transformers'
    BitsAndBytesConfig names in brackets."""

    load_in_4bit: bool = option(True,
                                "a 4-bit base (load_in_4bit); the only mode offered: 8-bit bases are not")
    quant_type: Literal["nf4", "fp4"] = option("nf4", "the 4-bit format (bnb_4bit_quant_type): nf4 = QLoRA's "
                                          "NormalFloat, built for normally distributed weights")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = option(
        "bfloat16", "dtype the 4-bit layers dequantize to and multiply in (bnb_4bit_compute_dtype)")
    double_quant: bool = option(True, "quantize the per-block quantization constants too "
                            "(bnb_4bit_use_double_quant; QLoRA's double quantization: ~0.4 bit per parameter "
                            "saved)")


@dataclass
class ModelConfig(Options):
    """params.yaml `model:`: which model, in which dtype, how it is adapted (LoRA, QLoRA) and run on CPUs."""

    name_or_path: str = option("artifacts/base_model", "a local directory or a hub model id")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "dtype of the exported model, of the frozen reference and of sampling in "
        "calibrate/evaluate; trained weights are float32 master weights whatever this says "
        "(train.mixed_precision sets the compute dtype), and LoRA keeps the frozen base in this dtype")
    trust_remote_code: bool = option(False, "run code shipped with the model (only for models you trust)")
    attn_implementation: str | None = option(None,
                                             "transformers attn_implementation (sdpa, flash_attention_2, "
                                             "...)")
    lora: LoraConfig | None = option(None,
                                     "train LoRA adapters instead of all weights (needs the `lora` extra)")
    quantization: QuantizationConfig | None = option(
        None, "QLoRA: the frozen base in 4 bits (bitsandbytes, the `qlora` extra) under model.lora's "
        "adapters; null = the base in model.dtype. The export merges the adapters into the full-precision "
        "base")
    cpu_threads: int = option(0, "torch CPU threads in stages that run the model (0 = torch's default)", ge=0)
    cpu_kernels: CpuKernels = option(
        "native", "instruction set torch's CPU kernels may use in every stage (ATen, oneDNN, MKL): "
        "avx2 = the same bytes on every x86-64 CPU with AVX2; native = the CPU's best "
        "(grpo_core/model/cpu_kernels.py)")

    def check(self) -> None:
        q = self.quantization
        if q is not None and not q.load_in_4bit:
            raise ConfigError("quantization.load_in_4bit: false is not offered (no 8-bit base); for a base "
                              "in model.dtype set model.quantization: null")
        if q is not None and self.lora is None:
            raise ConfigError("quantization: needs model.lora; a 4-bit base is frozen (its packed weights "
                              "take no gradient), so only LoRA adapters over it can be trained - set "
                              "model.lora, e.g. {r: 16}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(InputUnreadable, ValueError):
    """The model or tokenizer cannot be loaded; the message names model.name_or_path."""


def resolve_model_path(name_or_path: str, root: str | Path = ".") -> str:
    """A local directory (relative to the repo root) if one exists, else a hub id.

    Something that is plainly a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) but does not exist is an
    error here, rather than a confusing hub lookup later. A ``*.gguf`` file stands for the folder the
    ``convert`` stage made from it.
    """
    if is_gguf(name_or_path):
        return str(converted_model_dir(name_or_path, root))
    candidate = Path(root, name_or_path).expanduser()
    if candidate.is_dir():
        return str(candidate)
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path or not name_or_path:
        raise ModelLoadError(f"model.name_or_path: '{name_or_path}' is not a directory (looked in "
                             f"{candidate}); run the `prepare` stage for the embedded model, "
                             "or give a hub id")
    return name_or_path


def load_tokenizer(cfg: ModelConfig, root: str | Path = "."):
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.name_or_path, root)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"model.name_or_path: cannot load a tokenizer from '{path}': {err}") from err
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"model.name_or_path: the tokenizer of '{path}' has neither a pad nor an "
                                 "EOS token")
        tok.pad_token = tok.eos_token  # masks, not the pad id, decide what is trained on
        log.info("tokenizer has no pad token; using the EOS token '%s' for padding", tok.eos_token)
    return tok


def apply_cpu_threads(cfg: ModelConfig) -> None:
    """Pin torch's CPU thread count when ``model.cpu_threads`` asks for it.

    A tiny model gains nothing from a second thread, and on a loaded 2-core machine two OpenMP threads
    waiting on each other made every matmul ~50x slower (13 s vs 0.2 s for one rollout, measured).
    """
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)


def compute_device() -> torch.device:
    """Where every stage runs the model: this process's GPU when there is one (LOCAL_RANK under a launcher),
    else the CPU - the choice the trainer's Accelerator makes, shared by calibrate and evaluate."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_model(cfg: ModelConfig, root: str | Path = ".", dtype: torch.dtype | None = None,
               quantized: bool = False):
    """A causal LM from ``model.name_or_path`` in ``dtype`` (default: ``model.dtype``). ``quantized``: its
    linear layers in 4 bits as ``model.quantization`` says (QLoRA; bitsandbytes' ``Linear4bit``), on
    ``compute_device()`` (bitsandbytes quantizes as it places the weights); everything else stays in
    ``dtype``."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    apply_cpu_threads(cfg)
    path = resolve_model_path(cfg.name_or_path, root)
    kwargs = {"dtype": dtype or DTYPES[cfg.dtype], "trust_remote_code": cfg.trust_remote_code,
              "use_safetensors": True}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if quantized:
        kwargs["quantization_config"] = bitsandbytes_config(cfg)
        kwargs["device_map"] = {"": compute_device()}
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a damaged or cut weights file
        raise ModelLoadError(f"model.name_or_path: cannot load a causal LM from '{path}' "
                             f"(safetensors weights required): {type(err).__name__}: {err}") from err


def bitsandbytes_config(cfg: ModelConfig):
    """transformers' ``BitsAndBytesConfig`` for ``model.quantization``; a ModelLoadError naming the ``qlora``
    extra when bitsandbytes is missing."""
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    if q is None:
        raise ValueError("model.quantization is not set")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ModelLoadError(f"model.quantization: a 4-bit base needs bitsandbytes ({err}); install the "
                             "extra: pip install -e '.[qlora]'") from err
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
                              bnb_4bit_use_double_quant=q.double_quant)


def keep_4bit_layers_trainable(model: torch.nn.Module) -> int:
    """Stop bitsandbytes repacking a 4-bit layer for CPU inference; returns how many layers there are.

    On a CPU with AVX512-BF16, bitsandbytes 0.50's ``Linear4bit`` rewrites its packed weight into an
    inference-only layout the first time it runs in eval mode without grad (a rollout, the reference pass) and
    keeps it: every later training forward then takes the inference kernel, which fails in backward ("a view
    of a leaf Variable that requires grad is being used in an in-place operation"). Switched off, the layer
    keeps the one layout that trains; rollouts run the generic dequantize-and-matmul path."""
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


def is_quantized(model) -> bool:
    """True for a model whose base was loaded through a quantizer (QLoRA's 4-bit base),
    peft-wrapped or not."""
    base = model.get_base_model() if is_peft_model(model) else model
    return getattr(base, "hf_quantizer", None) is not None


def check_model_folder(cfg: ModelConfig, root: str | Path = ".") -> str:
    """Fail fast (in validate) on a model that would not load in calibrate or train; returns what was checked.

    Reads the config and the safetensors headers (no weights) and compares the tensor names with the ones the
    architecture expects; only when they differ (a checkpoint whose names transformers converts on load) does
    it load the model for real, so a mismatch is judged by ``from_pretrained`` itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(cfg.name_or_path, root)
    if not Path(path).is_dir():
        return f"{cfg.name_or_path}: a hub id, not checked offline"
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"model.name_or_path: '{path}' has no readable config.json: {err}") from err
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model.name_or_path: '{path}' holds no *.safetensors weights (safetensors "
                             "weights required; pickled .bin files are refused)")
    from safetensors import safe_open

    found: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                found.update(fh.keys())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"model.name_or_path: {f} is not a readable safetensors file: "
                                 f"{err}") from err
    from accelerate import init_empty_weights

    with init_empty_weights():
        expected = set(AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
                       .state_dict())
    missing = {k for k in expected - found if not (k.startswith("lm_head") and config.tie_word_embeddings)}
    if missing:
        # names transformers may convert: the real load decides (and raises ModelLoadError)
        load_model(cfg, root)
    # named as params.yaml names it: the report is a DVC output, the same in every clone
    return (f"{cfg.name_or_path}: {config.model_type}, {len(found)} tensors in {len(files)} safetensors "
            "file(s)")


def _load_with_tokenizer(cfg: ModelConfig, root: str | Path, dtype: torch.dtype | None):
    """(model, tokenizer), the model's pad id taken from the tokenizer when its config has none."""
    tokenizer = load_tokenizer(cfg, root)
    model = load_model(cfg, root, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_for_inference(cfg: ModelConfig, root: str | Path = "."):
    """(model, tokenizer) for sampling (calibrate, evaluate): ``model.dtype`` weights, eval mode, on
    ``compute_device()`` - the device the trainer samples on."""
    model, tokenizer = _load_with_tokenizer(cfg, root, dtype=None)
    return model.to(compute_device()).eval(), tokenizer


def load_policy(cfg: ModelConfig, root: str | Path = ".", gradient_checkpointing: bool = False):
    """(model, tokenizer): trainable policy, with LoRA adapters when ``cfg.lora`` is set.

    Trainable weights are float32 master weights whatever ``model.dtype`` says: AdamW on bf16 weights
    rounds an update smaller than half a bf16 step (~0.4 % of the weight) away, so a run at lr 1e-6 barely
    moves. ``train.mixed_precision`` runs the forward and backward in bf16/fp16 under autocast (TRL's
    convention) and the export casts back to ``model.dtype``. Under LoRA the frozen base stays in
    ``model.dtype`` and only the adapters are float32 (peft's ``autocast_adapter_dtype``). Under QLoRA
    (``model.quantization``) the base's linear layers are 4-bit (bitsandbytes ``Linear4bit``, computing in
    ``quantization.compute_dtype``), the rest of the base (embeddings, norms, head) in ``model.dtype``, the
    adapters float32 as under LoRA. peft's ``prepare_model_for_kbit_training`` is not called: it would upcast
    the frozen embeddings, norms and head to float32 (for Qwen2.5-0.5B +0.27 GB), and the rest of what it does
    (inputs that require grad for gradient checkpointing) LoRA does here already.
    """
    if cfg.quantization is not None and cfg.lora is None:
        raise ModelLoadError("model.quantization: needs model.lora (a 4-bit base is frozen: only adapters "
                             "train)")
    tokenizer = load_tokenizer(cfg, root)
    model = load_model(cfg, root, dtype=None if cfg.lora is not None else torch.float32,
                       quantized=cfg.quantization is not None)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.quantization is not None:
        keep_4bit_layers_trainable(model)
    if gradient_checkpointing:  # newer transformers call it activation checkpointing
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.config.use_cache = False
        # frozen embeddings: the checkpointed blocks need an input that requires grad
        if cfg.lora is not None:
            model.enable_input_require_grads()
    if cfg.lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as err:
            raise ModelLoadError("model.lora: LoRA needs peft; install the extra: pip install -e "
                                 "'.[lora]'") from err
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout,
                          target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    return model, tokenizer


def disable_dropout(model: torch.nn.Module) -> int:
    """Every ``nn.Dropout`` of ``model`` (LoRA's adapter dropout included) set to p = 0, so the policy's
    training-mode log-probs are those it sampled with (TRL's ``disable_dropout``). Returns how many there
    were. Attention dropout that a model applies inside its attention kernel, not through a module, is its
    config's business."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    for m in dropouts:
        m.p = 0.0
    return len(dropouts)


class Float32Head(torch.nn.Linear):
    """An LM head that computes its logits in float32 whatever the autocast or weight dtype (TRL's
    ``cast_lm_head_to_fp32``, the ScaleRL recipe): bf16 logits round log-probs by up to ~0.4% of their value,
    and the importance ratio is a difference of log-probs. Same parameters and state-dict keys as the
    ``nn.Linear`` it replaces (``cast_lm_head_to_fp32`` swaps the class in place)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s LM head a ``Float32Head``; an untied head's weights become float32 too (a tied head
    keeps the embedding's dtype and is upcast per call, so the embeddings stay as they are). Returns the
    head."""
    base = model.get_base_model() if is_peft_model(model) else model
    head = base.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, Float32Head):
        raise ValueError(f"train.cast_lm_head_to_fp32: the LM head is a {type(head).__name__}, not a plain "
                         "Linear (a LoRA adapter on lm_head? leave lm_head out of model.lora.target_modules)")
    tied = head.weight is base.get_input_embeddings().weight
    if not tied:
        head.float()
    head.__class__ = Float32Head
    return head


def is_peft_model(model) -> bool:
    """True for a peft-wrapped model (LoRA); peft is optional, so a missing peft means no."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class AdapterDisabledReference(torch.nn.Module):
    """The reference under LoRA: the same base weights with adapters switched off (no second copy).

    It owns no weights (the policy is held outside its module tree), so it is never moved, saved or synced.
    """

    def __init__(self, peft_model):
        super().__init__()
        self._peft = [peft_model]  # a list, so the policy is not registered as a submodule

    @property
    def device(self) -> torch.device:
        return model_device(self._peft[0])

    @property
    def policy(self) -> torch.nn.Module:
        """The LoRA-wrapped policy whose base this view is."""
        return self._peft[0]

    def adapters_off(self):
        """A context in which the policy computes as this reference: its adapters switched off."""
        return self._peft[0].disable_adapter()

    def forward(self, *args, **kwargs):
        with self.adapters_off():
            return self._peft[0](*args, **kwargs)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's weights are: its first parameter's device, else its ``device`` attribute (the LoRA
    reference view, which owns no parameters), else the CPU."""
    for p in model.parameters():
        return p.device
    return getattr(model, "device", torch.device("cpu"))


def owns_weights(reference: torch.nn.Module) -> bool:
    """False for the LoRA reference view: it shares the policy's weights (nothing to move, save or sync)."""
    return not isinstance(reference, AdapterDisabledReference)


def load_reference(cfg: ModelConfig, root: str | Path, policy) -> torch.nn.Module:
    """A frozen reference: the base weights as loaded (a fresh copy), or the adapter-less view under LoRA."""
    if cfg.lora is not None:
        return AdapterDisabledReference(policy)
    ref = load_model(cfg, root)
    ref.eval()
    ref.requires_grad_(False)
    return ref
