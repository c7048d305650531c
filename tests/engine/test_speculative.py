"""Speculative decoding end to end: identity with plain decoding, step accounting, caches.

The coupled rule's promise is exact: for every drafter, sampling setting and seed, the
speculative reply is token-for-token the plain reply. Tiny random models make that cheap to
check over many prompts (a hypothesis property test); the demo model checks it on a real
model. The rejection rule is checked for identity only at temperature 0 (its distribution
is checked in test_rejection_stats.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cache import cache_length, make_caches
from engine.decode import ChatSession, GenerateOptions
from engine.drafters.base import Draft
from engine.drafters.ngram import NgramDrafter
from engine.errors import IncompatibleDraftError
from engine.events import Finished, Step, TokenKind
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.speculative import speculative_steps, step_kinds
from engine.steps import prefill
from engine.tuning import EXTRA_NODES, Choice, PolicyMemory
from tests.fixtures.tiny_models import write_tiny_model, write_tiny_pair
from tools.replay_trees import Clock

DRAFTERS = ("ngram", "model", "layerskip", "auto")
SAMPLINGS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
    SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.3, seed=5),
)
PROMPTS = (
    "Hello world! The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",  # repeats: prompt lookup matches
    "What is the capital of France?",
)
K_CHOICES = (None, 1, 3, 6)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def run(session: ChatSession, options: GenerateOptions, messages: Sequence[dict] | None = None,
        ids: Sequence[int] | None = None) -> tuple[list[Step], Finished]:
    events = list(session.generate(messages, options) if ids is None
                  else session.generate_ids(ids, options))
    finished = events[-1]
    assert isinstance(finished, Finished)
    return [e for e in events if isinstance(e, Step)], finished


class Counting:
    """A model that counts the tokens each call feeds (to see what a cache saved)."""

    def __init__(self, model) -> None:
        self.model = model
        self.n_layers = model.n_layers
        self.args = model.args
        self.fed: list[int] = []

    def __call__(self, inputs: mx.array, mask=None, cache=None, n_layers=None,
                 last_only: bool = False) -> mx.array:
        self.fed.append(inputs.shape[1])
        return self.model(inputs, mask=mask, cache=cache, n_layers=n_layers,
                          last_only=last_only)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def target(pair_dirs: tuple[Path, Path]) -> LoadedModel:
    return load_model(str(pair_dirs[0]))


@pytest.fixture(scope="module")
def session(pair_dirs: tuple[Path, Path], target: LoadedModel) -> ChatSession:
    """Target + a smaller random draft: drafts are often rejected."""
    return ChatSession(target, load_model(str(pair_dirs[1])))


@pytest.fixture(scope="module")
def self_session(pair_dirs: tuple[Path, Path], target: LoadedModel) -> ChatSession:
    """The target drafting for itself: under the coupled rule every draft is accepted."""
    return ChatSession(target, load_model(str(pair_dirs[0])))


# ----------------------------------------------------------------------------- identity


def test_step_kinds_display_order() -> None:
    A, R = TokenKind.ACCEPTED, TokenKind.REJECTED
    assert step_kinds(0, 0) == [TokenKind.TARGET]
    assert step_kinds(3, 3) == [A, A, A, TokenKind.BONUS]
    assert step_kinds(3, 1) == [A, R, R, TokenKind.REPLACED]
    assert step_kinds(2, 0) == [R, R, TokenKind.REPLACED]
    for d in range(5):
        for n in range(d + 1):
            assert step_kinds(d, n) == expected_kinds(d, n)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: f"T{s.temperature}")
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_text_equals_plain_text(session: ChatSession, drafter: str,
                                            sampling: SamplingParams) -> None:
    for i, prompt in enumerate(PROMPTS):
        plain_opts = GenerateOptions(max_tokens=40, sampling=sampling)
        _, plain = run(session, plain_opts, user(prompt))
        accepts = ("coupled", "rejection") if sampling.greedy else ("coupled",)
        for accept in accepts:
            spec_opts = dataclasses.replace(plain_opts, drafter=drafter, accept=accept,
                                            k=K_CHOICES[i % len(K_CHOICES)])
            steps, spec = run(session, spec_opts, user(prompt))
            assert spec.token_ids == plain.token_ids, (drafter, accept, prompt)
            assert spec.text == plain.text
            assert spec.stats.finish_reason == plain.stats.finish_reason
            if drafter in ("model", "layerskip") and spec_opts.k:
                # the prefill's own token comes first, then every step drafts
                assert steps[0].n_drafted == 0 and len(steps[0].tokens) == 1
                assert all(s.n_drafted for s in steps[1:])


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_self_draft_accepts_everything_and_still_matches(self_session: ChatSession,
                                                         drafter: str) -> None:
    sampling = SamplingParams(temperature=0.8, seed=2)
    _, plain = run(self_session, GenerateOptions(max_tokens=40, sampling=sampling),
                   user(PROMPTS[0]))
    steps, spec = run(self_session, GenerateOptions(max_tokens=40, sampling=sampling,
                                                    drafter=drafter, k=4), user(PROMPTS[0]))
    assert spec.token_ids == plain.token_ids
    check_steps(steps, spec)
    if drafter == "model":
        # every draft's chain passes (a tree's runner-up leaves are rejected ghosts)
        assert all(s.n_accepted == s.k for s in steps[1:-1])
        assert spec.stats.tau > 4.0  # k + 1 tokens per pass, except at the end
        assert steps[0].tokens[-1].kind is TokenKind.TARGET  # the prefill's own token
        assert all(s.tokens[-1].kind is TokenKind.BONUS for s in steps[1:-1])


def test_stop_strings_cut_speculative_text_where_plain_stops(session: ChatSession) -> None:
    sampling = SamplingParams(temperature=0.8, seed=7)
    _, full = run(session, GenerateOptions(max_tokens=40, sampling=sampling), user(PROMPTS[0]))
    stop = full.text[12:15]
    assert len(stop) == 3
    plain_opts = GenerateOptions(max_tokens=40, sampling=sampling, stop=(stop,))
    _, plain = run(session, plain_opts, user(PROMPTS[0]))
    assert plain.stats.finish_reason == "stop" and stop not in plain.text
    for drafter in DRAFTERS:
        _, spec = run(session, dataclasses.replace(plain_opts, drafter=drafter, k=5),
                      user(PROMPTS[0]))
        assert (spec.text, spec.stats.finish_reason) == (plain.text, "stop")


@st.composite
def spec_cases(draw: st.DrawFn) -> tuple[list[int], SamplingParams, str, int | None, str, bool]:
    prompt = draw(st.lists(st.integers(3, 60), min_size=1, max_size=24))
    sampling = dataclasses.replace(draw(st.sampled_from(SAMPLINGS)),
                                   seed=draw(st.integers(0, 2**64 - 1)))
    drafter = draw(st.sampled_from(DRAFTERS))
    k = draw(st.sampled_from(K_CHOICES))
    accept = draw(st.sampled_from(("coupled", "rejection"))) if sampling.greedy else "coupled"
    return prompt, sampling, drafter, k, accept, draw(st.booleans())


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=spec_cases())
def test_identity_over_random_prompts(session: ChatSession, self_session: ChatSession,
                                      case: tuple) -> None:
    """Any prompt (repeats make prompt lookup match), seed, drafter, K: same tokens."""
    prompt, sampling, drafter, k, accept, use_self = case
    chat = self_session if use_self else session
    plain_opts = GenerateOptions(max_tokens=24, sampling=sampling)
    _, plain = run(chat, plain_opts, ids=prompt)
    _, spec = run(chat, dataclasses.replace(plain_opts, drafter=drafter, k=k, accept=accept),
                  ids=prompt)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text


# ----------------------------------------------------------------------------- accounting


def expected_kinds(n_drafted: int, n_accepted: int) -> list[TokenKind]:
    """ACCEPTED..., then REJECTED... + REPLACED, or BONUS; TARGET when nothing was drafted."""
    if n_drafted == 0:
        return [TokenKind.TARGET]
    tail = ([TokenKind.REJECTED] * (n_drafted - n_accepted) + [TokenKind.REPLACED]
            if n_accepted < n_drafted else [TokenKind.BONUS])
    return [TokenKind.ACCEPTED] * n_accepted + tail


def check_steps(steps: list[Step], finished: Finished) -> None:
    """Every step's tokens, counts and fates agree with each other and with the totals."""
    committed_ids: list[int] = []
    text = ""
    for i, step in enumerate(steps):
        kinds = [t.kind for t in step.tokens]
        full = expected_kinds(step.n_drafted, step.n_accepted)
        tree = any(t.branch for t in step.tokens)
        if tree:
            # a tree's ghosts stand where their branches left the path (test_tree.py), and
            # its walk may end at a leaf: compare the committed tokens' fates
            kinds = [t.kind for t in step.committed]
            full = [k for k in full if k.committed]
            if kinds[-1] is TokenKind.BONUS and len(kinds) == len(full):
                full[-1] = TokenKind.BONUS
        if i < len(steps) - 1:
            assert kinds == full
            assert len(step.committed) == step.n_accepted + 1
        else:  # the last step may end early (max tokens, eos, stop string)
            assert kinds == full[: len(kinds)]
            assert len(step.committed) <= step.n_accepted + 1
        # a tree adds up to EXTRA_NODES beyond K (a cut-short last step may hide its ghosts)
        extra = EXTRA_NODES if tree or i == len(steps) - 1 else 0
        assert step.n_drafted == 0 or step.k + extra >= step.n_drafted
        assert (step.drafter == "none") == (step.n_drafted == 0)
        rejected = [t for t in step.tokens if t.kind is TokenKind.REJECTED]
        replaced = [t for t in step.tokens if t.kind is TokenKind.REPLACED]
        if rejected and replaced and not tree:
            # the target's token where the first draft failed is a different token
            assert replaced[0].id != rejected[0].id
        committed_ids += [t.id for t in step.committed]
        text += step.text
    assert tuple(committed_ids) == finished.token_ids
    assert text == finished.text
    stats = finished.stats
    assert stats.target_passes == len(steps)
    assert stats.generated_tokens == len(finished.token_ids)
    assert stats.n_drafted == sum(s.n_drafted for s in steps)
    assert stats.n_accepted == sum(s.n_accepted for s in steps)
    assert stats.tau == pytest.approx(stats.generated_tokens / stats.target_passes)
    if stats.n_drafted:
        assert stats.acceptance == pytest.approx(stats.n_accepted / stats.n_drafted)


@pytest.mark.parametrize("sampling", SAMPLINGS[:3], ids=lambda s: f"T{s.temperature}")
@pytest.mark.parametrize("k", [1, 4])
def test_model_drafter_accounting_and_cache_lengths(session: ChatSession,
                                                    sampling: SamplingParams, k: int) -> None:
    """After each step both caches hold the committed sequence minus its newest token."""
    messages = user(PROMPTS[0])
    n_prompt = len(session.encode(messages))
    options = GenerateOptions(max_tokens=40, sampling=sampling, drafter="model", k=k)
    steps: list[Step] = []
    generated = 0
    for event in session.generate(messages, options):
        if isinstance(event, Step):
            steps.append(event)
            generated += len(event.committed)
            n = n_prompt + generated - 1
            if len(steps) == 1:
                # the prefill's own token: committed before any drafting, fed with the drafts
                assert event.n_drafted == 0 and generated == 1
                assert session.cache_lengths()["target"] == n
                continue
            if len(event.committed) == event.n_accepted + 1:  # not cut short at the end
                assert session.cache_lengths() == {"target": n, "draft": n}
            # K drafts, plus the runner-ups a draft tree kept
            assert event.k == k and k <= event.n_drafted <= k + EXTRA_NODES
            assert event.drafter == "model"
        elif isinstance(event, Finished):
            finished = event
    check_steps(steps, finished)
    assert finished.stats.generated_tokens == 40
    assert any(s.n_accepted < s.n_drafted for s in steps)  # the rejection path was taken
    assert any(s.n_accepted > 0 for s in steps)  # and the acceptance path


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_accounting_for_every_drafter(session: ChatSession, self_session: ChatSession,
                                      drafter: str) -> None:
    for chat, k in ((session, None), (self_session, 3)):
        steps, finished = run(chat, GenerateOptions(
            max_tokens=30, sampling=SamplingParams(temperature=0.8, seed=1), drafter=drafter,
            k=k), user(PROMPTS[1]))
        check_steps(steps, finished)


def test_rejected_tokens_never_reach_the_text(session: ChatSession) -> None:
    options = GenerateOptions(max_tokens=40, sampling=SamplingParams(temperature=0.8, seed=9),
                              drafter="model", k=4)
    steps, finished = run(session, options, user(PROMPTS[2]))
    check_steps(steps, finished)
    rejected = [t for s in steps for t in s.tokens if t.kind is TokenKind.REJECTED]
    assert rejected
    # rebuild the reply from each step's committed ids: REJECTED ids are not among them
    positions = 0
    for step in steps:
        for t in step.tokens:
            if t.kind is TokenKind.REJECTED:
                continue
            assert finished.token_ids[positions] == t.id
            positions += 1
    assert positions == len(finished.token_ids)
    assert session.target.tokenizer.decode(list(finished.token_ids),
                                           skip_special_tokens=True) == finished.text


# ----------------------------------------------------------------------------- prefix reuse


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture
def counted_session(pair_dirs: tuple[Path, Path], target: LoadedModel) -> tuple[ChatSession,
                                                                               Counting]:
    draft = load_model(str(pair_dirs[1]))
    counting = Counting(draft.model)
    return ChatSession(target, dataclasses.replace(draft, model=counting)), counting


def test_prefix_reuse_across_chat_turns(counted_session: tuple[ChatSession, Counting]) -> None:
    session, draft_calls = counted_session
    options = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=4),
                              drafter="model", k=3)
    turn1 = user("Hello world! The quick brown fox jumps")
    p1 = session.encode(turn1)
    _, first = run(session, options, turn1)
    assert first.stats.finish_reason == "length"
    assert first.stats.prefilled_tokens == len(p1)  # a cold cache computes everything
    n_cached = session.cache_lengths()["target"]

    turn2 = [*turn1, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "And the lazy dog?"}]
    p2 = session.encode(turn2)
    reused = min(common_prefix((p1 + list(first.token_ids))[:n_cached], p2), len(p2) - 1)
    assert reused >= len(p1)  # at least the whole first prompt

    draft_calls.fed.clear()
    _, second = run(session, options, turn2)
    assert second.stats.prompt_tokens == len(p2)
    assert second.stats.prefilled_tokens == len(p2) - reused  # only the new tokens (+1)
    # the draft model caught up on the new tokens only, in its first call
    assert draft_calls.fed[0] <= len(p2) - len(p1)

    session.reset()  # and reuse changed nothing: a cold session says the same
    _, cold = run(session, options, turn2)
    assert cold.token_ids == second.token_ids
    assert cold.stats.prefilled_tokens == len(p2)


def test_prefix_reuse_is_exact_at_the_token_level(
        counted_session: tuple[ChatSession, Counting]) -> None:
    session, draft_calls = counted_session
    options = GenerateOptions(max_tokens=10, sampling=SamplingParams(temperature=0.8, seed=6),
                              drafter="model", k=3)
    p1 = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    _, first = run(session, options, ids=p1)
    assert first.stats.finish_reason == "length"
    n_cached = session.cache_lengths()["target"]
    assert n_cached in (len(p1) + 10, len(p1) + 9)  # the newest token may be unfed

    new = [40, 41, 42, 43, 44]
    p2 = p1 + list(first.token_ids) + new
    draft_calls.fed.clear()
    _, second = run(session, options, ids=p2)
    assert second.stats.prefilled_tokens == len(p2) - n_cached <= len(new) + 1
    # the draft model's catch-up: the new tokens, at most the last reply's newest one and
    # the prefill's own token, never the whole history
    assert draft_calls.fed[0] <= len(new) + 2

    session.reset()
    _, cold = run(session, options, ids=p2)
    assert cold.token_ids == second.token_ids


@pytest.mark.parametrize("how", ["cancel", "stop", "length"])
def test_a_reply_cut_short_leaves_caches_the_next_turn_can_reuse(
        counted_session: tuple[ChatSession, Counting], how: str) -> None:
    """Whatever ended the last reply (the loop may have committed past its end), the next
    turn gives what a cold session gives."""
    session, _ = counted_session
    sampling = SamplingParams(temperature=0.8, seed=8)
    options = GenerateOptions(max_tokens=20, sampling=sampling, drafter="model", k=4)
    p1 = [20, 21, 22, 23, 24, 25, 26, 27]
    if how == "stop":
        _, probe = run(session, options, ids=p1)
        options = dataclasses.replace(options, stop=(probe.text[6:8],))
    cancel = threading.Event()
    events = []
    for event in session.generate_ids(p1, options, cancel if how == "cancel" else None):
        events.append(event)
        if isinstance(event, Step):
            cancel.set()
    first = events[-1]
    assert isinstance(first, Finished)
    assert first.stats.finish_reason == {"cancel": "cancelled"}.get(how, how)
    p2 = p1 + list(first.token_ids) + [30, 31, 32]
    _, warm = run(session, options, ids=p2)
    assert warm.stats.prefilled_tokens <= 4
    session.reset()
    _, cold = run(session, options, ids=p2)
    assert warm.token_ids == cold.token_ids


# ----------------------------------------------------------------------------- draft checks


def test_a_draft_with_another_tokenizer_is_refused(tmp_path: Path, pair_dirs: tuple[Path, Path],
                                                   target: LoadedModel) -> None:
    pytest.importorskip("engine.compat", reason="engine/compat.py is not written yet")
    other = write_tiny_model(tmp_path / "other", hidden_size=32, num_hidden_layers=1,
                             intermediate_size=64, seed=9)
    tok_path = other / "tokenizer.json"
    data = json.loads(tok_path.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[100], by_id[101]
    vocab[a], vocab[b] = 101, 100  # same strings, two ids swapped
    tok_path.write_text(json.dumps(data))
    with pytest.raises(IncompatibleDraftError, match="different strings") as err:
        ChatSession(target, load_model(str(other)))
    assert str(other) in str(err.value) and "100" in str(err.value)


def test_a_draft_sharing_the_tokenizer_is_accepted(tmp_path: Path,
                                                   pair_dirs: tuple[Path, Path],
                                                   target: LoadedModel) -> None:
    copy = shutil.copytree(pair_dirs[1], tmp_path / "draft-copy")
    assert "model" in ChatSession(target, load_model(str(copy))).drafters


def test_a_draft_with_a_padded_vocabulary(tmp_path: Path, target: LoadedModel) -> None:
    """Embeddings padded past the tokenizer are compatible; the draft never proposes the
    padding ids (its logits are cut to the target's vocabulary), and output is lossless.
    (Verification of ids outside the target's vocabulary is tested in test_verify.)"""
    padded = write_tiny_model(tmp_path / "padded", vocab_size=400, hidden_size=32,
                              num_hidden_layers=1, intermediate_size=64, seed=1)
    chat = ChatSession(target, load_model(str(padded)))
    vocab = target.model.args.vocab_size
    outside = 0
    for sampling, accept in ((SamplingParams(temperature=0.0), "coupled"),
                             (SamplingParams(temperature=0.0), "rejection"),
                             (SamplingParams(temperature=0.8, seed=2), "coupled"),
                             (SamplingParams(temperature=0.8, seed=2), "rejection")):
        options = GenerateOptions(max_tokens=30, sampling=sampling)
        _, plain = run(chat, options, user(PROMPTS[0]))
        steps, spec = run(chat, dataclasses.replace(options, drafter="model", k=4,
                                                     accept=accept), user(PROMPTS[0]))
        check_steps(steps, spec)
        assert all(t < vocab for t in spec.token_ids)
        if accept == "coupled" or sampling.greedy:
            assert spec.token_ids == plain.token_ids
        outside += sum(t.id >= vocab for s in steps for t in s.tokens)
    assert outside == 0  # no draft slot is wasted on a padding id


# ----------------------------------------------------------------------------- demo model


@pytest.fixture(scope="module")
def demo_session(demo_model_dir: Path) -> ChatSession:
    """The demo model drafting for itself (the "model" drafter at no extra memory).

    Its drafts come from 1-token passes and are checked by (K+1)-token passes, so any
    numeric difference between the two shapes shows up here as a changed reply. Real
    rejections on a real model come from layer skip and prompt lookup.
    """
    demo = load_model(str(demo_model_dir))
    return ChatSession(demo, demo)


DEMO_CASES = [
    ("Write a Python function that adds two numbers.", SamplingParams(temperature=0.0),
     [("ngram", 4, "coupled"), ("model", 4, "coupled"), ("layerskip", 1, "coupled"),
      ("model", 4, "rejection")]),
    ("Repeat after me: the cat sat on the mat, the cat sat on the mat.",
     SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3),
     [("model", 4, "coupled"), ("auto", 3, "coupled")]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "sampling", "runs"), DEMO_CASES, ids=["greedy", "sampled"])
def test_demo_model_speculative_equals_plain(demo_session: ChatSession, prompt: str,
                                             sampling: SamplingParams,
                                             runs: list[tuple[str, int, str]]) -> None:
    plain_opts = GenerateOptions(max_tokens=24, sampling=sampling)
    _, plain = run(demo_session, plain_opts, user(prompt))
    assert plain.text.strip()
    for drafter, k, accept in runs:
        steps, spec = run(demo_session, dataclasses.replace(
            plain_opts, drafter=drafter, k=k, accept=accept), user(prompt))
        assert spec.text == plain.text, (drafter, accept)
        assert spec.token_ids == plain.token_ids
        check_steps(steps, spec)
        if drafter == "model":
            # the same model mostly agrees with itself: most of each K-draft chain commits
            # (acceptance counts a tree's runner-ups too, which lose where the chain wins)
            drafting = [s for s in steps if s.n_drafted]
            assert sum(s.n_accepted for s in drafting) > 0.5 * k * len(drafting)


# ----------------------------------------------------------------------------- pending reads


class ScriptedPolicy:
    """Asks for a prompt-lookup draft once, then plain steps; says every guess was right
    (or wrong)."""

    def __init__(self, guess_right: bool) -> None:
        self.guess_right = guess_right
        self.calls = 0
        self.memory = PolicyMemory()

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        self.calls += 1
        return Choice("ngram", 3, "ngram2") if self.calls == 1 else Choice(None, 0)

    def observe(self, token: int, branched: bool = False) -> bool:
        return self.guess_right

    def update(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("right", [True, False])
def test_a_right_guess_keeps_the_draft_it_read_the_pending_token_for(target: LoadedModel,
                                                                     right: bool) -> None:
    """Drafting from pending logits first commits the pending token (a TARGET step). If
    prompt lookup guessed that token right, the next pass verifies its continuation without
    asking the policy again; if wrong, the next step drafts nothing."""
    model = target.model
    vocab = model.args.vocab_size
    context = [*range(vocab), *range(vocab)]  # every token has occurred: lookup always matches
    caches = make_caches(model.n_layers)
    *_, (_, logits) = prefill(model, context, caches, 512)
    policy = ScriptedPolicy(right)
    steps = speculative_steps(model, caches, context, logits, SamplingParams(), "coupled",
                              {"ngram": NgramDrafter(min_n=1)}, policy)
    first, second = next(steps), next(steps)
    assert first.kinds == [TokenKind.TARGET] and first.n_drafted == 0
    assert (second.n_drafted > 0) == right and second.k == (3 if right else 0)
    assert policy.calls == 1  # the second step's choice was carried from the first
    # verified: the caches stop before the newest token; a plain step has fed it too
    assert cache_length(caches) == len(context) - (1 if right else 0)


class PlainPolicy:
    """Plain steps only, recording the step timings the loop reports."""

    costs = None

    def __init__(self) -> None:
        self.memory = PolicyMemory()
        self.timings: list[float | None] = []

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        return Choice(None, 0)

    def observe(self, token: int, branched: bool = False) -> None:
        return None

    def update(self, choice: Choice, n_drafted: int, n_accepted: int,
               seconds: float | None = None, width: int | None = None,
               step_seconds: float | None = None, n_tokens: int = 0) -> None:
        self.timings.append(step_seconds)


@pytest.mark.parametrize("pause", [True, False])
def test_a_plain_step_after_the_consumer_paused_the_loop_is_not_timed(
        target: LoadedModel, pause: bool) -> None:
    """`understudy bench` runs another reply's turn between two steps and waits for every
    queued pass: the next plain step then only reads a finished pass, and timed, that ~1 ms
    would price a 1-token pass far too low. So a plain step is timed only when the step
    before it handed over promptly (and never the first: prefill's logits are ready)."""
    model = target.model
    context = list(range(12))
    caches = make_caches(model.n_layers)
    *_, (_, logits) = prefill(model, context, caches, 512)
    policy = PlainPolicy()
    steps = speculative_steps(model, caches, context, logits, SamplingParams(), "coupled",
                              {}, policy)
    for _ in range(6):
        next(steps)
        if pause:
            mx.synchronize()
            threading.Event().wait(0.05)  # longer than PAUSE_FALLBACK_S
    assert policy.timings[0] is None
    if pause:
        assert policy.timings == [None] * 6
    else:  # negative control: handed over at once, so every later step is timed
        assert all(t is not None and t > 0 for t in policy.timings[1:])


class CatchingUp(NgramDrafter):
    """Prompt lookup standing in for a head: bringing its state up to the context costs one
    virtual second a position it has not seen."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(min_n=1)
        self.clock, self.seen = clock, 0

    def commit(self, context: Sequence[int]) -> None:
        self.clock.now += max(len(context) - self.seen, 0)
        self.seen = len(context)


class DraftAfterPlainPolicy:
    """Plain steps, then prompt lookup twice; records what `update` is told."""

    costs = None

    def __init__(self, plain: int) -> None:
        self.memory = PolicyMemory()
        self.plain, self.calls = plain, 0
        self.drafted: list[tuple[float | None, float, int]] = []

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        self.calls += 1
        return Choice("ngram", 2, "ngram2") if self.calls > self.plain else Choice(None, 0)

    def observe(self, token: int, branched: bool = False) -> bool:
        return True

    def update(self, choice: Choice, n_drafted: int, n_accepted: int,
               seconds: float | None = None, width: int | None = None,
               step_seconds: float | None = None, n_tokens: int = 0,
               catchup_s: float = 0.0) -> None:
        if choice.drafter is not None:
            self.drafted.append((step_seconds, catchup_s, n_tokens))


def test_a_drafters_catch_up_after_sitting_out_is_timed_apart_from_its_step(
        target: LoadedModel) -> None:
    """A drafter that sat out plain steps first runs over every position they committed:
    that is reported as `catchup_s`, not in the step's seconds. The step's own seconds keep
    its commit after the pass (its accepted tokens), and the next step, caught up, reports
    no catch-up (the negative control)."""
    model = target.model
    vocab = model.args.vocab_size

    def drafted_after_plain_steps() -> list[tuple[float | None, float, int]]:
        context = [*range(vocab), *range(vocab)]  # every token has occurred: lookup matches
        caches = make_caches(model.n_layers)
        *_, (_, logits) = prefill(model, context, caches, 512)
        clock = Clock()
        drafter = CatchingUp(clock)
        drafter.seen = len(context)
        policy = DraftAfterPlainPolicy(plain=5)
        steps = speculative_steps(model, caches, context, logits, SamplingParams(),
                                  "coupled", {"ngram": drafter}, policy, tree="off",
                                  clock=clock)
        while len(policy.drafted) < 2:
            next(steps)
        return policy.drafted

    drafted_after_plain_steps()  # a pass that builds a kernel is not timed: build them
    (first_s, first_catchup, first_tokens), (second_s, second_catchup, second_tokens) = \
        drafted_after_plain_steps()
    assert first_catchup >= 5  # the plain steps' tokens, and the pending one
    assert first_s == first_tokens  # its own commit only: one second a committed token
    assert second_catchup == 0
    assert second_s == second_tokens


class AlwaysDrafts:
    """A model drafter's stand-in: drafts token 0 at every step."""

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        return Draft((0,))

    def commit(self, context: Sequence[int]) -> None:
        return None


class ModelDraftPolicy:
    """Always drafts with a model drafter ("head"); records each free check of lookup's
    guess: (context length, committed token, whether lookup's tree held it)."""

    costs = None

    def __init__(self) -> None:
        self.memory = PolicyMemory()
        self.context: Sequence[int] = ()
        self.checks: list[tuple[int, int, bool]] = []

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        self.context = context
        return Choice("head", 2, "head")

    def observe(self, token: int, branched: bool = False) -> bool:
        self.checks.append((len(self.context), token, branched))
        return False

    def update(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("tree", ["auto", "off"])
def test_lookups_guess_is_judged_by_its_tree_where_a_model_drafted(target: LoadedModel,
                                                                   tree: str) -> None:
    """Where another drafter's step commits the token after a lookup match, lookup's
    estimate is told whether its tree's first layer held that token, as on a plain step.
    Judged by the chain's guess alone, a head drafting after two-token matches on code
    edits drove lookup's estimate there from 10% to 4%, so lookup stopped drafting there
    (where its tree was right ~80% of the time). With trees off only the chain counts (the
    negative control: the same steps, never credited to the tree)."""
    model = target.model
    rng = np.random.default_rng(11)
    context = [int(t) for t in rng.integers(0, 12, size=120)]  # many repeats
    caches = make_caches(model.n_layers)
    *_, (_, logits) = prefill(model, context, caches, 512)
    policy = ModelDraftPolicy()
    sampling = SamplingParams(temperature=1.0, seed=1)  # a varied reply, with repeats
    steps = speculative_steps(model, caches, context, logits, sampling, "coupled",
                              {"ngram": NgramDrafter(min_n=1), "head": AlwaysDrafts()},
                              policy, tree=tree)
    for _ in range(16):
        next(steps)
    assert len(policy.checks) == 16  # one free check a step (the first: a pending token)
    held = [NgramDrafter(min_n=1).continued_with(context[:n], token)
            for n, token, _ in policy.checks]
    assert sum(held) >= 3  # the case at stake came up
    if tree == "auto":
        assert [branched for *_, branched in policy.checks] == held
    else:
        assert not any(branched for *_, branched in policy.checks)
