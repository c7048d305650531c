"""Tokenizer: chat templates in the sandbox, stop ids, streaming detokenizer, demo vocab."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelFormatError, PromptError, TemplateError
from engine.tokenizer import StreamingDetokenizer, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HELLO = [{"role": "user", "content": "Hi there"}]


def write_folder(path: Path, *, template: Any = CHAT, tok_config: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None,
                 gen_config: dict[str, Any] | None = None) -> Path:
    """A model folder's tokenizer files: byte-level BPE over all 256 bytes, a few merges."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                 [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    tc = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", **(tok_config or {})}
    if template is not None:
        tc["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    for name, data in (("config.json", config), ("generation_config.json", gen_config)):
        if data is not None:
            (path / name).write_text(json.dumps(data))
    return path


def load(tmp_path: Path, **kwargs: Any) -> Tokenizer:
    return Tokenizer.from_folder(write_folder(tmp_path / "m", **kwargs))


# ------------------------------------------------------------------------- chat templates


def test_renders_template_with_and_without_generation_prompt(tmp_path: Path) -> None:
    tok = load(tmp_path)
    assert tok.apply_chat_template(HELLO) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(HELLO, add_generation_prompt=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n")
    assert tok.template_warning is None
    ids = tok.encode_chat(HELLO)
    assert ids[0] == 1 and ids.count(1) == 2  # two <|im_start|>, nothing prepended
    assert tok.decode(ids) == tok.apply_chat_template(HELLO)


def test_continue_final_stops_inside_the_last_message(tmp_path: Path) -> None:
    """A reply cut short is continued: the prompt ends right after its text, without the
    end of turn, and a trailing newline a trimming template drops is put back."""
    cut = [*HELLO, {"role": "assistant", "content": "The answer is\n"}]
    tok = load(tmp_path)
    assert tok.decode(tok.encode_chat(cut, continue_final=True)) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nThe answer is\n")
    trimming = CHAT.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    tok = load(tmp_path / "trim", template=trimming)
    assert tok.apply_chat_template(cut, False).endswith("The answer is<|im_end|>\n")
    assert tok.decode(tok.encode_chat(cut, continue_final=True)).endswith(
        "<|im_start|>assistant\nThe answer is\n")
    # nothing to continue from: an empty reply, or a template that never shows it
    with pytest.raises(PromptError, match="cannot continue"):
        tok.encode_chat([*HELLO, {"role": "assistant", "content": " "}], continue_final=True)
    hidden = load(tmp_path / "hidden", template="{{ messages[0]['content'] }}")
    with pytest.raises(PromptError, match="cannot continue"):
        hidden.encode_chat(cut, continue_final=True)


def test_trim_blocks_like_hf(tmp_path: Path) -> None:
    template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n"
                "[{{ m['content'] }}]\n    {% endif %}\n{% endfor %}")
    assert load(tmp_path, template=template).apply_chat_template(HELLO) == "[Hi there]\n"


@pytest.mark.parametrize(("add_bos", "template", "first_ids"), [
    (True, "{{ bos_token }}" + CHAT, [0, 1]),  # template renders BOS: not added again
    (True, CHAT, [0, 1]),                      # template lacks it: added once
    (False, CHAT, [1]),                        # not wanted: nothing added
])
def test_encode_chat_never_doubles_bos(tmp_path: Path, add_bos: bool, template: str,
                                       first_ids: list[int]) -> None:
    tok = load(tmp_path, template=template,
               tok_config={"add_bos_token": add_bos, "bos_token": "<|endoftext|>"})
    ids = tok.encode_chat(HELLO)
    assert tok.bos_token_id == 0
    assert ids[:len(first_ids)] == first_ids
    assert ids.count(0) == (1 if add_bos else 0)
    # counting the prompt (fitting a long chat to the window) adds BOS by the same rule
    assert tok.count_chat(HELLO) == len(ids)
    assert tok.count_chat(HELLO, continue_final=True) == len(
        tok.encode_chat(HELLO, continue_final=True))


def test_no_bos_prepended_without_add_bos(tmp_path: Path) -> None:
    tok = load(tmp_path, tok_config={"add_bos_token": False, "bos_token": "<|endoftext|>"})
    assert 0 not in tok.encode_chat(HELLO)
    assert tok.encode("the", add_special_tokens=True) == tok.encode("the")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages[0].__class__.__subclasses__() }}",
    "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}",
    "{{ 'a' * 100000000 }}",
    "{{ 9 ** 9999999 }}",
])
def test_sandbox_escapes_are_refused(tmp_path: Path, template: str) -> None:
    tok = load(tmp_path, template=template)
    with pytest.raises(TemplateError, match="sandbox"):
        tok.apply_chat_template(HELLO)


def test_escape_payload_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    template = ("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
                "{{ joiner.__init__.__globals__['__builtins__']['open']('" + str(marker)
                + "', 'w') }}")
    with pytest.raises(TemplateError):
        load(tmp_path, template=template).apply_chat_template(HELLO)
    assert not marker.exists()


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"


@pytest.mark.parametrize("body", ["", "{% set x = i * j %}"])
def test_a_template_that_never_ends_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               body: str) -> None:
    """10^10 iterations writing nothing: stopped in its own thread, which then runs on."""
    monkeypatch.setattr("engine.render_budget.RENDER_SECONDS", 0.5)
    tok = load(tmp_path, template=NESTED.replace("BODY", body))
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=r"ran for more than 0.5 s"):
        tok.apply_chat_template(HELLO)
    assert time.monotonic() - t0 < 3
    ok = load(tmp_path / "ok")
    for _ in range(50):  # nothing scheduled for this thread is left to land later
        assert ok.apply_chat_template(HELLO).startswith("<|im_start|>user")
        time.sleep(0.01)


def test_a_template_that_writes_without_end_is_stopped(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.render_budget.MAX_RENDER_CHARS", 200_000)
    tok = load(tmp_path, template=NESTED.replace("BODY", "{{ 'x' * 1000 }}"))
    with pytest.raises(TemplateError, match="output passed 200,000 characters"):
        tok.apply_chat_template(HELLO)


MISTRAL_V02 = (  # Mistral-7B-Instruct-v0.2's template: strict turns, no system role
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")


def test_a_system_prompt_goes_into_the_first_user_turn_where_the_template_refuses_it(
        tmp_path: Path) -> None:
    tok = load(tmp_path, template=MISTRAL_V02)
    chat = [{"role": "system", "content": "Be brief."}, *HELLO,
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(chat) == (
        "<|im_start|>[INST] Be brief.\n\nHi there [/INST]Hello!<|im_end|>[INST] Bye [/INST]")
    assert tok.apply_chat_template(chat[1:]) == (
        "<|im_start|>[INST] Hi there [/INST]Hello!<|im_end|>[INST] Bye [/INST]")
    # a refusal that folding does not cure is the template's own message, as written
    two_users = [{"role": "system", "content": "Be brief."}, *HELLO, *HELLO]
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.apply_chat_template(two_users)
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "system", "content": "Be brief."}])


@pytest.mark.parametrize(("template", "name"), [
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 10.0 ** 999 }}", "OverflowError"),
])
def test_whatever_a_template_raises_is_a_template_error(tmp_path: Path, template: str,
                                                        name: str) -> None:
    """These reached the user as a traceback (the CLI) or a crash report (the app)."""
    with pytest.raises(TemplateError, match=f"^chat template failed: {name}: "):
        load(tmp_path, template=template).apply_chat_template(HELLO)


def test_raise_exception_reports_the_templates_message(tmp_path: Path) -> None:
    template = ("{% if messages[0]['role'] != 'system' %}"
                "{{ raise_exception('Conversations must start with a system message') }}"
                "{% endif %}")
    with pytest.raises(TemplateError, match="must start with a system message"):
        load(tmp_path, template=template).apply_chat_template(HELLO)


def test_helpers_tojson_and_strftime_now(tmp_path: Path) -> None:
    template = ("{{ {'tool': '<b>é</b>', 'n': [1, 2]} | tojson }}|"
                "{{ messages | tojson(indent=1) | length > 10 }}|{{ strftime_now('%Y') }}")
    out = load(tmp_path, template=template).apply_chat_template(HELLO)
    assert out == f'{{"tool": "<b>é</b>", "n": [1, 2]}}|True|{datetime.now().year}'


def test_template_variables_and_extra_kwargs(tmp_path: Path) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}"
    out = load(tmp_path, template=template).apply_chat_template(HELLO, enable_thinking=False)
    assert out == "<|im_start|>|<|im_end|>|False"


def test_named_templates_pick_default_and_jinja_file_wins(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    assert load(tmp_path / "a", template=named).apply_chat_template(HELLO) == "PLAIN"
    folder = write_folder(tmp_path / "b")
    (folder / "chat_template.jinja").write_text("FROM FILE {{ messages | length }}")
    assert Tokenizer.from_folder(folder).apply_chat_template(HELLO) == "FROM FILE 1"


def test_missing_template_falls_back_to_chatml_with_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no chat template; using ChatML"):
        tok = load(tmp_path, template=None, tok_config={"eos_token": "<|endoftext|>"})
    assert tok.template_warning is not None and "ChatML" in tok.template_warning
    assert tok.apply_chat_template(HELLO) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_ids == {0, 2}  # its own eos, and the end of a ChatML turn


def test_chatml_fallback_stops_at_the_written_marker_where_the_vocabulary_lacks_it(
        tmp_path: Path) -> None:
    """A base model without ChatML's tokens writes "<|im_end|>" out as text when its turn
    ends; that text stops the reply as the token would, instead of the model going on to
    write the user's next turn."""
    folder = tmp_path / "base"
    folder.mkdir()
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    with pytest.warns(UserWarning, match="no chat template"):
        base = Tokenizer.from_folder(folder)
    assert base.stop_strings == ("<|im_end|>",) and base.eos_token_ids == frozenset()
    with pytest.warns(UserWarning, match="no chat template"):
        chatml = load(tmp_path, template=None)
    assert chatml.stop_strings == () and 2 in chatml.eos_token_ids
    assert load(tmp_path / "t").stop_strings == ()


def test_syntax_error_is_reported_at_load(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="syntax error"):
        load(tmp_path, template="{% for m in messages %}{{ m['content'] }")


def test_bad_messages_are_prompt_errors(tmp_path: Path) -> None:
    tok = load(tmp_path)
    with pytest.raises(PromptError):
        tok.apply_chat_template([])
    with pytest.raises(PromptError, match=r"messages\[1\]"):
        tok.apply_chat_template([*HELLO, {"role": "user", "content": None}])


# ------------------------------------------------------------------------------ folders


def test_eos_ids_are_the_union_of_every_source(tmp_path: Path) -> None:
    tok = load(tmp_path, config={"eos_token_id": [0, 5], "bos_token_id": 1},
               gen_config={"eos_token_id": 7})
    assert tok.eos_token_ids == frozenset({0, 2, 5, 7})
    assert tok.bos_token_id == 1
    tok = load(tmp_path / "x", config={"eos_token_id": 9}, gen_config={"eos_token_id": [9, 4]})
    assert tok.eos_token_ids == frozenset({2, 4, 9})


def test_special_tokens_as_dicts(tmp_path: Path) -> None:
    tok = load(tmp_path, tok_config={"eos_token": {"content": "<|endoftext|>", "special": True}})
    assert tok.eos_token_ids == {0}


def test_folder_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "empty")
    folder = write_folder(tmp_path / "bad")
    (folder / "tokenizer_config.json").write_text("{ not json")
    with pytest.raises(ModelFormatError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelFormatError, match="tokenizer.json: cannot be read"):
        Tokenizer.from_folder(folder)


def test_text_round_trip_and_specials(tmp_path: Path) -> None:
    tok = load(tmp_path)
    for text in ["the cat", "héllo wörld", "日本語", "🙂👨‍👩‍👧", "x = {'a': [1, 2]}\n\tpass"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode(" the") == [261]  # merged all the way to "Ġthe"
    assert tok.vocab_size == 262
    assert tok.token_text(2) == "<|im_end|>"


# ------------------------------------------------------------------ streaming detokenizer


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    d = tok.detokenizer()
    return [d.add(i) for i in ids] + [d.flush()]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(write_folder(tmp_path_factory.mktemp("bytes") / "m"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(0, 261), max_size=40))
def test_stream_equals_full_decode_for_any_ids(byte_tokenizer: Tokenizer, ids: list[int]) -> None:
    """Any id sequence, including invalid UTF-8 byte runs and special tokens (left out)."""
    assert "".join(stream(byte_tokenizer, ids)) == byte_tokenizer.decode(
        ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)),
                    max_size=30))
def test_stream_never_splits_a_character(byte_tokenizer: Tokenizer, text: str) -> None:
    ids = byte_tokenizer.encode(text)
    pieces = stream(byte_tokenizer, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_leaves_special_tokens_out(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("the<|im_start|>user\n<|im_end|>é")
    assert 1 in ids and 2 in ids  # <|im_start|>, <|im_end|>
    assert "".join(stream(byte_tokenizer, ids)) == "theuser\né"
    assert byte_tokenizer.token_text(1) == "<|im_start|>"  # a drafted token still shows


def test_stream_holds_partial_characters_back(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("a😀b")  # 😀 is 4 byte tokens
    assert len(ids) == 6
    assert stream(byte_tokenizer, ids) == ["a", "", "", "", "😀", "b", ""]
    d = byte_tokenizer.detokenizer()
    assert [d.add(i) for i in ids[:3]] == ["a", "", ""]
    assert d.flush() == "\ufffd"  # a reply cut mid-character shows that it was cut


def test_a_fork_decodes_a_rejected_branch_on_from_the_reply(byte_tokenizer: Tokenizer) -> None:
    """A draft branch that differs from the reply inside a character (🦊 and 🐺 share
    their first two bytes) reads as its own character, special tokens shown; the reply's
    detokenizer goes on as if the branch had never been decoded."""
    fox, wolf = byte_tokenizer.encode("🦊"), byte_tokenizer.encode("🐺<|im_start|>")
    assert fox[:2] == wolf[:2] and len(fox) == 4
    reply = byte_tokenizer.detokenizer()
    assert [reply.add(i) for i in fox[:2]] == ["", ""]
    branch = reply.fork(byte_tokenizer.decode)
    assert [branch.add(i) for i in wolf[2:]] == ["", "🐺", "<|im_start|>"]
    assert [reply.add(i) for i in fox[2:]] == ["", "🦊"]


def test_stream_decodes_a_bounded_window() -> None:
    """Each step decodes a handful of ids, however long the reply (O(1) per token)."""
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids)

    d = StreamingDetokenizer(decode)
    out = "".join(d.add(i) for i in range(5000)) + d.flush()
    assert out == decode(list(range(5000)))
    assert max(seen[:-1]) <= 2


# ----------------------------------------------------------------------- the demo model


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(demo_model_dir)


@pytest.fixture(scope="module")
def oracle(demo_gguf_path: Path) -> Any:
    """transformers' own GGUF tokenizer builder (it needs no torch for this part), with the
    pre-tokenizer SmolLM2's published tokenizer.json declares: the builder does not know the
    GGUF's "smollm" pre-type and splits with ByteLevel alone, so it keeps a space joined to
    a non-ASCII numeral (" ²") that SmolLM2's own tokenizer and llama.cpp split off."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    import mlx.core as mx
    from tokenizers import pre_tokenizers

    _, meta = mx.load(str(demo_gguf_path), return_metadata=True)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    backend, _ = mapping.convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": meta["tokenizer.ggml.pre"],
        "tokens": meta["tokenizer.ggml.tokens"], "merges": meta["tokenizer.ggml.merges"],
        "token_type": meta["tokenizer.ggml.token_type"].tolist()})
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return backend


@pytest.mark.slow
def test_demo_digits_are_one_token_each(demo_tokenizer: Tokenizer) -> None:
    """SmolLM2 splits numbers digit by digit (its HF tokenizer's Digits pre-tokenizer)."""
    for number in ["2024", "3.14159", "1000000"]:
        ids = demo_tokenizer.encode(number)
        assert [demo_tokenizer.token_text(i) for i in ids] == list(number)
    ids = demo_tokenizer.encode("in 1999 there")
    assert [demo_tokenizer.token_text(i) for i in ids] == ["in", " ", "1", "9", "9", "9", " there"]


@pytest.mark.slow
def test_demo_round_trips_code_and_unicode(demo_tokenizer: Tokenizer) -> None:
    for text in ["def f(x):\n    return {'k': x ** 2}  # ok\n",
                 "Café, naïve, São Paulo, Zürich", "日本語のテキスト、中文", "emoji 🙂🚀👨‍👩‍👧 done",
                 "  leading and trailing  ", "tabs\tand\r\nnewlines"]:
        ids = demo_tokenizer.encode(text)
        assert demo_tokenizer.decode(ids) == text
        assert "".join(stream(demo_tokenizer, ids)) == text


@pytest.mark.slow
def test_demo_special_tokens_are_single_ids(demo_tokenizer: Tokenizer) -> None:
    assert demo_tokenizer.encode("<|endoftext|>") == [0]
    assert demo_tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert demo_tokenizer.encode("<|im_end|>") == [2]
    assert demo_tokenizer.eos_token_ids == {2}
    assert demo_tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_demo_chat_prompt(demo_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = demo_tokenizer.apply_chat_template(messages)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = demo_tokenizer.encode_chat(messages)
    assert ids.count(1) == 3 and ids[0] == 1  # three <|im_start|>, no extra BOS
    assert demo_tokenizer.decode(ids) == text


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
@example(text=" ²")  # a space before a non-ASCII numeral: found by a random draw in CI
@example(text="x ³ in 1999, ½")
def test_demo_ids_match_transformers(demo_tokenizer: Tokenizer, oracle: Any, text: str) -> None:
    assert demo_tokenizer.encode(text) == oracle.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.one_of(st.integers(0, 49151),
                              st.sampled_from([40993, 179, 120, 248, 15107, 235, 241, 115])),
                    max_size=30))
def test_demo_stream_equals_full_decode(demo_tokenizer: Tokenizer, ids: list[int]) -> None:
    assert "".join(stream(demo_tokenizer, ids)) == demo_tokenizer.decode(
        ids, skip_special_tokens=True)
