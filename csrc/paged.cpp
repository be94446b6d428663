// The paged KV ops: kvq.paged_append (tokens into their pages by slot; full pages compressed),
// kvq.paged_decode_plan (the work list of a batch), kvq.paged_decode_attention (group-quantized
// and fp16 pages) and kvq.paged_decode_attention_hqmq (HQMQ pages).  Argument checks and the CPU
// implementations; the CUDA ones are in cuda_bindings.cpp.  Storage layout:
// include/kvq/attention/paged_decode_attention.h and docs/serving.md.  Built with
// -ffp-contract=off like hqmq.cpp, so that the HQMQ pages decode exactly like kvq.hqmq_decode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kvq/attention/paged_decode_attention.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

static const char* kAppend = "paged_append";
static const char* kPlan = "paged_decode_plan";
static const char* kAttn = "paged_decode_attention";
static const char* kAttnHqmq = "paged_decode_attention_hqmq";

/// log2 of the page size P of a full-precision pool [pages, H, P, D] (P a power of two).
static int page_shift_of(const char* op, const at::Tensor& fp, const char* name) {
  const int64_t P = fp.size(2);
  KVQ_CHECK_ARG(P > 0 && (P & (P - 1)) == 0, op, name, "must hold pages of a power-of-two token count P, got P=", P);
  int s = 0;
  while ((int64_t(1) << s) < P) ++s;
  return s;
}

static void check_fp_pools(const char* op, const at::Tensor& k_fp, const at::Tensor& v_fp) {
  CHECK_FLOATING(op, k_fp, "k_fp");
  CHECK_DIM(op, k_fp, "k_fp", 4);
  CHECK_DIM(op, v_fp, "v_fp", 4);
  CHECK_SAME_DEVICE(op, k_fp, "k_fp", v_fp, "v_fp");
  KVQ_CHECK_ARG(v_fp.sizes() == k_fp.sizes() && v_fp.scalar_type() == k_fp.scalar_type(), op, "v_fp",
                "must have the shape and dtype of 'k_fp' (", k_fp.sizes(), ", ", k_fp.scalar_type(), "), got ",
                v_fp.sizes(), ", ", v_fp.scalar_type());
  KVQ_CHECK_ARG(k_fp.is_contiguous() && v_fp.is_contiguous(), op, "k_fp", "and 'v_fp' must be contiguous");
}

/// Group size of a compressed role from its scale pool: per channel [pages, H, P / G, D],
/// per token [pages, H, P, D / G].
static int64_t pool_group(const char* op, const at::Tensor& scale, const char* name, bool per_channel, int64_t P,
                          int64_t D) {
  CHECK_DIM(op, scale, name, 4);
  const int64_t n = per_channel ? scale.size(2) : scale.size(3);
  KVQ_CHECK_ARG(per_channel ? scale.size(3) == D : scale.size(2) == P, op, name, "must be [pages, H, ",
                per_channel ? "P/G, D" : "P, D/G", "] for ", per_channel ? "per-channel" : "per-token",
                " grouping, got ", scale.sizes());
  const int64_t len = per_channel ? P : D;
  KVQ_CHECK_ARG(n > 0 && len % n == 0, op, name, "has ", n, " groups, which does not divide ", len);
  return len / n;
}

/// The compressed pool of one role: codes int32 [pages, H, P, D * bits / 32], scale / zero fp16.
static attention::QuantKV make_pool_role(const char* op, const std::string& r, const at::Tensor& fp,
                                         const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& scale,
                                         const std::optional<at::Tensor>& zero, int64_t bits, bool per_channel) {
  attention::QuantKV s;
  const int64_t H = fp.size(1), P = fp.size(2), D = fp.size(3);
  s.residual = fp.data_ptr();
  s.res_sb = fp.stride(0), s.res_sh = fp.stride(1);
  s.bits = (int)bits;
  s.per_channel = per_channel;
  const bool has = codes.has_value() && codes->defined();
  const auto cn = r + "_codes", sn = r + "_scale", zn = r + "_zero";
  KVQ_CHECK_ARG(has == (scale.has_value() && scale->defined()) && has == (zero.has_value() && zero->defined()), op,
                cn.c_str(), "'", sn, "' and '", zn, "' must be given together");
  if (!has) return s;
  KVQ_CHECK_ARG(supported_bits(bits), op, "bits", "must be ", kBitsText, ", got ", bits);
  CHECK_DTYPE(op, *codes, cn.c_str(), at::kInt);
  CHECK_DTYPE(op, *scale, sn.c_str(), at::kHalf);
  CHECK_DTYPE(op, *zero, zn.c_str(), at::kHalf);
  CHECK_DIM(op, *codes, cn.c_str(), 4);
  for (const at::Tensor* t : {&*codes, &*scale, &*zero}) {
    const char* name = t == &*codes ? cn.c_str() : t == &*scale ? sn.c_str() : zn.c_str();
    CHECK_SAME_DEVICE(op, fp, "k_fp", *t, name);
    KVQ_CHECK_ARG(t->is_contiguous(), op, name, "must be contiguous");
  }
  KVQ_CHECK_ARG(codes->size(1) == H && codes->size(2) == P && codes->size(3) == D * bits / 32, op, cn.c_str(),
                "must be [pages, H=", H, ", P=", P, ", D*bits/32=", D * bits / 32, "], got ", codes->sizes());
  s.group = pool_group(op, *scale, sn.c_str(), per_channel, P, D);
  KVQ_CHECK_ARG(scale->size(0) == codes->size(0) && scale->size(1) == H && zero->sizes() == scale->sizes(), op,
                sn.c_str(), "and '", zn, "' must have one entry per page and head of '", cn, "'");
  s.codes = codes->data_ptr<int32_t>();
  s.scale = reinterpret_cast<const uint16_t*>(scale->data_ptr());
  s.zero = reinterpret_cast<const uint16_t*>(zero->data_ptr());
  s.codes_sb = codes->stride(0), s.codes_sh = codes->stride(1);
  s.scale_sb = scale->stride(0), s.scale_sh = scale->stride(1);
  s.Tq = codes->size(0) * P;  // nonzero: the pool exists (lengths are per sequence, on the device)
  return s;
}

// ---------------------------------------------------------------------------------------------
// kvq.paged_append
// ---------------------------------------------------------------------------------------------
/// The page compression of a paged_append call over the contiguous pairs src / dst (undefined:
/// none): every argument checked (on the CPU also every pair's pages), nothing written.  M = 0
/// when the call compresses nothing.
static attention::PagedCompressParams prepare_paged_compress(
    const at::Tensor& k_fp, const at::Tensor& v_fp, const std::optional<at::Tensor>& k_codes,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
    const std::optional<at::Tensor>& v_codes, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& v_zero, const at::Tensor& src, const at::Tensor& dst, int64_t bits,
    bool k_per_channel, bool v_per_channel) {
  attention::PagedCompressParams c;
  KVQ_CHECK_ARG(src.defined() == dst.defined(), kAppend, "compress_src", "and 'compress_dst' must be given together");
  if (!src.defined()) return c;
  for (const at::Tensor* t : {&src, &dst}) {
    const char* name = t == &src ? "compress_src" : "compress_dst";
    CHECK_DTYPE(kAppend, *t, name, at::kLong);
    CHECK_SAME_DEVICE(kAppend, k_fp, "k_fp", *t, name);
    KVQ_CHECK_ARG(t->dim() == 1 && t->size(0) == src.size(0), kAppend, name,
                  "must be [M] with M = len(compress_src), got ", t->sizes());
  }
  const attention::QuantKV ks = make_pool_role(kAppend, "k", k_fp, k_codes, k_scale, k_zero, bits, k_per_channel);
  const attention::QuantKV vs = make_pool_role(kAppend, "v", v_fp, v_codes, v_scale, v_zero, bits, v_per_channel);
  KVQ_CHECK_ARG(ks.codes != nullptr && vs.codes != nullptr, kAppend, "k_codes",
                "(and the other compressed pools) are needed to compress pages");
  KVQ_CHECK_ARG(v_codes->size(0) == k_codes->size(0), kAppend, "v_codes", "must have as many pages as 'k_codes' (",
                k_codes->size(0), "), got ", v_codes->size(0));
  c.src = src.data_ptr<int64_t>(), c.dst = dst.data_ptr<int64_t>();
  c.M = src.size(0), c.H = k_fp.size(1), c.P = k_fp.size(2), c.D = k_fp.size(3), c.bits = (int)bits;
  c.fp_pages = k_fp.size(0), c.comp_pages = k_codes->size(0);
  const std::optional<at::Tensor>* pools[2][3] = {{&k_codes, &k_scale, &k_zero}, {&v_codes, &v_scale, &v_zero}};
  for (int r = 0; r < 2; ++r) {
    attention::PagedCompressRole& cr = c.role[r];
    cr.fp = (r == 0 ? k_fp : v_fp).data_ptr();
    cr.codes = (*pools[r][0])->data_ptr<int32_t>();
    cr.scale = reinterpret_cast<uint16_t*>((*pools[r][1])->data_ptr());
    cr.zero = reinterpret_cast<uint16_t*>((*pools[r][2])->data_ptr());
    cr.group = (r == 0 ? ks : vs).group, cr.per_channel = (r == 0 ? ks : vs).per_channel;
  }
  if (k_fp.is_cpu())
    for (int64_t m = 0; m < c.M; ++m) {
      KVQ_CHECK_ARG(c.src[m] >= 0 && c.src[m] < c.fp_pages, kAppend, "compress_src", "entry ", m, " is ", c.src[m],
                    ", not a page of the full-precision pool (", c.fp_pages, " pages)");
      KVQ_CHECK_ARG(c.dst[m] >= 0 && c.dst[m] < c.comp_pages, kAppend, "compress_dst", "entry ", m, " is ", c.dst[m],
                    ", not a page of the compressed pool (", c.comp_pages, " pages)");
    }
  return c;
}

void paged_append(const at::Tensor& k_fp, const at::Tensor& v_fp, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_codes,
                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
                  const std::optional<at::Tensor>& v_codes, const std::optional<at::Tensor>& v_scale,
                  const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& compress_src,
                  const std::optional<at::Tensor>& compress_dst, int64_t bits, bool k_per_channel,
                  bool v_per_channel) {
  check_fp_pools(kAppend, k_fp, v_fp);
  KVQ_CHECK_ARG(k_fp.is_cpu() || k_fp.is_cuda(), kAppend, "k_fp", "must be on the CPU or a CUDA device, got ",
                k_fp.device());
#ifndef KVQ_WITH_CUDA
  KVQ_CHECK_ARG(k_fp.is_cpu(), kAppend, "k_fp", "must be on the CPU (this build has no CUDA), got ", k_fp.device());
#endif
  const int64_t H = k_fp.size(1), P = k_fp.size(2), D = k_fp.size(3);
  for (const at::Tensor* t : {&k, &v}) {
    const char* name = t == &k ? "k" : "v";
    CHECK_DIM(kAppend, *t, name, 3);
    CHECK_SAME_DEVICE(kAppend, k_fp, "k_fp", *t, name);
    KVQ_CHECK_ARG(t->size(1) == H && t->size(2) == D, kAppend, name, "must be [N, H=", H, ", D=", D, "], got ",
                  t->sizes());
    KVQ_CHECK_ARG(t->scalar_type() == k_fp.scalar_type(), kAppend, name, "must have the cache dtype ",
                  k_fp.scalar_type(), ", got ", t->scalar_type());
  }
  KVQ_CHECK_ARG(v.size(0) == k.size(0), kAppend, "v", "must hold as many tokens as 'k' (", k.size(0), "), got ",
                v.size(0));
  CHECK_DTYPE(kAppend, slot_mapping, "slot_mapping", at::kLong);
  CHECK_SAME_DEVICE(kAppend, k_fp, "k_fp", slot_mapping, "slot_mapping");
  KVQ_CHECK_ARG(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), kAppend, "slot_mapping",
                "must be [N=", k.size(0), "], got ", slot_mapping.sizes());
  const at::Tensor slots = slot_mapping.contiguous();
  attention::PagedWriteParams w;
  w.N = k.size(0), w.H = H, w.D = D, w.pages = k_fp.size(0);
  w.page_shift = page_shift_of(kAppend, k_fp, "k_fp");
  w.slots = slots.data_ptr<int64_t>();
  if (k_fp.is_cpu()) {
    const int64_t capacity = w.pages * P;
    for (int64_t n = 0; n < w.N; ++n)
      KVQ_CHECK_ARG(w.slots[n] < capacity, kAppend, "slot_mapping", "entry ", n, " is ", w.slots[n],
                    ", past the pool's ", capacity, " slots (", w.pages, " pages of ", P, " tokens)");
  }
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const at::Tensor src = given(compress_src) ? compress_src->contiguous() : at::Tensor();
  const at::Tensor dst = given(compress_dst) ? compress_dst->contiguous() : at::Tensor();
  const attention::PagedCompressParams c = prepare_paged_compress(
      k_fp, v_fp, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, src, dst, bits, k_per_channel, v_per_channel);
  // every argument is checked: first the tokens, then the pages (which may hold them)
  if (w.N > 0) {
    // rows with a contiguous last dim; the pools are written in place (schema: Tensor(a!), Tensor(b!))
    const at::Tensor kr = k.stride(2) == 1 ? k : k.contiguous(), vr = v.stride(2) == 1 ? v : v.contiguous();
    w.k = kr.data_ptr(), w.v = vr.data_ptr();
    w.k_sn = kr.stride(0), w.k_sh = kr.stride(1), w.v_sn = vr.stride(0), w.v_sh = vr.stride(1);
    w.k_fp = k_fp.data_ptr(), w.v_fp = v_fp.data_ptr();
    w.elem_bytes = (int)k_fp.element_size();
    if (k_fp.is_cpu()) {
      attention::paged_write_rows_host(w);
    } else {
#ifdef KVQ_WITH_CUDA
      paged_write_rows_on_device(w, k_fp);
#endif
    }
  }
  if (c.M == 0) return;
  if (k_fp.is_cpu()) {
    const auto dt = dtype_id(k_fp.scalar_type());
    at::parallel_for(0, c.M * H, parallel_grain(2 * P * D), [&](int64_t lo, int64_t hi) {
      KVQ_DISPATCH_DTYPE(dt, DType, [&] { attention::paged_compress_host<DType>(c, lo, hi); });
    });
  } else {
#ifdef KVQ_WITH_CUDA
    paged_compress_on_device(c, k_fp);
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// kvq.paged_decode_plan
// ---------------------------------------------------------------------------------------------
at::Tensor paged_decode_plan_prepare(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items) {
  CHECK_DTYPE(kPlan, seq_lens, "seq_lens", at::kInt);
  CHECK_DTYPE(kPlan, comp_lens, "comp_lens", at::kInt);
  CHECK_SAME_DEVICE(kPlan, seq_lens, "seq_lens", comp_lens, "comp_lens");
  KVQ_CHECK_ARG(seq_lens.dim() == 1 && seq_lens.is_contiguous(), kPlan, "seq_lens", "must be a contiguous [num_seqs]");
  KVQ_CHECK_ARG(comp_lens.sizes() == seq_lens.sizes() && comp_lens.is_contiguous(), kPlan, "comp_lens",
                "must be a contiguous [num_seqs=", seq_lens.size(0), "], got ", comp_lens.sizes());
  const int64_t n = seq_lens.size(0);
  KVQ_CHECK_ARG(max_items >= attention::paged_min_items(n) && max_items <= 65535, kPlan, "max_items",
                "must be in [2 num_seqs + 2 = ", attention::paged_min_items(n), ", 65535], got ", max_items);
  return at::empty({attention::PagedWork{max_items, n}.size()}, seq_lens.options());
}

at::Tensor paged_decode_plan_cpu(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items) {
  at::Tensor work = paged_decode_plan_prepare(seq_lens, comp_lens, max_items);
  attention::paged_plan_host(seq_lens.data_ptr<int32_t>(), comp_lens.data_ptr<int32_t>(), seq_lens.size(0), max_items,
                             work.data_ptr<int32_t>());
  return work;
}

// ---------------------------------------------------------------------------------------------
// kvq.paged_decode_attention
// ---------------------------------------------------------------------------------------------
/// q, the full-precision pools, the tables and the outputs of a paged attention call of `op`
/// (p.k / p.v: the full-precision pools only; the caller adds the compressed pools).
static void prepare_paged_common(const char* op, PagedAttentionCall& c, const at::Tensor& q, const at::Tensor& k_fp,
                                 const at::Tensor& v_fp, const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 const at::Tensor& comp_lens, const at::Tensor& work, double scale) {
  CHECK_FLOATING(op, q, "q");
  CHECK_DIM(op, q, "q", 3);
  check_fp_pools(op, k_fp, v_fp);
  c.q = q.contiguous();
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t H = k_fp.size(1), P = k_fp.size(2);
  KVQ_CHECK_ARG(supported_head_dim(D), op, "q", "head dim must be ", kHeadDimsText, ", got ", D);
  KVQ_CHECK_ARG(k_fp.size(3) == D, op, "k_fp", "must have the head dim of 'q' (", D, "), got ", k_fp.size(3));
  KVQ_CHECK_ARG(H > 0 && Hq % H == 0, op, "q", "has ", Hq, " heads, which is not a multiple of the cache's ", H,
                " KV heads");
  KVQ_CHECK_ARG(Hq / H <= attention::kPagedMaxGroup, op, "q", "has ", Hq / H, " query heads per KV head; at most ",
                attention::kPagedMaxGroup, " are supported per call (split the query heads)");
  KVQ_CHECK_ARG(q.scalar_type() == k_fp.scalar_type(), op, "q", "must have the cache dtype ", k_fp.scalar_type(),
                ", got ", q.scalar_type());
  CHECK_SAME_DEVICE(op, q, "q", k_fp, "k_fp");
  auto& p = c.params;
  p.paged.page_shift = page_shift_of(op, k_fp, "k_fp");
  const std::optional<at::Tensor> none;
  p.k = make_pool_role(op, "k", k_fp, none, none, none, 2, true);
  p.v = make_pool_role(op, "v", v_fp, none, none, none, 2, false);
  for (const at::Tensor* t : {&block_table, &seq_lens, &comp_lens, &work}) {
    const char* name = t == &block_table ? "block_table" : t == &seq_lens ? "seq_lens" : t == &comp_lens ? "comp_lens"
                                                                                                           : "work";
    CHECK_DTYPE(op, *t, name, at::kInt);
    CHECK_SAME_DEVICE(op, q, "q", *t, name);
  }
  KVQ_CHECK_ARG(block_table.dim() == 2 && block_table.size(0) == n && block_table.stride(1) == 1, op, "block_table",
                "must be [num_seqs=", n, ", max_pages] with a contiguous last dim, got ", block_table.sizes());
  KVQ_CHECK_ARG(seq_lens.dim() == 1 && seq_lens.size(0) == n && seq_lens.is_contiguous(), op, "seq_lens",
                "must be a contiguous [num_seqs=", n, "]");
  KVQ_CHECK_ARG(comp_lens.dim() == 1 && comp_lens.size(0) == n && comp_lens.is_contiguous(), op, "comp_lens",
                "must be a contiguous [num_seqs=", n, "]");
  const int64_t wn = work.numel() - attention::PagedWork::kHeader - 2 * n;
  KVQ_CHECK_ARG(work.dim() == 1 && work.is_contiguous() && wn > 0 && wn % 3 == 0 &&
                    wn / 3 >= attention::paged_min_items(n),
                op, "work", "must be the plan of these ", n, " sequences (kvq.paged_decode_plan), got ",
                work.sizes());
  p.paged.max_items = wn / 3;
  p.paged.block_table = block_table.data_ptr<int32_t>();
  p.paged.bt_stride = block_table.stride(0);
  p.paged.seq_lens = seq_lens.data_ptr<int32_t>();
  p.paged.comp_lens = comp_lens.data_ptr<int32_t>();
  p.paged.work = work.data_ptr<int32_t>();
  c.out = at::empty_like(c.q);
  c.lse = at::empty({n, Hq}, c.q.options().dtype(at::kFloat));
  p.paged.lse = c.lse.data_ptr<float>();
  p.q = c.q.data_ptr();
  p.out = c.out.data_ptr();
  p.B = n, p.H = H, p.Hq = Hq, p.D = D, p.T = block_table.size(1) * P;
  p.scale = (float)scale;
  p.dtype_bytes = (int)c.q.element_size();
}

PagedAttentionCall prepare_paged_decode_attention(KVQ_PAGED_ATTN_ARGS) {
  PagedAttentionCall c;
  prepare_paged_common(kAttn, c, q, k_fp, v_fp, block_table, seq_lens, comp_lens, work, scale);
  auto& p = c.params;
  p.k = make_pool_role(kAttn, "k", k_fp, k_codes, k_scale, k_zero, bits, k_per_channel);
  p.v = make_pool_role(kAttn, "v", v_fp, v_codes, v_scale, v_zero, bits, v_per_channel);
  KVQ_CHECK_ARG((p.k.codes != nullptr) == (p.v.codes != nullptr), kAttn, "v_codes",
                "must be given exactly when 'k_codes' is");
  if (p.k.codes != nullptr)
    KVQ_CHECK_ARG(k_codes->size(0) == v_codes->size(0), kAttn, "v_codes", "must have as many pages as 'k_codes'");
  return c;
}

/// The CPU reads the lengths and the block table: check them (the CUDA kernels trust them).
/// `ncp` compressed pages (0: none), `nfp` full-precision pages.
static void check_paged_tables_cpu(const char* op, const attention::DecodeAttnParams& p, int64_t max_pages,
                                   int64_t ncp, int64_t nfp) {
  const int64_t P = int64_t(1) << p.paged.page_shift;
  for (int64_t s = 0; s < p.B; ++s) {
    const int64_t len = p.paged.seq_lens[s], comp = p.paged.comp_lens[s];
    KVQ_CHECK_ARG(len >= 0 && len <= max_pages * P, op, "seq_lens", "entry ", s, " is ", len,
                  ", outside [0, max_pages * P = ", max_pages * P, "]");
    KVQ_CHECK_ARG(comp >= 0 && comp <= len && comp % P == 0 && (comp == 0 || ncp > 0), op, "comp_lens", "entry ", s,
                  " is ", comp, ": must be a multiple of P=", P, " in [0, seq_lens[s]=", len,
                  "] (and 0 without compressed pools)");
    for (int64_t i = 0; i < (len + P - 1) / P; ++i) {
      const int64_t id = p.paged.block_table[s * p.paged.bt_stride + i], lim = i * P < comp ? ncp : nfp;
      KVQ_CHECK_ARG(id >= 0 && id < lim, op, "block_table", "entry [", s, ", ", i, "] = ", id, " is not a page of ",
                    i * P < comp ? "the compressed pool" : "the full-precision pool", " (", lim, " pages)");
    }
  }
}

/// Runs row(bh) for every (sequence, KV head) on the CPU's threads, the grain from the
/// average work of a row.
template <typename Row>
static void paged_rows_parallel(const attention::DecodeAttnParams& p, Row&& row) {
  int64_t total_len = 0;
  for (int64_t s = 0; s < p.B; ++s) total_len += p.paged.seq_lens[s];
  const int64_t H = p.H;
  // per (sequence, KV head), on average: Hq/H queries x its tokens x D, a key and a value
  // multiply-add each
  const int64_t per_row = 4 * (p.Hq / std::max<int64_t>(H, 1)) * (total_len / std::max<int64_t>(p.B, 1)) * p.D;
  at::parallel_for(0, p.B * H, parallel_grain(per_row), [&](int64_t lo, int64_t hi) {
    std::vector<float> r, kbuf;
    for (int64_t bh = lo; bh < hi; ++bh) row(bh / H, bh % H, r, kbuf);
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cpu(KVQ_PAGED_ATTN_ARGS) {
  PagedAttentionCall c = prepare_paged_decode_attention(q, k_fp, v_fp, k_codes, k_scale, k_zero, v_codes, v_scale,
                                                        v_zero, block_table, seq_lens, comp_lens, work, bits,
                                                        k_per_channel, v_per_channel, scale);
  const auto& p = c.params;
  check_paged_tables_cpu(kAttn, p, block_table.size(1), k_codes.has_value() && k_codes->defined() ? k_codes->size(0) : 0,
                         k_fp.size(0));
  const auto dt = c.q.scalar_type();
  paged_rows_parallel(p, [&](int64_t s, int64_t h, std::vector<float>& r, std::vector<float>& kbuf) {
    KVQ_DISPATCH_DTYPE(dtype_id(dt), DType, [&] { attention::paged_decode_attention_cpu<DType>(p, s, h, r, kbuf); });
  });
  return {c.out, c.lse};
}

// ---------------------------------------------------------------------------------------------
// kvq.paged_decode_attention_hqmq
// ---------------------------------------------------------------------------------------------
/// The HQMQ pool of one role: packed rows int16 [pages, H, P, U], secondary sets float32
/// [H, S, 4], both contiguous.
static attention::HqmqKV make_hqmq_pool_role(const std::string& r, const at::Tensor& fp, const at::Tensor& codes,
                                             const at::Tensor& secondary, int64_t radius_bits) {
  const int64_t H = fp.size(1), P = fp.size(2), D = fp.size(3);
  attention::HqmqKV s = hqmq_role_fields(kAttnHqmq, r, "radius_bits", fp, "k_fp", codes, secondary, radius_bits, H, D);
  for (const at::Tensor* t : {&codes, &secondary}) {
    const std::string name = r + (t == &codes ? "_codes" : "_secondary");
    KVQ_CHECK_ARG(t->is_contiguous(), kAttnHqmq, name.c_str(), "must be contiguous");
  }
  KVQ_CHECK_ARG(codes.size(2) == P, kAttnHqmq, (r + "_codes").c_str(), "must hold pages of P=", P,
                " tokens, got ", codes.sizes());
  s.secondary = secondary.data_ptr<float>();
  return s;
}

PagedHqmqCall prepare_paged_decode_attention_hqmq(KVQ_PAGED_ATTN_HQMQ_ARGS) {
  PagedHqmqCall c;
  prepare_paged_common(kAttnHqmq, c, q, k_fp, v_fp, block_table, seq_lens, comp_lens, work, scale);
  c.k = make_hqmq_pool_role("k", k_fp, k_codes, k_secondary, radius_bits);
  c.v = make_hqmq_pool_role("v", v_fp, v_codes, v_secondary, radius_bits);
  KVQ_CHECK_ARG(v_codes.size(0) == k_codes.size(0), kAttnHqmq, "v_codes", "must have as many pages as 'k_codes' (",
                k_codes.size(0), "), got ", v_codes.size(0));
  return c;
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_hqmq_cpu(KVQ_PAGED_ATTN_HQMQ_ARGS) {
  PagedHqmqCall c = prepare_paged_decode_attention_hqmq(q, k_fp, v_fp, k_codes, k_secondary, v_codes,
                                                        v_secondary, block_table, seq_lens, comp_lens, work,
                                                        radius_bits, scale);
  const attention::PagedHqmqParams hp = c.kernel_params();
  check_paged_tables_cpu(kAttnHqmq, hp.base, block_table.size(1), k_codes.size(0), k_fp.size(0));
  const auto dt = c.q.scalar_type();
  paged_rows_parallel(hp.base, [&](int64_t s, int64_t h, std::vector<float>& r, std::vector<float>& kbuf) {
    KVQ_DISPATCH_DTYPE(dtype_id(dt), DType,
                       [&] { attention::paged_decode_attention_hqmq_cpu<DType>(hp, s, h, r, kbuf); });
  });
  return {c.out, c.lse};
}

}  // namespace kvq
