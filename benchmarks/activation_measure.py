"""What one micro-batch's forward and backward add to a process's memory, measured on CPU: the check on
benchmarks/memory_plan.py's activation term.

    python -m benchmarks.activation_measure HIDDEN LAYERS HEADS KV_HEADS INTERMEDIATE ROWS TOKENS
                                            CHECKPOINTING

A random Qwen2 of that shape (float32, a 512-token vocabulary so the logits are negligible; one position's
logits kept, as the fused head keeps one chunk) takes a warm-up step (gradients allocated: those are the
plan's persistent state), then one forward and backward of ROWS x TOKENS. Printed as JSON: the peak RSS
(VmHWM: benchmarks/rss.py) over the RSS just before that step. Run it with ``MALLOC_MMAP_THRESHOLD_=65536``
(``measure`` does) so freed tensors leave the heap and the peak is the step's, not the allocator's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.rss import current_rss_bytes, peak_rss_bytes


def step_bytes(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, rows: int, tokens: int,
               checkpointing: bool) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, tie_word_embeddings=True, use_cache=False)
    model = Qwen2ForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=torch.randint(5, 500, (1, 8)),
          logits_to_keep=1).logits.sum().backward()  # warm-up: gradients
    ids = torch.randint(5, 500, (rows, tokens))
    before = current_rss_bytes()
    model(input_ids=ids, logits_to_keep=1).logits.sum().backward()
    return peak_rss_bytes() - before


def measure(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, rows: int, tokens: int,
            checkpointing: bool = False) -> int:
    """step_bytes in a fresh process (its own peak), with the allocator set as the module docstring says."""
    args = [str(v) for v in (hidden, layers, heads, kv_heads, intermediate, rows, tokens, int(checkpointing))]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.activation_measure", *args], capture_output=True,
                          text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["activations"]


if __name__ == "__main__":
    h, n, a, kv, i, r, t, c = (int(v) for v in sys.argv[1:9])
    print(json.dumps({"activations": step_bytes(h, n, a, kv, i, r, t, bool(c))}))
