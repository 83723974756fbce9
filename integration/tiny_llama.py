"""Build a tiny, seeded, random-weight Llama checkpoint (real safetensors) on the fly.

Why not ``load_format="dummy"``: vLLM's dummy weights (±1e-3) make attention
scores nearly uniform, so a wrong GQA mapping, a missing causal mask or a
dropped newest token change the logits by almost nothing. These weights are
scaled so that attention rows are far from uniform and such bugs flip tokens.

Shape: GQA with 4 query / 2 KV heads, head size 64, 2 layers, vocab 512. A
WordLevel tokenizer (``w0 w1 ...``) is written too, so servers and text prompts
work offline.

    python -m integration.tiny_llama OUT_DIR [--seed 0] [--heads 4 --kv-heads 2 --head-size 64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(VOCAB - len(SPECIAL)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(out))


def build(out: str | Path, *, seed: int = 0, num_heads: int = 4, num_kv_heads: int = 2,
          head_size: int = 64, num_layers: int = 2, max_positions: int = 4096) -> Path:
    """Write config.json, model.safetensors and a tokenizer into ``out``; return it.

    Deterministic: the same arguments give the same bytes. Skips the work if a
    checkpoint built with the same arguments is already there.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    stamp = {"seed": seed, "heads": num_heads, "kv_heads": num_kv_heads, "head_size": head_size,
             "layers": num_layers, "max_positions": max_positions, "format": 2}
    stamp_file = out / "dhp_tiny_llama.json"
    if built(stamp_file, stamp):
        return out
    out.mkdir(parents=True, exist_ok=True)

    hidden = num_heads * head_size
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_size,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    fill_llama_like(model, seed)
    return save(model, out, stamp_file, stamp)


def fill_llama_like(model, seed: int) -> None:
    """Seeded weights for a Llama-like model (pre-norms scaled by ``weight``), in name order.

    q/k gain 2: scaled scores have std ~2-4, so softmax rows are peaked. Also fills
    what Llama lacks, for the windowed architectures (`integration.tiny_windowed`):
    biases and sinks (1-D, small), fused q/k/v projections (gain 2) and stacked
    experts (3-D, fan-in the middle dimension).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases; gpt-oss's sinks (logits of a few units, as trained ones)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.1))
            else:
                fan_in = p.shape[1]
                gain = 2.0 if ("q_proj" in name or "k_proj" in name or "qkv_proj" in name) else 1.0
                if "lm_head" in name:
                    gain = 3.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(fan_in)))


def built(stamp_file: Path, stamp: dict) -> bool:
    """Whether ``stamp_file`` (written last by `save`) says a checkpoint of these arguments is there."""
    return stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp


def save(model, out: Path, stamp_file: Path, stamp: dict) -> Path:
    """Write the model (safetensors), the tokenizer and the stamp that `build` checks; return ``out``."""
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out)
    stamp_file.write_text(json.dumps(stamp))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    print(build(a.out, seed=a.seed, num_heads=a.heads, num_kv_heads=a.kv_heads,
                head_size=a.head_size, num_layers=a.layers))


if __name__ == "__main__":
    main()
