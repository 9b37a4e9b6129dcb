"""Small randomly initialised models of the supported families, for tests and examples.

:func:`make_tiny_model` writes a complete transformers model directory (config, safetensors
weights and a byte-level tokenizer) without downloading anything, so that the ``--model PATH``
route, grouped-query attention, head dims 64 and 128, sliding windows (every layer, or alternating
with full layers), learned attention sinks, key norms and scaled RoPE variants can be exercised in
seconds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from kverr.exceptions import ModelError

log = logging.getLogger(__name__)

__all__ = ["TINY_VARIANTS", "make_tiny_model"]

#: Variant name -> (model_type, config overrides). All are small (2-3 layers, hidden 128).
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama, head dim 64, 2 query heads per kv head, plain RoPE.
    "llama": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    # Llama 3 style frequency-dependent RoPE scaling.
    "llama3": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 128}),
    ),
    # Mistral, head dim 128, 4 query heads per kv head, a sliding window shorter than the tests.
    "mistral": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128, num_hidden_layers=2,
             sliding_window=40, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    # Qwen2, head dim 128, q/k/v biases, YaRN RoPE (attention_scaling != 1).
    "qwen2": (
        "qwen2",
        dict(num_attention_heads=6, num_key_value_heads=2, head_dim=128, num_hidden_layers=2,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 256}),
    ),
    # gpt-oss: sliding-window and full layers alternating, a learned sink logit per query head,
    # q/k/v biases, YaRN RoPE, a mixture of experts.
    "gpt_oss": (
        "gpt_oss",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
             layer_types=["sliding_attention", "full_attention"], sliding_window=32,
             num_local_experts=4, num_experts_per_tok=2,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256}),
    ),
    # Gemma 3: two sliding-window layers to one full, a RoPE per layer type (local theta 1e4,
    # global 1e6 with linear scaling), RMS norms on queries and keys, a query scale of its own.
    "gemma3": (
        "gemma3_text",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=32,
             query_pre_attn_scalar=48,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
    ),
    # Qwen3: RMS norm on keys before RoPE (k_pre is the normed key).
    "qwen3": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=2,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
}


def _byte_tokenizer() -> Any:
    """A byte-level tokenizer: one token per UTF-8 byte, plus <s> (BOS) and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_tiny_model(path: str | Path, variant: str = "qwen2", *, seed: int = 0) -> Path:
    """Write a small random model of one of :data:`TINY_VARIANTS` to ``path``.

    Parameters
    ----------
    path : path-like
        Directory to create (``save_pretrained`` layout).
    variant : str
        Key of :data:`TINY_VARIANTS`.
    seed : int
        Seed of the random weights.

    Returns
    -------
    pathlib.Path
        ``path``, loadable with :func:`kverr.capturing.load_model`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if variant not in TINY_VARIANTS:
        raise ModelError(f"unknown tiny model variant {variant!r}; choose from {sorted(TINY_VARIANTS)}")
    model_type, overrides = TINY_VARIANTS[variant]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=258,
        hidden_size=128,
        intermediate_size=256,
        max_position_embeddings=1024,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=True,
        **overrides,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The default init (std 0.02) gives near-uniform attention; larger q/k weights make
        # the attention peaked, so that the proofs are tested where they are hard.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    param.mul_(8.0)
                elif name.endswith("self_attn.sinks"):
                    # sink logits as large as the peaked scores, so that they take real weight
                    param.copy_(4.0 * torch.randn(param.shape))
    out = Path(path)
    model.save_pretrained(out)
    _byte_tokenizer().save_pretrained(out)
    log.info("wrote a tiny %s model to %s", variant, out)
    return out
