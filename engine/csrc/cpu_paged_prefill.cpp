// Prefill attention over the paged KV cache on a CPU: the query rows of a step's prefill
// chunks, each causal over its sequence's cached context and its own new tokens (whose K/V
// the step has already written to the cache), read straight from the cache blocks. A chunk
// after a prefix-cache hit or an earlier chunk attends to the cached blocks the same way.
//
// torch's SDPA on a CPU needs each chunk's context gathered into a dense tensor first, and in
// bfloat16 runs at about a third of what this machine's vector units give (docs/engine.md).
// Here the work is split into items of one chunk, one KV head and a tile of query positions;
// an item's query rows are its positions times the KV head's group of query heads, which share
// every key and value it reads. An item converts the keys it needs once into tiles of kKeys
// keys laid out by head dimension, then computes its scores as vectors over keys (a query
// element broadcast against a vector of keys: no horizontal sums), takes an exact softmax of
// each row over the keys its position may see, and sums the values weighted by it. Scores and
// sums are float32 whatever the cache dtype. Items go to torch's threads by their cost (a later
// position attends to more keys), so that the threads finish together.

#include "cpu_attention_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;      // one AVX2 register of float32
constexpr int64_t kKeys = 16;      // keys per tile of scores: two vectors of lanes
constexpr int64_t kPositions = 16; // query positions per work item
constexpr int64_t kRowBlock = 4;   // query rows computed together, sharing each key load

// kLanes floats as one value of the compiler's vector extension: a register where the target
// has one that wide (wider vectors than the target's registers compile to slow code).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, const Lanes& v) { std::memcpy(p, &v, sizeof v); }

struct Item {
  int64_t chunk, kv_head;
  int64_t first, count;  // query positions [first, first + count) of the chunk
  int64_t keys;          // keys its last position sees
};

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, max_blocks;
  int64_t q_row;  // elements from one query row to the next
};

// Per thread: the item's query rows (scaled), its keys as tiles, its values, its scores.
struct Scratch {
  std::vector<float> query, keys, values, scores, row;
};

template <typename T, int DIM>
void run_item(const Item& it, const Shape& sh, const T* q, const T* k_cache, const T* v_cache,
              const int64_t* table, int64_t q_start, float scale, T* out,
              Scratch& s) {
  const int64_t dim = DIM > 0 ? DIM : sh.dim;
  const int64_t group = sh.group;
  const int64_t rows = it.count * group;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t tiles = (it.keys + kKeys - 1) / kKeys;
  const int64_t width = tiles * kKeys;
  const int64_t token_elems = sh.kv_heads * dim;
  const int64_t position0 = it.keys - it.count;  // the position of the item's first query

  // Row r is position first + r / group of query head kv_head * group + r % group; rows past
  // the item's (to fill the last row block) are zeros.
  s.query.assign(padded_rows * dim, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + it.first + r / group;
    const int64_t head = it.kv_head * group + r % group;
    float* dst = s.query.data() + r * dim;
    to_float(q + token * sh.q_row + head * dim, dst, dim);
    for (int64_t d = 0; d < dim; ++d) dst[d] *= scale;
  }

  // Keys: element d of key t at keys[((t / kKeys) * dim + d) * kKeys + t % kKeys]; the last
  // tile's lanes past the item's keys are zeros (their scores are never used).
  s.keys.resize(tiles * dim * kKeys);
  s.values.resize(it.keys * dim);
  s.row.resize(dim);
  std::fill(s.keys.end() - dim * kKeys, s.keys.end(), 0.f);
  for (int64_t t = 0; t < it.keys; ++t) {
    const int64_t slot = table[t / sh.block_size] * sh.block_size + t % sh.block_size;
    const int64_t offset = slot * token_elems + it.kv_head * dim;
    to_float(k_cache + offset, s.row.data(), dim);
    float* tile = s.keys.data() + (t / kKeys) * dim * kKeys + t % kKeys;
    for (int64_t d = 0; d < dim; ++d) tile[d * kKeys] = s.row[d];
    to_float(v_cache + offset, s.values.data() + t * dim, dim);
  }

  // Scores: kRowBlock rows at a time against each tile of keys.
  s.scores.resize(padded_rows * width);
  for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowBlock) {
    const float* qr = s.query.data() + r0 * dim;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const float* kt = s.keys.data() + tile * dim * kKeys;
      Lanes acc[kRowBlock][2] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const Lanes low = load(kt + d * kKeys), high = load(kt + d * kKeys + kLanes);
        for (int64_t j = 0; j < kRowBlock; ++j) {
          const float x = qr[j * dim + d];
          acc[j][0] += x * low;
          acc[j][1] += x * high;
        }
      }
      for (int64_t j = 0; j < kRowBlock; ++j) {
        float* dst = s.scores.data() + (r0 + j) * width + tile * kKeys;
        store(dst, acc[j][0]);
        store(dst + kLanes, acc[j][1]);
      }
    }
  }

  // Each row: softmax over the keys its position sees, then the weighted sum of their values.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seen = position0 + r / group + 1;
    float* p = s.scores.data() + r * width;
    softmax(p, seen);
    float* o = s.row.data();
    if constexpr (DIM > 0 && DIM % kLanes == 0 && DIM <= 128) {
      Lanes acc[DIM / kLanes] = {};
      for (int64_t t = 0; t < seen; ++t) {
        const float* vt = s.values.data() + t * DIM;
        for (int64_t c = 0; c < DIM / kLanes; ++c) acc[c] += p[t] * load(vt + c * kLanes);
      }
      for (int64_t c = 0; c < DIM / kLanes; ++c) store(o + c * kLanes, acc[c]);
    } else {
      std::fill(o, o + dim, 0.f);
      for (int64_t t = 0; t < seen; ++t) {
        const float* vt = s.values.data() + t * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] += p[t] * vt[d];
      }
    }
    const int64_t token = q_start + it.first + r / group;
    const int64_t head = it.kv_head * group + r % group;
    from_float(o, out + (token * sh.heads + head) * dim, dim);
  }
}

template <typename T, int DIM>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
             const at::Tensor& context_lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t chunks = tables.size(0);
  Shape sh{q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2), block_size,
           tables.size(1), q.stride(0)};
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();

  // Items in order of chunk, KV head and position; each costs its rows times its keys.
  std::vector<Item> items;
  std::vector<double> cost_before{0.0};
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t cached = contexts[c] - lens[c];
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      for (int64_t first = 0; first < lens[c]; first += kPositions) {
        const int64_t count = std::min(kPositions, lens[c] - first);
        items.push_back({c, h, first, count, cached + first + count});
        cost_before.push_back(cost_before.back() +
                              static_cast<double>(count) * static_cast<double>(cached + first + count));
      }
    }
  }
  const double total = cost_before.back();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Thread `part` takes the items whose cost starts in its share [part, part + 1) / threads.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t part = begin; part < end; ++part) {
      for (size_t i = 0; i < items.size(); ++i) {
        const auto owner = static_cast<int64_t>(cost_before[i] * threads / total);
        if (std::min(owner, threads - 1) != part) continue;
        const Item& it = items[i];
        run_item<T, DIM>(it, sh, qp, kp, vp, tp + it.chunk * sh.max_blocks, starts[it.chunk],
                         fscale, op, scratch);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                  const at::Tensor& context_lens, int64_t block_size, double scale,
                  at::Tensor& out) {
  switch (q.size(2)) {
    case 64:
      return prefill<T, 64>(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens,
                            block_size, scale, out);
    case 128:
      return prefill<T, 128>(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens,
                             block_size, scale, out);
    default:
      return prefill<T, 0>(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens,
                           block_size, scale, out);
  }
}

}  // namespace

// q, out: [tokens, heads, dim], the step's batch (q's rows may lie apart); only the rows of the chunks are read and
// written. k_cache, v_cache: [num_slots, kv_heads, dim], num_slots a multiple of block_size.
// tables: [chunks, max_blocks] int64 block ids; q_starts, q_lens, context_lens: [chunks] int64,
// chunk c's query is rows [q_starts[c], q_starts[c] + q_lens[c]) of q, in order and apart, the
// last q_lens[c] tokens of a context of context_lens[c] tokens. Everything is checked before any
// read, so a wrong table or offset is an error, never a read outside the cache or q.
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                   const at::Tensor& context_lens, int64_t block_size, double scale,
                   at::Tensor& out) {
  check_attention_tensors("paged_prefill", q, k_cache, v_cache, block_size, out);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "tables must be a contiguous [chunks, max_blocks] int64 tensor");
  const int64_t chunks = tables.size(0);
  check_index_vector(q_starts, chunks, "q_starts");
  check_index_vector(q_lens, chunks, "q_lens");
  check_index_vector(context_lens, chunks, "context_lens");
  const int64_t cache_blocks = k_cache.size(0) / block_size;
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  int64_t free_row = 0;  // the first row of q no earlier chunk holds
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(lens[c] > 0 && lens[c] <= contexts[c], "chunk ", c, " has ", lens[c],
                " query tokens in a context of ", contexts[c]);
    TORCH_CHECK(starts[c] >= free_row && starts[c] <= q.size(0) - lens[c], "chunk ", c,
                "'s rows start at ", starts[c], ": outside q or over an earlier chunk's");
    free_row = starts[c] + lens[c];
    check_context(tp + c * max_blocks, max_blocks, contexts[c], c, block_size, cache_blocks);
  }
  if (chunks == 0) return;
  switch (q.scalar_type()) {
    case at::kBFloat16:
      return dispatch_dim<at::BFloat16>(q, k_cache, v_cache, tables, q_starts, q_lens,
                                        context_lens, block_size, scale, out);
    case at::kHalf:
      return dispatch_dim<at::Half>(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens,
                                    block_size, scale, out);
    default:  // float32 (the dtype was checked)
      return dispatch_dim<float>(q, k_cache, v_cache, tables, q_starts, q_lens, context_lens,
                                 block_size, scale, out);
  }
}
