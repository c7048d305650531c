// Helpers for the fused verify sampler (after the hash constants, which Python writes).
// The hash must equal kernels/noise.py bit for bit: integer arithmetic mod 2^32 only.

inline uint coupled_fmix32(uint h) {
  h ^= h >> 16;
  h *= COUPLED_FMIX_1;
  h ^= h >> 13;
  h *= COUPLED_FMIX_2;
  h ^= h >> 16;
  return h;
}

// log1p(x) for x in (-1, 0], accurate near 0 (Kahan's trick; Metal has no log1p).
inline float coupled_log1p(float x) {
  const float y = 1.0f + x;
  return y == 1.0f ? x : metal::log(y) * (x / (y - 1.0f));
}

// Gumbel(0, 1) noise of vocabulary entry v in a row keyed by (row_hash, row_key).
// The uniform is exact: 1 - u = (2^24 - odd) / 2^24 with odd = 2 * (bits >> 9) + 1.
inline float coupled_gumbel(uint row_hash, uint row_key, uint v) {
  const uint bits = coupled_fmix32(coupled_fmix32(row_hash + v * COUPLED_VOCAB_STEP) ^ row_key);
  const uint odd = (bits >> 9) * 2u + 1u;
  const float one_minus_u = float((1u << 24) - odd) * 5.9604644775390625e-08f;  // 2^-24
  return -metal::log(-coupled_log1p(-one_minus_u));
}

// Merge (max, sum of exp(s - max), best score, its index) pairs; ties go to the lower index.
inline void coupled_merge(
    thread float& m, thread float& z, thread float& best, thread int& best_i,
    float m2, float z2, float best2, int best_i2) {
  const float top = metal::max(m, m2);
  if (top > -INFINITY) {
    z = (m > -INFINITY ? z * metal::exp(m - top) : 0.0f) +
        (m2 > -INFINITY ? z2 * metal::exp(m2 - top) : 0.0f);
    m = top;
  }
  if (best2 > best || (best2 == best && best_i2 < best_i)) {
    best = best2;
    best_i = best_i2;
  }
}
