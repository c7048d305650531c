// Pass 2 of the fused verify sampler: one threadgroup of 32 threads for all N <= 16 rows.
// scores: [N, V] T            as in pass 1 (read again for two entries per row)
// draft: [N] int              draft token for rows 0..K-1, then -1 (never a token)
// inv_temperature: [1] float  applied when NORMALIZE
// part_f: [N, N_GROUPS, 3] float, part_i: [N, N_GROUPS] int  from pass 1
// tokens: [N] int             each row's coupled Gumbel-max token
// n_accepted: [1] int         drafts equal to the row's token, counted up to the first miss
// p_token: [N] float          probability of each row's token
// p_draft: [N] float          target probability of each draft token (0 past K or V)
const uint r = thread_position_in_threadgroup.x;
const float scale = NORMALIZE ? inv_temperature[0] : 1.0f;
threadgroup int sh_tok[32];
if (r < N) {
  float m = -INFINITY;
  float z = 0.0f;
  float best = -INFINITY;
  int best_i = part_i[r * N_GROUPS];
  for (uint g = 0; g < N_GROUPS; ++g) {
    const uint at = r * N_GROUPS + g;
    coupled_merge(m, z, best, best_i, part_f[at * 3 + 0], part_f[at * 3 + 1],
                  part_f[at * 3 + 2], part_i[at]);
  }
  const float lse = NORMALIZE ? m + metal::log(z) : 0.0f;
  const int d = draft[r];
  tokens[r] = best_i;
  sh_tok[r] = best_i;
  if (GREEDY) {
    p_token[r] = 1.0f;
    p_draft[r] = d == best_i ? 1.0f : 0.0f;
  } else {
    p_token[r] = metal::exp(float(scores[r * V + best_i]) * scale - lse);
    p_draft[r] = (d >= 0 && d < int(V)) ? metal::exp(float(scores[r * V + d]) * scale - lse)
                                         : 0.0f;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (r == 0) {
  int n = 0;
  while (n < int(N) && draft[n] == sh_tok[n]) {
    ++n;
  }
  n_accepted[0] = n;
}
