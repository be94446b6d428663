// kvq.hqmq_encode / kvq.hqmq_decode: argument checks, output allocation and the CPU
// implementation (the CUDA one is in cuda_bindings.cpp and shares prepare_* / finish_*).
// Format: include/kvq/hqmq/hqmq.h.  NOTE(hqmq): built with -ffp-contract=off so the
// CPU twin rounds exactly like the CUDA kernels (same codes on both devices).
#include <ATen/Parallel.h>

#include "ops.h"
#include "utils.h"

namespace kvq {

static void check_hqmq_head_dim(const char* op, const char* arg, int64_t D) {
  KVQ_CHECK_ARG(D % 4 == 0, op, arg,
                "must have a head dim (last dimension) divisible by 4 (quaternion chunks), got ", D);
  KVQ_CHECK_ARG(supported_head_dim(D), op, arg, "must have a head dim of ", kHeadDimsText, ", got ", D);
}

static void check_radius_bits(const char* op, int64_t radius_bits) {
  KVQ_CHECK_ARG(radius_bits >= 1 && radius_bits <= 8, op, "radius_bits",
                "must be in 1..8, got ", radius_bits);
}

static void check_secondary(const char* op, const at::Tensor& sec, int64_t H) {
  CHECK_DTYPE(op, sec, "secondary", at::kFloat);
  CHECK_DIM(op, sec, "secondary", 3);
  KVQ_CHECK_ARG(sec.size(0) == H && sec.size(2) == 4, op, "secondary",
                "must have shape [H, S, 4] with H=", H, " (the KV heads), got ", sec.sizes());
  KVQ_CHECK_ARG(sec.size(1) >= 1 && sec.size(1) <= hqmq::kMaxSecondary, op, "secondary",
                "must hold S in 1..", hqmq::kMaxSecondary, " quaternions per head, got S=",
                sec.size(1));
}

static void fill_common(hqmq::HqmqParams& p, int64_t N, int64_t H, int64_t T, int64_t D, int64_t S,
                        int64_t radius_bits) {
  p.N = N;
  p.H = H;
  p.T = T;
  p.D = D;
  p.S = S;
  p.radius_bits = (int)radius_bits;
  p.row = hqmq::hqmq_row_layout(D, S, (int)radius_bits);
}

HqmqEncodeCall prepare_hqmq_encode(const at::Tensor& x_in, const at::Tensor& secondary,
                                   int64_t radius_bits,
                                   const c10::optional<at::Tensor>& outlier_threshold,
                                   bool check_finite) {
  const char* op = "hqmq_encode";
  CHECK_FLOATING(op, x_in, "x");
  CHECK_MIN_DIM(op, x_in, "x", 3);
  check_radius_bits(op, radius_bits);
  const int64_t H = x_in.size(-3), T = x_in.size(-2), D = x_in.size(-1);
  check_hqmq_head_dim(op, "x", D);
  check_secondary(op, secondary, H);
  CHECK_SAME_DEVICE(op, x_in, "x", secondary, "secondary");
  const bool has_thr = outlier_threshold.has_value();
  if (has_thr) {
    const at::Tensor& th = *outlier_threshold;
    CHECK_DTYPE(op, th, "outlier_threshold", at::kFloat);
    KVQ_CHECK_ARG(th.dim() == 1 && th.size(0) == H, op, "outlier_threshold",
                  "must have shape [H] with H=", H, ", got ", th.sizes());
    CHECK_SAME_DEVICE(op, x_in, "x", th, "outlier_threshold");
  }
  HqmqEncodeCall c;
  c.x = contiguous_aligned(x_in);
  c.secondary = contiguous_aligned(secondary);
  const int64_t N = leading_numel(c.x, 2);
  KVQ_CHECK_ARG(N < ((int64_t)1 << 23) && T < ((int64_t)1 << 31), op, "x",
                "is too large for the outlier record format (N < 2^23 rows, T < 2^31)");
  auto& p = c.params;
  fill_common(p, N, H, T, D, secondary.size(1), radius_bits);
  auto lead = c.x.sizes().slice(0, c.x.dim() - 2).vec();
  auto cshape = lead;
  cshape.push_back(T);
  cshape.push_back(p.row.units);
  c.codes = at::empty(cshape, c.x.options().dtype(at::kShort));
  if (check_finite) c.status = at::zeros({1}, c.x.options().dtype(at::kInt));
  if (has_thr) {
    c.threshold = outlier_threshold->contiguous();
    c.flag_mask = at::zeros({N * T}, c.x.options().dtype(at::kLong));
    c.flag_count = at::zeros({N * T}, c.x.options().dtype(at::kInt));
    p.threshold = c.threshold.data_ptr<float>();
    p.flag_mask = c.flag_mask.data_ptr<int64_t>();
    p.flag_count = c.flag_count.data_ptr<int32_t>();
  }
  p.x = c.x.data_ptr();
  p.secondary = c.secondary.data_ptr<float>();
  p.codes = c.codes.data_ptr<int16_t>();
  p.status = check_finite ? c.status.data_ptr<int32_t>() : nullptr;
  return c;
}

int64_t hqmq_prepare_records(HqmqEncodeCall& c) {
  auto& p = c.params;
  int64_t M = 0;
  if (p.threshold != nullptr && p.N * p.T > 0) {
    at::Tensor incl = at::cumsum(c.flag_count, 0, at::kLong);
    M = incl[-1].item<int64_t>();
    c.offsets = incl - c.flag_count;
    p.offsets = c.offsets.data_ptr<int64_t>();
  }
  c.outliers = at::empty({M, 4}, c.x.options().dtype(at::kInt));
  p.outliers = c.outliers.data_ptr<int32_t>();
  p.num_outliers = M;
  return M;
}

HqmqDecodeCall prepare_hqmq_decode(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                                   int64_t radius_bits, int64_t head_dim, at::ScalarType dtype) {
  const char* op = "hqmq_decode";
  check_radius_bits(op, radius_bits);
  CHECK_DTYPE(op, codes, "codes", at::kShort);
  CHECK_DTYPE(op, outliers, "outliers", at::kInt);
  CHECK_MIN_DIM(op, codes, "codes", 3);
  KVQ_CHECK_ARG(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op, "dtype",
                "must be ", kDTypesText, ", got ", dtype);
  check_hqmq_head_dim(op, "head_dim", head_dim);
  const int64_t H = codes.size(-3), T = codes.size(-2);
  check_secondary(op, secondary, H);
  CHECK_SAME_DEVICE(op, codes, "codes", secondary, "secondary");
  CHECK_SAME_DEVICE(op, codes, "codes", outliers, "outliers");
  const int U = hqmq::hqmq_units(head_dim, secondary.size(1), (int)radius_bits);
  KVQ_CHECK_ARG(codes.size(-1) == U, op, "codes", "must have ", U, " 16-bit units per token for head_dim=",
                head_dim, ", S=", secondary.size(1), ", radius_bits=", radius_bits, ", got shape ",
                codes.sizes());
  KVQ_CHECK_ARG(outliers.dim() == 2 && outliers.size(1) == 4, op, "outliers",
                "must have shape [M, 4], got ", outliers.sizes());
  HqmqDecodeCall c;
  c.codes = contiguous_aligned(codes);
  c.secondary = contiguous_aligned(secondary);
  c.outliers = contiguous_aligned(outliers);
  auto oshape = codes.sizes().vec();
  oshape.back() = head_dim;
  c.out = at::empty(oshape, codes.options().dtype(dtype));
  auto& p = c.params;
  fill_common(p, leading_numel(c.codes, 2), H, T, head_dim, secondary.size(1), radius_bits);
  p.out = c.out.data_ptr();
  p.codes = c.codes.data_ptr<int16_t>();
  p.secondary = c.secondary.data_ptr<float>();
  p.outliers = c.outliers.data_ptr<int32_t>();
  p.num_outliers = c.outliers.size(0);
  return c;
}

std::tuple<at::Tensor, at::Tensor> hqmq_encode_cpu(
    const at::Tensor& x, const at::Tensor& secondary, int64_t radius_bits,
    const c10::optional<at::Tensor>& outlier_threshold, bool check_finite) {
  HqmqEncodeCall c = prepare_hqmq_encode(x, secondary, radius_bits, outlier_threshold, check_finite);
  const int64_t rows = c.params.N * c.params.T;
  const auto dt = dtype_id(c.x.scalar_type());
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dt, DType, [&] {
      // per row: D/4 chunks x S candidate products (16 multiply-adds each) and their scores
      at::parallel_for(0, rows, parallel_grain(8 * c.params.D * c.params.S), [&](int64_t b, int64_t e) {
        hqmq::hqmq_encode_cpu<DType>(c.params, b, e);
      });
    });
  });
  if (check_finite) raise_status("hqmq_encode", "x", c.status.item<int32_t>(), kHqmqOutOfRange);
  if (hqmq_prepare_records(c) > 0) {
    translate_errors([&] {
      KVQ_DISPATCH_DTYPE(dt, DType, [&] {
        at::parallel_for(0, rows, parallel_grain(c.params.D * (int64_t)sizeof(DType)), [&](int64_t b, int64_t e) {
          hqmq::hqmq_write_records_cpu<DType>(c.params, b, e);
        });
      });
    });
  }
  return {c.codes, c.outliers};
}

at::Tensor hqmq_decode_cpu(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                           int64_t radius_bits, int64_t head_dim, at::ScalarType dtype) {
  HqmqDecodeCall c =
      prepare_hqmq_decode(codes, secondary, outliers, radius_bits, head_dim, dtype);
  const auto& p = c.params;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(dtype), DType, [&] {
      // per row: D/4 quaternion products (16 multiply-adds each)
      at::parallel_for(0, p.N * p.T, parallel_grain(4 * p.D), [&](int64_t b, int64_t e) {
        hqmq::hqmq_decode_cpu<DType>(p, b, e);
      });
      // Serial: records may (only if corrupt) name the same chunk twice; last one wins.
      hqmq::hqmq_apply_records_cpu<DType>(p, 0, p.num_outliers);
    });
  });
  return c.out;
}

}  // namespace kvq
