// Paged decode attention (kvq.paged_decode_plan / kvq.paged_decode_attention): the work list
// of a batch of sequences of different lengths, and the CPU twin.  Torch-free.
//
// Storage of one layer (docs/serving.md): two pools of pages of P tokens x H KV heads,
//   compressed pool: per role codes int32 [pages, H, P, D * bits / 32], scale / zero fp16
//     [pages, H, P / G, D] (keys per channel) or [pages, H, P, D / G] (per token) -- exactly
//     kvq.quantize's output for a [1, H, P, D] block, page by page;
//   full-precision pool: per role [pages, H, P, D] in the cache dtype.
// Sequence s holds seq_lens[s] tokens; its first comp_lens[s] (a multiple of P) are compressed.
// Logical page i of s is block_table[s, i]: an id into the compressed pool when
// i < comp_lens[s] / P, into the full-precision pool otherwise.
//
// out[s, hq] = softmax_t(scale q[s, hq] . K[s, hq / g, t]) . V[s, hq / g, t] over
// t < seq_lens[s]; an empty sequence gives zeros and lse = -inf.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/attention/decode_attention.h"
#include "kvq/attention/decode_attention_hqmq.h"

namespace kvq {
namespace attention {

/// \brief Layout of the int32 work list written by the plan step and read by the split and
/// combine kernels.  Items are (sequence, token range); the compressed tokens of a sequence
/// come in chunks of `chunk_comp` tokens, its full-precision tokens in chunks of `chunk_fp`;
/// a sequence's items are consecutive, sequences in order.
///   [0] items  [1] chunk_comp  [2] chunk_fp  [3] 0
///   item_seq [max_items], item_t0 [max_items], item_t1 [max_items],
///   seq_first [num_seqs], seq_count [num_seqs]
struct PagedWork {
  static constexpr int64_t kHeader = 4;
  int64_t max_items = 0, num_seqs = 0;
  KVQ_HOST_DEVICE int64_t item_seq(int64_t i) const { return kHeader + i; }
  KVQ_HOST_DEVICE int64_t item_t0(int64_t i) const { return kHeader + max_items + i; }
  KVQ_HOST_DEVICE int64_t item_t1(int64_t i) const { return kHeader + 2 * max_items + i; }
  KVQ_HOST_DEVICE int64_t seq_first(int64_t s) const { return kHeader + 3 * max_items + s; }
  KVQ_HOST_DEVICE int64_t seq_count(int64_t s) const { return kHeader + 3 * max_items + num_seqs + s; }
  KVQ_HOST_DEVICE int64_t size() const { return kHeader + 3 * max_items + 2 * num_seqs; }
};

/// Query heads per KV head one call takes (the CUDA-core kernels' limit; the tensor-core ones take 8).
constexpr int kPagedMaxGroup = 16;

/// Tokens of the compressed chunks are a multiple of this (kWarps tiles of 32) and at least
/// kPagedMinChunk; full-precision chunks are a multiple of 32.
constexpr int64_t kPagedChunkStep = 128;
constexpr int64_t kPagedMinChunk = 256;
constexpr int64_t kPagedFpStep = 32;

/// The smallest work-list capacity the plan accepts for `num_seqs` sequences.
KVQ_HOST_DEVICE int64_t paged_min_items(int64_t num_seqs) { return 2 * num_seqs + 2; }

/// \brief The token write of kvq.paged_append: row n of k / v [N, H, D] (element strides
/// k_sn / k_sh, last dim contiguous) goes to page slots[n] >> page_shift, row
/// slots[n] & (P - 1) of the contiguous pools k_fp / v_fp [pages, H, P, D].  A negative slot is
/// padding and writes nothing; so does (on the device, which cannot raise) a slot past the pool.
struct PagedWriteParams {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_sn = 0, k_sh = 0, v_sn = 0, v_sh = 0;
  void* k_fp = nullptr;
  void* v_fp = nullptr;
  const int64_t* slots = nullptr;
  int64_t N = 0, H = 0, D = 0, pages = 0;
  int page_shift = 0;
  int elem_bytes = 2;
};

/// \brief The CPU twin of the token write (slots already checked by the caller).
inline void paged_write_rows_host(const PagedWriteParams& p) {
  const int64_t row_bytes = p.D * p.elem_bytes, P = int64_t(1) << p.page_shift;
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t slot = p.slots[n];
    if (slot < 0 || (slot >> p.page_shift) >= p.pages) continue;
    const int64_t page = slot >> p.page_shift, row = slot & (P - 1);
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t dst = ((page * p.H + h) * P + row) * row_bytes;
      std::copy_n(static_cast<const char*>(p.k) + (n * p.k_sn + h * p.k_sh) * p.elem_bytes, row_bytes,
                  static_cast<char*>(p.k_fp) + dst);
      std::copy_n(static_cast<const char*>(p.v) + (n * p.v_sn + h * p.v_sh) * p.elem_bytes, row_bytes,
                  static_cast<char*>(p.v_fp) + dst);
    }
  }
}

/// \brief One role of the page compression of kvq.paged_append: the full-precision pool
/// [fp_pages, H, P, D] and the compressed pool it is quantized into (codes [pages, H, P, D * bits
/// / 32], scale / zero fp16 [pages, H, P / G, D] per channel or [pages, H, P, D / G] per token).
struct PagedCompressRole {
  const void* fp = nullptr;
  int32_t* codes = nullptr;
  uint16_t* scale = nullptr;
  uint16_t* zero = nullptr;
  int64_t group = 0;  // G, resolved
  bool per_channel = false;
};

/// \brief The page compression of kvq.paged_append: for every pair m with dst[m] != 0,
/// full-precision page src[m] of each role is group-quantized into compressed page dst[m],
/// exactly as kvq.quantize quantizes that page as a [1, H, P, D] block (the page layout is the
/// block layout).  Page 0 of the compressed pool is scratch: pairs into it are skipped, so a
/// captured step may list a pair for every row and point the rows with nothing to compress
/// there.  On the device a pair outside the pools is skipped too (the host checks them).
struct PagedCompressParams {
  const int64_t* src = nullptr;  // [M] full-precision page ids
  const int64_t* dst = nullptr;  // [M] compressed page ids
  int64_t M = 0, H = 0, P = 0, D = 0;
  int64_t fp_pages = 0, comp_pages = 0;
  int bits = 2;
  PagedCompressRole role[2];  // keys, values
};

/// Entries of a role's scale (and zero) per (page, head).
KVQ_HOST_DEVICE int64_t paged_compress_qparams(const PagedCompressParams& p, const PagedCompressRole& r) {
  return r.per_channel ? p.P / r.group * p.D : p.P * (p.D / r.group);
}

/// \brief The group-quantize block of (pair m, head h) of role r: group_quantize_cpu's
/// parameters of one [1, P, D] matrix at the pair's pages.
template <typename DType>
quant::GroupQuantParams paged_compress_block(const PagedCompressParams& p, const PagedCompressRole& r, int64_t m,
                                             int64_t h) {
  const int64_t W = p.D * p.bits / 32, nq = paged_compress_qparams(p, r);
  const int64_t sb = (p.src[m] * p.H + h) * p.P, db = p.dst[m] * p.H + h;
  quant::GroupQuantParams g;
  g.x = static_cast<const DType*>(r.fp) + sb * p.D;
  g.codes = r.codes + db * p.P * W;
  g.scale = r.scale + db * nq;
  g.zero = r.zero + db * nq;
  g.N = 1, g.T = p.P, g.D = p.D, g.group = r.group, g.bits = p.bits, g.per_channel = r.per_channel;
  return g;
}

/// \brief The CPU twin of the page compression over units [begin, end) of the M * H units
/// (pair m, head h) = (u / H, u % H), both roles each (pairs already checked by the caller).
template <typename DType>
void paged_compress_host(const PagedCompressParams& p, int64_t begin, int64_t end) {
  for (int64_t u = begin; u < end; ++u) {
    const int64_t m = u / p.H, h = u % p.H;
    if (p.dst[m] == 0) continue;  // scratch
    for (const PagedCompressRole& r : p.role) {
      const quant::GroupQuantParams g = paged_compress_block<DType>(p, r, m, h);
      quant::group_quantize_cpu<DType>(g, 0, quant::group_quant_cpu_units(g));
    }
  }
}

/// Compressed tokens of a sequence as the kernels read them: comp clamped to [0, len].
KVQ_HOST_DEVICE int64_t paged_comp_len(int64_t len, int64_t comp) {
  return comp < 0 ? 0 : (comp > len ? len : comp);
}

/// \brief Chunk sizes for a batch: the item budget (max_items - 2 num_seqs) split between the
/// compressed tokens (bc items) and the full-precision ones (bf), evenly when the batch has
/// both.  Then every sequence takes at most ceil(c / cc) + ceil(f / cf) items and all of them
/// fit: sum ceil(c_s / cc) <= total_c / cc + num_seqs <= bc + num_seqs, likewise for f, and
/// bc + bf = budget whenever both kinds occur.
KVQ_HOST_DEVICE void paged_chunks(int64_t total_comp, int64_t total_fp, int64_t num_seqs, int64_t max_items,
                                         int64_t& cc, int64_t& cf) {
  int64_t budget = max_items - 2 * num_seqs;
  if (budget < 2) budget = 2;
  // a batch with one kind of token only gives it the whole budget
  const int64_t bc = total_fp == 0 ? budget : (total_comp == 0 ? 1 : budget / 2), bf = budget - bc > 0 ? budget - bc : 1;
  cc = (total_comp + bc - 1) / bc;
  if (cc < kPagedMinChunk) cc = kPagedMinChunk;
  cc = (cc + kPagedChunkStep - 1) / kPagedChunkStep * kPagedChunkStep;
  cf = (total_fp + bf - 1) / bf;
  if (cf < kPagedFpStep) cf = kPagedFpStep;
  cf = (cf + kPagedFpStep - 1) / kPagedFpStep * kPagedFpStep;
}

/// \brief Items of one sequence of `len` tokens, `comp` of them compressed.
KVQ_HOST_DEVICE int64_t paged_seq_items(int64_t len, int64_t comp, int64_t cc, int64_t cf) {
  const int64_t c = paged_comp_len(len, comp), f = (len > 0 ? len : 0) - c;
  return (c + cc - 1) / cc + (f + cf - 1) / cf;
}

/// \brief Item j of a sequence: its token range [t0, t1).  The sequence's ceil(c / cc) compressed
/// items split its c compressed tokens evenly (chunks of ceil(c / items) rounded up to
/// kPagedChunkStep, never more than cc), likewise the full-precision ones (rounded up to
/// kPagedFpStep): the items of a sequence do equal work.
KVQ_HOST_DEVICE void paged_seq_item(int64_t len, int64_t comp, int64_t cc, int64_t cf, int64_t j, int64_t& t0,
                                           int64_t& t1) {
  const int64_t c = paged_comp_len(len, comp), nc = (c + cc - 1) / cc;
  if (j < nc) {
    const int64_t step = ((c + nc - 1) / nc + kPagedChunkStep - 1) / kPagedChunkStep * kPagedChunkStep;
    t0 = j * step, t1 = t0 + step < c ? t0 + step : c;
  } else {
    const int64_t f = len - c, nf = (f + cf - 1) / cf;
    const int64_t step = ((f + nf - 1) / nf + kPagedFpStep - 1) / kPagedFpStep * kPagedFpStep;
    t0 = c + (j - nc) * step, t1 = t0 + step < len ? t0 + step : len;
  }
}

/// \brief The plan on the host (the CPU op; the CUDA plan kernel writes the same list).
/// `work` holds PagedWork{max_items, num_seqs}.size() ints; requires max_items >=
/// paged_min_items(num_seqs).
inline void paged_plan_host(const int32_t* seq_lens, const int32_t* comp_lens, int64_t num_seqs, int64_t max_items,
                            int32_t* work) {
  const PagedWork wl{max_items, num_seqs};
  std::fill(work, work + wl.size(), 0);
  int64_t tc = 0, tf = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens[s] > 0 ? seq_lens[s] : 0, c = paged_comp_len(len, comp_lens[s]);
    tc += c, tf += len - c;
  }
  int64_t cc = 0, cf = 0;
  paged_chunks(tc, tf, num_seqs, max_items, cc, cf);
  int64_t n = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens[s] > 0 ? seq_lens[s] : 0, ni = paged_seq_items(len, comp_lens[s], cc, cf);
    work[wl.seq_first(s)] = (int32_t)n;
    work[wl.seq_count(s)] = (int32_t)ni;
    for (int64_t j = 0; j < ni; ++j, ++n) {
      int64_t t0 = 0, t1 = 0;
      paged_seq_item(len, comp_lens[s], cc, cf, j, t0, t1);
      work[wl.item_seq(n)] = (int32_t)s, work[wl.item_t0(n)] = (int32_t)t0, work[wl.item_t1(n)] = (int32_t)t1;
    }
  }
  work[0] = (int32_t)n, work[1] = (int32_t)cc, work[2] = (int32_t)cf;
}

/// \brief Paged decode attention over HQMQ pages (kvq.paged_decode_attention_hqmq).  `base`
/// holds q / out, the shapes, the tables and the full-precision pools (base.k / base.v
/// .residual); k / v the HQMQ pools: packed rows int16 [pages, H, P, U] (kvq.hqmq_encode of one
/// [1, H, P, D] block per page: codes_sb is the page stride), the secondary sets [H, S, 4].
/// Pages hold no Med3x records.
struct PagedHqmqParams {
  DecodeAttnParams base;
  HqmqKV k, v;
};

/// \brief CPU twin, any page format: attention of the g query heads of (sequence s, KV head h)
/// in fp32, read through the block table.  `load_comp(role, page, row, x)` decodes row `row`
/// of compressed page `page` of role 0 (keys) or 1 (values) into x [D]; full-precision pages
/// are p.k / p.v .residual.  `row` and `kbuf` are scratch (resized here).
template <typename DType, typename LoadComp>
void paged_attention_rows_cpu(const DecodeAttnParams& p, int64_t s, int64_t h, std::vector<float>& row,
                              std::vector<float>& kbuf, LoadComp&& load_comp) {
  const PagedKV& pg = p.paged;
  const int64_t D = p.D, g = p.Hq / p.H;
  const int64_t T = pg.seq_lens[s] > 0 ? pg.seq_lens[s] : 0, Tc = paged_comp_len(T, pg.comp_lens[s]);
  const int64_t P = int64_t(1) << pg.page_shift;
  const int32_t* bt = pg.block_table + s * pg.bt_stride;
  const DType* q = static_cast<const DType*>(p.q) + (s * p.Hq + h * g) * D;
  DType* out = static_cast<DType*>(p.out) + (s * p.Hq + h * g) * D;
  row.resize(g * (T > 0 ? T : 1));
  kbuf.resize(D + 2 * g * D);
  float* xt = kbuf.data();
  float* qf = xt + D;
  float* acc = qf + g * D;
  for (int64_t i = 0; i < g * D; ++i) qf[i] = to_float(q[i]), acc[i] = 0.f;
  auto load = [&](int role, int64_t t) {
    const int64_t page = bt[t / P], r = t % P;
    if (t < Tc) {
      load_comp(role, page, r, xt);
    } else {
      const QuantKV& st = role == 0 ? p.k : p.v;
      const DType* x = static_cast<const DType*>(st.residual) + page * st.res_sb + h * st.res_sh + r * D;
      for (int64_t c = 0; c < D; ++c) xt[c] = to_float(x[c]);
    }
  };
  std::vector<float> m(g, -INFINITY), l(g, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    load(0, t);
    for (int64_t j = 0; j < g; ++j) {
      float sc = 0.f;
      for (int64_t c = 0; c < D; ++c) sc += qf[j * D + c] * xt[c];
      row[j * T + t] = sc * p.scale;
      m[j] = std::fmax(m[j], row[j * T + t]);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    load(1, t);
    for (int64_t j = 0; j < g; ++j) {
      const float e = std::exp(row[j * T + t] - m[j]);
      l[j] += e;
      for (int64_t c = 0; c < D; ++c) acc[j * D + c] += e * xt[c];
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t c = 0; c < D; ++c) out[j * D + c] = from_float<DType>(l[j] > 0.f ? acc[j * D + c] / l[j] : 0.f);
    if (pg.lse != nullptr) pg.lse[s * p.Hq + h * g + j] = l[j] > 0.f ? m[j] + std::log(l[j]) : -INFINITY;
  }
}

/// \brief CPU twin of kvq.paged_decode_attention (group-quantized pages).
template <typename DType>
void paged_decode_attention_cpu(const DecodeAttnParams& p, int64_t s, int64_t h, std::vector<float>& row,
                                std::vector<float>& kbuf) {
  paged_attention_rows_cpu<DType>(p, s, h, row, kbuf, [&](int role, int64_t page, int64_t r, float* x) {
    const QuantKV& st = role == 0 ? p.k : p.v;
    for (int64_t c = 0; c < p.D; ++c) x[c] = dequant_at(st, page, h, r, c, p.D);
  });
}

/// \brief CPU twin of kvq.paged_decode_attention_hqmq (HQMQ pages: the dense decode of
/// hqmq_decode_row_cpu, as kvq.hqmq_decode).
template <typename DType>
void paged_decode_attention_hqmq_cpu(const PagedHqmqParams& hp, int64_t s, int64_t h, std::vector<float>& row,
                                     std::vector<float>& kbuf) {
  paged_attention_rows_cpu<DType>(hp.base, s, h, row, kbuf, [&](int role, int64_t page, int64_t r, float* x) {
    const HqmqKV& st = role == 0 ? hp.k : hp.v;
    hqmq_decode_row_cpu(st, h, st.codes + page * st.codes_sb + h * st.codes_sh + r * st.row.units, hp.base.D, x);
  });
}

}  // namespace attention
}  // namespace kvq
