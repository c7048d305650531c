"""The decode loop (plain decoding): events, stopping rules, cancel, prefill, stats, errors.

Two kinds of tiny model: a random one (any text; exercises sampling) and a *chain* model
whose weights are built so that greedy decoding follows a fixed script of tokens. The
script makes exact assertions possible: stop strings that span tokens, an emoji split over
four byte tokens, eos ids taken from config.json or generation_config.json.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.errors import EngineError, PromptError
from engine.events import Finished, PromptProgress, Step, TokenKind
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from tests.fixtures.tiny_models import special_token_id, write_tiny_model

CHAIN_TEXT = "Hé🦊 fox!"  # é is 2 byte tokens, 🦊 4: no token repeats, so a chain can spell it
IM_END = special_token_id("<|im_end|>")  # eos in config.json and generation_config.json
ENDOFTEXT = special_token_id("<|endoftext|>")  # eos in generation_config.json only
USER = [{"role": "user", "content": "Tell me something."}]


def write_chain_model(dest: Path, text: str = CHAIN_TEXT, end: int | None = IM_END) -> Path:
    """A tiny llama folder whose greedy reply to any ChatML prompt is `text`, then `end`.

    Each block's output projections are zero, so the residual stream at a position is just
    the current token's embedding, and the (untied) lm_head maps token a's normalised
    embedding onto its successor b. Random 64-dim embeddings are nearly orthogonal, so b
    wins by a wide margin. The chain starts at the prompt's last token ("\\n" after
    "assistant"), so the tokens of `text` must all differ (`end=None`: no end token).
    """
    dest = write_tiny_model(dest, tie=False, num_hidden_layers=1)
    tok = Tokenizer.from_folder(dest)
    start = tok.encode_chat(USER)[-1]
    chain = [start, *tok.encode(text)] + ([end] if end is not None else [])
    successor = dict(zip(chain, chain[1:], strict=False))
    if len(successor) != len(chain) - 1:
        raise ValueError(f"{text!r}: a token repeats, a chain cannot spell it")
    weights = dict(mx.load(str(dest / "model.safetensors")))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(w)
        elif name.endswith("norm.weight"):
            weights[name] = mx.ones_like(w)
    emb = np.array(weights["model.embed_tokens.weight"])
    unit = emb / np.sqrt((emb**2).mean(-1, keepdims=True) + 1e-5)  # what the final norm gives
    head = np.zeros_like(emb)
    for a, b in successor.items():
        head[b] += unit[a] * (50.0 / emb.shape[1])
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def run(session: ChatSession, options: GenerateOptions, messages: Sequence[dict] = USER,
        cancel: threading.Event | None = None) -> tuple[list, list[Step], Finished]:
    events = list(session.generate(messages, options, cancel))
    assert isinstance(events[-1], Finished)
    assert all(not isinstance(e, Finished) for e in events[:-1])
    return events, [e for e in events if isinstance(e, Step)], events[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("decode") / "tiny"))


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_chain_model(tmp_path_factory.mktemp("decode") / "chain"))


# ------------------------------------------------------------------------------ events


def test_plain_decoding_one_target_token_per_step(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    _, steps, fin = run(session, GenerateOptions(max_tokens=12))
    assert len(steps) == 12
    for s in steps:
        assert len(s.tokens) == 1 and s.tokens[0].kind is TokenKind.TARGET
        assert 0.0 < s.tokens[0].prob <= 1.0  # greedy: a one-hot distribution
        assert (s.n_drafted, s.n_accepted, s.k, s.drafter) == (0, 0, 0, "none")
        assert s.verify_s > 0
    assert fin.token_ids == tuple(s.tokens[0].id for s in steps)
    assert fin.text == "".join(s.text for s in steps)
    st = fin.stats
    assert (st.finish_reason, st.generated_tokens, st.target_passes, st.tau) == (
        "length", 12, 12, 1.0)
    assert session.stats == st


def test_max_tokens_is_exact(tiny: LoadedModel) -> None:
    for n in (1, 5):
        _, steps, fin = run(ChatSession(tiny), GenerateOptions(max_tokens=n))
        assert len(steps) == len(fin.token_ids) == fin.stats.generated_tokens == n
        assert fin.stats.finish_reason == "length"


def test_chain_model_streams_whole_characters(chain: LoadedModel) -> None:
    """Bytes of é and 🦊 arrive in separate tokens; text only ever shows whole characters."""
    _, steps, fin = run(ChatSession(chain), GenerateOptions(max_tokens=50))
    texts = [s.text for s in steps if s.tokens]
    assert texts == ["H", "", "é", "", "", "", "🦊", " ", "f", "o", "x", "!"]
    assert fin.text == CHAIN_TEXT == "".join(s.text for s in steps)
    assert fin.token_ids == tuple(chain.tokenizer.encode(CHAIN_TEXT))
    assert fin.stats.finish_reason == "eos" and fin.stats.generated_tokens == 12
    assert all(t.kind is TokenKind.TARGET for s in steps for t in s.tokens)


def test_streamed_text_has_no_replacement_chars(tiny: LoadedModel, chain: LoadedModel) -> None:
    """Valid UTF-8 never shows U+FFFD mid-stream (the random model, whose bytes may be
    invalid, must still agree with its own Finished text)."""
    _, steps, fin = run(ChatSession(chain), GenerateOptions())
    assert not any("\ufffd" in s.text for s in steps)
    for seed in range(3):
        opts = GenerateOptions(max_tokens=16, sampling=SamplingParams(temperature=1.0, seed=seed))
        _, steps, fin = run(ChatSession(tiny), opts)
        assert fin.text == "".join(s.text for s in steps)


def test_special_tokens_that_do_not_stop_are_left_out_of_the_text(tmp_path: Path) -> None:
    """A control token the model writes (not an eos id) is markup: the reply's text, streamed
    and whole, leaves it out, so it never shows nor comes back as a control token in the
    next turn's prompt; the step still carries the token."""
    start = special_token_id("<|im_start|>")
    path = write_chain_model(tmp_path / "m", "Hé<|im_start|>fox")
    _, steps, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=20))
    assert (fin.text, fin.stats.finish_reason) == ("Héfox", "eos")
    assert "".join(s.text for s in steps) == "Héfox"
    assert start in fin.token_ids
    assert [t.text for s in steps for t in s.tokens if t.id == start] == [""]


def test_the_tokenizers_stop_strings_end_the_reply(tmp_path: Path) -> None:
    """What a tokenizer says ends a turn in text (the ChatML fallback's "<|im_end|>" for a
    vocabulary without that token) stops the reply as a user's stop string does."""
    model = load_model(write_chain_model(tmp_path / "m"))
    model.tokenizer.stop_strings = ("🦊",)
    _, steps, fin = run(ChatSession(model), GenerateOptions(max_tokens=50))
    assert (fin.text, fin.stats.finish_reason) == ("Hé", "stop")
    assert "".join(s.text for s in steps) == "Hé"
    _, _, fin = run(ChatSession(model), GenerateOptions(max_tokens=50, stop=("x",)))
    assert (fin.text, fin.stats.finish_reason) == ("Hé", "stop")


# ---------------------------------------------------------------------------- stopping


def test_every_eos_id_stops(tmp_path: Path) -> None:
    """eos ids from config.json and from generation_config.json both end the reply."""
    path = write_chain_model(tmp_path / "m", "Hi", end=ENDOFTEXT)  # generation_config only
    _, _, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=20))
    assert (fin.text, fin.stats.finish_reason) == ("Hi", "eos")

    bang = Tokenizer.from_folder(path).encode("!")[0]
    path = write_chain_model(tmp_path / "c", "Hi!")  # "!" then <|im_end|>
    _, _, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=20))
    assert (fin.text, fin.stats.finish_reason) == ("Hi!", "eos")

    edit_json(path / "config.json", eos_token_id=bang)  # now "!" is an eos id as well
    _, _, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=20))
    assert (fin.text, fin.stats.finish_reason) == ("Hi", "eos")

    edit_json(path / "config.json", eos_token_id=IM_END)
    edit_json(path / "generation_config.json", eos_token_id=[bang])
    _, _, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=20))
    assert (fin.text, fin.stats.finish_reason) == ("Hi", "eos")
    assert bang not in fin.token_ids


@pytest.mark.parametrize(
    ("stop", "text"),
    [
        ("🦊 f", "Hé"),  # spans five tokens, starting mid-character
        ("ox", "Hé🦊 f"),
        ("é🦊", "H"),
        ("H", ""),
        ("fox!", "Hé🦊 "),
        ("cat", CHAIN_TEXT),  # never matches
        ("fix", CHAIN_TEXT),  # partial match "f" released when "o" arrives
    ],
)
def test_stop_strings(chain: LoadedModel, stop: str, text: str) -> None:
    _, steps, fin = run(ChatSession(chain), GenerateOptions(stop=(stop, "zzz")))
    assert fin.text == text == "".join(s.text for s in steps)
    assert fin.stats.finish_reason == ("eos" if text == CHAIN_TEXT else "stop")
    shown = ""
    for s in steps:  # what was shown is never taken back
        shown += s.text
        assert text.startswith(shown)


def test_text_held_for_a_stop_prefix_is_released_at_eos(chain: LoadedModel) -> None:
    """"!" might begin the stop "!?"; eos comes next, so "!" belongs to the reply."""
    _, steps, fin = run(ChatSession(chain), GenerateOptions(stop=("!?",)))
    assert fin.stats.finish_reason == "eos"
    assert fin.text == CHAIN_TEXT == "".join(s.text for s in steps)


def test_held_text_is_released_at_max_tokens(chain: LoadedModel) -> None:
    _, steps, fin = run(ChatSession(chain), GenerateOptions(max_tokens=9, stop=("fox?",)))
    assert fin.stats.finish_reason == "length"
    assert fin.text == "Hé🦊 f" == "".join(s.text for s in steps)


# ------------------------------------------------------------------------------ cancel


@pytest.mark.parametrize("after", [1, 3])
def test_cancel_between_steps(tiny: LoadedModel, after: int) -> None:
    session = ChatSession(tiny)
    cancel = threading.Event()
    steps: list[Step] = []
    fin = None
    for ev in session.generate(USER, GenerateOptions(max_tokens=100), cancel):
        if isinstance(ev, Step):
            steps.append(ev)
            if len(steps) == after:
                cancel.set()
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None and fin.stats.finish_reason == "cancelled"
    # the flag is read after each step: at most the step already under way completes
    assert after <= len(steps) <= after + 1
    assert len(fin.token_ids) == fin.stats.generated_tokens == len(steps)
    assert fin.text == "".join(s.text for s in steps)


def test_cancel_set_before_start(tiny: LoadedModel) -> None:
    cancel = threading.Event()
    cancel.set()
    _, steps, fin = run(ChatSession(tiny), GenerateOptions(max_tokens=100), cancel=cancel)
    assert fin.stats.finish_reason == "cancelled" and not steps


def test_cancel_while_the_prompt_is_read(tiny: LoadedModel) -> None:
    """Stop during a long paste ends the reply at the next chunk, not after the whole
    prompt; what was read stays cached, so sending it again reads only the rest."""
    ids = tiny.tokenizer.encode("Hello world! The quick brown fox.")[:13]
    session = ChatSession(tiny)
    cancel = threading.Event()
    events = []
    for ev in session.generate_ids(ids, GenerateOptions(max_tokens=4, prefill_chunk=4),
                                   cancel):
        events.append(ev)
        if isinstance(ev, PromptProgress) and ev.done == 8:
            cancel.set()
    assert [type(e).__name__ for e in events] == ["PromptProgress"] * 2 + ["Finished"]
    fin = events[-1]
    assert fin.stats.finish_reason == "cancelled" and fin.text == "" and not fin.token_ids
    assert fin.stats.prefilled_tokens == 8 and fin.stats.generated_tokens == 0
    again = list(session.generate_ids(ids, GenerateOptions(max_tokens=4, prefill_chunk=4)))
    assert again[-1].stats.prefilled_tokens == 13 - 8
    fresh = list(ChatSession(tiny).generate_ids(ids, GenerateOptions(max_tokens=4)))
    assert again[-1].token_ids == fresh[-1].token_ids and len(fresh[-1].token_ids) == 4


def test_cancel_from_another_thread(tiny: LoadedModel) -> None:
    """The GUI's Stop button: another thread sets the flag while the loop runs."""
    session = ChatSession(tiny)
    cancel = threading.Event()
    first_step = threading.Event()
    stopper = threading.Thread(target=lambda: first_step.wait(10) and cancel.set())
    stopper.start()
    n = 0
    for ev in session.generate(USER, GenerateOptions(max_tokens=1000), cancel):
        if isinstance(ev, Step):
            n += 1
            first_step.set()
            if n == 1:
                stopper.join()
    assert session.stats.finish_reason == "cancelled" and n <= 2


# ----------------------------------------------------------------------- prefill, stats


def test_prompt_prefilled_in_chunks_with_progress(tiny: LoadedModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tiny.tokenizer.encode("Hello world! The quick brown fox.")[:13]
    assert len(ids) == 13
    events = list(ChatSession(tiny).generate_ids(ids, GenerateOptions(max_tokens=4,
                                                                      prefill_chunk=4)))
    progress = [e for e in events if isinstance(e, PromptProgress)]
    assert progress == [PromptProgress(4, 13), PromptProgress(8, 13), PromptProgress(12, 13),
                        PromptProgress(13, 13)]
    first_step = next(i for i, e in enumerate(events) if isinstance(e, Step))
    assert all(isinstance(e, PromptProgress) for e in events[:first_step])
    whole = list(ChatSession(tiny).generate_ids(ids, GenerateOptions(max_tokens=4)))
    assert [e for e in whole if isinstance(e, PromptProgress)] == [PromptProgress(13, 13)]
    # progress is live: each event arrives as its chunk is done, not after the whole prompt
    session = ChatSession(tiny)
    stream = session.generate_ids(ids, GenerateOptions(max_tokens=4, prefill_chunk=4))
    seen = [(ev.done, session.cache_lengths()["target"]) for ev in itertools.islice(stream, 3)]
    assert seen == [(4, 4), (8, 8), (12, 12)]
    stream.close()
    assert whole[-1].token_ids == events[-1].token_ids  # chunking changes nothing
    # by default the rows per chunk follow the keys they attend to (engine.steps.chunk_rows;
    # as they do without the fused CPU attention, which reads every chunk in 256 rows)
    from kernels import host_attention

    monkeypatch.setattr(host_attention, "kernel", lambda: None)
    long_ids = (ids * 100)[:1200]
    session = ChatSession(tiny)
    done = [ev.done for ev in session.generate_ids(long_ids, GenerateOptions(max_tokens=1))
            if isinstance(ev, PromptProgress)]
    assert done == [256, 512, 768, 1024, 1152, 1200]


def test_stats(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    seen: list[int] = []
    for ev in session.generate(USER, GenerateOptions(max_tokens=6)):
        if isinstance(ev, Step):
            seen.append(session.stats.generated_tokens)  # a snapshot after every step
            assert session.stats.finish_reason in (None, "length")
        elif isinstance(ev, Finished):
            st = ev.stats
    assert seen == [1, 2, 3, 4, 5, 6]
    n_prompt = len(tiny.tokenizer.encode_chat(USER))
    assert st.prompt_tokens == st.prefilled_tokens == n_prompt
    assert st.prompt_s > 0 and st.prompt_tps > 0
    assert st.decode_s > 0 and st.decode_tps > 0
    assert st.peak_memory_bytes > 0
    d = st.as_dict()
    assert d["prompt_tps"] == st.prompt_tps and d["generated_tokens"] == 6


def test_sampling_seed(tiny: LoadedModel) -> None:
    def text(seed: int, temperature: float = 1.0) -> tuple[int, ...]:
        opts = GenerateOptions(max_tokens=12,
                               sampling=SamplingParams(temperature=temperature, seed=seed))
        return run(ChatSession(tiny), opts)[2].token_ids

    assert text(1) == text(1)
    assert len({text(1), text(2), text(3)}) > 1
    assert text(1, 0.0) == text(2, 0.0)  # greedy ignores the seed


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("messages", [[], [{"role": "user", "content": "   "}]])
def test_empty_prompt(tiny: LoadedModel, messages: list[dict]) -> None:
    with pytest.raises(PromptError, match="empty"):
        ChatSession(tiny).generate(messages)  # raised at the call, before iterating


def test_empty_prompt_ids(tiny: LoadedModel) -> None:
    with pytest.raises(PromptError, match="empty"):
        ChatSession(tiny).generate_ids([])


def test_prompt_longer_than_context_window(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "short")
    edit_json(path / "config.json", max_position_embeddings=16)
    session = ChatSession(load_model(path))
    with pytest.raises(PromptError, match=r"max_position_embeddings\) is 16"):
        session.generate([{"role": "user", "content": "The quick brown fox jumps over it."}])
    with pytest.raises(PromptError, match="16"):
        session.generate_ids(list(range(3, 19)))
    assert run(session, GenerateOptions(max_tokens=2), [{"role": "user", "content": "Hi"}])


def test_reply_stops_at_the_context_window(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "short")
    edit_json(path / "config.json", max_position_embeddings=20)
    _, steps, fin = run(ChatSession(load_model(path)), GenerateOptions(max_tokens=100),
                        [{"role": "user", "content": "Hi"}])
    assert fin.stats.prompt_tokens + fin.stats.generated_tokens == 20
    assert fin.stats.finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"drafter": "magic"}, "drafter"),
        ({"accept": "sometimes"}, "accept"),
        ({"k": 0}, "k"),
        ({"k": 16}, "k must be from 1 to 15"),  # K_MAX: the longest draft the cost table prices
    ],
)
def test_bad_generate_options(kwargs: dict, field: str) -> None:
    with pytest.raises(EngineError, match=field):
        GenerateOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stop": "abc"}, "stop"),  # a bare string would stop on each of its letters
    ],
)
def test_unchecked_generate_options(kwargs: dict, field: str) -> None:
    with pytest.raises(EngineError, match=field):
        GenerateOptions(**kwargs)


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2},
                                    {"min_p": 2.0}, {"seed": -1}])
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(EngineError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_drafter_model_without_a_draft(tiny: LoadedModel) -> None:
    with pytest.raises(EngineError, match="draft"):
        ChatSession(tiny).generate(USER, GenerateOptions(drafter="model", k=2))
