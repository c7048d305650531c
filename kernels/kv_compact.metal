// KV compaction after a draft tree's verify pass: gather the accepted rows of one layer's
// keys AND values in one dispatch (one thread per (head element, kept row, batch x kv head)).
// keys:   [B, H, C, D] T   the layer's key buffer (C = its capacity in rows)
// values: [B, H, C, D] T
// rows:   [N] int32        absolute source rows, in the order they are committed
// keys_out, values_out: [B, H, N, D] T
// Outputs are fresh buffers (MLX never aliases a custom kernel's output with an input), so no
// row is overwritten before it is read, whatever the order of `rows`; the cache then writes
// them at start, start + 1, ... with one slice update per tensor.
const uint d = thread_position_in_grid.x;
const uint j = thread_position_in_grid.y;
const uint bh = thread_position_in_grid.z;
const uint capacity = uint(keys_shape[2]);
const uint n = uint(rows_shape[0]);
const uint src = (bh * capacity + uint(rows[j])) * D + d;
const uint dst = (bh * n + j) * D + d;
keys_out[dst] = keys[src];
values_out[dst] = values[src];
