"""Mixture-of-experts MLPs (Qwen3-MoE): a router picks k of E expert MLPs per token.

Qwen3-30B-A3B holds 128 experts a layer and runs 8 of them per token, so a token costs
about what a 3B model's does while the weights are those of a 30B one: on a Mac with the
memory for it, the fastest large model there is, and Qwen3-0.6B (the same tokenizer)
drafts for it.

The experts of a layer are stacked, one (E, out, in) tensor per projection, as mlx-lm
converts the checkpoints (`mlp.switch_mlp.{gate,up,down}_proj`), and a pass multiplies
each row by its own k experts through MLX's gather products: `mx.gather_mm` on float
weights, `mx.gather_qmm` on quantized ones. A verify pass's rows, a draft tree's
included, each route on their own, exactly as one-token steps would. A pass of many rows
(a prompt's chunk) first sorts its (row, expert) pairs by expert, so each expert's weights
are read once for all the rows it serves rather than once per row (`SORT_PAIRS`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from engine.models.activations import gated

# (row, expert) pairs from which a pass sorts them by expert: a decode step's few pairs
# gain nothing from the sort and would pay for it
SORT_PAIRS = 64


class SwitchLinear(nn.Module):
    """E linear layers stacked, (E, out, in); row r goes through the experts `idx[r]` names."""

    def __init__(self, in_dims: int, out_dims: int, n_experts: int) -> None:
        super().__init__()
        bound = math.sqrt(1 / in_dims)
        self.weight = mx.random.uniform(-bound, bound, (n_experts, out_dims, in_dims))

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., 1 or k, 1, in), idx (..., k) -> (..., k, 1, out)."""
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=idx,
                            sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     **_: object) -> QuantizedSwitchLinear:
        """What `nn.quantize` builds for a quantized checkpoint."""
        return QuantizedSwitchLinear.from_switch(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """`SwitchLinear` with each expert's weight stored as MLX's affine quantization."""

    def __init__(self, in_dims: int, out_dims: int, n_experts: int, group_size: int = 64,
                 bits: int = 4, mode: str = "affine") -> None:
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, self.biases = mx.quantize(
            mx.zeros((n_experts, out_dims, in_dims)), group_size, bits)
        self.freeze()

    @classmethod
    def from_switch(cls, layer: SwitchLinear, group_size: int, bits: int,
                    mode: str) -> QuantizedSwitchLinear:
        n_experts, out_dims, in_dims = layer.weight.shape
        return cls(in_dims, out_dims, n_experts, group_size, bits, mode)

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(x, self["weight"], self["scales"], self["biases"],
                             rhs_indices=idx, transpose=True, group_size=self.group_size,
                             bits=self.bits, sorted_indices=sorted_indices)


class SwitchGLU(nn.Module):
    """The experts' SwiGLU MLPs, stacked: down(silu(gate(x)) * up(x)) through k of them."""

    def __init__(self, dims: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, n_experts)
        self.up_proj = SwitchLinear(dims, hidden, n_experts)
        self.down_proj = SwitchLinear(hidden, dims, n_experts)

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        """x (B, L, D), idx (B, L, k) -> (B, L, k, D): each row through each of its k."""
        if idx.size >= SORT_PAIRS:
            return self._by_expert(x, idx)
        x = mx.expand_dims(x, (-2, -3))  # (B, L, 1, 1, D): one row, shared by its k experts
        h = gated(self.gate_proj(x, idx), self.up_proj(x, idx))  # (B, L, k, 1, H)
        return self.down_proj(h, idx).squeeze(-2)

    def _by_expert(self, x: mx.array, idx: mx.array) -> mx.array:
        """The same products with the (row, expert) pairs sorted by expert, then put back."""
        *lead, k = idx.shape
        flat = idx.flatten()
        order = mx.argsort(flat)
        rows = mx.expand_dims(x.reshape(-1, x.shape[-1])[order // k], -2)  # (P, 1, D)
        experts = flat[order]
        h = gated(self.gate_proj(rows, experts, sorted_indices=True),
                  self.up_proj(rows, experts, sorted_indices=True))  # (P, 1, H)
        out = self.down_proj(h, experts, sorted_indices=True)  # (P, 1, D)
        return out[mx.argsort(order)].reshape(*lead, k, -1)


class SparseMoE(nn.Module):
    """Route each row to its `top_k` experts by the router's softmax and sum their outputs
    weighted by it (renormalized over the k where `norm_topk_prob`, as Qwen3 does)."""

    def __init__(self, dims: int, hidden: int, n_experts: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dims, n_experts, bias=False)
        self.switch_mlp = SwitchGLU(dims, hidden, n_experts)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        idx = mx.argpartition(probs, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        weights = mx.take_along_axis(probs, idx, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = self.switch_mlp(x, mx.stop_gradient(idx))  # (B, L, k, D)
        return (out * weights[..., None].astype(out.dtype)).sum(axis=-2)
