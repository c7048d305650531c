"""The trained head as a drafter: feature taps, hot vocabulary, checkpoints, losslessness.

A tiny random 4-layer target stands in for a real one; a head trained for a few dozen steps
on its own replies drafts well enough that some drafts are accepted and some rejected, so
both verification paths run. Coupled decoding with the head must be token-identical to
plain decoding at any temperature; its draft distribution q (for the rejection rule) is
the head's, lifted to the full vocabulary with zeros outside the hot set.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.cache import make_caches
from engine.decode import ChatSession, GenerateOptions
from engine.drafters.base import RUNNER_UPS, DraftRun, draft_tokens, with_runner_ups
from engine.drafters.head import HeadConfig, HeadDrafter, HeadModel, default_layers
from engine.drafters.head_io import (
    current_checkpoint,
    find_head,
    head_for_drafter,
    head_root,
    load_head,
    publish_checkpoint,
    require_head,
    write_head,
)
from engine.errors import HeadError
from engine.events import Finished
from engine.loading import LoadedModel, load_model
from engine.models.taps import FeatureTap
from engine.sampling import SamplingParams
from engine.training.fit import FitOptions
from engine.training.head_init import init_head
from engine.training.job import TrainOptions, train_drafter
from engine.training.online import OnlineTap
from tests.fixtures.tiny_models import write_tiny_model

USER = [{"role": "user", "content": "Hello world! The quick brown fox"}]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_model(tmp_path_factory.mktemp("head") / "t", num_hidden_layers=4, seed=1)
    return load_model(str(path))


@pytest.fixture(scope="module")
def trained(target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> HeadModel:
    """A head trained briefly on the target's replies (data + 40 steps, seconds)."""
    root = tmp_path_factory.mktemp("head-train")
    options = TrainOptions(minutes=5, rounds=1, gen_batch=8, max_new=24, max_steps=40,
                           checkpoint_every=1000, data_share=0.0,
                           fit=FitOptions(batch_size=4, window=64))
    for _ in train_drafter(target, options, root=root):
        pass
    folder = current_checkpoint(root)
    assert folder is not None
    return load_head(folder, target.model)


def random_head(target: LoadedModel, n_hot: int = 50, seed: int = 0) -> HeadModel:
    V = target.model.args.vocab_size
    hot = np.sort(np.random.default_rng(seed).choice(V, n_hot, replace=False))
    return init_head(target.model, hot, None, seed)


def test_default_layers_are_eagle3s() -> None:
    assert default_layers(30) == (2, 15, 27)
    assert default_layers(4) == (2, 2, 1)


def test_capture_and_tap_do_not_change_the_logits(target: LoadedModel) -> None:
    model = target.model
    ids = mx.array([[5, 17, 40, 41, 99, 3]])
    plain = model(ids, cache=make_caches(model.n_layers))
    caches = make_caches(model.n_layers)
    tap = FeatureTap((1, 2, 3), caches[0])
    model.feature_taps.add(tap)
    try:
        tapped = model(ids, cache=caches)
    finally:
        model.feature_taps.remove(tap)
    assert mx.array_equal(plain, tapped)
    assert tap.length == 6
    # the head's tap keeps hidden states only, so a prompt's chunk still skips the head's
    # other rows; a tap that keeps logits (the online buffer's) gets every row
    for kind, rows in ((FeatureTap, 1), (OnlineTap, ids.shape[1])):
        fresh = make_caches(model.n_layers)
        watcher = kind((1, 2, 3), fresh[0])  # a tap watches the passes through its caches
        model.feature_taps.add(watcher)
        try:
            out = model(ids, cache=fresh, last_only=True)
        finally:
            model.feature_taps.remove(watcher)
        assert out.shape[1] == rows
        assert mx.allclose(out[:, -1], plain[:, -1], atol=1e-4)
    capture: dict = dict.fromkeys((1, 2, 3))
    model(ids, capture=capture)
    want = mx.concatenate([capture[i][0] for i in (1, 2, 3)], axis=-1)
    assert mx.allclose(tap.rows(0, 6), want, atol=1e-5)


def test_tap_rows_follow_rollbacks(target: LoadedModel) -> None:
    """A pass starting at position p replaces every row from p on (rejected drafts)."""
    model = target.model
    caches = make_caches(model.n_layers)
    tap = FeatureTap((2,), caches[0])
    model.feature_taps.add(tap)
    try:
        model(mx.array([[5, 17, 40, 41]]), cache=caches)
        for c in caches:
            c.trim(2)
        model(mx.array([[7, 8, 9]]), cache=caches)
    finally:
        model.feature_taps.remove(tap)
    capture: dict = {2: None}
    model(mx.array([[5, 17, 7, 8, 9]]), capture=capture)
    assert tap.length == 5
    assert mx.allclose(tap.rows(0, 5), capture[2][0], atol=1e-5)
    with pytest.raises(KeyError):
        tap.rows(3, 6)


def test_hot_vocabulary_maps_and_lifts(target: LoadedModel) -> None:
    head = random_head(target, n_hot=10)
    V = target.model.args.vocab_size
    hot = head.hot_ids
    logits = mx.arange(10, dtype=mx.float32)[None]  # hot index i has logit i
    full = head.lift(logits)
    assert full.shape == (1, V)
    full_np = np.array(full[0])
    assert np.array_equal(full_np[hot], np.arange(10))
    assert np.all(np.isneginf(np.delete(full_np, hot)))
    assert head.to_target(mx.array([0, 9])).tolist() == [int(hot[0]), int(hot[9])]


def test_checkpoint_has_eagle3_layout_and_round_trips(target: LoadedModel,
                                                      tmp_path: Path) -> None:
    head = random_head(target)
    write_head(head, tmp_path, {"steps": 0})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 50
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    tensors = mx.load(str(tmp_path / "model.safetensors"))
    D, V = target.model.args.hidden_size, target.model.args.vocab_size
    assert tensors["fc.weight"].shape == (D, 3 * D)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * D
    assert tensors["midlayer.hidden_norm.weight"].shape == (D,)
    assert tensors["lm_head.weight"].shape == (50, D)
    assert tensors["d2t"].shape == (50,) and tensors["t2d"].shape == (V,)
    assert tensors["t2d"].dtype == mx.bool_
    d2t = np.array(tensors["d2t"])
    assert np.array_equal(np.arange(50) + d2t, head.hot_ids)
    assert np.array(tensors["t2d"]).sum() == 50
    again = load_head(tmp_path, target.model)
    assert np.array_equal(again.hot_ids, head.hot_ids)
    for (k, a), (k2, b) in zip(tree_flatten(head.parameters()),
                               tree_flatten(again.parameters()), strict=True):
        assert k == k2 and mx.array_equal(a, b), k


def eagle3_checkpoint(folder: Path, D: int, V: int, Vd: int, heads: int, kv: int,
                      inter: int, layers: list[int] | None, prefix: str = "midlayer.",
                      hot_max: int | None = None) -> np.ndarray:
    """An EAGLE-3 head folder written from numpy under the published names (not through
    our writer), as a hub checkpoint would arrive; returns its hot ids."""
    rng = np.random.default_rng(3)
    hd = D // heads

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.05, shape).astype(np.float16)

    hot = np.sort(rng.choice(V if hot_max is None else hot_max, Vd, replace=False))
    if hot_max is not None:
        hot[-1] = hot_max
    t2d = np.zeros(V, dtype=np.bool_)
    t2d[hot[hot < V]] = True
    tensors = {
        "fc.weight": w(D, 3 * D), "norm.weight": np.ones(D, np.float16),
        "lm_head.weight": w(Vd, D), "embed_tokens.weight": w(V, D),
        prefix + "self_attn.q_proj.weight": w(heads * hd, 2 * D),
        prefix + "self_attn.k_proj.weight": w(kv * hd, 2 * D),
        prefix + "self_attn.v_proj.weight": w(kv * hd, 2 * D),
        prefix + "self_attn.o_proj.weight": w(D, heads * hd),
        prefix + "mlp.gate_proj.weight": w(inter, D), prefix + "mlp.up_proj.weight": w(inter, D),
        prefix + "mlp.down_proj.weight": w(D, inter),
        prefix + "input_layernorm.weight": np.ones(D, np.float16),
        prefix + "hidden_norm.weight": np.ones(D, np.float16),
        prefix + "post_attention_layernorm.weight": np.ones(D, np.float16),
        "d2t": (hot - np.arange(Vd)).astype(np.int64), "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v) for k, v in tensors.items()})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": D, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
              "vocab_size": V, "draft_vocab_size": Vd, "torch_dtype": "float16",
              "tie_word_embeddings": False}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    (folder / "config.json").write_text(json.dumps(config))
    return hot


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_published_eagle3_layout_loads_and_drafts(target: LoadedModel, tmp_path: Path,
                                                  prefix: str) -> None:
    a = target.model.args
    hot = eagle3_checkpoint(tmp_path, a.hidden_size, a.vocab_size, 40, a.num_attention_heads,
                            a.num_key_value_heads, a.intermediate_size, [1, 2, 3], prefix)
    head = load_head(tmp_path, target.model)
    assert head.config.aux_layers == (1, 2, 3)
    assert np.array_equal(head.hot_ids, hot)
    q = np.array(mx.load(str(tmp_path / "model.safetensors"))[prefix + "self_attn.q_proj.weight"])
    assert np.allclose(np.array(head.midlayer.self_attn.q_proj.weight), q.astype(np.float32))
    session = ChatSession(target, None, head)
    fin = list(session.generate(USER, GenerateOptions(max_tokens=12, drafter="head", k=2)))[-1]
    assert isinstance(fin, Finished) and fin.stats.n_drafted > 0


def test_bad_heads_are_one_clear_error(target: LoadedModel, tmp_path: Path) -> None:
    a = target.model.args
    shape = (a.num_attention_heads, a.num_key_value_heads, a.intermediate_size)
    wrong = tmp_path / "wrong"
    eagle3_checkpoint(wrong, a.hidden_size * 2, a.vocab_size, 40, *shape, None)
    with pytest.raises(HeadError, match=r"config.json: hidden_size .* another model"):
        load_head(wrong, target.model)
    big = tmp_path / "big"
    eagle3_checkpoint(big, a.hidden_size, a.vocab_size, 40, *shape, None,
                      hot_max=a.vocab_size + 5)
    with pytest.raises(HeadError, match=r"model.safetensors: d2t maps to target id "
                                        rf"{a.vocab_size + 5}.*outside"):
        load_head(big, target.model)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(wrong.parent / "big", corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadError, match=r"corrupt[/\\]model.safetensors"):
        load_head(corrupt, target.model)
    layers = tmp_path / "layers"
    eagle3_checkpoint(layers, a.hidden_size, a.vocab_size, 40, *shape, [1, 2, 9])
    with pytest.raises(HeadError, match=r"not layers of the target \(it has 4\)"):
        load_head(layers, target.model)
    (layers / "config.json").write_text("{not json")
    with pytest.raises(HeadError, match=r"layers[/\\]config.json: not valid JSON"):
        load_head(layers, target.model)


def test_missing_head_says_how_to_train_one(target: LoadedModel) -> None:
    assert find_head(target) is None
    assert head_for_drafter(target, "auto") is None
    with pytest.raises(HeadError, match="understudy train-drafter --model"):
        require_head(target)
    session = ChatSession(target)
    with pytest.raises(HeadError, match="Train a Drafter") as err:  # the app's way too
        session.generate(USER, GenerateOptions(drafter="head"))
    assert f"train-drafter --model {target.name}`" in str(err.value)  # no placeholder


def test_stored_head_is_found_by_weights(target: LoadedModel, trained: HeadModel,
                                         tmp_path: Path) -> None:
    root = head_root(target.path)
    staged = tmp_path / "staged"
    write_head(trained, staged, {"heldout_top1": [0.42, 0.2]})
    try:
        publish_checkpoint(root, staged, "ckpt-0000001")
        found = find_head(target)
        assert found is not None
        head, record = found
        assert head.heldout_top1 == pytest.approx(0.42) and record is not None
        assert head_for_drafter(target, "auto") is not None
        # another model's weights have another key: the head is never offered to it
        other = write_tiny_model(tmp_path / "other", num_hidden_layers=4, seed=2)
        assert find_head(load_model(str(other))) is None
    finally:
        shutil.rmtree(root)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [None, 3])
def test_coupled_head_decoding_is_identical_to_plain(target: LoadedModel, trained: HeadModel,
                                                     temperature: float, k: int | None) -> None:
    sampling = SamplingParams(temperature=temperature, seed=11)
    plain = ChatSession(target)
    spec = ChatSession(target, None, trained)
    total_accepted = 0
    for prompt in ("Hello world! The quick brown fox", "What is the capital of France?",
                   "def add(a, b):"):
        msgs = [{"role": "user", "content": prompt}]
        want = list(plain.generate(msgs, GenerateOptions(max_tokens=40, sampling=sampling)))[-1]
        got = list(spec.generate(msgs, GenerateOptions(max_tokens=40, sampling=sampling,
                                                       drafter="head", k=k)))[-1]
        assert got.token_ids == want.token_ids
        total_accepted += got.stats.n_accepted
    if k is not None:
        assert total_accepted > 0  # the head's drafts were verified, some accepted


def test_rejection_rule_with_head_is_identical_at_temperature_zero(
        target: LoadedModel, trained: HeadModel) -> None:
    plain = ChatSession(target)
    spec = ChatSession(target, None, trained)
    want = list(plain.generate(USER, GenerateOptions(max_tokens=40)))[-1]
    got = list(spec.generate(USER, GenerateOptions(max_tokens=40, drafter="head", k=3,
                                                   accept="rejection")))[-1]
    assert got.token_ids == want.token_ids and got.stats.n_drafted > 0


@contextlib.contextmanager
def tapped_drafter(target: LoadedModel, head: HeadModel) -> Iterator[tuple[HeadDrafter, list[int]]]:
    """A head drafter over a fresh target cache that has read USER's prompt (the tapped pass
    the head drafts from), and that prompt's ids; detached afterwards."""
    caches = make_caches(target.model.n_layers)
    drafter = HeadDrafter(head, target.model, caches)
    try:
        ids = target.tokenizer.encode_chat(USER)
        target.model(mx.array([ids[:-1]]), cache=caches)  # the target's pass, tapped
        yield drafter, ids
    finally:
        drafter.detach()


def test_q_is_lifted_to_the_full_vocabulary(target: LoadedModel, trained: HeadModel) -> None:
    with tapped_drafter(target, trained) as (drafter, ids):
        draft = drafter.propose(ids, 4, SamplingParams(temperature=0.8, seed=2), "rejection")
    assert len(draft.ids) == 4 and draft.logq is not None
    V = target.model.args.vocab_size
    q = np.exp(np.array(draft.logq))
    assert q.shape == (4, V)
    assert np.allclose(q.sum(-1), 1.0, atol=1e-5)
    cold = np.setdiff1d(np.arange(V), trained.hot_ids)
    assert np.all(q[:, cold] == 0.0)
    assert set(draft.ids) <= set(trained.hot_ids.tolist())


@pytest.mark.parametrize(("temperature", "accept"), [(0.0, "coupled"), (1.5, "coupled"),
                                                      (0.0, "rejection")])
def test_head_draws_over_its_hot_vocabulary_the_tokens_the_lifted_rows_give(
        target: LoadedModel, trained: HeadModel, temperature: float, accept: str) -> None:
    """`propose` samples over the hot columns (noise for those ids only); the reference
    lifts every step's logits to the whole vocabulary first, as drafting did before. (An
    untrained head on the trained one's hot vocabulary, the first seed whose reference
    drafts vary: a draft of one repeated token would compare little.)"""
    sampling = SamplingParams(temperature=temperature, seed=5)
    for seed in range(3, 23):
        head = init_head(target.model, trained.hot_ids, None, seed=seed)
        with tapped_drafter(target, head) as (drafter, ids):
            drafter.commit(ids)
            out = drafter._last

            def step(tok: mx.array, head=head, drafter=drafter) -> mx.array:
                nonlocal out
                out = head(out, tok[None], cache=drafter.cache)
                return head.lift(head.logits(out[0]))

            assert out is not None
            want = draft_tokens(head.lift(head.logits(out[0])), step, ids, 6, sampling,
                                accept)  # over the whole vocabulary
            drafter.cache.trim(len(ids) - 1)
            got = drafter.propose(ids, 6, sampling, accept)
        if len(set(want.ids)) > 1:
            break
    assert len(set(want.ids)) > 1, "no seed gave varied drafts"
    assert got.ids == want.ids
    assert got.logq is not None
    np.testing.assert_allclose(np.array(got.logq), np.array(want.logq), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_head_trees_add_its_runner_ups_from_the_hot_vocabulary(
        target: LoadedModel, trained: HeadModel, temperature: float) -> None:
    """The head is a tree source like the draft model: its chain plus runner-ups under the
    same noise at depths 1-2 (issue 13), never outside its hot vocabulary."""
    sampling = SamplingParams(temperature=temperature, seed=2)
    with tapped_drafter(target, trained) as (drafter, ids):
        chain = drafter.propose(ids, 4, sampling, "coupled")
        tree = drafter.propose_tree(ids, 4, 8, sampling=sampling, accept="coupled")
        refused = drafter.propose_tree(ids, 4, 8, sampling=sampling, accept="rejection")
    assert tree.parents is not None and tree.ids[:4] == chain.ids
    extra = tree.ids[4:]
    assert len(extra) == sum(RUNNER_UPS) and set(extra) <= set(trained.hot_ids.tolist())
    # deepest fork first: depth 2's leaves, then depth 1's
    n1, n2 = RUNNER_UPS
    assert tree.parents[4:] == (0,) * n2 + (-1,) * n1
    assert chain.ids[1] not in extra[:n2] and chain.ids[0] not in extra[n2:]
    assert tree.conf is not None and len(tree.conf) == len(tree.ids)
    assert tree.logq is not None and tree.logq.shape[0] == len(tree.ids)
    assert refused.parents is None  # the rejection rule verifies chains only


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_head_runner_ups_over_its_columns_are_those_over_the_whole_vocabulary(
        target: LoadedModel, trained: HeadModel, temperature: float) -> None:
    """The head's leaves are scored over its hot columns (lifting each depth's row to the
    vocabulary cost more than the head step): the same leaves and confidences as over the lifted
    rows. Negative control: columns that are not the run's pick other leaves."""
    sampling = SamplingParams(temperature=temperature, seed=3)
    with tapped_drafter(target, trained) as (drafter, ids):
        chain = drafter.propose(ids, 4, sampling, "coupled")
        run = drafter._drawn
    assert run is not None and run.columns is not None
    assert run.logits[0].shape[-1] == len(trained.hot_ids) < target.model.args.vocab_size
    lifted = DraftRun(run.ids, trained.lift(run.logq),
                      tuple(trained.lift(r) for r in run.logits))
    got = with_runner_ups(chain, run, len(ids), sampling, "coupled", 8)
    want = with_runner_ups(chain, lifted, len(ids), sampling, "coupled", 8)
    assert len(got.ids) == 4 + sum(RUNNER_UPS)
    assert got.ids == want.ids and got.parents == want.parents
    assert got.conf == pytest.approx(want.conf, abs=1e-5)
    shuffled = DraftRun(run.ids, run.logq, run.logits, run.columns[::-1])
    assert with_runner_ups(chain, shuffled, len(ids), sampling, "coupled", 8).ids != got.ids


def test_head_config_json_round_trip(target: LoadedModel) -> None:
    config = HeadConfig.for_target(target.model.args, 77)
    data = config.to_json()
    assert data["draft_vocab_size"] == 77 and data["num_hidden_layers"] == 1
    assert data["vocab_size"] == target.model.args.vocab_size


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_with_a_head_among_the_drafters_is_identical_to_plain(
        target: LoadedModel, trained: HeadModel, temperature: float) -> None:
    """In auto the head competes with prompt lookup and layer skip (trees included): every
    pass still feeds the head's tap, and the text stays plain decoding's."""
    sampling = SamplingParams(temperature=temperature, seed=4)
    plain, spec = ChatSession(target), ChatSession(target, None, trained)
    assert "head" in spec.drafters
    messages = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]
    for turn in range(2):  # the second turn reuses the cached prefix, the head's rows too
        want = list(plain.generate(messages, GenerateOptions(max_tokens=40,
                                                             sampling=sampling)))[-1]
        got = list(spec.generate(messages, GenerateOptions(max_tokens=40, sampling=sampling,
                                                           drafter="auto")))[-1]
        assert got.token_ids == want.token_ids, turn
        messages = [*messages, {"role": "assistant", "content": want.text},
                    {"role": "user", "content": "Again, please."}]
