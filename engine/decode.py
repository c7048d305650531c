"""The decode loop: a stack of small generators.

`ChatSession.generate` encodes the conversation, reuses the cached prefix, prefills the
rest in chunks, then drives a *step generator* (plain here, speculative in
`engine/speculative.py`). A step generator yields one `RawStep` per target pass — token ids
with their fates — and keeps the KV caches at the committed length. The driver turns raw
steps into `Step` events with text, applies stop strings, eos, max tokens and cancel, and
keeps `Stats`. Every event is built in exactly one place: here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from engine import blas_threads
from engine.cache import cache_length, model_caches, trim_caches
from engine.calibration import (
    CALIBRATION_FILE,
    calibration_key,
    load_or_measure_costs,
    measure_costs,
    save_costs,
)
from engine.choices import ACCEPT_RULES, DRAFTERS, TREE_MODES
from engine.context_fit import fit_to_window, reply_room
from engine.drafters.base import Drafter
from engine.drafters.head import HeadDrafter, HeadModel, default_layers
from engine.drafters.layerskip import LayerSkipDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.errors import EngineError, HeadError, IncompatibleDraftError, PromptError
from engine.events import CUT_MARK, Finished, PromptProgress, Stats, Step, Token
from engine.loading import LoadedModel
from engine.models.taps import FeatureTap
from engine.paths import cache_dir
from engine.prefix_store import PrefixStore
from engine.sampling import SamplingParams
from engine.speculative import speculative_steps
from engine.steps import RawStep, plain_steps, prefill
from engine.stopping import StopMatcher
from engine.tokenizer import StreamingDetokenizer
from engine.training.online import OnlineBuffer, OnlineRecorder
from engine.tuning import K_MAX, AcceptanceEstimate, CostModel, DraftPolicy, PolicyMemory

log = logging.getLogger(__name__)


def _check_prompt(messages: Sequence[dict]) -> None:
    """Refuse a conversation with nothing to reply to, in one line."""
    if not messages:
        raise PromptError("the conversation is empty: give at least one message")
    if not any(str(m.get("content", "")).strip() for m in messages):
        raise PromptError("the prompt is empty: write a message first")


@dataclass(frozen=True)
class GenerateOptions:
    """Everything that shapes one reply besides the conversation itself."""

    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    prefill_chunk: int | None = None  # rows per prompt chunk; None: by backend and length
    drafter: str = "none"
    k: int | None = None  # draft length; None = adaptive
    accept: str = "coupled"
    tree: str = "auto"  # draft trees: "auto" (the policy's call) or "off" (chains only)
    # text the reply will likely repeat though the conversation does not hold it (a
    # client's predicted output, the reply being regenerated): prompt lookup drafts from
    # it too. Only drafts come from it, so the reply is the same with or without it.
    reference: str = ""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if value is None and name == "prefill_chunk":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"{name} must be an integer of at least 1, got {value!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise EngineError(f"stop must be a tuple of strings, got {self.stop!r}")
        if not all(self.stop):  # "" would stop everywhere; the server refuses it too
            raise EngineError("stop: stop strings must not be empty")
        if self.drafter not in DRAFTERS:
            raise EngineError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.accept not in ACCEPT_RULES:
            raise EngineError(f"accept must be one of {', '.join(ACCEPT_RULES)}, got {self.accept!r}")
        if not isinstance(self.reference, str):
            raise EngineError(f"reference must be text, got {type(self.reference).__name__}")
        if self.tree not in TREE_MODES:
            raise EngineError(f"tree must be one of {', '.join(TREE_MODES)}, got {self.tree!r}")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                   or not 1 <= self.k <= K_MAX):
            raise EngineError(f"k must be from 1 to {K_MAX} (or auto), got {self.k}")


class ChatSession:
    """A loaded target (and optional draft) with KV caches kept across turns.

    A follow-up turn whose conversation prefix is unchanged only prefills the new tokens:
    the cache remembers the ids it holds, and the next prompt is compared against them.
    The draft model's cache does the same through its drafter. Every call must come from
    the thread that loaded the models (MLX streams are thread-local).
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 head: HeadModel | None = None, online: OnlineBuffer | None = None) -> None:
        """`head`: a trained drafter head for this target (engine/drafters/head_io.py).
        `online`: a buffer that records every reply's committed positions (`set_online`)."""
        self.target = target
        self.draft = draft
        if draft is not None:
            from engine.compat import require_compatible

            require_compatible(target.path, draft.path)
        self.caches_tgt = model_caches(target.model)
        blas_threads.tick()  # loading started the window: it may have closed by now
        self.cached_ids_tgt: list[int] = []
        # caches of conversations this session left, for when a prompt comes back to one
        self.prefixes = PrefixStore()
        # a draft model is a fraction of the target: so are its caches
        self.draft_prefixes = PrefixStore(self.prefixes.budget_bytes // 4)
        self.stats = Stats()
        self._drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
        if target.model.n_layers > 1:
            self._drafters["layerskip"] = LayerSkipDrafter(target.model, self.caches_tgt)
        if draft is not None:
            self._drafters["model"] = ModelDrafter(
                draft.model, vocab_size=target.model.args.vocab_size)
        self.head = head
        if head is not None:
            self._drafters["head"] = HeadDrafter(head, target.model, self.caches_tgt)
        self._costs: CostModel | None = None
        # where the costs came from, and how many live corrections that file has seen
        self._calibration: tuple[str, Path, int] | None = None
        self._policy_memory: dict[str, PolicyMemory] = {}  # per drafter mode, across replies
        self._recorder: OnlineRecorder | None = None
        self.set_online(online)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers a head reads (this session's head's, else EAGLE-3's default)."""
        if self.head is not None:
            return tuple(self.head.config.aux_layers)
        return default_layers(self.target.model.n_layers)

    def set_online(self, buffer: OnlineBuffer | None) -> None:
        """Record each reply's committed positions (features and the target's top-k) into
        `buffer` from the next pass on; None stops recording (engine/training/online.py)."""
        if self._recorder is not None and self._recorder.buffer is buffer:
            return
        if self._recorder is not None:
            self._recorder.detach()
            self._recorder = None
        if buffer is not None:
            self._recorder = OnlineRecorder(buffer, self.target.model, self.caches_tgt,
                                            self.feature_layers)

    @property
    def costs(self) -> CostModel | None:
        """The pass-cost model adaptive replies use (None until the first one calibrates)."""
        return self._costs

    @property
    def context_window(self) -> int:
        return int(self.target.model.args.max_position_embeddings)

    @property
    def drafters(self) -> tuple[str, ...]:
        """Drafters this session can use ("model" only with a draft model loaded)."""
        return tuple(self._drafters)

    def cache_lengths(self) -> dict[str, int]:
        """Rows held by each cache (target, and the draft model's when loaded)."""
        out = {"target": cache_length(self.caches_tgt)}
        model = self._drafters.get("model")
        if isinstance(model, ModelDrafter):
            out["draft"] = cache_length(model.caches)
        return out

    def reset(self) -> None:
        """Forget the cached prefix (the next turn prefills everything)."""
        trim_caches(self.caches_tgt, 0)
        self.cached_ids_tgt = []
        self.prefixes.clear()
        self.draft_prefixes.clear()
        for d in self._drafters.values():
            d.reset()
        if self._recorder is not None:
            self._recorder.tap.clear()

    def encode(self, messages: Sequence[dict], continue_final: bool = False) -> list[int]:
        """Prompt ids for a reply to `messages`, or (`continue_final`) for the rest of the
        last one (see `Tokenizer.encode_chat`)."""
        _check_prompt(messages)
        return self.target.tokenizer.encode_chat(list(messages), add_generation_prompt=True,
                                                 continue_final=continue_final)

    def prompt_length(self, messages: Sequence[dict], continue_final: bool = False) -> int:
        """`len(self.encode(messages, continue_final))`, without tokenizing again the parts
        of a long conversation counted on earlier turns (`Tokenizer.count_chat`)."""
        _check_prompt(messages)
        return self.target.tokenizer.count_chat(list(messages), add_generation_prompt=True,
                                                continue_final=continue_final)

    def generate(
        self,
        messages: Sequence[dict],
        options: GenerateOptions | None = None,
        cancel: threading.Event | None = None,
        continue_final: bool = False,
    ) -> Iterator[PromptProgress | Step | Finished]:
        """Reply to `messages` (role/content dicts), yielding progress, steps, then Finished.
        `continue_final`: write on from the end of the last message (an assistant reply cut
        short) instead of starting a new one; the events carry only the new text.

        A conversation longer than the context window has its oldest exchanges left out
        (`engine.context_fit`); the reply's stats say how many messages.
        """
        options = options or GenerateOptions()
        window = self.context_window
        fitted = fit_to_window(messages, lambda m: self.encode(m, continue_final), window,
                               reply_room(window, options.max_tokens),
                               count=lambda m: self.prompt_length(m, continue_final))
        return self._start(fitted.ids, options, cancel, fitted.dropped)

    def _reuse_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Trim the cache to the longest prefix shared with `prompt_ids`; return its length.

        A conversation the session left and comes back to gets its parked cache back
        (`engine.prefix_store`), the draft model's too. At least the last prompt token is
        always recomputed: its logits start the reply.
        """
        held = self.cached_ids_tgt[: cache_length(self.caches_tgt)]
        n = self.prefixes.reuse(held, self.caches_tgt, self._taps(), prompt_ids,
                                len(prompt_ids) - 1)
        self.cached_ids_tgt = list(prompt_ids[:n])
        model = self._drafters.get("model")
        if isinstance(model, ModelDrafter):
            # its `commit` feeds whatever the shared prefix leaves out
            held = model.cached_ids[: cache_length(model.caches)]
            m = self.draft_prefixes.reuse(held, model.caches, [], prompt_ids,
                                           len(prompt_ids) - 1)
            model.cached_ids = list(prompt_ids[:m])
        return n

    def _taps(self) -> list[FeatureTap]:
        """The feature taps recording this session's target passes (the head drafter's,
        the online buffer's): their rows belong to the cache's conversation."""
        taps = getattr(self.target.model, "feature_taps", None)
        return taps.find_all(self.caches_tgt[0]) if taps and self.caches_tgt else []

    def _policy(self, options: GenerateOptions) -> DraftPolicy:
        mode = options.drafter
        if mode == "model" and "model" not in self._drafters:
            raise IncompatibleDraftError(
                "drafter 'model' needs a draft model: pass --draft MODEL (or pick one in the app)"
            )
        if mode == "layerskip" and "layerskip" not in self._drafters:
            raise EngineError("drafter 'layerskip' needs a target with at least 2 layers")
        if mode == "head" and "head" not in self._drafters:
            name = self.target.name
            raise HeadError(f"drafter 'head' needs a head trained for {name}: in the app, "
                            "Chat ▸ Train a Drafter for This Model…; on the command line, `understudy "
                            f"train-drafter --model {name}`")
        available = tuple(self._drafters) if mode == "auto" else (mode,)
        if options.reference and "ngram" not in available:
            # the reference is what prompt lookup drafts from: a reply that names another
            # drafter (a draft model, the head) takes lookup's copy where it has one and
            # its own guesses elsewhere, or the text it was handed would speed nothing
            available += ("ngram",)
        costs = None
        if options.k is None:
            costs = self._costs = self._costs or self._calibrate()
        # a reply with a reference learns apart: its lookup matches run into text the reply
        # was given, far surer than the context's, and must not teach the next reply so
        memory = self._policy_memory.setdefault(
            f"{mode}+reference" if options.reference else mode, PolicyMemory())
        if self.head is not None and self.head.heldout_top1:
            # the head's first estimate is its held-out agreement from training
            memory.estimates.setdefault("head", AcceptanceEstimate(self.head.heldout_top1))
        return DraftPolicy(mode, available, costs, options.k, self._lookup.match_with_length,
                           memory)

    def _calibrate(self) -> CostModel:
        """Measure pass costs once per model/draft/device/BLAS; cached on disk."""
        layerskip = self._drafters.get("layerskip")
        n_skip = layerskip.n_layers if isinstance(layerskip, LayerSkipDrafter) else None
        draft_model = self.draft.model if self.draft is not None else None
        key = calibration_key(self.target.path, self.target.model,
                              self.draft.path if self.draft else None, n_skip)
        costs = load_or_measure_costs(
            key, lambda: measure_costs(self.target.model, draft_model, n_skip))
        self._calibration = (key, cache_dir() / CALIBRATION_FILE, len(costs.corrections))
        head = self._drafters.get("head")
        if isinstance(head, HeadDrafter) and "head" not in costs.draft_s:
            costs.draft_s["head"] = head.step_seconds()
        return costs

    def _save_corrections(self) -> None:
        """Write the cost table back once live passes have corrected it, so the next run
        starts from what this machine does now rather than probing its way there again.
        Never fails a reply: an unwritable cache only costs that head start."""
        if self._calibration is None or self._costs is None:
            return
        key, path, saved = self._calibration
        if len(self._costs.corrections) <= saved:
            return
        try:
            save_costs(key, self._costs, path)
        except OSError as e:
            log.warning("%s: cannot save corrected pass costs (%s)", path, e)
        self._calibration = (key, path, len(self._costs.corrections))

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        options: GenerateOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[PromptProgress | Step | Finished]:
        """Like `generate`, from token ids, which must fit the context window as they are.
        Validates eagerly, then returns the event stream."""
        return self._start(prompt_ids, options or GenerateOptions(), cancel, 0)

    def _start(self, prompt_ids: Sequence[int], options: GenerateOptions,
               cancel: threading.Event | None, dropped: int,
               ) -> Iterator[PromptProgress | Step | Finished]:
        if not prompt_ids:
            raise PromptError("the prompt is empty: it encodes to no tokens")
        if len(prompt_ids) + 1 > self.context_window:
            raise PromptError(
                f"the prompt is {len(prompt_ids)} tokens long, but the model's context window "
                f"(config.json max_position_embeddings) is {self.context_window}"
            )
        policy = self._policy(options) if options.drafter != "none" else None
        return self._run(list(prompt_ids), options, cancel, policy, dropped)

    def _run(
        self,
        prompt_ids: list[int],
        options: GenerateOptions,
        cancel: threading.Event | None,
        policy: DraftPolicy | None,
        dropped: int = 0,
    ) -> Iterator[PromptProgress | Step | Finished]:
        mx.reset_peak_memory()
        stats = Stats(prompt_tokens=len(prompt_ids), dropped_messages=dropped)
        self.stats = stats
        t_start = time.perf_counter()
        reused = self._reuse_prefix(prompt_ids)
        if self._recorder is not None:
            self._recorder.begin(len(prompt_ids))
        todo = prompt_ids[reused:]
        blas_threads.tick()
        logits = None
        waited = 0.0  # time the consumer held a progress event: not prompt time
        for done, chunk_logits in prefill(self.target.model, todo, self.caches_tgt,
                                          options.prefill_chunk):
            blas_threads.tick()
            logits = chunk_logits
            t_yield = time.perf_counter()
            yield PromptProgress(reused + done, len(prompt_ids))
            waited += time.perf_counter() - t_yield
            if cancel is not None and cancel.is_set():
                # stopped while the prompt is read (a long paste can take a minute): end
                # now, keeping what was read cached, so sending it again starts from there
                self.cached_ids_tgt = list(prompt_ids[: reused + done])
                stats = replace(stats, prefilled_tokens=done, finish_reason="cancelled",
                                prompt_s=time.perf_counter() - t_start - waited)
                self.stats = stats
                yield Finished(stats, "", ())
                return
        assert logits is not None  # _reuse_prefix always leaves the last token to compute
        stats = replace(stats, prefilled_tokens=len(todo),
                        prompt_s=time.perf_counter() - t_start - waited)
        self.stats = stats

        context = list(prompt_ids)
        self._set_reference(len(prompt_ids), options.reference if policy is not None else "")
        steps: Iterator[RawStep]
        if policy is None:
            steps = plain_steps(self.target.model, self.caches_tgt, logits, context,
                                options.sampling)
        else:
            steps = speculative_steps(self.target.model, self.caches_tgt, context, logits,
                                      options.sampling, options.accept, self._drafters, policy,
                                      tree=options.tree)
        yield from self._drive(steps, context, len(prompt_ids), options, cancel, stats)

    def _set_reference(self, n_prompt: int, text: str) -> None:
        """Give prompt lookup the reply's reference text, at most a context window of it
        (a reply never outgrows the window, and the index grows with what it holds)."""
        ids = self.target.tokenizer.encode(text)[: self.context_window] if text else []
        self._lookup.set_reference(n_prompt, ids)

    @property
    def _lookup(self) -> NgramDrafter:
        """Prompt lookup, which every session has (the policy asks it for matches)."""
        ngram = self._drafters["ngram"]
        assert isinstance(ngram, NgramDrafter)
        return ngram

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
        stopper = StopMatcher((*options.stop, *tok.stop_strings))
        eos = tok.eos_token_ids
        text_parts: list[str] = []
        generated: list[int] = []
        t0 = time.perf_counter()
        finish: str | None = None
        window = self.context_window
        try:
            for raw in steps:
                blas_threads.tick()
                tokens: list[Token] = []
                eos_token: Token | None = None
                ghost: tuple[str, StreamingDetokenizer] | None = None  # (branch, its text)
                branches = raw.branches or [""] * len(raw.ids)
                for tid, kind, prob, branch in zip(raw.ids, raw.kinds, raw.probs, branches,
                                                   strict=True):
                    if not kind.committed:
                        if ghost is None or ghost[0] != branch:
                            # decoded on from the reply (special tokens shown), so a byte
                            # token that completes a character reads as it, and one that
                            # only begins it reads "" (alone each read U+FFFD)
                            ghost = (branch, detok.fork(tok.decode))
                        text = ghost[1].add(tid).replace(CUT_MARK, "")
                        tokens.append(Token(tid, text, kind, prob, branch))
                        continue
                    ghost = None
                    if tid in eos:
                        finish = "eos"
                        eos_token = Token(tid, "", kind, prob)
                        break
                    generated.append(tid)
                    piece = stopper.feed(detok.add(tid))
                    tokens.append(Token(tid, piece, kind, prob))
                    if stopper.stopped:
                        finish = "stop"
                    elif (len(generated) >= options.max_tokens
                          or n_prompt + len(generated) >= window):
                        finish = "length"
                    if finish is not None:
                        break
                if finish is None and cancel is not None and cancel.is_set():
                    finish = "cancelled"
                if finish not in (None, "stop"):
                    tail = stopper.flush() + detok.flush()
                    # held-back text rides on this step's last committed token (never a
                    # rejected one); an eos-only step has none, so the eos token carries it
                    last = next((i for i in reversed(range(len(tokens)))
                                 if tokens[i].kind.committed), None)
                    if tail and last is not None:
                        t = tokens[last]
                        tokens[last] = Token(t.id, t.text + tail, t.kind, t.prob)
                    elif tail and eos_token is not None:
                        tokens.append(replace(eos_token, text=tail))
                text_parts.extend(t.text for t in tokens if t.kind.committed)
                # a pass that only produced eos shows nothing: no Step, and tau stays
                # visible tokens per pass (exactly 1.0 for plain decoding)
                shown = bool(tokens)
                stats = replace(
                    stats,
                    generated_tokens=len(generated),
                    decode_s=time.perf_counter() - t0,
                    target_passes=stats.target_passes + shown,
                    n_drafted=stats.n_drafted + raw.n_drafted,
                    n_accepted=stats.n_accepted + raw.n_accepted,
                    draft_s=stats.draft_s + raw.draft_s,
                    verify_s=stats.verify_s + raw.verify_s,
                    peak_memory_bytes=mx.get_peak_memory(),
                    finish_reason=finish,
                )
                self.stats = stats
                if shown:
                    yield Step(tuple(tokens), raw.n_drafted, raw.n_accepted, raw.draft_s,
                               raw.verify_s, raw.k, raw.drafter, raw.error)
                if finish is not None:
                    break
        finally:
            steps.close()
            # The last step queued the pass for a token nobody will read (pipelined_step).
            # Wait for it: a reply leaves no MLX work in flight. A process that exits while
            # that pass is inside OpenBLAS on MLX's stream thread hangs for ever in
            # OpenBLAS's exit handler (its thread pool misses the shutdown wake-up).
            mx.synchronize()
            committed = context[: n_prompt + len(generated) + (1 if finish == "eos" else 0)]
            n_cached = min(cache_length(self.caches_tgt), len(committed))
            trim_caches(self.caches_tgt, n_cached)
            self.cached_ids_tgt = committed[:n_cached]
            self._save_corrections()
            if self._recorder is not None:
                try:
                    self._recorder.harvest(committed, n_prompt, "".join(text_parts))
                except Exception as e:  # noqa: BLE001 - recording must never break a chat
                    log.warning("online training buffer: reply not recorded (%s)", e)
        yield Finished(stats, "".join(text_parts), tuple(generated))
