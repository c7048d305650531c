"""The decode loop: a stack of small generators.

`ChatSession.generate` encodes the conversation, reuses the cached prefix, prefills the
rest in chunks, then drives a *step generator* (plain here, speculative in
`engine/speculative.py`). A step generator yields one `RawStep` per target pass — token ids
with their fates — and keeps the KV caches at the committed length. The driver turns raw
steps into `Step` events with text, applies stop strings, eos, max tokens and cancel, and
keeps `Stats`. Every event is built in exactly one place: here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from engine.cache import KVCache, cache_length, make_caches, trim_caches
from engine.errors import EngineError, PromptError
from engine.events import Finished, PromptProgress, Stats, Step, Token, TokenKind
from engine.loading import LoadedModel
from engine.sampling import SamplingParams, log_probs, sample_coupled
from engine.stopping import StopMatcher

DRAFTERS = ("none", "model", "ngram", "layerskip", "auto")
ACCEPT_RULES = ("coupled", "rejection")


@dataclass(frozen=True)
class GenerateOptions:
    """Everything that shapes one reply besides the conversation itself."""

    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    prefill_chunk: int = 512
    drafter: str = "none"
    k: int | None = None  # draft length; None = adaptive
    accept: str = "coupled"

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.drafter not in DRAFTERS:
            raise EngineError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.accept not in ACCEPT_RULES:
            raise EngineError(f"accept must be one of {', '.join(ACCEPT_RULES)}, got {self.accept!r}")
        if self.k is not None and self.k < 1:
            raise EngineError(f"k must be at least 1 (or auto), got {self.k}")


@dataclass
class RawStep:
    """One target pass as a step generator reports it: ids in display order and fates."""

    ids: list[int]
    kinds: list[TokenKind]
    probs: list[float | None]
    n_drafted: int = 0
    n_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    k: int = 0
    drafter: str = "none"


def forward(model, ids: Sequence[int], caches: Sequence[KVCache]) -> mx.array:
    """Run `ids` through the model, appending to `caches`; returns logits (L, V)."""
    return model(mx.array([list(ids)]), cache=list(caches))[0]


def prefill(
    model,
    ids: Sequence[int],
    caches: Sequence[KVCache],
    chunk: int,
    on_chunk=None,
) -> mx.array:
    """Feed `ids` in chunks of `chunk` tokens; returns the logits of the last one (V,).

    Chunking bounds the attention working set for long prompts and lets the GUI show
    progress. `on_chunk(done, total)` is called after each chunk is computed.
    """
    total = len(ids)
    logits = None
    for start in range(0, total, chunk):
        part = ids[start : start + chunk]
        logits = forward(model, part, caches)[-1]
        mx.eval(logits)
        if on_chunk is not None:
            on_chunk(min(start + chunk, total), total)
    assert logits is not None
    return logits


def choose(logits: mx.array, params: SamplingParams, positions: Sequence[int],
           histories: Sequence[Sequence[int]] | None) -> tuple[mx.array, mx.array, mx.array]:
    """The target's distribution and coupled sample for each row of `logits` (N, V).

    Returns (log-probabilities (N, V), chosen ids (N,), probability of each chosen id (N,)).
    The token at absolute position t depends only on the distribution, the seed and t —
    the property that makes speculative output identical to plain output.
    """
    lp = log_probs(logits, params, histories)
    ids = sample_coupled(lp, params.seed, positions)
    p = mx.exp(mx.take_along_axis(lp, ids[:, None], axis=-1)[:, 0])
    return lp, ids, p


def plain_steps(
    model,
    caches: Sequence[KVCache],
    logits: mx.array,
    context: list[int],
    params: SamplingParams,
) -> Iterator[RawStep]:
    """Plain decoding: one target pass per token, pipelined.

    The next forward pass is queued (`async_eval`) before the current token is read back, so
    the host never waits idle between passes. `context` holds the committed ids and is
    appended to; the caches hold every committed id except the newest (it is fed by the next
    pass), which the driver accounts for when it stops.
    """
    want_history = params.repetition_penalty != 1.0
    _, tok, p = choose(logits[None], params, [len(context)], [context] if want_history else None)
    mx.async_eval(tok, p)
    while True:
        t0 = time.perf_counter()
        nxt_logits = model(tok[None], cache=list(caches))[0, -1]
        pos = len(context) + 1
        tid = tok.item()
        prob = p.item()
        context.append(tid)
        _, nxt_tok, nxt_p = choose(nxt_logits[None], params, [pos],
                                   [context] if want_history else None)
        mx.async_eval(nxt_tok, nxt_p)
        yield RawStep([tid], [TokenKind.TARGET], [prob], verify_s=time.perf_counter() - t0)
        tok, p = nxt_tok, nxt_p


class ChatSession:
    """A loaded target (and optional draft) with KV caches kept across turns.

    A follow-up turn whose conversation prefix is unchanged only prefills the new tokens:
    the cache keeps the ids it holds, and the next prompt is compared against them.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        self.target = target
        self.draft = draft
        self.caches_tgt = make_caches(target.model.n_layers)
        self.cached_ids_tgt: list[int] = []
        self.stats = Stats()

    @property
    def context_window(self) -> int:
        return int(self.target.model.args.max_position_embeddings)

    def reset(self) -> None:
        """Forget the cached prefix (the next turn prefills everything)."""
        trim_caches(self.caches_tgt, 0)
        self.cached_ids_tgt = []

    def encode(self, messages: Sequence[dict]) -> list[int]:
        if not messages:
            raise PromptError("the conversation is empty: give at least one message")
        if not any(str(m.get("content", "")).strip() for m in messages):
            raise PromptError("the prompt is empty: write a message first")
        return self.target.tokenizer.encode_chat(list(messages), add_generation_prompt=True)

    def generate(
        self,
        messages: Sequence[dict],
        options: GenerateOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[PromptProgress | Step | Finished]:
        """Reply to `messages` (role/content dicts), yielding progress, steps, then Finished."""
        return self.generate_ids(self.encode(messages), options, cancel)

    def _reuse_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Trim the cache to the longest prefix shared with `prompt_ids`; return its length."""
        n = 0
        limit = min(len(self.cached_ids_tgt), cache_length(self.caches_tgt), len(prompt_ids) - 1)
        while n < limit and self.cached_ids_tgt[n] == prompt_ids[n]:
            n += 1
        trim_caches(self.caches_tgt, n)
        self.cached_ids_tgt = list(prompt_ids[:n])
        return n

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        options: GenerateOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[PromptProgress | Step | Finished]:
        options = options or GenerateOptions()
        if not prompt_ids:
            raise PromptError("the prompt is empty: it encodes to no tokens")
        if len(prompt_ids) + 1 > self.context_window:
            raise PromptError(
                f"the prompt is {len(prompt_ids)} tokens long, but the model's context window "
                f"(config.json max_position_embeddings) is {self.context_window}"
            )
        if options.drafter != "none":
            raise EngineError(f"drafter {options.drafter!r} is not available in this build")
        return self._run(list(prompt_ids), options, cancel)

    def _run(
        self, prompt_ids: list[int], options: GenerateOptions, cancel: threading.Event | None
    ) -> Iterator[PromptProgress | Step | Finished]:
        mx.reset_peak_memory()
        stats = Stats(prompt_tokens=len(prompt_ids))
        self.stats = stats
        t_start = time.perf_counter()
        reused = self._reuse_prefix(prompt_ids)
        todo = prompt_ids[reused:]
        progress: list[PromptProgress] = []
        logits = prefill(self.target.model, todo, self.caches_tgt, options.prefill_chunk,
                         lambda d, t: progress.append(PromptProgress(reused + d, reused + t)))
        yield from progress
        stats = replace(stats, prefilled_tokens=len(todo), prompt_s=time.perf_counter() - t_start)
        self.stats = stats

        context = list(prompt_ids)
        steps = plain_steps(self.target.model, self.caches_tgt, logits, context,
                            options.sampling)
        yield from self._drive(steps, context, len(prompt_ids), options, cancel, stats)

    def _drive(
        self,
        steps: Iterator[RawStep],
        context: list[int],
        n_prompt: int,
        options: GenerateOptions,
        cancel: threading.Event | None,
        stats: Stats,
    ) -> Iterator[Step | Finished]:
        """Turn raw steps into events until eos, a stop string, max tokens or cancel."""
        tok = self.target.tokenizer
        detok = tok.detokenizer()
        stopper = StopMatcher(options.stop)
        eos = tok.eos_token_ids
        text_parts: list[str] = []
        generated: list[int] = []
        t0 = time.perf_counter()
        finish: str | None = None
        try:
            for raw in steps:
                tokens: list[Token] = []
                for tid, kind, prob in zip(raw.ids, raw.kinds, raw.probs, strict=True):
                    if not kind.committed:
                        tokens.append(Token(tid, tok.token_text(tid), kind, prob))
                        continue
                    if tid in eos:
                        finish = "eos"
                        break
                    generated.append(tid)
                    piece = stopper.feed(detok.add(tid))
                    tokens.append(Token(tid, piece, kind, prob))
                    if stopper.stopped:
                        finish = "stop"
                    elif len(generated) >= options.max_tokens:
                        finish = "length"
                    if finish is not None:
                        break
                if finish is None and cancel is not None and cancel.is_set():
                    finish = "cancelled"
                if finish not in (None, "stop"):
                    tail = stopper.flush() + detok.flush()
                    if tail and tokens:
                        last = tokens[-1]
                        tokens[-1] = Token(last.id, last.text + tail, last.kind, last.prob)
                text_parts.extend(t.text for t in tokens if t.kind.committed)
                stats = replace(
                    stats,
                    generated_tokens=len(generated),
                    decode_s=time.perf_counter() - t0,
                    target_passes=stats.target_passes + 1,
                    n_drafted=stats.n_drafted + raw.n_drafted,
                    n_accepted=stats.n_accepted + raw.n_accepted,
                    draft_s=stats.draft_s + raw.draft_s,
                    verify_s=stats.verify_s + raw.verify_s,
                    peak_memory_bytes=mx.get_peak_memory(),
                    finish_reason=finish,
                )
                self.stats = stats
                yield Step(tuple(tokens), raw.n_drafted, raw.n_accepted, raw.draft_s,
                           raw.verify_s, raw.k, raw.drafter)
                if finish is not None:
                    break
        finally:
            steps.close()
            committed = context[: n_prompt + len(generated) + (1 if finish == "eos" else 0)]
            n_cached = min(cache_length(self.caches_tgt), len(committed))
            trim_caches(self.caches_tgt, n_cached)
            self.cached_ids_tgt = committed[:n_cached]
        yield Finished(stats, "".join(text_parts), tuple(generated))
