"""Build a tiny, seeded, random-weight Gemma-2 checkpoint that uses logits soft-capping.

What it is for: the end-to-end test of soft-capping (issue 31) on vLLM's CPU
engine, DHP against vLLM's own CPU attention. Weights are scaled as the tiny
Llama's (`integration.tiny_llama`): scaled attention scores have a std of about
2-4, so a cap of 5 (``attn_logit_softcapping``; Gemma-2's own is 50 for its
larger scores) changes every attention row and a backend that ignored it would
flip tokens. Sliding windows are off (every layer ``full_attention``, no
``sliding_window``): the windowed architectures are `integration.tiny_windowed`'s.

Shape: 4 query / 2 KV heads, head size 64, 2 layers, vocab 512, the tiny
Llama's WordLevel tokenizer.

    python -m integration.tiny_gemma2 OUT_DIR [--seed 0] [--soft-cap 5]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from integration.tiny_llama import VOCAB, built, save


def build(out: str | Path, *, seed: int = 0, soft_cap: float | None = 5.0, num_heads: int = 4,
          num_kv_heads: int = 2, head_size: int = 64, num_layers: int = 2, max_positions: int = 4096) -> Path:
    """Write config.json, model.safetensors and a tokenizer into ``out``; return it.

    Deterministic: the same arguments give the same bytes; skips the work if a
    checkpoint built with the same arguments is already there.
    """
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out = Path(out)
    stamp = {"arch": "gemma2", "seed": seed, "soft_cap": soft_cap, "heads": num_heads, "kv_heads": num_kv_heads,
             "head_size": head_size, "layers": num_layers, "max_positions": max_positions, "format": 4}
    stamp_file = out / "dhp_tiny_model.json"
    if built(stamp_file, stamp):
        return out
    out.mkdir(parents=True, exist_ok=True)

    hidden = num_heads * head_size
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_size,
        max_position_embeddings=max_positions, query_pre_attn_scalar=head_size,  # scale = head_size ** -0.5
        attn_logit_softcapping=soft_cap, final_logit_softcapping=30.0,
        sliding_window=None, layer_types=["full_attention"] * num_layers,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config.dtype = "float32"
    model = Gemma2ForCausalLM(config)
    fill_gemma_like(model, seed, hidden)
    return save(model, out, stamp_file, stamp)


def fill_gemma_like(model, seed: int, hidden: int) -> None:
    """Seeded weights for a Gemma-2/3 model, in name order.

    vLLM's Gemma ties the LM head to the embedding, and Gemma scales the input
    embedding by sqrt(hidden): with plain random weights a token's own embedding
    then dominates its logits and every prompt repeats its last token, whatever
    attention computes. So: small embeddings (the residual stream is the layers'
    outputs, RMS ~4 each after Gemma's post-norms) and a final norm that restores
    logits of std ~3 (peaked rows, wide greedy margins). RMSNorm scales by
    ``1 + weight``; Gemma-3's q/k norms are norms too.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                p.copy_(3.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "model.norm.weight":
                p.copy_(20.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.15 / math.sqrt(hidden)))
            else:
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(p.shape[1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soft-cap", type=float, default=5.0)
    a = ap.parse_args()
    print(build(a.out, seed=a.seed, soft_cap=a.soft_cap))


if __name__ == "__main__":
    main()
