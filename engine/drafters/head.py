"""A trained drafter head over the target's own hidden states (EAGLE-3 style).

The head sees, at each committed position j, the target's hidden states of a low, a middle
and a high layer (fused 3D -> D by `fc`) together with the embedding of the next token
x_{j+1} (the target's own, frozen), runs one decoder block (`midlayer`, the same attention
and MLP code as the target's, with q/k/v reading both halves), and predicts x_{j+2} over a
"hot" vocabulary of the tokens the target uses most (`d2t` maps a hot index to a target
id). Drafting feeds its own output state back for the next step, on its own small KV cache.

Losslessness never depends on the head: drafts are sampled with the target's coupled noise
(the head's distribution lifted to the full vocabulary, zero outside the hot set), and
verification is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.cache import KVCache, PreallocatedKVCache, shared_length
from engine.drafters.base import Draft, DraftRun, draft_tokens, with_runner_ups
from engine.models.decoder import LONGROPE, MLP, Attention, Linear, ModelArgs, rope_kind
from engine.models.taps import FeatureTap
from engine.sampling import SamplingParams, log_probs

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice of feature layers (low, middle, high), as layer-input indices."""
    return (min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0))


@dataclass
class HeadConfig:
    """The head's config.json (EAGLE-3's field names; `aux_layers` in `eagle_config`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # the hot vocabulary's
    aux_layers: tuple[int, ...]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.aux_layers = tuple(int(i) for i in self.aux_layers)

    @classmethod
    def for_target(cls, args: ModelArgs, draft_vocab_size: int,
                   layers: Sequence[int] | None = None) -> HeadConfig:
        """A head shaped like one of the target's blocks. Its block is a llama block, which
        rotates whole heads: a target's LongRoPE (whose factors are for part of a head, on
        Phi-4-mini) stays the target's, and the head, trained from scratch, turns with
        plain RoPE at the target's base."""
        assert args.num_key_value_heads is not None
        rope_scaling = None if rope_kind(args.rope_scaling) in LONGROPE else args.rope_scaling
        return cls(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                   num_attention_heads=args.num_attention_heads,
                   num_key_value_heads=args.num_key_value_heads, vocab_size=args.vocab_size,
                   draft_vocab_size=draft_vocab_size,
                   aux_layers=tuple(layers or default_layers(args.num_hidden_layers)),
                   head_dim=args.head_dim, rms_norm_eps=args.rms_norm_eps,
                   rope_theta=args.rope_theta, rope_scaling=rope_scaling,
                   max_position_embeddings=args.max_position_embeddings)

    def block_args(self) -> ModelArgs:
        """The decoder's args for the head's one block."""
        return ModelArgs(model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
                         intermediate_size=self.intermediate_size,
                         num_attention_heads=self.num_attention_heads,
                         vocab_size=self.draft_vocab_size, rms_norm_eps=self.rms_norm_eps,
                         num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                         max_position_embeddings=self.max_position_embeddings,
                         rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        layers = list(d.pop("aux_layers"))
        return {**extra, "architectures": [HEAD_ARCHITECTURE], "model_type": "llama",
                "num_hidden_layers": 1, "tie_word_embeddings": False, **d,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}}


class HeadAttention(Attention):
    """The target's attention, except q/k/v read [embedding ; hidden] (2D wide)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        D = 2 * args.hidden_size
        self.q_proj = Linear(D, self.n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(D, self.n_kv_heads * self.head_dim, bias=False)


class MidLayer(nn.Module):
    """EAGLE-3's decoder block: attention over the joined embedding and hidden state."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = HeadAttention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, emb: mx.array, hidden: mx.array, mask: mx.array | str | None = None,
                 cache: KVCache | None = None) -> mx.array:
        x = mx.concatenate([self.input_layernorm(emb), self.hidden_norm(hidden)], axis=-1)
        h = hidden + self.self_attn(x, mask, cache)  # (B, L, D)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Held:
    """Arrays and modules kept outside the head's parameter tree (never trained or saved):
    the target's embedding and the hot-vocabulary lookups."""

    def __init__(self, **items: Any) -> None:
        self.__dict__.update(items)


class HeadModel(nn.Module):
    """fc, midlayer, norm, lm_head: the EAGLE-3 checkpoint's modules, under its names."""

    def __init__(self, config: HeadConfig, hot_ids: np.ndarray, embed: nn.Module) -> None:
        super().__init__()
        D = config.hidden_size
        args = config.block_args()
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * D, D, bias=False)
        self.midlayer = MidLayer(args)
        self.norm = nn.RMSNorm(D, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(D, config.draft_vocab_size, bias=False)
        self.set_hot_ids(hot_ids)
        self._frozen = _Held(embed=embed)
        self.heldout_top1: float | None = None  # from the training record, when known
        attn = self.midlayer.self_attn
        if "_freqs" in attn:  # llama3's RoPE table: a constant, kept out of the weights
            object.__setattr__(attn, "_freqs", attn.pop("_freqs"))

    def set_hot_ids(self, hot_ids: np.ndarray) -> None:
        """The hot vocabulary: hot index i is target id hot_ids[i] (sorted, unique)."""
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        hot = np.asarray(hot_ids, dtype=np.int64)
        if hot.shape != (Vd,):
            raise ValueError(f"hot_ids has shape {hot.shape}, expected ({Vd},)")
        index = np.full(V, Vd, dtype=np.int32)  # target id -> hot index, Vd = "not hot"
        index[hot] = np.arange(Vd, dtype=np.int32)
        self.hot_ids = hot  # numpy: an object attribute, not a parameter
        self._hot = _Held(index=mx.array(index), ids=mx.array(hot.astype(np.int32)))

    @property
    def lift_index(self) -> mx.array:
        """(V,) target id -> hot index, or draft_vocab_size where the id is not hot."""
        return self._hot.index

    @property
    def hot_ids_mx(self) -> mx.array:
        return self._hot.ids

    def embed(self, ids: mx.array) -> mx.array:
        return mx.stop_gradient(self._frozen.embed(ids))

    def fuse(self, features: mx.array) -> mx.array:
        """Target features (..., n_layers * D) -> the hidden input (..., D)."""
        return self.fc(features)

    def __call__(self, hidden: mx.array, ids: mx.array, mask: mx.array | str | None = None,
                 cache: KVCache | None = None) -> mx.array:
        """Rows (hidden_j, x_{j+1}) -> output states (B, L, D), which predict x_{j+2}."""
        B, L, D = hidden.shape
        if mask is None and L > 1:
            mask = "causal"
        return self.midlayer(self.embed(ids), hidden, mask, cache)

    def logits(self, out: mx.array) -> mx.array:
        """Output states -> hot-vocabulary logits (..., draft_vocab_size)."""
        return self.lm_head(self.norm(out))

    def lift(self, logits: mx.array) -> mx.array:
        """Hot logits (N, Vd) -> full-vocabulary logits (N, V), -inf outside the hot set."""
        pad = mx.full((logits.shape[0], 1), -mx.inf, dtype=logits.dtype)
        return mx.take(mx.concatenate([logits, pad], axis=-1), self.lift_index, axis=-1)

    def to_target(self, hot_index: mx.array) -> mx.array:
        """Hot indices -> target ids."""
        return mx.take(self.hot_ids_mx, hot_index)


class HeadDrafter:
    """Drafts with a trained head on its own KV cache, from the target's tapped features.

    Its cache holds one row per committed position j < len(context) - 1: (f_j, x_{j+1}).
    `commit` trims rows past the shared prefix and feeds the new ones from the tap.
    """

    name = "head"
    stops_early = True  # `propose(until=)`: a chain it is unsure of ends early

    def __init__(self, head: HeadModel, target, caches_tgt: Sequence[KVCache]) -> None:
        if not caches_tgt:
            raise ValueError("the head drafter needs the target's caches")
        self.head = head
        self.tap = FeatureTap(head.config.aux_layers, caches_tgt[0])
        target.feature_taps.add(self.tap)
        self._target = target
        self.cache = PreallocatedKVCache(chunk=256)
        self.ids: list[int] = []  # the committed context the cache's rows belong to
        self._last: mx.array | None = None  # output state of the newest row (1, 1, D)
        self._drawn: DraftRun | None = None  # the last proposal's draw

    def detach(self) -> None:
        """Stop recording the target's features (the drafter is being dropped)."""
        self._target.feature_taps.remove(self.tap)

    def commit(self, context: Sequence[int]) -> None:
        """Hold rows for positions 0 .. len(context) - 2, fed from the tapped features."""
        n = shared_length(self.ids, context)
        keep = min(self.cache.offset, max(n - 1, 0))
        if keep < self.cache.offset:
            self.cache.trim(keep)
            self._last = None
        want = len(context) - 1
        if self._last is None and keep == want and keep > 0:
            keep -= 1  # recompute the newest row: its output state starts the draft
            self.cache.trim(keep)
        if keep < want:
            try:
                feats = self.tap.rows(keep, want)[None]  # (1, n, F)
            except KeyError:  # not recorded (cannot happen in a session): no draft now
                self.ids, self._last = list(context[: keep + 1]), None
                return
            ids = mx.array([list(context[keep + 1 : want + 1])])
            out = self.head(self.head.fuse(feats.astype(self.head.fc.weight.dtype)), ids,
                            cache=self.cache)
            self._last = out[:, -1:]
            mx.eval(self._last)
        self.ids = list(context)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str, until: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """k head steps from the newest committed row (fewer where `until` stops them:
        `draft_tokens`); the cache is cut back afterwards."""
        if k <= 0 or len(context) < 2:
            return Draft(())
        self.commit(context)
        if self._last is None:
            return Draft(())
        out = self._last
        # draw over the hot vocabulary itself (no lift, no noise for the other tokens),
        # unless a repetition penalty needs rows over every token id
        hot = sampling.repetition_penalty == 1.0
        logits = self.head.logits if hot else self._full_logits

        def step(tok: mx.array) -> mx.array:
            """Feed the drawn token with the head's own output state as its hidden input."""
            nonlocal out
            out = self.head(out, tok[None], cache=self.cache)
            return logits(out[0])

        run = draft_tokens(logits(out[0]), step, context, k, sampling, accept,
                           vocab=self.head.hot_ids_mx if hot else None, until=until)
        self.cache.trim(len(context) - 1)
        self._drawn = run
        # q over the whole vocabulary, lazily: only the rejection rule reads it
        return Draft(run.ids, self.head.lift(run.logq) if hot else run.logq)

    def propose_tree(self, context: Sequence[int], k: int, extra: int,
                     sampling: SamplingParams | None = None, accept: str = "coupled",
                     until: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """The chain `propose` drafts plus the head's runner-ups at the shallow depths (as
        the draft model's; none outside the hot vocabulary)."""
        sampling = sampling or SamplingParams()
        chain = self.propose(context, k, sampling, accept, until)
        return with_runner_ups(chain, self._drawn, len(context), sampling, accept, extra)

    def _full_logits(self, out: mx.array) -> mx.array:
        """Output states (1, D) -> logits over the target's vocabulary (1, V)."""
        return self.head.lift(self.head.logits(out))

    def reset(self) -> None:
        self.cache.trim(0)
        self.ids = []
        self._last = None
        self.tap.clear()

    def step_seconds(self, reps: int = 5) -> float:
        """Measured seconds of one draft step (calibration of the draft cost)."""
        import time

        cache = PreallocatedKVCache()
        D = self.head.config.hidden_size
        hidden = mx.zeros((1, 32, D))
        mx.eval(self.head(hidden, mx.zeros((1, 32), dtype=mx.int32), cache=cache))
        samples = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            o = self.head(hidden[:, :1], mx.zeros((1, 1), dtype=mx.int32), cache=cache)
            lq = log_probs(self.head.logits(o[0]), SamplingParams())
            mx.eval(self.head.to_target(mx.argmax(lq, axis=-1)))  # as `propose` draws
            samples.append(time.perf_counter() - t0)
            cache.trim(32)
        return sorted(samples[1:])[reps // 2]
