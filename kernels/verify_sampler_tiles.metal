// Pass 1 of the fused verify sampler: one threadgroup of TG threads per (group of
// GROUP_TILES vocabulary tiles of TG entries, row); a row's last group may hold fewer tiles.
// scores: [N, V] T            the row's unnormalized log-weights (or log-probs); V % TG == 0
// positions: [N] uint         absolute position of each row (the noise's counter)
// keys: [2] uint              the seed's two 32-bit keys
// inv_temperature: [1] float  applied when NORMALIZE (1.0 otherwise)
// part_f: [N, N_GROUPS, 3] float  group max, sum exp(s - max), best perturbed score
// part_i: [N, N_GROUPS] int       vocabulary index of the best perturbed score
const uint group = threadgroup_position_in_grid.x;
const uint row = threadgroup_position_in_grid.y;
const uint lid = thread_position_in_threadgroup.x;
const float scale = NORMALIZE ? inv_temperature[0] : 1.0f;
const uint row_hash = coupled_fmix32(positions[row] * COUPLED_GOLDEN + keys[1]);
const uint row_key = coupled_fmix32(row_hash ^ COUPLED_ROW_SALT) + keys[0];

float m = -INFINITY;
float z = 0.0f;
float best = -INFINITY;
int best_i = int(group * GROUP_TILES * TG + lid);
for (uint i = 0; i < GROUP_TILES; ++i) {
  const uint tile = group * GROUP_TILES + i;
  if (tile >= V / TG) {  // the same for every thread of the group
    break;
  }
  const uint v = tile * TG + lid;  // a tile's threads read TG consecutive entries
  const float s = float(scores[row * V + v]) * scale;
  if (s > m) {
    z = (m > -INFINITY ? z * metal::exp(m - s) : 0.0f) + 1.0f;
    m = s;
  } else if (s > -INFINITY) {
    z += metal::exp(s - m);
  }
  const float key = GREEDY ? s : s + coupled_gumbel(row_hash, row_key, v);
  if (key > best) {  // v grows with i: strict > keeps the lowest index of a tie
    best = key;
    best_i = int(v);
  }
}

threadgroup float sh_m[TG];
threadgroup float sh_z[TG];
threadgroup float sh_best[TG];
threadgroup int sh_i[TG];
sh_m[lid] = m;
sh_z[lid] = z;
sh_best[lid] = best;
sh_i[lid] = best_i;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint stride = TG / 2; stride > 0; stride >>= 1) {
  if (lid < stride) {
    float m1 = sh_m[lid];
    float z1 = sh_z[lid];
    float b1 = sh_best[lid];
    int i1 = sh_i[lid];
    coupled_merge(m1, z1, b1, i1, sh_m[lid + stride], sh_z[lid + stride],
                  sh_best[lid + stride], sh_i[lid + stride]);
    sh_m[lid] = m1;
    sh_z[lid] = z1;
    sh_best[lid] = b1;
    sh_i[lid] = i1;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (lid == 0) {
  const uint out = row * N_GROUPS + group;
  part_f[out * 3 + 0] = sh_m[0];
  part_f[out * 3 + 1] = sh_z[0];
  part_f[out * 3 + 2] = sh_best[0];
  part_i[out] = sh_i[0];
}
