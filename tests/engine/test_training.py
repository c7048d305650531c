"""Training the head: data from the target's own passes, the unrolled loss, checkpoints.

Tiny random targets keep every test to seconds. The batched reply generator must produce
each row exactly as a lone run would (left padding is invisible); the unrolled training
forward must compute exactly what drafting computes (train as used); the loss must fall
on a fixed batch; a cancelled job must resume to the very weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from engine.bench import DEFAULT_PROMPTS, load_prompts
from engine.cache import PreallocatedKVCache, cache_length, make_caches
from engine.decode import ChatSession, GenerateOptions
from engine.drafters.head_io import current_checkpoint, load_head
from engine.errors import EngineError
from engine.loading import LoadedModel, load_model
from engine.training.data import (
    TOP_K,
    DiskRows,
    Item,
    builtin_items,
    generate_samples,
    generating_samples,
    history_items,
    host_sample,
    host_topk_probs,
    load_shard,
    read_items,
    read_positions,
    read_samples,
    save_shard,
    top_k_ids,
    topk_probs,
)
from engine.training.fit import (
    FitOptions,
    Trainer,
    batch_rows,
    cooldown_scale,
    label_counts,
    logsumexp_last,
    loss_fn,
    make_batch,
    staged_value_and_grad,
    unrolled_outputs,
    windows,
)
from engine.training.head_init import init_head
from engine.training.job import TrainOptions, choose_hot_ids, resolve_items, train_drafter
from tests.engine.test_online import assert_same_distribution, teacher_forced
from tests.fixtures.tiny_models import write_tiny_model

LAYERS = (2, 2, 1)
PROMPTS = ("Hello world! The quick brown fox", "What is the capital of France?",
           "def add(a, b):\n    return a + b", "The cat sat on the mat.")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_model(tmp_path_factory.mktemp("train") / "t", num_hidden_layers=4, seed=1)
    return load_model(str(path))


def items(prompts=PROMPTS) -> list[Item]:
    return [Item(f"t:{i}", ({"role": "user", "content": p},)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def samples(target: LoadedModel):
    return generate_samples(target.model, target.tokenizer, items(), LAYERS, max_new=20,
                            temperature=0.0)


def test_generating_in_slices_gives_the_same_samples(target: LoadedModel, samples) -> None:
    """The app's training slices: the batch yields every few passes (a reply sent meanwhile
    runs between them), and the samples are the ones made in one go."""
    steps = generating_samples(target.model, target.tokenizer, items(), LAYERS, max_new=20,
                               temperature=0.0, every=4)
    written: list[int] = []
    while True:
        try:
            written.append(next(steps))
        except StopIteration as end:
            sliced = end.value
            break
    assert len(written) >= 3 and written == sorted(written) and written[0] > 0
    assert [s.tokens.tolist() for s in sliced] == [s.tokens.tolist() for s in samples]


def test_host_topk_is_the_device_topk() -> None:
    """The CPU backend's numpy top-k (MLX's `exp` there is one element at a time) keeps
    the same ids with the same probabilities as the device's, including -inf columns."""
    logits = mx.random.normal((3, 5, 4096), key=mx.random.key(7)) * 4
    logits = mx.where(mx.arange(4096) % 97 == 0, -mx.inf, logits)
    want_ids, want_p = topk_probs(logits, TOP_K)
    got_ids, got_p = host_topk_probs(logits, TOP_K)
    assert got_ids.shape == got_p.shape == (3, 5, TOP_K)
    assert got_ids.dtype == np.int32 and got_p.dtype == np.float32
    for b in range(3):
        assert_same_distribution(got_ids[b], got_p[b], np.array(want_ids[b]),
                                 np.array(want_p[b]))
    # negative control: the top 15 plus the 17th is not the same set
    shifted = np.array(mx.argsort(-logits, axis=-1)[..., 1:TOP_K + 1])
    with pytest.raises(AssertionError):
        assert_same_distribution(shifted[0], got_p[0], got_ids[0], got_p[0])


def test_the_host_logsumexp_and_its_gradient_are_the_device_ones() -> None:
    """The loss's logsumexp on the CPU backend (numpy's exponentials, forward and
    backward) gives MLX's value and gradient to float rounding, inside a gradient
    transform as training takes it."""
    logits = mx.random.normal((2, 7, 4096), key=mx.random.key(3)) * 6
    weights = mx.random.uniform(shape=(2, 7, 1), key=mx.random.key(4))

    def loss(lse):
        return lambda x: mx.sum(weights * lse(x))

    device = lambda x: mx.logsumexp(x, axis=-1, keepdims=True)  # noqa: E731
    want, want_grad = mx.value_and_grad(loss(device))(logits)
    got, got_grad = mx.value_and_grad(loss(logsumexp_last))(logits)
    assert logsumexp_last(logits).shape == (2, 7, 1)
    assert float(got.item()) == pytest.approx(float(want.item()), rel=1e-6)
    assert mx.allclose(got_grad, want_grad, atol=1e-7, rtol=1e-4)
    assert float(mx.abs(want_grad).max().item()) > 1e-3
    # negative control: the gradient of a logsumexp over other logits is not this one
    _, other = mx.value_and_grad(loss(logsumexp_last))(logits * 1.01)
    assert not mx.allclose(other, want_grad, atol=1e-7, rtol=1e-4)


def test_top_k_ids_are_the_largest_values() -> None:
    """The candidates' top-k holds the k largest values of each row, as a full
    `argpartition` does: rows of the demo's vocabulary size, one nearly constant (ties
    everywhere), one with most columns -inf. Negative control: the 17th largest is not in."""
    x = np.array(mx.random.normal((6, 49152), key=mx.random.key(9)) * 3)
    x[1] = np.round(x[1] / 10)  # a handful of distinct values
    x[2, 100:] = -np.inf
    ids = top_k_ids(x, TOP_K)
    assert ids.shape == (6, TOP_K) and ids.dtype == np.int32
    want = np.sort(np.partition(x, -TOP_K, axis=-1)[:, -TOP_K:], axis=-1)
    got = np.sort(np.take_along_axis(x, ids, axis=-1), axis=-1)
    assert np.array_equal(got, want)
    assert all(len(set(row)) == TOP_K for row in ids.tolist())
    seventeenth = np.argsort(-x[0])[TOP_K]
    assert seventeenth not in ids[0]


def test_host_sampling_draws_from_the_tempered_distribution() -> None:
    """Frequencies of 40,000 draws (seed fixed) against softmax(logits / T), a total
    variation under 0.02 chosen in advance (its standard error here is ~0.003); the same
    seed draws the same tokens. Negative control: the untempered distribution is as far
    off as the test must notice."""
    logits = mx.array([[2.0, 1.0, 0.0, -1.0, -mx.inf, 0.5]] * 8)
    T = 0.7
    draws: list[int] = []
    rng = np.random.default_rng(11)
    for _ in range(5000):
        draws += host_sample(logits, T, rng)
    freq = np.bincount(draws, minlength=6) / len(draws)
    want = np.array(mx.softmax(logits[0] / T))
    assert freq[4] == 0.0
    assert 0.5 * np.abs(freq - want).sum() < 0.02
    untempered = np.array(mx.softmax(logits[0]))
    assert 0.5 * np.abs(freq - untempered).sum() > 0.02
    a, b = np.random.default_rng(11), np.random.default_rng(11)
    assert host_sample(logits, T, a) == host_sample(logits, T, b)


def test_host_sampling_in_blocks_is_the_one_level_inverse_cdf() -> None:
    """Over a 5,000-token vocabulary the two-level draw (blocks, then the chosen block's
    columns) picks the token a single float64 CDF over every column picks for the same
    uniform numbers. Negative control: other uniforms pick other tokens."""
    logits = mx.random.normal((64, 5000), key=mx.random.key(5)) * 3
    logits = mx.where(mx.arange(5000) % 71 == 0, -mx.inf, logits)
    T = 0.7

    def one_level(seed: int) -> list[int]:
        x = np.exp((np.array(logits) - np.array(logits).max(-1, keepdims=True)) / T)
        cdf = np.cumsum(x, axis=-1, dtype=np.float64)
        u = np.random.default_rng(seed).random(64) * cdf[:, -1]
        return [int(np.searchsorted(c, v, side="right")) for c, v in zip(cdf, u, strict=True)]

    got = host_sample(logits, T, np.random.default_rng(21))
    assert got == one_level(21)
    assert all(t % 71 for t in got)
    assert sum(a != b for a, b in zip(got, one_level(22), strict=True)) > 32


def _builtin_rows() -> list[dict]:
    return [json.loads(line) for line in
            Path("resources/drafter_prompts.jsonl").read_text().splitlines()]


def test_builtin_prompts_are_many_and_varied() -> None:
    rows = _builtin_rows()
    assert len(rows) >= 300
    assert len({r["prompt"].strip().lower() for r in rows}) == len(rows)
    assert len({r["id"] for r in rows}) == len(rows)
    categories = ["chat", "advice", "explanation", "writing", "code"]
    assert {r["category"] for r in rows} == set(categories)
    # categories take turns, so a short job's first replies cover every kind
    assert [r["category"] for r in rows[:10]] == categories * 2
    got = builtin_items()
    assert len(got) == len(rows) and not any(it.teacher_forced for it in got)
    held = sum(it.heldout for it in got)
    assert 10 <= held <= 60  # about one in ten, chosen by prompt


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _near_copies(prompts: list[str], others: list[str], limit: float = 0.6) -> list[str]:
    """Prompts whose word set overlaps one of `others` by Jaccard >= limit."""
    return [p for p in prompts for o in others
            if len(_words(p) & _words(o)) / len(_words(p) | _words(o)) >= limit]


def test_no_builtin_prompt_is_a_bench_prompt() -> None:
    """The bench measures prompts the head never trained on."""
    bench = [p.messages[-1]["content"] for p in load_prompts(DEFAULT_PROMPTS)]
    assert _near_copies([r["prompt"] for r in _builtin_rows()], bench) == []
    # negative control: the three the set once held are caught, an unrelated one is not
    leaked = ["Write a Python function that reverses a string.",
              "Write a function that checks if a number is prime.",
              "Write a function that returns the Fibonacci numbers up to n."]
    assert _near_copies(leaked + ["Write a Python decorator that times a function."],
                        bench) == leaked


def test_batched_generation_matches_each_reply_alone(target: LoadedModel, samples) -> None:
    """Left-padded rows decode exactly as a plain greedy reply to each prompt."""
    session = ChatSession(target)
    for it, s in zip(items(), samples, strict=True):
        fin = list(session.generate(list(it.messages), GenerateOptions(max_tokens=20)))[-1]
        prompt = target.tokenizer.encode_chat(list(it.messages))
        assert s.start == len(prompt) - 1
        assert s.tokens[: len(prompt)].tolist() == prompt
        assert s.tokens[len(prompt):].tolist() == list(fin.token_ids)[: len(s.tokens) - len(prompt)]


def test_generated_features_and_labels_are_the_teacher_forced_ones(target: LoadedModel,
                                                                   samples) -> None:
    s = samples[0]
    capture: dict = dict.fromkeys(LAYERS)
    logits = target.model(mx.array([s.tokens[:-1].tolist()]), capture=capture)[0]
    want = np.array(mx.concatenate([capture[i][0] for i in LAYERS], axis=-1))
    assert s.features.shape == want.shape
    assert np.allclose(s.features.astype(np.float32), want, atol=2e-2, rtol=1e-2)
    p = np.array(mx.softmax(logits.astype(mx.float32), axis=-1))
    top = np.argmax(p, axis=-1)
    assert np.array_equal(s.top_ids[np.arange(len(top)), np.argmax(s.top_p, -1)], top)
    rows = np.arange(len(top))[:, None]
    assert np.allclose(s.top_p.astype(np.float32), p[rows, s.top_ids], atol=2e-3)


def test_prompts_are_read_in_chunks_as_in_one_pass(target: LoadedModel) -> None:
    """Chunked reading (so a batch's full-vocabulary logits never exist at once) gives the
    one-pass features and top-k, left padding included."""
    rng = np.random.default_rng(0)
    grid = rng.integers(1, 200, size=(3, 23)).astype(np.int32)
    valid = np.ones(grid.shape, dtype=bool)
    valid[1, :7] = valid[2, :15] = False  # left padding
    whole = read_positions(target.model, grid, valid, make_caches(target.model.n_layers),
                           LAYERS, 8, chunk=64)
    caches = make_caches(target.model.n_layers)
    parts = read_positions(target.model, grid, valid, caches, LAYERS, 8, chunk=5)
    assert cache_length(caches) == grid.shape[1]
    for b in range(3):
        real = valid[b]
        assert np.allclose(parts.feats[b, real].astype(np.float32),
                           whole.feats[b, real].astype(np.float32), atol=2e-2, rtol=1e-2)
        assert np.array_equal(parts.top_ids[b, real, 0], whole.top_ids[b, real, 0])
        assert np.allclose(parts.top_p[b, real], whole.top_p[b, real], atol=2e-3)
    assert np.allclose(np.array(parts.last), np.array(whole.last), atol=1e-3)
    # negative control: without the padding mask the padded rows read differently
    wrong = read_positions(target.model, grid, np.ones(grid.shape, dtype=bool),
                           make_caches(target.model.n_layers), LAYERS, 8, chunk=5)
    assert not np.allclose(wrong.feats[2, 15:].astype(np.float32),
                           whole.feats[2, 15:].astype(np.float32), atol=2e-2, rtol=1e-2)


def test_history_is_read_teacher_forced(target: LoadedModel) -> None:
    conv = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! The quick brown fox."}]
    got = history_items([conv, [{"role": "user", "content": "only a question"}]])
    assert [it.id for it in got] == ["history:0:1"] and got[0].teacher_forced
    (s,) = read_samples(target.model, target.tokenizer, got, LAYERS)
    full = target.tokenizer.encode_chat(conv, add_generation_prompt=False)
    prompt = target.tokenizer.encode_chat(conv[:1])
    # kept from the last prompt token (as the online buffer keeps a reply): the rows of
    # one pass over the whole conversation from there on
    cut = len(prompt) - 1
    assert s.tokens.tolist() == full[cut:] and s.start == 0
    feats, top_ids, top_p = teacher_forced(target, full[:-1], LAYERS)
    assert len(s.features) == len(full) - 1 - cut
    assert np.allclose(np.asarray(s.features, np.float32), feats[cut:], atol=2e-2)
    assert_same_distribution(s.top_ids, s.top_p, top_ids[cut:], top_p[cut:])
    with pytest.raises(EngineError, match="history: no assistant replies"):
        history_items([[{"role": "user", "content": "hi"}]])


def test_a_chat_longer_than_the_window_is_read_as_the_model_read_it(
        target: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten exchanges of ~400 tokens against the tiny model's 2,048-token window: each turn
    is read with its oldest exchanges left out, as the reply was written, so no pass runs
    past the window (read whole, the last turn alone would be ~4,100 positions)."""
    import engine.training.data as data

    conv = []
    for i in range(10):
        conv += [{"role": "user", "content": f"question {i}: " + "tell me more " * 20},
                 {"role": "assistant", "content": f"answer {i}: " + "here is more " * 20}]
    window = target.model.args.max_position_embeddings
    assert len(target.tokenizer.encode_chat(conv, add_generation_prompt=False)) > 2 * window
    read_lengths: list[int] = []
    real = data.read_positions

    def read_positions(model, grid, *args, **kwargs):
        read_lengths.append(grid.shape[1])
        return real(model, grid, *args, **kwargs)

    monkeypatch.setattr(data, "read_positions", read_positions)
    samples = read_samples(target.model, target.tokenizer, history_items([conv]), LAYERS)
    assert len(samples) == 10 and max(read_lengths) < window
    reply = target.tokenizer.encode(conv[-1]["content"])
    assert samples[-1].tokens.tolist()[1:len(reply) + 1] == reply  # the last reply, whole


def test_data_file_errors_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"nope": 1}\n')
    with pytest.raises(EngineError, match=r"p.jsonl:2: expected"):
        read_items(f)
    f.write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(EngineError, match=r"p.jsonl:2: not valid JSON"):
        read_items(f)
    with pytest.raises(EngineError, match="no such file"):
        read_items(tmp_path / "missing.jsonl")


def test_shards_round_trip_and_damage_is_named(samples, tmp_path: Path) -> None:
    path = tmp_path / "shard-00000"
    save_shard(path, samples)
    assert not list(tmp_path.glob(".*tmp"))
    again = load_shard(path)
    assert [s.id for s in again] == [s.id for s in samples]
    for a, b in zip(samples, again, strict=True):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.features, b.features)
        assert np.array_equal(a.top_ids, b.top_ids) and np.array_equal(a.top_p, b.top_p)
        assert a.start == b.start and a.heldout == b.heldout
    # on disk, not in the process: rows are read when a batch asks for them
    assert isinstance(again[0].features, DiskRows)
    assert np.array_equal(again[1].features[2:5], np.asarray(samples[1].features)[2:5])
    with pytest.raises(TypeError):
        again[0].features[::2]  # row ranges only
    # an open shard stays readable if its folder is deleted meanwhile (the online buffer
    # drops old segments while a job may still read them)
    copy = tmp_path / "shard-00001"
    shutil.copytree(path, copy)
    held = load_shard(copy)
    shutil.rmtree(copy)
    assert np.array_equal(held[0].features[:3], np.asarray(samples[0].features)[:3])
    assert np.array_equal(held[0].top_ids[:3], samples[0].top_ids[:3])
    assert np.array_equal(held[0].top_p[:3], samples[0].top_p[:3])
    (path / "features.npy").write_bytes((path / "features.npy").read_bytes()[:100])
    with pytest.raises(EngineError, match="shard-00000: damaged"):
        load_shard(path)
    # a features file cut short after its header is damaged too
    save_shard(path.with_name("shard-00002"), samples)
    cut = path.with_name("shard-00002") / "features.npy"
    cut.write_bytes(cut.read_bytes()[:-64])
    with pytest.raises(EngineError, match="shard-00002: damaged.*shorter than its header"):
        load_shard(cut.parent)


def test_hot_ids_are_the_most_used(samples, target: LoadedModel) -> None:
    V = target.model.args.vocab_size
    every = choose_hot_ids(samples, V, 10_000)
    few = choose_hot_ids(samples, V, 8)
    assert len(few) == 8 and np.all(np.diff(few) > 0) and set(few) <= set(every)
    reply = np.concatenate([s.tokens[s.start + 1:] for s in samples])
    assert set(reply.tolist()) <= set(every.tolist())


def test_unrolled_training_computes_what_drafting_computes(target: LoadedModel,
                                                           samples) -> None:
    """Step 2 of the unrolled forward at chain j equals drafting from position j: the
    head's cache holds target rows 0..j, then its own output state is fed back."""
    V = target.model.args.vocab_size
    head = init_head(target.model, choose_hot_ids(samples, V, 10_000), LAYERS, 0)
    s = samples[0]
    batch = make_batch([s], [(0, 0)], 64, 2, np.array(head.lift_index))
    step1, step2 = unrolled_outputs(head, batch, 2)
    j = s.start + 2
    cache = PreallocatedKVCache()
    feats = mx.array(s.features[: j + 1].astype(np.float32))[None]
    out = head(head.fuse(feats), mx.array([s.tokens[1 : j + 2].tolist()]), cache=cache)
    assert mx.allclose(head.logits(out[:, -1]), step1[:, j], atol=1e-4)
    out2 = head(out[:, -1:], mx.array([[int(s.tokens[j + 2])]]), cache=cache)
    assert mx.allclose(head.logits(out2[:, -1]), step2[:, j], atol=1e-4)


def test_batches_from_a_shard_on_disk_equal_batches_from_memory(target: LoadedModel,
                                                               samples, tmp_path: Path) -> None:
    """A loaded shard's per-position arrays are read by row ranges (`DiskRows`), the
    windows and unrolled label rows included, up to each sample's end."""
    V = target.model.args.vocab_size
    lift = np.array(init_head(target.model, choose_hot_ids(samples, V, 64), LAYERS, 0)
                    .lift_index)
    save_shard(tmp_path / "shard-00000", samples)
    loaded = load_shard(tmp_path / "shard-00000")
    assert all(isinstance(x, DiskRows) for s in loaded for x in (s.top_ids, s.top_p))
    picks = [(i, a) for i, a in windows(samples, 8)][:12]
    assert any(a > 0 for _, a in picks)  # windows that start inside a sample
    for unroll in (1, 3):
        want = make_batch(samples, picks, 8, unroll, lift)
        got = make_batch(loaded, picks, 8, unroll, lift)
        for name in ("features", "ids", "label_ids", "label_p", "mask", "top1"):
            a, b = getattr(want, name), getattr(got, name)
            for x, y in zip(a if isinstance(a, list) else [a],
                            b if isinstance(b, list) else [b], strict=True):
                assert mx.array_equal(x, y).item(), (name, unroll)
        assert want.n_tokens == got.n_tokens > 0


def test_loss_falls_on_a_fixed_batch(target: LoadedModel, samples) -> None:
    V = target.model.args.vocab_size
    head = init_head(target.model, choose_hot_ids(samples, V, 10_000), LAYERS, 0)
    trainer = Trainer(head, samples, FitOptions(batch_size=4, window=64, warmup=1,
                                                learning_rate=3e-3))
    fixed = trainer.rows[:4]
    trainer.picks = lambda step: fixed  # type: ignore[method-assign]
    batch = make_batch(samples, fixed, 64, 3, trainer.lift)
    before = float(loss_fn(head, batch, 3, 0.8).item())
    for _ in range(30):
        trainer.train_step()
    after = float(loss_fn(head, batch, 3, 0.8).item())
    # 0.6: the head starts from the target's layer (head_init), nearer the labels'
    # entropy floor (~4.6 here) than a random block, so there is less to fall
    assert after < 0.6 * before, (before, after)
    # negative control: the same number of steps at learning rate 0 leaves it unchanged
    head0 = init_head(target.model, choose_hot_ids(samples, V, 10_000), LAYERS, 0)
    still = Trainer(head0, samples, FitOptions(batch_size=4, window=64, warmup=1,
                                               learning_rate=0.0, weight_decay=0.0))
    still.picks = lambda step: fixed  # type: ignore[method-assign]
    for _ in range(3):
        still.train_step()
    assert float(loss_fn(head0, batch, 3, 0.8).item()) == pytest.approx(before, rel=1e-5)


def test_the_cooldown_lowers_the_rate_over_the_last_part_of_a_bound() -> None:
    o = FitOptions(cooldown=0.25, final_lr=0.1)
    # 100 minutes (or steps): full rate until 25 are left, then linear down to the floor
    got = [cooldown_scale(left, 100.0, o) for left in (100, 30, 25, 20, 12.5, 5, 0, -3)]
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.8, 0.5, 0.2, 0.1, 0.1])
    assert cooldown_scale(0.0, 100.0, replace(o, cooldown=0.0)) == 1.0  # no cooldown


def test_the_rate_scale_scales_each_update(target: LoadedModel, samples) -> None:
    """AdamW's first step moves every weight by the rate (times a sign-like term), so at
    half the scale each weight moves exactly half as far."""
    V = target.model.args.vocab_size
    hot = choose_hot_ids(samples, V, 10_000)
    moved = []
    for scale in (1.0, 0.5):
        head = init_head(target.model, hot, LAYERS, 0)
        before = {k: np.array(v) for k, v in tree_flatten(head.trainable_parameters())}
        trainer = Trainer(head, samples, FitOptions(batch_size=2, window=32, warmup=1))
        trainer.lr_scale = scale
        trainer.train_step()
        moved.append({k: np.array(v) - before[k]
                      for k, v in tree_flatten(head.trainable_parameters())})
    full, half = moved
    for k in full:
        assert np.abs(full[k]).max() > 0, k
        # within float32's rounding of (weight + step) - weight, far below the step's half
        np.testing.assert_allclose(half[k], 0.5 * full[k], rtol=0,
                                   atol=0.02 * np.abs(full[k]).max(), err_msg=k)


def test_micro_batches_step_as_the_whole_batch(target: LoadedModel, samples) -> None:
    """A batch's gradient summed over one-row micro-batches (so only a row's logits are
    alive at once) is the whole batch's: two steps land on the same weights."""
    V = target.model.args.vocab_size
    hot = choose_hot_ids(samples, V, 10_000)
    heads = []
    for micro in (4, 1):
        head = init_head(target.model, hot, LAYERS, 0)
        trainer = Trainer(head, samples, FitOptions(batch_size=4, window=64, warmup=1,
                                                    learning_rate=3e-3, micro_batch=micro))
        losses = [trainer.train_step() for _ in range(2)]
        heads.append((head, losses))
    (whole, l4), (parts, l1) = heads
    assert l1 == pytest.approx(l4, rel=1e-4)
    for (name, a), (_, b) in zip(tree_flatten(whole.trainable_parameters()),
                                 tree_flatten(parts.trainable_parameters()), strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-4), name
    # negative control: micro-batches that average over their own rows step differently
    batch = make_batch(samples, Trainer(whole, samples, FitOptions()).rows[:4], 64, 3,
                       np.array(whole.lift_index))
    own = sum(float(loss_fn(whole, batch_rows(batch, i, i + 1), 3, 0.8).item())
              for i in range(4))
    assert own != pytest.approx(float(loss_fn(whole, batch, 3, 0.8).item()), rel=1e-2)


def test_staged_gradient_is_the_one_graph_gradient(target: LoadedModel, samples) -> None:
    """The staged gradient (states, then each step's output loss, then the block pulled
    along the state gradients) is the gradient of `loss_fn` as one graph, and it adds
    into a running sum as the micro-batches of `train_step` need."""
    V = target.model.args.vocab_size
    head = init_head(target.model, choose_hot_ids(samples, V, 10_000), LAYERS, 0)
    rows = Trainer(head, samples, FitOptions()).rows[:2]
    batch = make_batch(samples, rows, 64, 3, np.array(head.lift_index))
    counts = label_counts(batch)
    part = batch_rows(batch, 0, 1)
    want_loss, want = nn.value_and_grad(head, loss_fn)(head, part, 3, 0.8, counts)
    got_loss, got = staged_value_and_grad(head, part, 3, 0.8, counts)
    assert float(got_loss.item()) == pytest.approx(float(want_loss.item()), rel=1e-6)
    want_flat, got_flat = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert sorted(got_flat) == sorted(want_flat)
    for name, g in want_flat.items():
        assert float(mx.abs(g).max().item()) > 0, name  # every part gets a gradient
        assert mx.allclose(got_flat[name], g, atol=1e-6, rtol=1e-4), name
    # the module holds its own parameters again, not the transforms' stand-ins
    assert float(loss_fn(head, part, 3, 0.8, counts).item()) == pytest.approx(
        float(want_loss.item()), rel=1e-6)
    # added into a running sum: row 0's gradient plus row 1's
    other = batch_rows(batch, 1, 2)
    _, second = nn.value_and_grad(head, loss_fn)(head, other, 3, 0.8, counts)
    _, total = staged_value_and_grad(head, other, 3, 0.8, counts, got)
    summed = dict(tree_flatten(tree_map(mx.add, want, second)))
    for name, g in dict(tree_flatten(total)).items():
        assert mx.allclose(g, summed[name], atol=1e-6, rtol=1e-4), name
    # negative control: another row's gradient is not this one's
    assert not mx.allclose(dict(tree_flatten(second))["fc.weight"], want_flat["fc.weight"],
                           atol=1e-6, rtol=1e-4)


def test_the_update_one_tensor_at_a_time_is_adamw(target: LoadedModel, samples) -> None:
    """Trainer's update, evaluated parameter by parameter, lands where AdamW's own
    `update` does, weights and moments alike."""
    V = target.model.args.vocab_size
    hot = choose_hot_ids(samples, V, 10_000)
    heads = [init_head(target.model, hot, LAYERS, 0) for _ in range(2)]
    mine, theirs = (Trainer(h, samples, FitOptions(warmup=1, learning_rate=3e-3))
                    for h in heads)
    grads = tree_map(lambda p: mx.ones_like(p) * 0.01, heads[0].trainable_parameters())
    for _ in range(2):
        mine._apply(dict(grads))
        theirs.optimizer.update(heads[1], grads)
    for (name, a), (_, b) in zip(tree_flatten(heads[0].trainable_parameters()),
                                 tree_flatten(heads[1].trainable_parameters()), strict=True):
        assert mx.array_equal(a, b).item(), name
    for (name, a), (_, b) in zip(tree_flatten(mine.optimizer.state),
                                 tree_flatten(theirs.optimizer.state), strict=True):
        assert mx.array_equal(a, b).item(), name
    # negative control: one more step on one side moves it
    mine._apply(dict(grads))
    assert not mx.array_equal(heads[0].fc.weight, heads[1].fc.weight).item()


def test_windows_cover_reply_labels_only(samples) -> None:
    rows = windows(samples, 8)
    for i, a in rows:
        assert a + 8 > samples[i].start  # every row has at least one reply label


def _options(max_steps: int) -> TrainOptions:
    return TrainOptions(minutes=5, rounds=1, gen_batch=8, max_new=16, max_steps=max_steps,
                        checkpoint_every=2, data_share=0.0,
                        fit=FitOptions(batch_size=2, window=32))


def _weights(root: Path, target: LoadedModel) -> dict[str, np.ndarray]:
    folder = current_checkpoint(root)
    assert folder is not None
    head = load_head(folder, target.model)
    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


def test_cancelled_training_resumes_to_the_same_weights(target: LoadedModel,
                                                        tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    events = list(train_drafter(target, _options(6), root=whole))
    assert events[-1].phase == "done" and events[-1].step == 6
    assert [e.step for e in events if e.phase == "checkpoint"] == [2, 4, 6]
    # the same data, trained in two runs with a cancel in between
    parts = tmp_path / "parts"
    parts.mkdir()
    shutil.copytree(whole / "data", parts / "data")
    cancel = threading.Event()
    first = []
    for e in train_drafter(target, _options(6), cancel, root=parts):
        first.append(e)
        if e.step == 3:
            cancel.set()
    assert first[-1].phase == "done" and first[-1].step == 3
    assert current_checkpoint(parts).name == "ckpt-0000003"
    rest = list(train_drafter(target, _options(6), root=parts))
    assert rest[0].step == 4 and rest[-1].step == 6
    a, b = _weights(whole, target), _weights(parts, target)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    record = json.loads((current_checkpoint(parts) / "training.json").read_text())
    assert record["steps"] == 6 and record["data"] == "builtin"
    assert [h["step"] for h in record["history"]] == [2, 3, 5, 6]
    # the cooldown goes by the step alone (the last 20% of 6 steps: only the sixth step,
    # 1 step of a 1.2-step tail left), so the resumed run took the same rates
    assert [h["lr"] for h in record["history"]] == pytest.approx([1e-3, 1e-3, 1e-3, 1e-3 / 1.2])


def test_checkpoints_never_leave_a_half_written_head(target: LoadedModel,
                                                     tmp_path: Path) -> None:
    root = tmp_path / "r"
    list(train_drafter(target, _options(2), root=root))
    names = sorted(p.name for p in root.iterdir())
    assert names == [".job.lock", "ckpt-0000002", "current.json", "data"]
    assert not list(root.rglob(".*.tmp"))
    assert sorted(p.name for p in (root / "ckpt-0000002").iterdir()) == [
        "config.json", "model.safetensors", "optimizer.safetensors", "trainer.json",
        "training.json"]


def _prompt_file(folder: Path) -> Path:
    """Four prompts to reply to, and one chat whose assistant turn is read as it is."""
    path = folder / "p.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"Tell me about number {i}."} for i in range(4)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello there."}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_each_round_replies_again_but_reads_a_written_reply_once(tmp_path: Path) -> None:
    got = resolve_items(TrainOptions(data=str(_prompt_file(tmp_path)), rounds=3))
    ids = [it.id for it in got]
    # a reply read teacher-forced is the same in every round: once; prompts once a round
    assert sum(i.endswith(":chat#r0") for i in ids) == 1
    assert not any(":chat#r" in i and not i.endswith("#r0") for i in ids)
    assert sorted(i.rsplit("#r", 1)[1] for i in ids if ":p" in i) == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
    assert TrainOptions().rounds == 12


def test_data_rounds_go_on_while_the_time_allows_and_stop_at_the_data_limit(
        target: LoadedModel, tmp_path: Path) -> None:
    """A long run keeps making fresh rounds of replies (four rounds took ~23 minutes of
    making, and an evening's run refit them after), until the data on disk reaches `max_data_mb` or the disk would
    keep less than `min_free_mb` free: then it trains on what it has and says so once."""
    data = str(_prompt_file(tmp_path))
    options = TrainOptions(minutes=5, data=data, rounds=3, gen_batch=5, max_new=8,
                           max_steps=1, checkpoint_every=1, data_share=1.0, min_free_mb=0,
                           fit=FitOptions(batch_size=2, window=32))

    def run(root: Path, opts: TrainOptions) -> tuple[list, list[str]]:
        lines: list[str] = []
        events = list(train_drafter(target, opts, root=root, warn=lines.append))
        return events, lines

    events, lines = run(tmp_path / "all", options)
    shards = sorted((tmp_path / "all" / "data").glob("shard-*[0-9]"))
    assert len(shards) == 3 and lines == []  # the chat once, four prompts a round
    ids = [m["id"] for sh in shards for m in json.loads((sh / "meta.json").read_text())]
    assert sorted(i.rsplit("#r", 1)[1] for i in ids) == ["0"] * 5 + ["1"] * 4 + ["2"] * 4
    assert events[-1].phase == "done" and events[-1].step == 1
    first = sum(f.stat().st_size for f in shards[0].iterdir()) / 2**20

    # a limit the first shard already passes: one batch, one line, and training goes on
    events, lines = run(tmp_path / "capped", replace(options, max_data_mb=first / 2))
    assert len(list((tmp_path / "capped" / "data").glob("shard-*[0-9]"))) == 1
    assert len(lines) == 1 and "reached its limit" in lines[0]
    assert str(tmp_path / "capped" / "data") in lines[0]
    assert events[-1].phase == "done" and events[-1].step == 1
    with pytest.raises(EngineError, match="--max-data-mb must be a positive number"):
        TrainOptions(max_data_mb=0)

    # a disk that would keep less free than asked: one batch, one line, training goes on
    # (asking more than any disk has: the real free space, read as a run reads it)
    events, lines = run(tmp_path / "full", replace(options, min_free_mb=2.0**40))
    assert len(list((tmp_path / "full" / "data").glob("shard-*[0-9]"))) == 1
    assert len(lines) == 1 and "MB free under" in lines[0]
    assert "making no more training data" in lines[0]
    assert events[-1].phase == "done" and events[-1].step == 1


def test_a_job_whose_time_went_to_data_keeps_it_and_writes_no_untrained_head(
        target: LoadedModel, tmp_path: Path) -> None:
    """A budget spent making data (a first short run) saves the data and no head of 0
    steps, which `auto` would be offered as a drafter; the next run trains from it."""
    root = tmp_path / "r"
    short = replace(_options(2), minutes=1e-6)  # spent by the first batch of replies
    events = list(train_drafter(target, short, root=root))
    # the batch's slices, then the batch, then done
    assert {e.phase for e in events[:-1]} == {"data"} and events[-1].phase == "done"
    assert events[-1].checkpoint is None and events[-1].step == 0
    assert current_checkpoint(root) is None and not list(root.glob("ckpt-*"))
    assert sorted(p.name for p in (root / "data").glob("shard-*")) == ["shard-00000"]
    rest = list(train_drafter(target, _options(2), root=root))
    assert rest[-1].phase == "done" and rest[-1].step == 2
    assert current_checkpoint(root).name == "ckpt-0000002"
    assert (root / "data" / "shard-00000").is_dir()  # the first run's data, trained on


def test_the_data_phase_yields_within_a_batch_and_stops_there(target: LoadedModel,
                                                               tmp_path: Path) -> None:
    """A batch of 16 replies is ~200 passes (17 s of a reply waiting in the app, with no
    progress shown and Stop unheard): the job now yields every few passes, showing the
    tokens written, and a Stop there ends it at once, dropping the batch cut short."""
    import threading

    root = tmp_path / "r"
    cancel = threading.Event()
    job = train_drafter(target, _options(2), cancel, root=root)
    first = [next(job) for _ in range(2)]
    assert [p.phase for p in first] == ["data", "data"]
    assert all(p.data_sequences == 0 for p in first)  # inside the first batch
    assert 0 < first[0].data_tokens < first[1].data_tokens
    cancel.set()
    rest = list(job)
    assert [p.phase for p in rest] == ["done"] and rest[0].step == 0
    assert not list((root / "data").glob("shard-*"))  # nothing half-made was kept


def test_a_second_job_on_one_head_is_refused_in_one_line(target: LoadedModel,
                                                         tmp_path: Path) -> None:
    """Two jobs on one head folder made the same shard numbers, and the second ended with
    a write error that blamed the disk. The second is refused, naming the first's process;
    once the first ends (or dies: the lock is the kernel's) a job runs again."""
    import os

    from engine.training.locks import BusyError

    root = tmp_path / "r"
    first = train_drafter(target, _options(2), root=root)
    progress = next(first)
    while progress.data_sequences == 0:  # slices of the first batch, before its shard
        progress = next(first)
    assert progress.phase == "data"  # running, between two slices
    with pytest.raises(BusyError, match=rf"another drafter training job for \S+ is running "
                                        rf"\(process {os.getpid()}, holding .*\.job\.lock\)"):
        next(train_drafter(target, _options(2), root=root))
    assert sorted(p.name for p in (root / "data").glob("shard-*")) == ["shard-00000"]
    rest = list(first)  # the first job was not disturbed
    assert rest[-1].phase == "done" and rest[-1].step == 2
    again = list(train_drafter(target, _options(4), root=root))
    assert again[-1].step == 4
    # a job closed early (the app's Stop, a dropped generator) lets the next one in too
    early = train_drafter(target, _options(6), root=root)
    next(early)
    early.close()
    assert list(train_drafter(target, _options(6), root=root))[-1].step == 6


def test_time_budget_must_be_positive() -> None:
    """Refused where the options are made, before a front end loads a model or prints a
    plan (the CLI used to print its plan and then fail)."""
    for minutes in (0, -1, float("nan"), float("inf")):
        with pytest.raises(EngineError, match="--minutes must be a positive number"):
            TrainOptions(minutes=minutes)
    assert TrainOptions(minutes=0.5).minutes == 0.5


def test_time_the_caller_holds_the_job_is_not_spent_from_its_minutes() -> None:
    """The app answers a chat message between two training slices; that wait is not
    training time (the control: a clock left running counts it)."""
    import time

    from engine.training.job import ActiveClock

    paused, running = ActiveClock(), ActiveClock()
    paused.pause()
    time.sleep(0.3)
    paused.resume()
    assert paused.elapsed() < 0.1
    assert running.elapsed() >= 0.3


def test_a_lock_file_that_cannot_be_opened_is_one_line(target: LoadedModel,
                                                       tmp_path: Path) -> None:
    """Hand-damaged app-data: a folder where the job's lock file goes."""
    root = tmp_path / "r"
    (root / ".job.lock").mkdir(parents=True)
    with pytest.raises(EngineError, match=r"\.job\.lock: cannot open the lock file"):
        next(train_drafter(target, _options(2), root=root))
    assert not (root / "data").exists()  # nothing started
