"""Tokenizer: `tokenizers` for text <-> ids, jinja2 sandbox for chat templates.

Chat templates come with downloaded models, so they are untrusted code: they render in an
immutable sandbox where touching an unsafe attribute raises at once (jinja's default is to
return an undefined value and only fail later, if ever), within a time and output budget
(`render_budget`). Models without a template fall back
to ChatML with a visible warning rather than refusing to chat.

Generated text reaches the screen through `StreamingDetokenizer`, which never splits a
multi-byte character that arrives in several byte-level tokens.
"""

from __future__ import annotations

import json
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import AppWarning, ModelFormatError, PromptError, TemplateError
from engine.events import CUT_MARK, without_cut_mark
from engine.render_budget import render_bounded
from engine.token_count import TokenCounter, cut_tokens

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MAX_SEQUENCE = 1_000_000  # longest string/list a template may build with `*`
_MAX_EXPONENT = 1_000


class ChatTemplateWarning(AppWarning):
    """A model without a chat template is run with ChatML; front ends say so in one line."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, made loud and bounded.

    Unsafe attribute access raises immediately, and `*`/`**` refuse results large enough to
    exhaust memory, so a hostile template fails with a message instead of misbehaving.
    """

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(right, int | float) and abs(right) > _MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is too large")
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, str | list | tuple) and isinstance(n, int)
                        and len(seq) * n > _MAX_SEQUENCE):
                    raise SecurityError("repetition would build a value that is too large")
        return {"*": operator.mul, "**": operator.pow}[op](left, right)


class TemplateRefusal(TemplateError):
    """The template itself refused the conversation (its `raise_exception(...)`)."""


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(f"chat template: {message}")


def _fold_system(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with its system text put before the first user message's, or None
    where there is no system message or no user message to carry it."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    first_user = next((m for m in rest if m["role"] == "user"), None)
    if not system or first_user is None:
        return None
    first_user["content"] = "\n\n".join([*system, first_user["content"]])
    return rest


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Like HF's `tojson`: plain JSON, no HTML escaping (jinja's built-in escapes `<`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _make_environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class StreamingDetokenizer:
    """Turns ids arriving one at a time into text, never emitting half a character.

    Keeps a small window of ids: those already emitted as `prefix` context plus unread ones.
    Text is released only when the decoded window does not end in U+FFFD (an incomplete
    UTF-8 sequence); the window then slides forward, so each step decodes a few tokens no
    matter how long the reply is. The prefix keeps decoders that depend on the previous
    token (SentencePiece's leading space) right.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # the window: prefix ids, then unread ids
        self._n_prefix = 0  # how many of `_ids` are already-emitted context
        self._prefix_text = ""  # decode(_ids[:_n_prefix])

    def add(self, token_id: int) -> str:
        """Take one id; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(CUT_MARK):
            return ""
        new = text[len(self._prefix_text):]
        self._ids = self._ids[self._n_prefix:]  # last emitted ids become the new prefix
        self._n_prefix = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def fork(self, decode: Callable[[list[int]], str]) -> StreamingDetokenizer:
        """A copy that goes on from here with `decode`, this one left as it is: a rejected
        draft branch decoded after the text it hangs from, so a token that completes a
        character begun before it (by the reply, or by the branch) reads as that character,
        not as U+FFFD."""
        other = StreamingDetokenizer(decode)
        other._ids, other._n_prefix = list(self._ids), self._n_prefix
        other._prefix_text = decode(self._ids[:self._n_prefix])
        return other

    def flush(self) -> str:
        """Return whatever is still held back (even an incomplete character) and reset."""
        text = self._decode(self._ids)[len(self._prefix_text):] if self._ids else ""
        self._ids, self._n_prefix, self._prefix_text = [], 0, ""
        return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"{folder / 'tokenizer_config.json'}: chat_template is not text")
    return template or None


class Tokenizer:
    """Text <-> ids for one model folder, plus its chat template and stop ids."""

    def __init__(self, tokenizer: HFTokenizer, *, chat_template: str | None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 extra_eos_ids: Iterable[int] = (), bos_token_id: int | None = None,
                 add_bos_token: bool = False, special_tokens: dict[str, str] | None = None,
                 source: str = "model") -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.template_warning: str | None = None
        # text that ends a reply as an eos id would (see the ChatML fallback below)
        self.stop_strings: tuple[str, ...] = ()
        if bos_token_id is None and bos_token is not None:
            bos_token_id = tokenizer.token_to_id(bos_token)
        self.bos_token_id: int | None = bos_token_id
        eos = set(extra_eos_ids)
        if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            eos.add(tokenizer.token_to_id(eos_token))
        if chat_template is None:
            chat_template = CHATML_TEMPLATE
            self.template_warning = (
                f"{source} has no chat template; using ChatML, which this model may not "
                "have been trained on, so replies may be poor")
            warnings.warn(self.template_warning, ChatTemplateWarning, stacklevel=2)
            im_end = tokenizer.token_to_id("<|im_end|>")
            if im_end is not None:
                eos.add(im_end)
            else:  # a base model's vocabulary: it ends its turn by writing the marker out
                self.stop_strings = ("<|im_end|>",)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._template_vars = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template_vars.update(bos_token=bos_token or "", eos_token=eos_token or "")
        self._counter = TokenCounter(
            lambda text: self._tok.encode(text, add_special_tokens=False).ids,
            cut_tokens(tokenizer))
        try:
            self._template = _make_environment().from_string(chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{source}: chat template has a syntax error: {e}") from e

    @classmethod
    def from_folder(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the eos ids of a model folder.

        Every eos id in config.json and generation_config.json (int or list) stops
        generation, together with tokenizer_config.json's `eos_token`.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFormatError(
                f"{tok_file}: missing (only models with a fast tokenizer.json are supported)")
        try:
            tokenizer = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ModelFormatError(f"{tok_file}: cannot be read ({e})") from e
        tok_config = _read_json(path / "tokenizer_config.json")
        config = _read_json(path / "config.json")
        gen_config = _read_json(path / "generation_config.json")
        specials = {k: _token_content(tok_config.get(k))
                    for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = _ids(config.get("bos_token_id"))
        if specials["bos_token"] is not None:
            bos_id = _ids(tokenizer.token_to_id(specials["bos_token"])) or bos_id
        return cls(
            tokenizer,
            chat_template=_pick_template(path, tok_config),
            bos_token=specials["bos_token"],
            eos_token=specials["eos_token"],
            extra_eos_ids=_ids(config.get("eos_token_id")) + _ids(gen_config.get("eos_token_id")),
            bos_token_id=bos_id[0] if bos_id else None,
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            special_tokens={k: v for k, v in specials.items() if v is not None},
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids for `text`; special-token text (e.g. "<|im_start|>") maps to its single id."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            ids = self._with_bos(ids)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """What one token looks like on its own (U+FFFD for a lone partial character)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def detokenizer(self) -> StreamingDetokenizer:
        """The reply's text as it streams, without special tokens.

        A special (control) token the model writes but that does not stop it (ChatML's
        `<|im_start|>` from a model whose template is another, a Llama header id) is
        markup, not text: shown, it reads as garbage, and stored in the reply it would come
        back as that control token in the next turn's prompt, since special-token text in a
        message is encoded as the token itself. Servers and chat apps (vLLM, llama.cpp's
        server, transformers' pipelines) leave them out the same way."""
        return StreamingDetokenizer(
            lambda ids: self.decode(ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render the conversation with the model's template in the sandbox.

        Extra keyword arguments become template variables (e.g. `enable_thinking`). A
        template that refuses a system message (Mistral-7B-Instruct v0.1/v0.2 demand strict
        user/assistant turns, Gemma's says "System role not supported") gets the system
        text at the start of the first user message instead, as those models' authors
        advise and Mistral's later templates do themselves; if it still refuses, its own
        message is the error.
        """
        check_messages(messages)
        try:
            return self._render(messages, add_generation_prompt, variables)
        except TemplateRefusal as refusal:
            folded = _fold_system(messages)
            if folded is None:
                raise
            try:
                return self._render(folded, add_generation_prompt, variables)
            except TemplateError:  # the refusal of the conversation as the user wrote it
                raise refusal from None

    def _render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                variables: dict[str, Any]) -> str:
        try:
            return render_bounded(self._template, {
                **self._template_vars, **variables,
                "messages": messages, "add_generation_prompt": add_generation_prompt})
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(
                f"chat template tried to escape its sandbox and was stopped: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - the template is untrusted
            # code: whatever it raises (1/0, 10.0 ** 999, a macro calling itself) is its
            # failure, said in one line, never a traceback
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final: bool = False, **variables: Any) -> list[int]:
        """Prompt ids for a conversation; BOS added only if wanted and not already rendered.

        `continue_final`: the prompt stops right after the last message's text, without the
        template's end-of-turn, so the model goes on writing that message (a reply cut
        short by its token limit or by Stop).
        """
        text = self.chat_text(messages, add_generation_prompt, continue_final, **variables)
        return self._with_bos(self.encode(text, add_special_tokens=False))

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                   continue_final: bool = False, **variables: Any) -> int:
        """`len(encode_chat(...))`, tokenizing only the parts of the rendered text this
        tokenizer has not counted before (`engine.token_count`): fitting a long chat to the
        window measures the whole conversation every turn."""
        text = self.chat_text(messages, add_generation_prompt, continue_final, **variables)
        n, first = self._counter.count(text)
        return n + int(self._adds_bos(first))

    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                  continue_final: bool = False, **variables: Any) -> str:
        """The text `encode_chat` tokenizes (see there)."""
        if continue_final:
            return self._continued(messages, **variables)
        return self.apply_chat_template(messages, add_generation_prompt, **variables)

    def _continued(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The rendered conversation cut right after the last message's text.

        Templates may trim a message (`| trim`), so the text is found without its trailing
        whitespace, which is then put back: a reply cut after a newline goes on from there.
        """
        check_messages(messages)
        messages = [*messages[:-1], {**messages[-1],
                                     "content": without_cut_mark(messages[-1]["content"])}]
        rendered = self.apply_chat_template(messages, False, **variables)
        content = messages[-1]["content"]
        body = content.rstrip()
        at = rendered.rfind(body) if body else -1
        if at < 0:
            raise PromptError("cannot continue the last message: it is empty, or the chat "
                              "template does not show its text as written")
        return rendered[:at + len(body)] + content[len(body):]

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_token_id is not None and self._adds_bos(ids[0] if ids else None):
            return [self.bos_token_id, *ids]
        return ids

    def _adds_bos(self, first_id: int | None) -> bool:
        """Whether ids starting with `first_id` (None: no ids) get BOS put in front."""
        return (self.add_bos_token and self.bos_token_id is not None
                and first_id != self.bos_token_id)


# The roles a conversation may hold, as the OpenAI API names them (the server takes the
# same four); "developer" is its newer name for a system message.
CHAT_ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages: Any, where: str = "messages") -> tuple[dict[str, str], ...]:
    """A conversation as every front end takes it (a request, a --messages file, a bench or
    training prompts file), checked once here: a non-empty list of {role, content} dicts
    with string values and a role from `CHAT_ROLES`. Returns them as plain dicts, a
    "developer" message as "system" (what chat templates know); errors name `where` and
    the turn."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: expected a non-empty list of {{role, content}} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"{where}[{i}]: expected a dict with a 'role' string "
                              "(a list of {role, content} dicts)")
        if m["role"] not in CHAT_ROLES:
            raise PromptError(f"{where}[{i}]: role {m['role']!r} is not one of "
                              f"{', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise PromptError(f"{where}[{i}]: 'content' must be a string "
                              "(a list of {role, content} dicts)")
    return tuple({"role": "system" if m["role"] == "developer" else m["role"],
                  "content": m["content"]} for m in messages)
