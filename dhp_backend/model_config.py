"""What a checkpoint's configuration says about its attention layers, for `dhp-backend build --model` and
`dhp-backend info --model`: the heads, the head size and each layer's model features (sliding window, logits soft-cap, attention sinks), so
that a container image can build exactly the csrc libraries the engine will load (the engine builds
them at start-up otherwise: `ops.plan.prepare_kernels`).

Read from the checkpoint's ``config.json`` (a local directory or the file itself; nothing is
downloaded), with the rules the model families use:

- head size: ``head_dim``, else ``hidden_size / num_attention_heads``;
- window: ``layer_types`` when the config has it (``"sliding_attention"`` layers are windowed: Gemma-2/3,
  gpt-oss); else, for the families whose released configs predate ``layer_types`` (Gemma-2 9B / 27B,
  Gemma-3, Cohere2), the pattern transformers derives on loading them (`FAMILY_PATTERNS`), which is
  what vLLM then runs; else ``sliding_window`` on every layer (Mistral-7B-v0.1, Phi-3) unless
  ``use_sliding_window`` is false (Qwen2's configs carry a window they do not use); a window at least
  the context (``max_position_embeddings``) is no window (Phi-3.5-mini, Phi-4-mini), as vLLM's check
  (`ops.attention.check_sliding_window`) makes it;
- soft-cap: ``attn_logit_softcapping`` (Gemma-2);
- sinks: gpt-oss (``model_type`` ``gpt_oss``: a learned sink per head on every layer).

A multimodal config's ``text_config`` is the language model's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


# Families whose layers alternate between windowed and full attention, for configs without
# ``layer_types``: model_type -> (the config key of the period, its default). Layer i is windowed unless
# (i + 1) is a multiple of the period: transformers' own rule when it loads such a config (Gemma2Config,
# Gemma3TextConfig, Cohere2Config, GptOssConfig: ``"sliding_attention" if (i + 1) % period else
# "full_attention"``), so a released Gemma-2 checkpoint (no ``layer_types``) has its even layers windowed.
FAMILY_PATTERNS = {"gemma2": (None, 2), "gemma3": ("sliding_window_pattern", 6),
                   "gemma3_text": ("sliding_window_pattern", 6), "cohere2": ("sliding_window_pattern", 4),
                   "gpt_oss": (None, 2)}


# The attention layer kinds a config's ``layer_types`` may name (the csrc and Triton kernels run both).
LAYER_TYPES = ("sliding_attention", "full_attention")


def family_layer_types(model_type: str, cfg: dict, num_layers: int) -> list[str] | None:
    """The layer types transformers gives a config of ``model_type`` that has no ``layer_types`` (None for a
    family whose layers are all alike)."""
    if model_type not in FAMILY_PATTERNS:
        return None
    key, default = FAMILY_PATTERNS[model_type]
    period = cfg.get(key, default) if key else default
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ModelConfigError(f"{key} is {period!r} in a {model_type} configuration; accepted: a positive int "
                               "(every how many layers one has full attention)")
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """The features of a group of a model's attention layers."""

    sliding_window: int | None
    logits_soft_cap: float | None
    sinks: bool

    def library_features(self) -> dict:
        """`cuda_build.feature_library`'s feature keywords."""
        return dict(window=self.sliding_window is not None, softcap=self.logits_soft_cap is not None,
                    sinks=self.sinks)

    def describe(self) -> str:
        parts = ([f"window {self.sliding_window}"] if self.sliding_window is not None else []) + (
            [f"soft-cap {self.logits_soft_cap:g}"] if self.logits_soft_cap is not None else []) + (
            ["sinks"] if self.sinks else [])
        return ", ".join(parts) or "plain"


@dataclasses.dataclass(frozen=True)
class ModelAttention:
    model_type: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    layers: dict[LayerKind, int]  # layer kind -> how many layers have it


class ModelConfigError(ValueError):
    """The configuration is missing or does not say what the attention layers are."""


def read(path: str | Path) -> ModelAttention:
    """The attention layers of the checkpoint at ``path`` (a directory holding config.json, or the file)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ModelConfigError(f"{f} does not exist; accepted: a local checkpoint directory holding config.json, "
                               "or the config.json file (nothing is downloaded)")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{f} is not a JSON configuration ({e})") from None
    model_type = str(cfg.get("model_type", ""))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads, layers = text.get("num_attention_heads"), text.get("num_hidden_layers")
    if not isinstance(heads, int) or not isinstance(layers, int) or heads < 1 or layers < 1:
        raise ModelConfigError(f"{f}: num_attention_heads / num_hidden_layers are {heads!r} / {layers!r}; "
                               "accepted: positive ints (a decoder language model's configuration)")
    head = text.get("head_dim")
    if not isinstance(head, int):
        hidden = text.get("hidden_size")
        if not isinstance(hidden, int) or hidden % heads:
            raise ModelConfigError(f"{f}: no head_dim, and hidden_size {hidden!r} is not a multiple of "
                                   f"num_attention_heads {heads}")
        head = hidden // heads
    kv_heads = text.get("num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ModelConfigError(f"{f}: num_key_value_heads {kv_heads!r} does not divide num_attention_heads {heads}")
    context = text.get("max_position_embeddings")
    window = text.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1 or text.get("use_sliding_window") is False
                               or (isinstance(context, int) and window >= context)):
        window = None
    layer_types = text.get("layer_types")
    if layer_types is None:
        try:
            layer_types = family_layer_types(str(text.get("model_type") or model_type), text, layers)
        except ModelConfigError as e:
            raise ModelConfigError(f"{f}: {e}") from None
    if layer_types is not None:  # one attention layer of a known kind per hidden layer, or the config is wrong
        if not isinstance(layer_types, list):
            what = f"is {layer_types!r}"
        elif bad := sorted({repr(t) for t in layer_types if t not in LAYER_TYPES}):
            what = f"holds {', '.join(bad)}"
        elif len(layer_types) != layers:
            what = f"has {len(layer_types)} entries for {layers} layers"
        else:
            what = None
        if what:
            raise ModelConfigError(f"{f}: layer_types {what}; accepted: one of {', '.join(LAYER_TYPES)} per layer "
                                   "(num_hidden_layers of them)")
    if window is not None and layer_types is not None:
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:
        windows = [window] * layers
    cap = text.get("attn_logit_softcapping")
    cap = float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None
    sinks = model_type == "gpt_oss" or text.get("model_type") == "gpt_oss"
    kinds: dict[LayerKind, int] = {}
    for w in windows:
        k = LayerKind(w, cap, sinks)
        kinds[k] = kinds.get(k, 0) + 1
    return ModelAttention(model_type=model_type or str(text.get("model_type", "")), num_heads=heads,
                          num_kv_heads=kv_heads, head_size=head, num_layers=layers, layers=kinds)
