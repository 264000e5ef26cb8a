"""Model plumbing: what turns a folder of weights into a policy and a policy into per-token log-probs.

    loading.py      policy (fp32 master weights, LoRA), reference, inference loading, model folder checks
    fastforward.py  the hand-written Qwen2/Llama layer stack (a group's shared prompt once; padding-free)
    logprobs.py     per-token log-probs and entropies, chunked; the fused LM head

Depends on the config only; rollouts and training build on it.
"""
