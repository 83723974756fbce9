"""Build tiny, seeded, random-weight checkpoints of the architectures with sliding windows.

What they are for: the end-to-end tests of sliding-window attention (issue 31) on
vLLM's CPU engine, DHP against vLLM's own CPU attention
(``tests/test_e2e_windowed.py``). Each window is far below the workload's prompts
(up to 260 tokens, `integration.run_generation`), so it changes what most rows
see; the weights are the tiny Llama's (`integration.tiny_llama.fill_llama_like`)
or the tiny Gemma-2's (`integration.tiny_gemma2.fill_gemma_like`), whose scaled
scores (std ~2-4) make attention rows peaked, so a backend that ignored the
window would flip tokens.

- ``mistral``: every layer windowed (vLLM's model-level ``sliding_window``),
  as Mistral-7B-v0.1;
- ``gemma2``: Gemma-2, a windowed layer then a full one, with the tiny Gemma-2's
  logits soft-cap (5) on both;
- ``gemma3``: Gemma-3 text, a windowed layer then a full one (``layer_types``);
- ``phi3``: every layer windowed, as Phi-3-mini-4k (fused qkv projection);
- ``gpt_oss``: attention sinks, a window on every other layer, biases, a small
  mixture of experts.

Shape: 4 query / 2 KV heads, head size 64, 2 layers, vocab 512, the tiny
Llama's WordLevel tokenizer.

    python -m integration.tiny_windowed OUT_DIR ARCH [--seed 0] [--window W]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from integration.tiny_gemma2 import fill_gemma_like
from integration.tiny_llama import VOCAB, built, fill_llama_like, save

#: each architecture's default window (tokens): below a 32-token block, one block and above,
#: all far below the workload's longest prompts
WINDOWS = {"mistral": 48, "gemma2": 56, "gemma3": 32, "phi3": 40, "gpt_oss": 24}


def _config(arch: str, window: int, *, num_heads: int, num_kv_heads: int, head_size: int, num_layers: int,
            max_positions: int):
    import transformers

    hidden = num_heads * head_size
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_size,
                  max_position_embeddings=max_positions, sliding_window=window, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if arch == "mistral":
        return transformers.MistralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "phi3":
        common.pop("head_dim")  # Phi-3's head size is hidden / heads
        return transformers.Phi3Config(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       original_max_position_embeddings=max_positions)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, layer_types=alternating, query_pre_attn_scalar=head_size,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                         tie_word_embeddings=True)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, layer_types=alternating, query_pre_attn_scalar=head_size,
                                             tie_word_embeddings=True)
    if arch == "gpt_oss":
        common.update(intermediate_size=hidden)
        return transformers.GptOssConfig(**common, layer_types=alternating, num_local_experts=4,
                                         num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                         rope_scaling=None)
    raise ValueError(f"unknown architecture {arch!r}; accepted: {', '.join(WINDOWS)}")


def build(out: str | Path, arch: str, *, seed: int = 0, window: int | None = None, num_heads: int = 4,
          num_kv_heads: int = 2, head_size: int = 64, num_layers: int = 2, max_positions: int = 4096) -> Path:
    """Write config.json, model.safetensors and a tokenizer into ``out``; return it.

    Deterministic: the same arguments give the same bytes; skips the work if a
    checkpoint built with the same arguments is already there.
    """
    from transformers import AutoModelForCausalLM

    window = WINDOWS[arch] if window is None and arch in WINDOWS else window
    out = Path(out)
    stamp = {"arch": arch, "seed": seed, "window": window, "heads": num_heads, "kv_heads": num_kv_heads,
             "head_size": head_size, "layers": num_layers, "max_positions": max_positions, "format": 1}
    stamp_file = out / "dhp_tiny_model.json"
    if built(stamp_file, stamp):
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, window, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     num_layers=num_layers, max_positions=max_positions)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    if arch in ("gemma2", "gemma3"):
        fill_gemma_like(model, seed, config.hidden_size)
    else:
        fill_llama_like(model, seed)
    return save(model, out, stamp_file, stamp)


def with_routed_expert_names(src: str | Path, out: str | Path) -> Path:
    """A copy of the gpt-oss checkpoint ``src`` whose expert tensors are named ``mlp.experts.routed_experts.*``.

    Why: vLLM 0.24 keeps a MoE layer's expert weights one module deeper
    (``MoERunner.routed_experts``) and its other models remap checkpoint names
    (``weight_utils.maybe_remap_moe_expert_param_name``; gpt-oss too from 0.32 on), but its gpt-oss loader
    for unquantized weights (``GptOssModel._load_weights_other``) does not: a
    checkpoint with the released names fails there with KeyError
    'layers.0.mlp.experts.w2_weight' on every attention backend. The real
    checkpoints are MXFP4 and take another loader. Only the names change; the
    tensors are the same bytes.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {k.replace(".mlp.experts.", ".mlp.experts.routed_experts.", 1): v for k, v in tensors.items()}
    if renamed.keys() == tensors.keys():
        raise ValueError(f"{src}: no tensor named *.mlp.experts.*; is it a gpt-oss checkpoint?")
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def vllm_needs_routed_expert_names() -> bool:
    """True where the installed vLLM's unquantized gpt-oss loader misses the routed-experts remap
    (`with_routed_expert_names` says why); read from its source, without importing vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(list(spec.submodule_search_locations)[0])
    model = root / "model_executor" / "models" / "gpt_oss.py"
    runner = root / "model_executor" / "layers" / "fused_moe" / "runner" / "moe_runner.py"
    if not (model.exists() and runner.exists()) or "self.routed_experts = " not in runner.read_text():
        return False
    text = model.read_text()
    if "def _load_weights_other" not in text:
        return False
    other = text.split("def _load_weights_other", 1)[1].split("\n    def ", 1)[0]
    return bool(other) and "remap_moe_expert" not in other  # 0.32+: remap_moe_expert_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("arch", choices=sorted(WINDOWS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=None)
    a = ap.parse_args()
    print(build(a.out, a.arch, seed=a.seed, window=a.window))


if __name__ == "__main__":
    main()
