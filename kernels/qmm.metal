// Small-batch affine-quantized matmul: y = x @ dequantize(w).T for M = 2..16 rows.
// Each simdgroup owns ROWS output channels; each lane walks packs of the reduction axis and
// dequantizes each packed weight once, then uses it for every one of the M rows of x.
// x: [M, K] T
// w: [N, K * BITS / 32] uint32   affine-quantized, value j of a pack at bits [BITS*j, BITS*(j+1))
// scales: [N, K / GS] T, biases: [N, K / GS] T
// y: [M, N] T
constexpr uint VPP = 32 / BITS;            // values per uint32 pack
constexpr uint PACKS = K * BITS / 32;      // packs per output channel
constexpr uint GROUPS = K / GS;
constexpr uint MASK = (1u << BITS) - 1u;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n0 = (threadgroup_position_in_grid.x * SIMDGROUPS + sg) * ROWS;

float acc[M][ROWS];
for (uint m = 0; m < M; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    acc[m][r] = 0.0f;
  }
}
for (uint p = lane; p < PACKS; p += 32) {
  const uint k = p * VPP;
  float xs[M][VPP];
  for (uint m = 0; m < M; ++m) {
    for (uint j = 0; j < VPP; ++j) {
      xs[m][j] = float(x[m * K + k + j]);
    }
  }
  for (uint r = 0; r < ROWS; ++r) {
    const uint n = n0 + r;
    const uint packed = w[n * PACKS + p];
    const float scale = float(scales[n * GROUPS + k / GS]);
    const float bias = float(biases[n * GROUPS + k / GS]);
    for (uint j = 0; j < VPP; ++j) {
      const float wv = scale * float((packed >> (BITS * j)) & MASK) + bias;
      for (uint m = 0; m < M; ++m) {
        acc[m][r] += xs[m][j] * wv;
      }
    }
  }
}
for (uint m = 0; m < M; ++m) {
  for (uint r = 0; r < ROWS; ++r) {
    const float total = simd_sum(acc[m][r]);
    if (lane == 0) {
      y[m * N + n0 + r] = T(total);
    }
  }
}
