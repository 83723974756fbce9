"""`dhp_backend.model_config` and `dhp-backend build --model`: a checkpoint's config.json gives the head
size and each layer's features, and the build makes exactly the csrc libraries those layers load."""

import json

import pytest

from dhp_backend import cli, model_config
from dhp_backend.model_config import LayerKind


def write(tmp_path, name, **cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


ALTERNATING = ["sliding_attention", "full_attention"] * 12


@pytest.mark.parametrize("cfg,head,layers", [
    # gpt-oss-20b: head 64, sinks on every layer, window 128 on every other
    (dict(model_type="gpt_oss", num_attention_heads=64, num_hidden_layers=24, head_dim=64, sliding_window=128,
          layer_types=ALTERNATING, max_position_embeddings=131072), 64,
     {LayerKind(128, None, True): 12, LayerKind(None, None, True): 12}),
    # Gemma-2-9B: head 256, soft-cap 50, window 4096 on every other layer
    (dict(model_type="gemma2", num_attention_heads=16, num_hidden_layers=42, head_dim=256, sliding_window=4096,
          attn_logit_softcapping=50.0, layer_types=["sliding_attention", "full_attention"] * 21,
          max_position_embeddings=8192), 256, {LayerKind(4096, 50.0, False): 21, LayerKind(None, 50.0, False): 21}),
    # Mistral-7B-v0.1: a window on every layer (no layer_types)
    (dict(model_type="mistral", num_attention_heads=32, num_hidden_layers=32, hidden_size=4096, sliding_window=4096,
          max_position_embeddings=32768), 128, {LayerKind(4096, None, False): 32}),
    # Qwen2: a window in the config that is not used
    (dict(model_type="qwen2", num_attention_heads=28, num_hidden_layers=28, hidden_size=3584, sliding_window=131072,
          use_sliding_window=False, max_position_embeddings=32768), 128, {LayerKind(None, None, False): 28}),
    # Phi-3.5-mini: a window at least the context is no window
    (dict(model_type="phi3", num_attention_heads=32, num_hidden_layers=32, hidden_size=3072, sliding_window=262144,
          max_position_embeddings=131072), 96, {LayerKind(None, None, False): 32}),
    # Gemma-3 (multimodal): the text_config's layers
    (dict(model_type="gemma3", text_config=dict(model_type="gemma3_text", num_attention_heads=16,
                                                num_hidden_layers=6, head_dim=128, sliding_window=1024,
                                                layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                                max_position_embeddings=131072)), 128,
     {LayerKind(1024, None, False): 5, LayerKind(None, None, False): 1}),
    # Gemma-2-9B as released (its config.json predates layer_types): transformers' pattern, even layers windowed
    (dict(model_type="gemma2", num_attention_heads=16, num_hidden_layers=42, head_dim=256, sliding_window=4096,
          attn_logit_softcapping=50.0, max_position_embeddings=8192), 256,
     {LayerKind(4096, 50.0, False): 21, LayerKind(None, 50.0, False): 21}),
    # Gemma-3 12B's language model as released: five windowed layers of six (sliding_window_pattern)
    (dict(model_type="gemma3_text", num_attention_heads=16, num_hidden_layers=48, head_dim=256, sliding_window=1024,
          sliding_window_pattern=6, max_position_embeddings=131072), 256,
     {LayerKind(1024, None, False): 40, LayerKind(None, None, False): 8}),
    # the multimodal Gemma-3 without a pattern in its text_config: transformers' default period 6
    (dict(model_type="gemma3", text_config=dict(model_type="gemma3_text", num_attention_heads=8,
                                                num_hidden_layers=7, head_dim=256, sliding_window=512,
                                                max_position_embeddings=32768)), 256,
     {LayerKind(512, None, False): 6, LayerKind(None, None, False): 1}),
], ids=["gpt-oss", "gemma2-9b", "mistral-v0.1", "qwen2", "phi3.5", "gemma3", "gemma2-released", "gemma3-released",
        "gemma3-default-pattern"])
def test_layers_of_each_family(tmp_path, cfg, head, layers):
    m = model_config.read(write(tmp_path, "m", **cfg))
    assert m.head_size == head and m.layers == layers and sum(layers.values()) == m.num_layers


def test_bad_configurations_say_what_is_accepted(tmp_path):
    with pytest.raises(model_config.ModelConfigError, match="accepted: a local checkpoint directory"):
        model_config.read(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(model_config.ModelConfigError, match="is not a JSON configuration"):
        model_config.read(tmp_path / "bad.json")
    with pytest.raises(model_config.ModelConfigError, match="accepted: positive ints"):
        model_config.read(write(tmp_path, "vision", model_type="clip"))
    with pytest.raises(model_config.ModelConfigError, match="not a multiple of num_attention_heads 3"):
        model_config.read(write(tmp_path, "odd", num_attention_heads=3, num_hidden_layers=2, hidden_size=100))
    with pytest.raises(model_config.ModelConfigError, match="sliding_window_pattern is 0 .* accepted: a positive int"):
        model_config.read(write(tmp_path, "g3", model_type="gemma3_text", num_attention_heads=8, num_hidden_layers=6,
                                head_dim=256, sliding_window=512, sliding_window_pattern=0))


@pytest.mark.parametrize("types, why", [
    (["sliding_attention", "full_attention"] * 20 + ["full_attention"], "has 41 entries for 42 layers"),
    (["sliding_attention", "chunked_attention"] * 21, "holds 'chunked_attention'"),
    ("sliding_attention", "is 'sliding_attention'"),
])
def test_a_wrong_layer_types_is_refused_not_read_as_every_layer_windowed(tmp_path, types, why):
    with pytest.raises(model_config.ModelConfigError, match=f"layer_types {why}; accepted: one of sliding_attention, "
                                                            "full_attention per layer"):
        model_config.read(write(tmp_path, "g2", model_type="gemma2", num_attention_heads=16, num_hidden_layers=42,
                                head_dim=256, sliding_window=4096, layer_types=types))


def test_released_configs_read_as_transformers_loads_them(tmp_path):
    """The end-to-end benchmark's model shapes (released config.json fields, `integration.e2e_throughput`):
    each layer's window as transformers' loader gives it (its ``layer_types``), the soft-cap where the
    config has one."""
    transformers = pytest.importorskip("transformers")
    from integration import e2e_throughput as et

    for kind in ("mistral-7b", "gemma2-9b", "gemma3-12b", "llama3-8b"):
        d = et.write_model(kind, "bfloat16", tmp_path / kind)
        m = model_config.read(d)
        cfg = transformers.AutoConfig.from_pretrained(d)
        types = getattr(cfg, "layer_types", None) or ["sliding_attention" if getattr(cfg, "sliding_window", None)
                                                      else "full_attention"] * cfg.num_hidden_layers
        want: dict = {}
        cap = getattr(cfg, "attn_logit_softcapping", None)
        for t in types:
            k = LayerKind(cfg.sliding_window if t == "sliding_attention" else None, cap, False)
            want[k] = want.get(k, 0) + 1
        assert m.layers == want and m.head_size == cfg.head_dim, kind
    assert model_config.read(tmp_path / "gemma2-9b").layers == {LayerKind(4096, 50.0, False): 21,
                                                                LayerKind(None, 50.0, False): 21}


def test_build_model_makes_exactly_the_libraries_its_layers_load(tmp_path, fake_nvcc, capsys):
    oss = write(tmp_path, "gpt-oss", model_type="gpt_oss", num_attention_heads=64, num_hidden_layers=4, head_dim=64,
                sliding_window=128, layer_types=ALTERNATING[:4], max_position_embeddings=131072)
    assert cli.main(["build", "--json", "--model", str(oss)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["library"] for r in rows) == ["dhp_decode_sm90_sinks_h64", "dhp_decode_sm90_window_sinks_h64",
                                                 "dhp_prefill_sm90_sinks_h64", "dhp_prefill_sm90_window_sinks_h64"]
    assert cli.main(["build", "--model", str(oss)]) == 0  # text: what it read, then the cache
    out = capsys.readouterr().out
    assert "gpt_oss, 4 attention layers, head size 64: 2 sinks; 2 window 128, sinks" in out
    assert out.count("in the cache") == 4
    gemma = write(tmp_path, "gemma2", model_type="gemma2", num_attention_heads=16, num_hidden_layers=2, head_dim=256,
                  sliding_window=4096, attn_logit_softcapping=50.0, max_position_embeddings=8192)
    assert cli.main(["build", "--json", "--model", str(gemma)]) == 0  # head 256: the head-256 libraries
    assert sorted(r["library"] for r in json.loads(capsys.readouterr().out)) == [  # (no layer_types: Gemma-2's
        "dhp_decode_sm90_softcap_h256", "dhp_decode_sm90_window_softcap_h256",  # alternating layers)
        "dhp_prefill_sm90_softcap_h256", "dhp_prefill_sm90_window_softcap_h256"]
    assert len(fake_nvcc()) == 8
    # Phi-3-mini-4k (head 96, a window of 2047 on every layer): the head-96 window library, head-128 tiles
    phi3 = write(tmp_path, "phi3", model_type="phi3", num_attention_heads=32, num_hidden_layers=32, hidden_size=3072,
                 sliding_window=2047, max_position_embeddings=4096)
    assert cli.main(["build", "--json", "--model", str(phi3)]) == 0
    assert sorted(r["library"] for r in json.loads(capsys.readouterr().out)) == [
        "dhp_decode_sm90_window_h96", "dhp_prefill_sm90_window_h96"]
    assert len(fake_nvcc()) == 10
    assert cli.main(["build", "--model", str(oss), "--head", "64"]) == 2
    assert "accepted: --model alone" in capsys.readouterr().err
    assert cli.main(["build", "--model", str(tmp_path / "nowhere")]) == 2
    assert "--model:" in capsys.readouterr().err


def test_the_tiny_checkpoints_read_as_vllm_runs_them(tmp_path):
    """The end-to-end tests' tiny checkpoints (transformers writes their config.json): the windows read here
    are those vLLM hands the layers (tests/test_e2e_windowed.py EXPECTED_WINDOWS, seen in the engine's
    trace), Gemma-2's soft-cap on every layer, gpt-oss's sinks on every layer."""
    from integration.tiny_windowed import WINDOWS, _config
    from test_e2e_windowed import EXPECTED_WINDOWS

    for arch, window in WINDOWS.items():
        d = tmp_path / arch
        _config(arch, window, num_heads=4, num_kv_heads=2, head_size=64, num_layers=2,
                max_positions=4096).save_pretrained(d)
        m = model_config.read(d)
        assert m.head_size == 64 and {k.sliding_window for k in m.layers} == EXPECTED_WINDOWS[arch], arch
        assert all((k.logits_soft_cap is not None) == (arch == "gemma2") for k in m.layers), arch
        assert all(k.sinks == (arch == "gpt_oss") for k in m.layers), arch


def test_info_model_reports_each_kind_of_layer(tmp_path, capsys, with_nvcc):
    oss = write(tmp_path, "gpt-oss", model_type="gpt_oss", num_attention_heads=64, num_key_value_heads=8,
                num_hidden_layers=24, head_dim=64, sliding_window=128, layer_types=ALTERNATING,
                max_position_embeddings=131072)
    assert cli.main(["info", "--device", "cuda", "--json", "--model", str(oss)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [(k["layers"], k["features"]) for k in r["layer_kinds"]] == [(12, "sinks"), (12, "window 128, sinks")]
    for k in r["layer_kinds"]:
        for case in k["report"]["cases"].values():  # head 64: the csrc kernels' head-64 libraries
            assert case["kernel"].startswith("cuda_") and "attention sinks" in case["binary"], case
            assert "_h64" in case["binary"], case
    gemma = write(tmp_path, "gemma2", model_type="gemma2", num_attention_heads=16, num_key_value_heads=8,
                  num_hidden_layers=2, head_dim=256, sliding_window=4096, attn_logit_softcapping=50.0,
                  layer_types=["sliding_attention", "full_attention"], max_position_embeddings=8192)
    assert cli.main(["info", "--device", "cuda", "--model", str(gemma)]) == 0
    out = capsys.readouterr().out
    assert "gemma2, 2 attention layers (16 query / 8 KV heads, head size 256), 2 kind(s) of layer" in out
    assert "== 1 layer(s): window 4096, soft-cap 50" in out and "== 1 layer(s): soft-cap 50" in out
    assert cli.main(["info", "--model", str(tmp_path / "nowhere")]) == 2
    assert "dhp-backend info: --model:" in capsys.readouterr().err
    with pytest.raises(model_config.ModelConfigError, match="num_key_value_heads 5 does not divide"):
        model_config.read(write(tmp_path, "kv5", num_attention_heads=32, num_key_value_heads=5,
                                num_hidden_layers=2, head_dim=128))
