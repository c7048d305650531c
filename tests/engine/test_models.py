"""Our loader + decoder against mlx-lm (a test-only oracle) on tiny random checkpoints.

Each case is a real folder written by tests/fixtures/tiny_models.py. mlx-lm loads the same
folder with its own model classes; logits must agree to 1e-4 relative. Half-precision
sources are compared with the oracle's weights upcast to float32 (exact), because our CPU
policy runs them in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

from engine.cache import make_caches
from engine.errors import EngineError
from engine.loading import load_weights
from engine.models import ModelArgs
from engine.models.decoder import Linear, Model
from tests.fixtures.tiny_models import write_tiny_model

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # small enough that a 16-dim head has low, medium and high frequency bands
    "original_max_position_embeddings": 64,
}

# three quarters of a 16-dim head rotated (6 frequencies), stretched 128x past a 16-token
# original window: LongRoPE's magnitude correction is sqrt(1 + ln 128 / ln 16)
PHI4_MINI_ROPE = {
    "partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [1.0 + 2.0 * i for i in range(6)]},
}

CASES: dict[str, dict[str, Any]] = {
    "llama-gqa-tied": {"model_type": "llama"},
    "llama-mha-untied": {"model_type": "llama", "n_kv_heads": 4, "tie": False},
    "llama3-rope-scaling": {"model_type": "llama", "rope_scaling": LLAMA3_SCALING,
                            "rope_theta": 500000.0, "tie": False},
    "mistral": {"model_type": "mistral", "n_kv_heads": 1},
    "qwen2-bias": {"model_type": "qwen2"},
    "qwen3-qk-norm": {"model_type": "qwen3", "tie": False},
    "llama-bf16": {"model_type": "llama", "dtype": "bfloat16"},
    "qwen2-fp16-untied": {"model_type": "qwen2", "dtype": "float16", "tie": False},
    "llama-q4": {"model_type": "llama", "quantize": (32, 4)},
    "qwen2-q8-untied": {"model_type": "qwen2", "quantize": (64, 8), "tie": False},
    "qwen3-q4-bf16-overrides": {
        "model_type": "qwen3", "quantize": (64, 4), "dtype": "bfloat16", "tie": False,
        "quant_overrides": {"lm_head": False, "model.embed_tokens": {"group_size": 32,
                                                                     "bits": 8}},
    },
    "llama-sharded": {"model_type": "llama", "sharded": True, "tie": False},
    "llama-q4-sharded-extra-keys": {"model_type": "llama", "quantize": (32, 4),
                                    "sharded": True, "extra_keys": True},
    # a sliding window of 8 on two of three layers: TOKENS cross it
    "gemma3": {"model_type": "gemma3_text", "num_hidden_layers": 3},
    "gemma3-linear-rope-untied": {"model_type": "gemma3_text", "num_hidden_layers": 3,
                                  "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                  "tie": False},
    "gemma3-q4-bf16": {"model_type": "gemma3_text", "num_hidden_layers": 3,
                       "quantize": (32, 4), "dtype": "bfloat16"},
    # the third layer has no RoPE
    "smollm3-nope": {"model_type": "smollm3", "num_hidden_layers": 3},
    # 2 of 4 experts per token on two layers, the third dense
    "qwen3-moe": {"model_type": "qwen3_moe", "num_hidden_layers": 3, "tie": False},
    "qwen3-moe-q4": {"model_type": "qwen3_moe", "num_hidden_layers": 3, "tie": False,
                     "quantize": (32, 4)},
    # fused q/k/v and gate/up; Phi-4-mini's partial rotary and LongRoPE
    "phi3": {"model_type": "phi3", "tie": False},
    "phi4-mini-partial-longrope": {"model_type": "phi3", "config_overrides": PHI4_MINI_ROPE},
    "phi3-q4": {"model_type": "phi3", "tie": False, "quantize": (32, 4)},
}

TOKENS = mx.array([[1, 17, 42, 299, 5, 77, 123, 2, 64, 9, 250, 33]])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_model(root / name, **kw) for name, kw in CASES.items()}


def oracle_logits(path: Path, upcast: bool) -> mx.array:
    model, _ = mlx_lm_utils.load_model(path)
    if upcast:
        model.set_dtype(mx.float32)
    return model(TOKENS).astype(mx.float32)


def rel_err(ours: mx.array, ref: mx.array) -> float:
    return (mx.abs(ours.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_policy_matches_mlx_lm(model_dirs: dict[str, Path], case: str) -> None:
    model, _ = load_weights(model_dirs[case], backend="cpu")
    ours = model(TOKENS)
    assert ours.dtype == mx.float32
    ref = oracle_logits(model_dirs[case], upcast=True)
    assert ours.shape == ref.shape == (1, TOKENS.shape[1], model.args.vocab_size)
    assert rel_err(ours, ref) < 1e-4
    assert np.std(np.array(ref)) > 0.5  # the fixture's logits are spread, not degenerate


@pytest.mark.parametrize("case", [c for c in CASES if "quantize" in CASES[c]
                                  or "dtype" in CASES[c]])
def test_stored_policy_matches_mlx_lm(model_dirs: dict[str, Path], case: str) -> None:
    """The Metal/CUDA policy keeps quantized layers and half precision, as mlx-lm does."""
    model, _ = load_weights(model_dirs[case], backend="metal")
    ref = oracle_logits(model_dirs[case], upcast=False)
    half = CASES[case].get("dtype", "float32") != "float32"
    assert rel_err(model(TOKENS), ref) < (2e-2 if half else 1e-4)


def test_llama3_scaling_changes_logits(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Guards the rope test above: without the scaling the logits would differ."""
    kw = {k: v for k, v in CASES["llama3-rope-scaling"].items() if k != "rope_scaling"}
    plain, _ = load_weights(write_tiny_model(tmp_path / "plain", **kw), backend="cpu")
    scaled, _ = load_weights(model_dirs["llama3-rope-scaling"], backend="cpu")
    assert rel_err(plain(TOKENS), scaled(TOKENS)) > 1e-3


def test_rope_parameters_config_matches_legacy_keys(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """transformers >= 5 writes rope_theta and scaling under `rope_parameters` only."""
    import json
    import shutil

    src = model_dirs["llama3-rope-scaling"]
    dst = tmp_path / "v5"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    params = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
    config["rope_parameters"] = params
    (dst / "config.json").write_text(json.dumps(config))
    args = ModelArgs.from_config(config)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling is not None and args.rope_scaling["factor"] == 8.0
    model, _ = load_weights(dst, backend="cpu")
    assert rel_err(model(TOKENS), oracle_logits(src, upcast=True)) < 1e-4


@pytest.mark.parametrize(("case", "backend"), [
    ("llama-gqa-tied", "cpu"), ("llama3-rope-scaling", "cpu"), ("qwen2-bias", "cpu"),
    ("qwen3-qk-norm", "cpu"), ("llama-q4", "metal"), ("gemma3", "cpu"),
    ("gemma3-q4-bf16", "metal"), ("qwen3-moe", "cpu"), ("qwen3-moe-q4", "metal"),
    ("phi4-mini-partial-longrope", "cpu"), ("phi3-q4", "metal"),
])
def test_incremental_decoding_matches_full_forward(
    model_dirs: dict[str, Path], case: str, backend: str
) -> None:
    """Prefill, single-token steps and a multi-token chunk through the KV cache give the
    same logits as one pass over the whole sequence."""
    model, _ = load_weights(model_dirs[case], backend=backend)
    full = model(TOKENS)
    caches = make_caches(model.n_layers, chunk=4)  # small chunks so the cache grows
    pieces = [model(TOKENS[:, :5], cache=caches)]
    for t in range(5, 8):
        pieces.append(model(TOKENS[:, t : t + 1], cache=caches))
    pieces.append(model(TOKENS[:, 8:10], cache=caches))  # verify-style chunks: 2 rows
    pieces.append(model(TOKENS[:, 10:], cache=caches))  # and 2 more (narrow products)
    assert caches[0].offset == TOKENS.shape[1]
    assert rel_err(mx.concatenate(pieces, axis=1), full) < 1e-4


def test_last_only_gives_the_last_rows_logits_and_fills_the_same_cache(
        model_dirs: dict[str, Path]) -> None:
    """A prompt's chunk needs the last row's logits only; the cache it leaves is the same,
    and those logits are the full pass's last row (a narrower product: to rounding)."""
    from engine.steps import prefill

    model, _ = load_weights(model_dirs["llama-gqa-tied"], backend="cpu")
    full_caches, caches = make_caches(model.n_layers), make_caches(model.n_layers)
    full = model(TOKENS, cache=full_caches)
    last = model(TOKENS, cache=caches, last_only=True)
    assert last.shape == (1, 1, full.shape[-1])
    assert rel_err(last[:, -1], full[:, -1]) < 1e-5
    assert not mx.allclose(last[:, -1], full[:, -2])  # it is the last row, not another
    for a, b in zip(caches, full_caches, strict=True):
        assert a.offset == b.offset and mx.array_equal(a.state[0], b.state[0])
    chunked = list(prefill(model, TOKENS[0].tolist(), make_caches(model.n_layers), 4))
    assert [done for done, _ in chunked] == [4, 8, 12]
    assert chunked[-1][1].shape == (full.shape[-1],)
    assert rel_err(chunked[-1][1], full[0, -1]) < 1e-4


def test_gemma_decodes_one_token_at_a_time_past_its_window(model_dirs: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """Forty single-token steps, each attending over the last 8 positions on the sliding
    layers (the keys before them cut off), give the full pass's logits; the window is
    real: the same weights with a window wider than the text give other logits."""
    import json
    import shutil

    tokens = mx.array([[*TOKENS[0].tolist()] * 4])[:, :40]
    model, _ = load_weights(model_dirs["gemma3"], backend="cpu")
    full = model(tokens)
    caches = make_caches(model.n_layers, chunk=16)
    steps = [model(tokens[:, t:t + 1], cache=caches) for t in range(tokens.shape[1])]
    assert rel_err(mx.concatenate(steps, axis=1), full) < 1e-4
    oracle, _ = mlx_lm_utils.load_model(model_dirs["gemma3"])
    assert rel_err(full, oracle(tokens)) < 1e-4
    wide = tmp_path / "wide"
    shutil.copytree(model_dirs["gemma3"], wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    unwindowed, _ = load_weights(wide, backend="cpu")
    other = unwindowed(tokens)
    assert rel_err(other[:, :8], full[:, :8]) < 1e-5  # the same until the window's edge
    assert rel_err(other[:, 8:], full[:, 8:]) > 1e-3


@pytest.mark.parametrize(("layout", "kw"), [("original", {}), ("transformers", {}),
                                           ("original", {"quantize": (32, 4)})],
                         ids=["original", "transformers", "original-q4"])
def test_gemma3_vision_language_checkpoint_reads_its_text_model(
        tmp_path: Path, layout: str, kw: dict[str, Any]) -> None:
    """Gemma 3 4B+ ship as one image-and-text model: its decoder, under `text_config`
    and a tensor prefix, is the same gemma3_text model (the same logits as the text-only
    checkpoint of the same weights, and mlx-lm's where it reads the layout), image parts
    unread, Gemma 3's defaults filled in where the config leaves fields out."""
    from tests.fixtures.tiny_models import write_tiny_gemma3_vlm

    text = write_tiny_model(tmp_path / "text", "gemma3_text", num_hidden_layers=3, **kw)
    wrapped = write_tiny_gemma3_vlm(tmp_path / "vlm", layout, num_hidden_layers=3, **kw)
    config = json.loads((wrapped / "config.json").read_text())
    assert config["model_type"] == "gemma3" and "rms_norm_eps" not in config["text_config"]
    ours, _ = load_weights(wrapped, backend="cpu")
    plain, _ = load_weights(text, backend="cpu")
    assert ours.args.model_type == "gemma3_text" and ours.args.rms_norm_eps == 1e-6
    assert ours.args.layer_window(2) is None and ours.args.layer_window(1) == 8
    # (to float32 rounding: each load times which matrix layout to hold)
    assert rel_err(ours(TOKENS), plain(TOKENS)) < 1e-5
    if layout == "original":  # the layout mlx-lm's gemma3 reads
        assert rel_err(ours(TOKENS), oracle_logits(wrapped, upcast=True)) < 1e-4


def test_a_gemma3_wrapper_without_its_text_config_is_named(tmp_path: Path) -> None:
    """One line naming the folder, whether the text config is missing or another model's."""
    from tests.fixtures.tiny_models import write_tiny_gemma3_vlm

    wrapped = write_tiny_gemma3_vlm(tmp_path / "vlm", num_hidden_layers=3)
    config = json.loads((wrapped / "config.json").read_text())
    for broken, message in (
            ({k: v for k, v in config.items() if k != "text_config"},
             "'gemma3' needs a text_config object"),
            ({**config, "text_config": {**config["text_config"], "model_type": "llama"}},
             "text_config.model_type is 'llama'")):
        (wrapped / "config.json").write_text(json.dumps(broken))
        with pytest.raises(EngineError, match=message) as caught:
            load_weights(wrapped, backend="cpu")
        assert str(caught.value).startswith(f"{wrapped}/config.json: ")


def test_longrope_without_an_original_window_takes_phi3s_default(tmp_path: Path) -> None:
    """transformers' Phi-3 reads a missing original window as 4,096 tokens."""
    rope = {k: v for k, v in PHI4_MINI_ROPE.items() if k != "original_max_position_embeddings"}
    folder = write_tiny_model(tmp_path / "phi", "phi3", config_overrides={
        **rope, "max_position_embeddings": 16384})
    model, _ = load_weights(folder, backend="cpu")
    # stretched 4x past 4,096: sqrt(1 + ln 4 / ln 4096)
    assert model.args.rope_scale == pytest.approx((1 + np.log(4) / np.log(4096)) ** 0.5)


def test_qwen3_moe_routes_each_row_to_its_experts(model_dirs: dict[str, Path]) -> None:
    """The experts are real: every row's output depends on which k it routes to (forcing
    one expert on all gives other logits), and the stacked experts load as float32 on the
    CPU policy and stay quantized under the Metal policy."""
    from engine.models.experts import QuantizedSwitchLinear, SparseMoE, SwitchLinear

    model, _ = load_weights(model_dirs["qwen3-moe"], backend="cpu")
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.switch_mlp.gate_proj, SwitchLinear)
    assert not isinstance(model.model.layers[2].mlp, SparseMoE)  # mlp_only_layers
    assert moe.switch_mlp.gate_proj.weight.dtype == mx.float32
    want = model(TOKENS)
    moe.top_k = 1
    assert rel_err(model(TOKENS), want) > 1e-3
    kept, _ = load_weights(model_dirs["qwen3-moe-q4"], backend="metal")
    assert isinstance(kept.model.layers[0].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)


@pytest.mark.parametrize(("case", "backend"), [("qwen3-moe", "cpu"), ("qwen3-moe-q4", "metal")])
def test_a_long_pass_sorts_its_rows_by_expert_to_the_same_logits(
        model_dirs: dict[str, Path], case: str, backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk's (row, expert) pairs go through the gather products sorted by
    expert and are put back in order: the logits equal those of the unsorted products,
    and the sorted path did run."""
    import engine.models.experts as experts

    model, _ = load_weights(model_dirs[case], backend=backend)
    tokens = mx.array([[(7 * i + 3) % 250 for i in range(80)]])  # 160 pairs at k = 2
    calls: list[int] = []
    sort = experts.SwitchGLU._by_expert
    monkeypatch.setattr(experts.SwitchGLU, "_by_expert",
                        lambda self, x, idx: calls.append(idx.size) or sort(self, x, idx))
    got = model(tokens)
    assert calls and min(calls) >= experts.SORT_PAIRS
    monkeypatch.setattr(experts, "SORT_PAIRS", 1 << 30)
    calls.clear()
    want = model(tokens)
    assert not calls
    assert rel_err(got, want) < 1e-5
    short = model(tokens[:, :8])  # 16 pairs: unsorted either way
    assert rel_err(short, want[:, :8]) < 1e-4


@pytest.mark.parametrize("case", ["phi4-mini-partial-longrope", "gemma3", "llama3-rope-scaling"])
def test_the_gpu_rope_path_turns_as_the_cpu_table_does(model_dirs: dict[str, Path],
                                                       case: str) -> None:
    """A Mac's passes rotate with `mx.fast.rope` (partial dims, LongRoPE's magnitude, a
    tree's per-row positions), this CPU's with the table: the same rotation."""
    model, _ = load_weights(model_dirs[case], backend="cpu")
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, attn.n_heads, 5, attn.head_dim), key=mx.random.key(3))
    positions = mx.array([7, 8, 9, 8, 9], dtype=mx.int32)
    for offset, pos in ((7, None), (7, positions)):
        want = attn._rope(x, offset, pos)
        assert mx.allclose(attn._fused_rope(x, offset, pos), want, atol=1e-4).item()
    if case.startswith("phi4"):  # the rotation is real where it should be, absent elsewhere
        turned = attn._rope(x, 7, None)
        assert mx.array_equal(turned[..., attn.rot:], x[..., attn.rot:]).item()
        assert not mx.allclose(turned[..., :attn.rot], x[..., :attn.rot]).item()
        assert attn._scale == pytest.approx((1 + np.log(128) / np.log(16)) ** 0.5)


def test_smollm3_layers_without_rope_are_real(model_dirs: dict[str, Path],
                                             tmp_path: Path) -> None:
    """Negative control for the mlx-lm case: rotating every layer gives other logits;
    a `no_rope_layers` list says the same as the interval it spells out."""
    import shutil

    src = model_dirs["smollm3-nope"]
    model, _ = load_weights(src, backend="cpu")
    want = model(TOKENS)
    for name, change in (("all-rope", {"no_rope_layers": [1, 1, 1]}),
                         ("listed", {"no_rope_layers": [1, 1, 0]})):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **change}))
        got, _ = load_weights(dst, backend="cpu")
        err = rel_err(got(TOKENS), want)
        assert err > 1e-3 if name == "all-rope" else err < 1e-6


def test_mistral_v01_slides_its_window(tmp_path: Path) -> None:
    """Mistral 7B v0.1 states a sliding window, and HF attends within it: with one layer
    and relative positions (RoPE), each position's logits are those of the last `window`
    tokens read on their own; one-token steps give the full pass's logits."""
    folder = write_tiny_model(tmp_path / "m", "mistral", num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 5}))
    model, _ = load_weights(folder, backend="cpu")
    assert model.args.layer_window(0) == 5
    tokens = TOKENS[:, :12]
    full = model(tokens)
    for p in (4, 5, 8, 11):
        alone = model(tokens[:, max(0, p - 4):p + 1])[:, -1]
        assert rel_err(full[:, p], alone) < 1e-4, p
    caches = make_caches(model.n_layers, chunk=4)
    steps = [model(tokens[:, t:t + 1], cache=caches) for t in range(tokens.shape[1])]
    assert rel_err(mx.concatenate(steps, axis=1), full) < 1e-4
    # without the window (v0.2 and later state none) position 11 reads all 12 tokens
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    unwindowed, _ = load_weights(folder, backend="cpu")
    assert rel_err(unwindowed(tokens)[:, 11], full[:, 11]) > 1e-3


def test_gemma_and_moe_config_errors_are_named() -> None:
    base = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300}
    for bad, message in (
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ({"sliding_window": "512"}, "sliding_window must be a positive integer"),
        ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar must be a positive number"),
        ({"layer_types": ["full_attention"]}, "layer_types must list"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be a positive"),
    ):
        with pytest.raises(EngineError, match=message):
            ModelArgs.from_config({**base, **bad})
    moe = {**base, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    ModelArgs.from_config(moe)
    for bad, message in (
        ({"num_experts_per_tok": 8}, "num_experts_per_tok \\(8\\) is more than"),
        ({"num_experts": "4"}, "num_experts must be a positive integer"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers must list"),
        ({"mlp_only_layers": [7]}, "indices below num_hidden_layers \\(2\\)"),
    ):
        with pytest.raises(EngineError, match=message):
            ModelArgs.from_config({**moe, **bad})
    # layer_types, where given, says which layers slide
    args = ModelArgs.from_config({**base, "sliding_window": 16,
                                  "layer_types": ["full_attention", "sliding_attention"]})
    assert (args.layer_window(0), args.layer_window(1)) == (None, 16)
    assert ModelArgs.from_config({**base, "sliding_window": 16}).layer_window(5 % 2) == 16


def test_quantized_layers_kept_or_dequantized(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen3-q4-bf16-overrides"]
    kept, _ = load_weights(path, backend="metal")
    attn = kept.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert isinstance(kept.model.embed_tokens, nn.QuantizedEmbedding)
    assert kept.model.embed_tokens.bits == 8 and kept.model.embed_tokens.group_size == 32
    assert type(kept.lm_head) is nn.Linear and kept.lm_head.weight.dtype == mx.bfloat16
    assert kept.model.norm.weight.dtype == mx.bfloat16

    cpu, _ = load_weights(path, backend="cpu")
    assert type(cpu.model.layers[0].self_attn.q_proj) is Linear
    assert type(cpu.model.embed_tokens) is nn.Embedding
    from mlx.utils import tree_flatten

    assert {v.dtype for _, v in tree_flatten(cpu.parameters())} == {mx.float32}


@pytest.mark.slow
def test_demo_model_matches_mlx_lm(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real model: the demo (SmolLM2-135M, imported from GGUF) through "demo" resolution,
    both weight policies, against mlx-lm loading the same folder."""
    from engine.errors import DemoModelMissingError
    from engine.loading import resolve_model_path

    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    try:
        folder = resolve_model_path("demo")
    except DemoModelMissingError as e:
        pytest.skip(str(e))
    tokens = mx.array([[1, 4093, 28, 614, 314, 260, 3575, 282, 4649, 47]])
    oracle, _ = mlx_lm_utils.load_model(folder)
    kept, _ = load_weights(folder, backend="metal")
    assert isinstance(kept.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert rel_err(kept(tokens), oracle(tokens).astype(mx.float32)) < 1e-4
    oracle.set_dtype(mx.float32)  # the CPU policy's precision, for a like-for-like check
    cpu, _ = load_weights(folder, backend="cpu")
    assert rel_err(cpu(tokens), oracle(tokens)) < 1e-4


def is_column_major(w: mx.array) -> bool:
    rows, cols = memoryview(w).strides  # bytes
    return rows == w.itemsize and cols == w.shape[0] * w.itemsize


@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen2-fp16-untied", "llama-q4"])
def test_the_cpu_policy_holds_every_matrix_in_the_chosen_layout(
        model_dirs: dict[str, Path], case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column-major: every matrix a pass multiplies by, the tied embedding too; vectors stay
    as they are. Row-major: as stored. Measured (auto): one or the other, whole. The stored
    policy keeps the checkpoint's layout and chooses nothing."""
    for pinned in ("column", "row", "auto"):
        monkeypatch.setenv("UNDERSTUDY_WEIGHT_LAYOUT", pinned)
        model, _ = load_weights(model_dirs[case], backend="cpu")
        assert model.weight_layout in (("row", "column") if pinned == "auto" else (pinned,))
        mats = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
        assert len(mats) == 7 * model.n_layers + ("lm_head" in model)
        if "lm_head" not in model:
            mats.append(model.model.embed_tokens.weight)
        assert [is_column_major(w) for w in mats] == [model.column_major] * len(mats)
        if "lm_head" in model:  # an untied embedding is only looked up: left as stored
            assert not is_column_major(model.model.embed_tokens.weight)
    stored, _ = load_weights(model_dirs[case], backend="metal")
    assert stored.weight_layout is None and not stored.column_major
    if "quantize" not in CASES[case]:
        assert not is_column_major(stored.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen2-bias", "llama-mha-untied"])
def test_column_major_matrices_give_the_same_logits(
        model_dirs: dict[str, Path], case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout changes what a pass costs, not what it computes: prefill and verify-style
    chunks of 1, 2, 3 and 9 rows, against the same weights held row-major, agree to float32
    rounding and pick the same tokens. (OpenBLAS's Prescott kernels happen to sum both
    operand orders alike, bit for bit; its SkylakeX kernels and MLX's bundled reference BLAS
    differ in the last bits.)"""
    monkeypatch.setenv("UNDERSTUDY_WEIGHT_LAYOUT", "column")
    laid_out, _ = load_weights(model_dirs[case], backend="cpu")
    plain = Model(laid_out.args)
    plain.update(tree_map(mx.contiguous, laid_out.parameters()))
    mx.eval(plain.parameters())
    assert is_column_major(laid_out.model.layers[0].mlp.up_proj.weight)
    assert not is_column_major(plain.model.layers[0].mlp.up_proj.weight)
    tokens = mx.concatenate([TOKENS, TOKENS[:, :5]], axis=1)  # 17 = 2 + 1 + 2 + 3 + 9
    outs = []
    for model in (laid_out, plain):
        caches = make_caches(model.n_layers)
        outs.append([model(tokens[:, a:b], cache=caches)
                     for a, b in ((0, 2), (2, 3), (3, 5), (5, 8), (8, 17))])
    for got, want in zip(*outs, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
        assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
