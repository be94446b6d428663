// kvq.outlier_select / kvq.lowrank_power_iter / kvq.gear_compress / kvq.gear_decompress:
// argument checks, output allocation and the CPU implementations (the CUDA ones are in
// cuda_bindings.cpp and share the prepare_*() functions below).
#include <ATen/Parallel.h>

#include <cmath>

#include "kvq/gear/gear.h"
#include "kvq/gear/gear_keys.h"
#include "kvq/linalg/power_svd.h"
#include "kvq/select/outlier_topk.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

static at::ScalarType index_dtype(int64_t L) {
  switch (select::index_bytes(L)) {
    case 1: return at::kByte;
    case 2: return at::kShort;
    default: return at::kInt;
  }
}

static std::vector<int64_t> lead_shape(const at::Tensor& t, int keep) {
  return t.sizes().slice(0, t.dim() - keep).vec();
}

static std::vector<int64_t> with_tail(std::vector<int64_t> s, int64_t a, int64_t b) {
  s.push_back(a);
  s.push_back(b);
  return s;
}

// ----------------------------------------------------------------------------- select
OutlierSelectCall prepare_outlier_select(const at::Tensor& x_in, int64_t k, bool per_channel,
                                         bool want_bounds, const char* op) {
  CHECK_FLOATING(op, x_in, "x");
  CHECK_MIN_DIM(op, x_in, "x", 2);
  const int64_t T = x_in.size(-2), D = x_in.size(-1);
  const int64_t V = per_channel ? D : T, L = per_channel ? T : D;
  KVQ_CHECK_ARG(k >= 0, op, "k", "must be >= 0, got ", k);
  KVQ_CHECK_ARG(2 * k <= L, op, "k", "must satisfy 2k <= vector length (",
                per_channel ? "T" : "D", "=", L, "), got k=", k);
  KVQ_CHECK_ARG(L < (int64_t(1) << 31), op, "x", "vectors longer than 2^31 are not supported");
  OutlierSelectCall c;
  c.x = contiguous_aligned(x_in);
  auto lead = lead_shape(c.x, 2);
  c.values = at::empty(with_tail(lead, V, 2 * k), c.x.options());
  c.indices = at::empty(with_tail(lead, V, 2 * k), c.x.options().dtype(index_dtype(L)));
  if (want_bounds) c.bounds = at::empty(with_tail(lead, V, 2), c.x.options().dtype(at::kFloat));
  c.index_bytes = select::index_bytes(L);
  auto& p = c.params;
  p.x = c.x.data_ptr();
  p.values = c.values.data_ptr();
  p.indices = c.indices.data_ptr();
  p.bounds = want_bounds ? c.bounds.data_ptr<float>() : nullptr;
  p.keys_ws = nullptr;
  p.N = leading_numel(c.x, 2);
  p.T = T;
  p.D = D;
  p.k = k;
  p.per_channel = per_channel;
  return c;
}

static void run_outlier_select_cpu(const OutlierSelectCall& c) {
  const auto& p = c.params;
  const int64_t nvec = p.N * select::num_vectors(p);
  if (p.k == 0 || nvec == 0) return;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.x.scalar_type()), DType, [&] {
      KVQ_DISPATCH_INDEX_BYTES(c.index_bytes, IdType, [&] {
        // per vector: passes over its L entries, a few per kept entry
        const int64_t work = 8 * select::vector_length(p) * (int64_t)sizeof(DType);
        at::parallel_for(0, nvec, parallel_grain(work), [&](int64_t b, int64_t e) {
          select::outlier_select_cpu<DType, IdType>(p, b, e);
        });
      });
    });
  });
}

std::tuple<at::Tensor, at::Tensor> outlier_select_cpu(const at::Tensor& x, int64_t k,
                                                      bool per_channel) {
  OutlierSelectCall c = prepare_outlier_select(x, k, per_channel, false, "outlier_select");
  run_outlier_select_cpu(c);
  return {c.values, c.indices};
}

// ----------------------------------------------------------------------------- power iteration
PowerIterCall prepare_power_iter(const at::Tensor& x_in, int64_t rank, int64_t iters, int64_t seed,
                                 bool want_ws, const char* op) {
  CHECK_FLOATING(op, x_in, "x");
  CHECK_MIN_DIM(op, x_in, "x", 2);
  const int64_t T = x_in.size(-2), d = x_in.size(-1);
  KVQ_CHECK_ARG(d >= 1 && d <= 256, op, "x", "must have a last dimension d in [1, 256], got ", d);
  KVQ_CHECK_ARG(rank >= 1 && rank <= linalg::kMaxRank, op, "rank", "must be in [1, 8], got ", rank);
  KVQ_CHECK_ARG(rank <= d && (T == 0 || rank <= T), op, "rank", "must be <= min(T, d) = min(", T,
                ", ", d, "), got ", rank);
  KVQ_CHECK_ARG(iters >= 1, op, "iters", "must be >= 1, got ", iters);
  PowerIterCall c;
  c.x = contiguous_aligned(x_in);
  auto lead = lead_shape(c.x, 2);
  c.A = at::empty(with_tail(lead, T, rank), c.x.options());
  c.B = at::empty(with_tail(lead, d, rank), c.x.options());
  auto& p = c.params;
  p.N = leading_numel(c.x, 2);
  p.T = T;
  p.d = d;
  p.rank = (int)rank;
  p.iters = (int)iters;
  p.seed = (uint64_t)seed;
  if (want_ws) {
    c.ws = at::empty({std::max<int64_t>(1, linalg::power_iter_workspace_floats(p.N, T, d, p.rank))},
                     c.x.options().dtype(at::kFloat));
    p.ws = c.ws.data_ptr<float>();
  } else {
    p.ws = nullptr;
  }
  p.x = c.x.data_ptr();
  p.A = c.A.data_ptr();
  p.B = c.B.data_ptr();
  return c;
}

static void run_power_iter_cpu(const PowerIterCall& c) {
  const auto& p = c.params;
  if (p.N == 0) return;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.x.scalar_type()), DType, [&] {
      // per matrix: iters x (A = X B, B = X^T A), 2 T d r multiply-adds each
      at::parallel_for(0, p.N, parallel_grain(4 * (int64_t)p.iters * p.T * p.d * p.rank), [&](int64_t b, int64_t e) {
        linalg::power_iter_cpu<DType>(p, b, e);
      });
    });
  });
}

std::tuple<at::Tensor, at::Tensor> lowrank_power_iter_cpu(const at::Tensor& x, int64_t rank,
                                                          int64_t iters, int64_t seed) {
  PowerIterCall c = prepare_power_iter(x, rank, iters, seed, false, "lowrank_power_iter");
  run_power_iter_cpu(c);
  return {c.A, c.B};
}

// ----------------------------------------------------------------------------- GEAR
GearCompressCall prepare_gear_compress(const at::Tensor& x, int64_t bits, int64_t group_size,
                                       bool per_channel, double sparsity, int64_t rank,
                                       int64_t iters, int64_t seed, bool check_finite,
                                       bool cuda) {
  const char* op = "gear_compress";
  CHECK_FLOATING(op, x, "x");
  CHECK_MIN_DIM(op, x, "x", 2);
  KVQ_CHECK_ARG(supported_bits(bits), op, "bits", "must be ", kBitsText, ", got ", bits);
  const int64_t T = x.size(-2), D = x.size(-1);
  KVQ_CHECK_ARG(supported_head_dim(D), op, "x",
                "must have a last (head) dimension of ", kHeadDimsText, ", got ", D);
  KVQ_CHECK_ARG(group_size == -1 || group_size > 0, op, "group_size",
                "must be positive or -1 (whole axis), got ", group_size);
  if (per_channel) {
    KVQ_CHECK_ARG(group_size == -1 || T % group_size == 0, op, "group_size",
                  "must divide the token count for per-channel (key) grouping: T=", T,
                  " is not a multiple of ", group_size);
  } else {
    const int64_t G = group_size == -1 ? D : group_size;
    KVQ_CHECK_ARG(D % G == 0 && G >= 8 && (G & (G - 1)) == 0, op, "group_size",
                  "must be a power of two >= 8 dividing the head dim ", D,
                  " for per-token (value) grouping, got ", group_size);
  }
  KVQ_CHECK_ARG(std::isfinite(sparsity) && sparsity >= 0.0 && sparsity < 0.5, op, "sparsity",
                "must be in [0, 0.5), got ", sparsity);
  KVQ_CHECK_ARG(rank >= 0 && rank <= linalg::kMaxRank, op, "rank", "must be in [0, 8], got ", rank);
  KVQ_CHECK_ARG(rank == 0 || T == 0 || rank <= std::min(T, D), op, "rank",
                "must be <= min(T, D) = min(", T, ", ", D, "), got ", rank);
  KVQ_CHECK_ARG(rank == 0 || iters >= 1, op, "iters", "must be >= 1, got ", iters);

  GearCompressCall c;
  c.x = contiguous_aligned(x);
  c.check_finite = check_finite;
  const int64_t N = leading_numel(c.x, 2);
  const int64_t L = per_channel ? T : D;
  c.k = select::outlier_count(sparsity, L);
  // CUDA, short matrices (decode blocks): one fused launch, no intermediate tensors.
  const bool small = cuda && N > 0 && gear::gear_small_smem(T, D) > 0;
  c.small = small;
  {
    const int64_t Gr = per_channel ? (group_size == -1 ? T : group_size) : (group_size == -1 ? D : group_size);
    const int rows = gear::gear_cqr_rows(T, D, Gr, per_channel);
    c.cqr = cuda && !small && N > 0 && N <= 65535 && rows > 0 && (!per_channel || T % rows == 0);
  }
  // CUDA, long fp16 / bf16 key matrices: one fused kernel (gear_keys.h), no xc / keys_ws;
  // KIVI grouping (plan.split): selection kernel (k > 0) + coalesced quantize / residual
  // kernel, exchanging per-channel bounds and thresholds through keys_sel.
  if (cuda && !small && per_channel && c.x.element_size() == 2 && select::index_bytes(T) == 2)
    c.keys = gear::gear_keys_plan(N, T, D, group_size == -1 ? T : group_size, c.k);
  if (c.keys.ok && c.keys.split && c.k > 0)
    c.keys_sel = at::empty({gear::gear_keys_sel_words(N, D)}, c.x.options().dtype(at::kInt));
  c.sel = prepare_outlier_select(c.x, c.k, per_channel, /*want_bounds=*/false, op);
  if (check_finite) c.status = at::zeros({1}, c.x.options().dtype(at::kInt));
  if (c.k > 0 && !small && !c.keys.ok) {
    if (!c.cqr) c.xc = at::empty_like(c.x);
    if (cuda && select::vector_length(c.sel.params) > 256)
      c.keys_ws = at::empty({std::max<int64_t>(1, N * T * D)}, c.x.options().dtype(at::kInt));
    if (c.keys_ws.defined()) c.sel.params.keys_ws = reinterpret_cast<uint32_t*>(c.keys_ws.data_ptr());
  }
  // Backbone (format of kvq.quantize); the finite check is done on x by the clamp step when
  // there are outliers, by the quantizer otherwise.
  c.quant = prepare_quantize(c.xc.defined() ? c.xc : c.x, bits, group_size, per_channel, false);
  c.quant.params.status = (check_finite && c.k == 0) ? c.status.data_ptr<int32_t>() : nullptr;
  auto lead = lead_shape(c.x, 2);
  if (small) {
    // NOTE: x itself is never modified; the fused kernel clamps and quantizes in shared memory.
    c.A = at::empty(with_tail(lead, T, rank), c.x.options().dtype(at::kHalf));
    c.B = at::empty(with_tail(lead, D, rank), c.x.options().dtype(at::kHalf));
    c.rank = rank;
    auto& s = c.small_params;
    s.x = c.x.data_ptr();
    s.codes = c.quant.params.codes;
    s.scale = c.quant.params.scale;
    s.zero = c.quant.params.zero;
    s.ovalues = c.sel.values.data_ptr();
    s.oindices = reinterpret_cast<uint8_t*>(c.sel.indices.data_ptr());
    s.A = reinterpret_cast<uint16_t*>(c.A.data_ptr());
    s.B = reinterpret_cast<uint16_t*>(c.B.data_ptr());
    s.status = check_finite ? c.status.data_ptr<int32_t>() : nullptr;
    s.N = N;
    s.T = T;
    s.D = D;
    s.group = c.quant.params.group;
    s.k = c.k;
    s.bits = (int)bits;
    s.rank = (int)rank;
    s.iters = (int)iters;
    s.seed = (uint64_t)seed;
    s.per_channel = per_channel;
    return c;
  }
  c.resid = at::empty({N, T, D}, c.x.options().dtype(at::kHalf));
  if (rank > 0 && T > 0) {
    c.pi = prepare_power_iter(c.resid, rank, iters, seed, cuda, op);
    c.A = c.pi.A.view(with_tail(lead, T, rank));
    c.B = c.pi.B.view(with_tail(lead, D, rank));
  } else {
    c.A = at::empty(with_tail(lead, T, rank), c.x.options().dtype(at::kHalf));
    c.B = at::zeros(with_tail(lead, D, rank), c.x.options().dtype(at::kHalf));
  }
  c.rank = rank;
  auto& g = c.gear;
  g.x = c.x.data_ptr();
  g.xc = c.xc.defined() ? c.xc.data_ptr() : nullptr;
  g.gbounds = nullptr;  // alloc_gear_fill (CPU and the multi-kernel CUDA path)
  g.omask = nullptr;
  g.resid = reinterpret_cast<uint16_t*>(c.resid.data_ptr());
  g.ovalues = c.sel.values.data_ptr();
  g.oindices = c.sel.indices.data_ptr();
  g.A = nullptr;
  g.B = nullptr;
  g.out = nullptr;
  g.status = check_finite ? c.status.data_ptr<int32_t>() : nullptr;
  g.q = c.quant.params;
  g.N = N;
  g.T = T;
  g.D = D;
  g.k = c.k;
  g.rank = (int)rank;
  g.per_channel = per_channel;
  g.keys_sel = c.keys_sel.defined() ? reinterpret_cast<uint32_t*>(c.keys_sel.data_ptr()) : nullptr;
  return c;
}

void alloc_gear_fill(GearCompressCall& c) {
  auto& g = c.gear;
  c.omask = at::zeros({g.N, g.T, g.D}, c.x.options().dtype(at::kByte));
  c.gbounds = at::empty({std::max<int64_t>(1, 2 * gear::num_groups(g))}, c.x.options().dtype(at::kFloat));
  g.omask = c.omask.data_ptr<uint8_t>();
  g.gbounds = c.gbounds.data_ptr<float>();
}

GearTuple gear_compress_cpu(const at::Tensor& x, int64_t bits, int64_t group_size, bool per_channel,
                            double sparsity, int64_t rank, int64_t iters, int64_t seed,
                            bool check_finite) {
  GearCompressCall c = prepare_gear_compress(x, bits, group_size, per_channel, sparsity, rank,
                                             iters, seed, check_finite, /*cuda=*/false);
  const auto& g = c.gear;
  const int64_t rows = g.N * g.T;
  const int64_t nvec = g.N * select::num_vectors(c.sel.params);
  const auto dt = dtype_id(c.x.scalar_type());
  translate_errors([&] {
    if (c.k > 0) {
      run_outlier_select_cpu(c.sel);
      alloc_gear_fill(c);
      KVQ_DISPATCH_INDEX_BYTES(c.sel.index_bytes, IdType, [&] {
        at::parallel_for(0, nvec, parallel_grain(2 * g.k * 8), [&](int64_t b, int64_t e) {
          gear::gear_set_outliers_cpu<IdType, uint8_t>(g, g.omask, 1, b, e);
        });
      });
      KVQ_DISPATCH_DTYPE(dt, DType, [&] {
        const int64_t ngroups = gear::num_groups(g);
        at::parallel_for(0, ngroups, parallel_grain(rows * g.D / std::max<int64_t>(ngroups, 1) * (int64_t)sizeof(DType)),
                         [&](int64_t b, int64_t e) {
                           for (int64_t u = b; u < e; ++u) gear::gear_group_bounds<DType>(g, u);
                         });
        at::parallel_for(0, rows, parallel_grain(g.D * (int64_t)sizeof(DType)),
                         [&](int64_t b, int64_t e) { gear::gear_clamp_cpu<DType>(g, b, e); });
      });
    }
    const auto& qp = c.quant.params;
    const int64_t units = quant::group_quant_cpu_units(qp);
    KVQ_DISPATCH_DTYPE(dt, DType, [&] {
      at::parallel_for(0, units, parallel_grain(quant::group_quant_cpu_unit_bytes(qp, sizeof(DType))),
                       [&](int64_t b, int64_t e) { quant::group_quantize_cpu<DType>(qp, b, e); });
    });
    at::Tensor deq = at::empty({g.N, g.T, g.D}, c.x.options().dtype(at::kFloat));
    quant::GroupQuantParams dp = qp;
    dp.out = deq.data_ptr<float>();
    at::parallel_for(0, rows, parallel_grain(g.D * (int64_t)sizeof(float)),
                     [&](int64_t b, int64_t e) { quant::group_dequantize_cpu<float>(dp, b, e); });
    KVQ_DISPATCH_DTYPE(dt, DType, [&] {
      at::parallel_for(0, rows, parallel_grain(g.D * (int64_t)(sizeof(DType) + sizeof(float))), [&](int64_t b, int64_t e) {
        gear::gear_residual_cpu<DType>(g, deq.data_ptr<float>(), b, e);
      });
    });
    if (c.k > 0) {
      KVQ_DISPATCH_INDEX_BYTES(c.sel.index_bytes, IdType, [&] {
        at::parallel_for(0, nvec, parallel_grain(2 * g.k * 8), [&](int64_t b, int64_t e) {
          gear::gear_set_outliers_cpu<IdType, uint16_t>(g, g.resid, 0, b, e);
        });
      });
    }
  });
  if (check_finite) raise_status("gear_compress", "x", c.status.item<int32_t>());
  if (c.rank > 0 && g.T > 0) run_power_iter_cpu(c.pi);
  return {c.quant.codes, c.quant.scale, c.quant.zero, c.sel.values, c.sel.indices, c.A, c.B};
}

GearDecompressCall prepare_gear_decompress(const at::Tensor& codes, const at::Tensor& scale,
                                           const at::Tensor& zero, const at::Tensor& ovalues,
                                           const at::Tensor& oindices, const at::Tensor& A,
                                           const at::Tensor& B, int64_t bits, bool per_channel,
                                           at::ScalarType dtype) {
  const char* op = "gear_decompress";
  GearDecompressCall c;
  c.dq = prepare_dequantize(codes, scale, zero, bits, per_channel, dtype);
  const int64_t T = codes.size(-2), D = c.dq.params.D, N = c.dq.params.N;
  const int64_t V = per_channel ? D : T, L = per_channel ? T : D;
  auto lead = lead_shape(codes, 2);
  CHECK_DTYPE(op, ovalues, "outlier_values", dtype);
  CHECK_DTYPE(op, oindices, "outlier_indices", index_dtype(L));
  KVQ_CHECK_ARG(ovalues.dim() == codes.dim() && lead_shape(ovalues, 2) == lead &&
                    ovalues.size(-2) == V && ovalues.size(-1) % 2 == 0,
                op, "outlier_values", "must have shape [..., ", V, ", 2k] matching 'codes' ",
                codes.sizes(), ", got ", ovalues.sizes());
  KVQ_CHECK_ARG(oindices.sizes() == ovalues.sizes(), op, "outlier_indices",
                "must have the shape of 'outlier_values' ", ovalues.sizes(), ", got ", oindices.sizes());
  CHECK_DTYPE(op, A, "A", at::kHalf);
  CHECK_DTYPE(op, B, "B", at::kHalf);
  const int64_t r = A.dim() >= 1 ? A.size(-1) : -1;
  KVQ_CHECK_ARG(A.dim() == codes.dim() && lead_shape(A, 2) == lead && A.size(-2) == T &&
                    r <= linalg::kMaxRank,
                op, "A", "must have shape [..., ", T, ", r] (r <= 8) matching 'codes', got ", A.sizes());
  KVQ_CHECK_ARG(B.dim() == codes.dim() && lead_shape(B, 2) == lead && B.size(-2) == D &&
                    B.size(-1) == r,
                op, "B", "must have shape [..., ", D, ", ", r, "] matching 'codes' and 'A', got ",
                B.sizes());
  CHECK_SAME_DEVICE(op, codes, "codes", ovalues, "outlier_values");
  CHECK_SAME_DEVICE(op, codes, "codes", oindices, "outlier_indices");
  CHECK_SAME_DEVICE(op, codes, "codes", A, "A");
  CHECK_SAME_DEVICE(op, codes, "codes", B, "B");
  c.ovalues = ovalues.contiguous();
  c.oindices = oindices.contiguous();
  c.A = A.contiguous();
  c.B = B.contiguous();
  c.index_bytes = select::index_bytes(L);
  auto& g = c.gear;
  g.x = nullptr;
  g.xc = nullptr;
  g.gbounds = nullptr;
  g.omask = nullptr;
  g.resid = nullptr;
  g.ovalues = c.ovalues.data_ptr();
  g.oindices = c.oindices.data_ptr();
  g.A = reinterpret_cast<const uint16_t*>(c.A.data_ptr());
  g.B = reinterpret_cast<const uint16_t*>(c.B.data_ptr());
  g.out = c.dq.out.data_ptr();
  g.status = nullptr;
  g.q = c.dq.params;
  g.N = N;
  g.T = T;
  g.D = D;
  g.k = ovalues.size(-1) / 2;
  g.rank = (int)r;
  g.per_channel = per_channel;
  return c;
}

at::Tensor gear_decompress_cpu(const at::Tensor& codes, const at::Tensor& scale,
                               const at::Tensor& zero, const at::Tensor& outlier_values,
                               const at::Tensor& outlier_indices, const at::Tensor& A,
                               const at::Tensor& B, int64_t bits, bool per_channel,
                               at::ScalarType dtype) {
  GearDecompressCall c = prepare_gear_decompress(codes, scale, zero, outlier_values, outlier_indices,
                                                 A, B, bits, per_channel, dtype);
  const auto& g = c.gear;
  const int64_t rows = g.N * g.T, L = per_channel ? g.T : g.D;
  if (c.oindices.numel() > 0) {
    const int64_t mx = c.oindices.max().item<int64_t>(), mn = c.oindices.min().item<int64_t>();
    KVQ_CHECK_ARG(mn >= 0 && mx < L, "gear_decompress", "outlier_indices",
                  "must lie in [0, ", L, "), got values in [", mn, ", ", mx, "]");
  }
  translate_errors([&] {
    at::Tensor deq = at::empty({g.N, g.T, g.D}, c.A.options().dtype(at::kFloat));
    quant::GroupQuantParams dp = g.q;
    dp.out = deq.data_ptr<float>();
    at::parallel_for(0, rows, parallel_grain(g.D * (int64_t)sizeof(float)),
                     [&](int64_t b, int64_t e) { quant::group_dequantize_cpu<float>(dp, b, e); });
    KVQ_DISPATCH_DTYPE(dtype_id(dtype), DType, [&] {
      // per row: D x rank multiply-adds
      at::parallel_for(0, rows, parallel_grain(2 * g.D * std::max(g.rank, 1)), [&](int64_t b, int64_t e) {
        gear::gear_lowrank_add_cpu<DType>(g, deq.data_ptr<float>(), b, e);
      });
      if (g.k > 0) {
        const int64_t nvec = g.N * (per_channel ? g.D : g.T);
        KVQ_DISPATCH_INDEX_BYTES(c.index_bytes, IdType, [&] {
          at::parallel_for(0, nvec, parallel_grain(2 * g.k * 8), [&](int64_t b, int64_t e) {
            gear::gear_scatter_outliers_cpu<DType, IdType>(g, b, e);
          });
        });
      }
    });
  });
  return c.dq.out;
}

}  // namespace kvq
