"""OpenAI response objects built from engine events (each shape built here, once).

Every response and final chunk carries `usage`. The extension field `understudy` (ignored by
standard clients) carries each chunk's token fates and, at the end, the speculative stats.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from engine.events import Finished, Stats, Step
from engine.prediction import PredictionUse

EXTENSION = "understudy"

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def finish_reason(stats: Stats) -> str:
    return _FINISH.get(stats.finish_reason or "", "stop")


def usage(stats: Stats, prediction: PredictionUse | None = None) -> dict[str, Any]:
    """OpenAI's usage object, `cached_tokens` included (`Stats.cached_tokens`), and how
    much of a request's `prediction` the reply used."""
    out = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
           "total_tokens": stats.prompt_tokens + stats.generated_tokens,
           "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}
    if prediction is not None:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": prediction.accepted,
            "rejected_prediction_tokens": prediction.rejected}
    return out


def step_extension(step: Step) -> dict[str, Any]:
    """Every token of one target pass with its fate (rejected ones are never in `content`).

    A token's `text` is never half a character: one that holds only part of a character
    has "" and the one completing it carries it (`engine.events.Token`), so a client that
    joins texts, or a rejected branch's, shows no U+FFFD."""
    return {"tokens": [{"id": t.id, "text": t.text, "kind": t.kind.value} for t in step.tokens],
            "drafted": step.n_drafted, "accepted": step.n_accepted, "drafter": step.drafter}


def final_extension(finished: Finished, drafter: str, steps_by_drafter: Counter[str]
                    ) -> dict[str, Any]:
    """The reply's speculative stats: what was drafted, what the target kept, tokens per pass."""
    s = finished.stats
    return {"drafter": drafter, "steps_by_drafter": dict(steps_by_drafter),
            "drafted": s.n_drafted, "accepted": s.n_accepted, "tau": s.tau,
            "acceptance": s.acceptance, "target_passes": s.target_passes,
            "prefilled_tokens": s.prefilled_tokens, "decode_tps": s.decode_tps,
            "prompt_tps": s.prompt_tps, "finish_reason": s.finish_reason}


def _envelope(rid: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model,
            "system_fingerprint": None}


def chat_response(rid: str, created: int, model: str, finished: Finished,
                  extension: dict[str, Any], prediction: PredictionUse | None = None
                  ) -> dict[str, Any]:
    return {**_envelope(rid, "chat.completion", created, model),
            "choices": [{"index": 0, "logprobs": None,
                         "finish_reason": finish_reason(finished.stats),
                         "message": {"role": "assistant", "content": finished.text}}],
            "usage": usage(finished.stats, prediction), EXTENSION: extension}


def completion_response(rid: str, created: int, model: str, finished: Finished,
                        extension: dict[str, Any], prediction: PredictionUse | None = None
                        ) -> dict[str, Any]:
    return {**_envelope(rid, "text_completion", created, model),
            "choices": [{"index": 0, "logprobs": None, "text": finished.text,
                         "finish_reason": finish_reason(finished.stats)}],
            "usage": usage(finished.stats, prediction), EXTENSION: extension}


def chunk(endpoint: str, rid: str, created: int, model: str, text: str | None, *,
          first: bool = False, finish: str | None = None,
          extension: dict[str, Any] | None = None,
          usage_: dict[str, int] | None = None, no_choices: bool = False) -> dict[str, Any]:
    """One streamed chunk; `no_choices` is the usage-only chunk of `include_usage`."""
    if endpoint == "chat":
        out = _envelope(rid, "chat.completion.chunk", created, model)
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
    else:
        out = _envelope(rid, "text_completion", created, model)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out["choices"] = [] if no_choices else [choice]
    if usage_ is not None:
        out["usage"] = usage_
    if extension is not None:
        out[EXTENSION] = extension
    return out


def model_object(card: Any) -> dict[str, Any]:
    """One served model: an entry of `/v1/models`, and all of `/v1/models/{id}`."""
    return {"id": card.id, "object": "model", "created": card.created,
            "owned_by": "understudy", EXTENSION: {
                "context_window": card.context_window, "drafters": list(card.drafters)}}


def models_list(cards: list[Any]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(c) for c in cards]}
