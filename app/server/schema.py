"""Request bodies: parsed strictly, checked whole, before anything reaches the engine.

Status codes: 400 for a body that is not UTF-8 JSON or asks for something this server does
not do (tools, n > 1, image parts, JSON mode, several prompts, a prompt longer than the
context); 422 for well-formed JSON with a field of the wrong type or out of range (the
message names the field); 413 for a body over the size limit; 404 for an unknown model. Fields OpenAI defines that change nothing here
(`user`, `metadata`, `store`, ...) are ignored; ones whose effect we cannot honour are refused.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.choices import DRAFTERS
from engine.tuning import K_MAX

DRAFTER_CHOICES = DRAFTERS  # the engine's list: a new drafter reaches the API with no edit here
MAX_STOP_STRINGS = 4
# the error type of a feature this server lacks (a 400, as tools are), not a malformed value
UNSUPPORTED = "unsupported"


class ApiError(Exception):
    """An error the client gets as an OpenAI-style error object with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error"
                                               if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    # "tool" is not here: tool calls are refused, so a tool result has nothing to answer
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """An image or audio part is a feature this server lacks; said so here, since the
        union's own error would blame the first member ("should be a valid string")."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" and isinstance(kind, str):
                    raise PydanticCustomError(
                        UNSUPPORTED, "only text parts are supported, got a part of type {kind}",
                        {"kind": repr(kind)})
        return value

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_results(cls, value: Any) -> Any:
        """A tool's result is a role OpenAI defines: the client is told that tool calls are
        what is missing, not that it misspelt a role."""
        if value in ("tool", "function"):
            raise PydanticCustomError(
                UNSUPPORTED, "{role} messages (tool results) are not supported: this "
                "server does not call tools", {"role": repr(value)})
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat (a file being
    edited). Prompt lookup drafts from it; the reply is what it would be without it."""

    type: Literal["content"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class StreamOptions(_Strict):
    include_usage: StrictBool = False


# list lengths (MAX_STOP_STRINGS, one prompt) are checked after parsing: a union's own error
# for a too-long list would name its first member ("should be a valid string") instead
Stop = StrictStr | list[StrictStr] | None
Temperature = Annotated[float, Field(ge=0.0, le=2.0)] | None
TopP = Annotated[float, Field(gt=0.0, le=1.0)] | None
# OpenAI's seeds are int64s, so negative ones are valid there; -1 is "random" to llama.cpp's
# server and the clients written for it (SillyTavern, KoboldCpp's), so it means that here
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None
RANDOM_SEED = -1
MaxTokens = Annotated[StrictInt, Field(ge=1)] | None
TopK = Annotated[StrictInt, Field(ge=0)] | None
MinP = Annotated[float, Field(ge=0.0, le=1.0)] | None
RepetitionPenalty = Annotated[float, Field(gt=0.0)] | None


class _Common(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    model: StrictStr
    max_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    stop: Stop = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    drafter: Literal[DRAFTER_CHOICES] | None = None  # extension: per-request drafter
    # extension: pin the draft length instead of letting the cost model choose it per step
    draft_k: Annotated[StrictInt, Field(ge=1, le=K_MAX)] | None = None
    # extensions local clients send (vLLM's names; llama.cpp's server calls the penalty
    # `repeat_penalty`, taken too): the engine honours each, and ignoring one would answer
    # something the client did not ask for. Off by default: 0, 0 and 1.
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    repeat_penalty: RepetitionPenalty = None
    prediction: Prediction | None = None


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: MaxTokens = None
    # extension (vLLM's name): write on from the end of the last message, an assistant
    # reply cut short, instead of starting a new one
    continue_final_message: StrictBool | None = False


class CompletionBody(_Common):
    # OpenAI's four forms: text, token ids (lm-evaluation-harness sends these), or a list of
    # either, which holds one prompt here
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


# Fields we refuse when set to anything but their "off" value: honouring them is not
# possible here, and silently ignoring them would return something the client did not ask for.
_OFF: tuple[Any, ...] = (None, False, [], {}, "none")
_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("tool calls are not supported by this server", _OFF),
    "functions": ("function calls are not supported by this server", _OFF),
    "tool_choice": ("tool calls are not supported by this server", _OFF),
    "logprobs": ("logprobs are not supported by this server", _OFF),
    "top_logprobs": ("logprobs are not supported by this server", (*_OFF, 0, 0.0)),
    "logit_bias": ("logit_bias is not supported by this server", _OFF),
    "presence_penalty": ("presence_penalty is not supported by this server", (*_OFF, 0, 0.0)),
    "frequency_penalty": ("frequency_penalty is not supported by this server", (*_OFF, 0, 0.0)),
    "echo": ("echo is not supported by this server", _OFF),
    "suffix": ("suffix (fill-in-the-middle) is not supported by this server", (*_OFF, "")),
    "best_of": ("best_of is not supported by this server", (*_OFF, 1)),
    "audio": ("audio output is not supported by this server", _OFF),
    # {"type": "text"} is what every reply here already is
    "response_format": ("response_format (JSON mode, structured outputs) is not supported by "
                        "this server: replies are plain text", (*_OFF, {"type": "text"})),
}


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: what the engine needs, in engine terms (prompt not yet encoded)."""

    endpoint: str  # "chat" | "completion"
    model: str
    messages: tuple[dict[str, str], ...] | None  # chat
    prompt: str | tuple[int, ...] | None  # completion: text, or token ids taken as they are
    max_tokens: int | None  # None: up to the context window
    temperature: float
    top_p: float
    seed: int  # the request's, or a fresh one per request (`fresh_seed`)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    drafter: str | None  # None: the server's default
    draft_k: int | None = None  # None: the policy chooses each step's draft length
    continue_final: bool = False  # chat: the reply continues the last (assistant) message
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    prediction: str = ""  # "": none


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_lone_surrogates(text, data)
    return data


def _refuse_lone_surrogates(text: str, data: dict[str, Any]) -> None:
    """JSON may spell half a UTF-16 pair ("\\ud800"); Python decodes it to a string no
    tokenizer or UTF-8 encoder takes, so it is refused here as the client's mistake rather
    than failing deep in the tokenizer as a server error."""
    if "\\u" not in text:  # a surrogate can only arrive as an escape: the body is UTF-8
        return
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body is not valid JSON text: it holds an unpaired "
                       "UTF-16 surrogate escape (such as \\ud800), which is not a "
                       "character", code="invalid_unicode") from None


def _validate(model: type[_Common], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = _cause(e.errors())
        where = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or "body"
        if err["type"] == UNSUPPORTED:  # a feature this server lacks, like tools: 400
            raise ApiError(400, f"{where}: {err['msg']}", param=where,
                           code="unsupported_parameter") from None
        raise ApiError(422, f"{where}: {err['msg']}", param=where,
                       code="invalid_value") from None


def _cause(errors: list[Any]) -> Any:
    """The error that says what is wrong. A value a union rejects fails every member; the
    members of another type than the value's ("str" for a list) only say "should be a valid
    string", so the error from the member that matched its type is the one to show."""
    def type_mismatch(err: Any) -> bool:
        loc = err["loc"]
        return bool(loc) and _is_union_tag(loc[-1]) and err["type"].endswith("_type")

    first = errors[0]
    if not type_mismatch(first):
        return first
    field = first["loc"][:-1]
    return next((err for err in errors if err["loc"][:len(field)] == field
                 and not type_mismatch(err)), first)


def _is_union_tag(part: int | str) -> bool:
    """pydantic names the union member that failed in `loc` ("str", "list[TextPart]"):
    the client wants the field's path, not our type's internals."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or "-" in part)


def _refuse_unsupported(body: _Common) -> None:
    extra = body.model_extra or {}
    for name, (why, off_values) in _REFUSED.items():
        value = extra.get(name)
        # type-exact comparison: True == 1 must not pass for "off"
        if not any(type(value) is type(off) and value == off for off in off_values):
            raise ApiError(400, why, param=name, code="unsupported_parameter")
    if body.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported: ask for one choice per request",
                       param="n", code="unsupported_parameter")


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(422, f"stop: at most {MAX_STOP_STRINGS} stop strings are supported, "
                       f"got {len(stops)}", param="stop", code="invalid_value")
    if any(not s for s in stops):
        raise ApiError(422, "stop: stop strings must not be empty", param="stop",
                       code="invalid_value")
    return stops


def fresh_seed() -> int:
    """A seed for a request that names none. OpenAI's semantics: without a seed each request
    samples anew, so a client's "regenerate" gets another reply; a seed makes it repeatable.
    Speculation stays lossless either way: draft and verify share the request's one seed."""
    return secrets.randbits(64)


def _seed(given: int | None) -> int:
    """The sampler's seed (0 to 2**64): a fresh one for none or -1, and any other negative
    seed as the same 64 bits unsigned, so it repeats its reply as a positive one does."""
    if given is None or given == RANDOM_SEED:
        return fresh_seed()
    return given % 2**64


def _common(body: _Common, endpoint: str, max_tokens: int | None,
            messages: tuple[dict[str, str], ...] | None, prompt: str | tuple[int, ...] | None
            ) -> GenerationRequest:
    _refuse_unsupported(body)
    return GenerationRequest(
        endpoint=endpoint, model=body.model, messages=messages, prompt=prompt,
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=_seed(body.seed),
        stop=_stop(body.stop), stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        drafter=body.drafter, draft_k=body.draft_k,
        top_k=body.top_k or 0,
        min_p=0.0 if body.min_p is None else float(body.min_p),
        repetition_penalty=_repetition_penalty(body),
        prediction=body.prediction.text() if body.prediction is not None else "",
    )


def _repetition_penalty(body: _Common) -> float:
    """The penalty under either name; two different values are a client's mistake."""
    given = {v for v in (body.repetition_penalty, body.repeat_penalty) if v is not None}
    if len(given) > 1:
        raise ApiError(422, "repetition_penalty and repeat_penalty name the same setting "
                       "and differ: send one", param="repeat_penalty", code="invalid_value")
    return float(given.pop()) if given else 1.0


def parse_chat(data: dict[str, Any]) -> GenerationRequest:
    """A /v1/chat/completions body → GenerationRequest ("developer" is a system message)."""
    body = _validate(ChatBody, data)
    messages = tuple({"role": "system" if m.role == "developer" else m.role,
                      "content": m.text()} for m in body.messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    request = _common(body, "chat", max_tokens, messages, None)
    if not body.continue_final_message:
        return request
    if messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message: the last message must be an assistant "
                       "reply to continue", param="continue_final_message")
    return replace(request, continue_final=True)


def parse_completion(data: dict[str, Any]) -> GenerationRequest:
    """A /v1/completions body → GenerationRequest (OpenAI's default of 16 tokens)."""
    body = _validate(CompletionBody, data)
    return _common(body, "completion", body.max_tokens or 16, None, _prompt(body.prompt))


def _prompt(given: str | list[str] | list[int] | list[list[int]]) -> str | tuple[int, ...]:
    """The one prompt: text, or token ids (a flat list of ints is one prompt's ids)."""
    if isinstance(given, str):
        return given
    if given and all(isinstance(i, int) for i in given):
        return tuple(given)  # type: ignore[arg-type]
    one = _one_prompt(given)  # type: ignore[arg-type]
    return one if isinstance(one, str) else tuple(one)


def _one_prompt(prompts: list[str] | list[list[int]]) -> str | list[int]:
    """OpenAI's list form of `prompt`, which this server takes with one prompt in it."""
    if not prompts:
        raise ApiError(422, "prompt: the list of prompts is empty", param="prompt",
                       code="invalid_value")
    if len(prompts) > 1:
        raise ApiError(400, f"prompt: only one prompt per request is supported, got "
                       f"{len(prompts)}: send one request per prompt", param="prompt",
                       code="unsupported_parameter")
    return prompts[0]
