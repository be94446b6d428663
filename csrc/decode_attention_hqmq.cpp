// kvq.decode_attention_hqmq: decode attention over an HQMQ cache layer (packed rows, Med3x
// records + their tile index, per role, and the optional full-precision
// recent window).  Argument checks, the CPU
// implementation, and (with CUDA) the call of the fused kernel in cuda_bindings.cpp.
// Built with -ffp-contract=off like hqmq.cpp so the CPU twin decodes exactly like
// kvq.hqmq_decode.
#include <ATen/Parallel.h>

#include <cmath>

#include "kvq/attention/decode_attention_hqmq.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

static const char* kOp = "decode_attention_hqmq";

/// The checks and fields every HQMQ role shares (contiguous caches and pages): packed rows int16
/// [N, H, R, U] (N rows of R tokens: batch rows of T tokens, or pages of P), secondary sets fp32
/// [H, S, 4], on the device of `ref`.  The secondary pointer
/// and the records are set by the caller.
attention::HqmqKV hqmq_role_fields(const char* op, const std::string& r, const char* rb_name, const at::Tensor& ref,
                                   const char* ref_name, const at::Tensor& codes, const at::Tensor& secondary,
                                   int64_t radius_bits, int64_t H, int64_t D) {
  const auto cn = r + "_codes", secn = r + "_secondary";
  KVQ_CHECK_ARG(radius_bits >= 1 && radius_bits <= 8, op, rb_name, "must be in 1..8, got ", radius_bits);
  CHECK_DTYPE(op, codes, cn.c_str(), at::kShort);
  CHECK_DTYPE(op, secondary, secn.c_str(), at::kFloat);
  CHECK_DIM(op, codes, cn.c_str(), 4);
  CHECK_DIM(op, secondary, secn.c_str(), 3);
  CHECK_SAME_DEVICE(op, ref, ref_name, codes, cn.c_str());
  CHECK_SAME_DEVICE(op, ref, ref_name, secondary, secn.c_str());
  KVQ_CHECK_ARG(codes.size(1) == H, op, cn.c_str(), "must have H=", H, " heads in dim 1, got ", codes.sizes());
  KVQ_CHECK_ARG(secondary.size(0) == H && secondary.size(2) == 4 && secondary.size(1) >= 1 &&
                    secondary.size(1) <= hqmq::kMaxSecondary,
                op, secn.c_str(), "must be [H=", H, ", S, 4] with S in 1..", hqmq::kMaxSecondary, ", got ",
                secondary.sizes());
  const int64_t S = secondary.size(1);
  const hqmq::RowLayout row = hqmq::hqmq_row_layout(D, S, (int)radius_bits);
  KVQ_CHECK_ARG(codes.size(3) == row.units, op, cn.c_str(), "must have ", row.units, " 16-bit units per token (D=",
                D, ", S=", S, ", radius_bits=", radius_bits, "), got ", codes.size(3));
  attention::HqmqKV s;
  s.codes = codes.numel() ? codes.data_ptr<int16_t>() : nullptr;
  s.codes_sb = codes.stride(0), s.codes_sh = codes.stride(1);
  s.S = S;
  s.radius_bits = (int)radius_bits;
  s.field_bits = hqmq::hqmq_dir_bits(S) + (int)radius_bits;
  s.row = row;
  return s;
}

static attention::HqmqKV make_hqmq_role(const char* role, const at::Tensor& q, const at::Tensor& codes,
                                        const at::Tensor& secondary,
                                        const at::Tensor& outliers, const at::Tensor& outlier_ptr,
                                        int64_t radius_bits, int64_t B, int64_t H, int64_t D) {
  const std::string r(role);
  const auto cn = r + "_codes", on = r + "_outliers", pn = r + "_outlier_ptr", rbn = r + "_radius_bits";
  attention::HqmqKV s = hqmq_role_fields(kOp, r, rbn.c_str(), q, "q", codes, secondary, radius_bits, H, D);
  CHECK_DTYPE(kOp, outliers, on.c_str(), at::kInt);
  CHECK_DTYPE(kOp, outlier_ptr, pn.c_str(), at::kLong);
  CHECK_DIM(kOp, outliers, on.c_str(), 2);
  CHECK_DIM(kOp, outlier_ptr, pn.c_str(), 1);
  CHECK_SAME_DEVICE(kOp, q, "q", outliers, on.c_str());
  CHECK_SAME_DEVICE(kOp, q, "q", outlier_ptr, pn.c_str());
  const int64_t T = codes.size(2), U = s.row.units;
  KVQ_CHECK_ARG(codes.size(0) == B && codes.size(1) == H, kOp, cn.c_str(), "must be [B=", B, ", H=", H,
                ", T, U], got ", codes.sizes());
  KVQ_CHECK_ARG(codes.numel() == 0 || (codes.stride(3) == 1 && codes.stride(2) == U), kOp, cn.c_str(),
                "must be contiguous in its last two dims");
  KVQ_CHECK_ARG(outliers.size(1) == 4, kOp, on.c_str(), "must be [M, 4] Med3x records, got ", outliers.sizes());
  const int64_t M = outliers.size(0);
  const int64_t nptr = (T + attention::kHqmqTile - 1) / attention::kHqmqTile * B * H + 1;
  KVQ_CHECK_ARG(outlier_ptr.size(0) == nptr || (M == 0 && outlier_ptr.size(0) == 0), kOp, pn.c_str(),
                "must hold ceil(T/32)*B*H+1=", nptr, " offsets (or be empty when there are no records), got ",
                outlier_ptr.size(0));
  s.num_outliers = M;
  return s;
}

/// The recent window of one role: [B, H, Tr, D] in q's dtype, inner [Tr, D] contiguous (an
/// absent or empty one holds no tokens).  Returns the tensor the params point into.
static at::Tensor attach_residual(const char* role, const at::Tensor& q, const std::optional<at::Tensor>& res,
                                  attention::HqmqKV& s, int64_t B, int64_t H, int64_t D) {
  if (!res.has_value() || !res->defined()) return at::Tensor();
  const std::string rn = std::string(role) + "_residual";
  const at::Tensor& r = *res;
  CHECK_DIM(kOp, r, rn.c_str(), 4);
  CHECK_SAME_DEVICE(kOp, q, "q", r, rn.c_str());
  KVQ_CHECK_ARG(r.scalar_type() == q.scalar_type(), kOp, rn.c_str(), "must have the dtype of 'q' (", q.scalar_type(),
                "), got ", r.scalar_type());
  KVQ_CHECK_ARG(r.size(0) == B && r.size(1) == H && r.size(3) == D, kOp, rn.c_str(), "must be [B=", B, ", H=", H,
                ", Tr, D=", D, "], got ", r.sizes());
  KVQ_CHECK_ARG(r.numel() == 0 || (r.stride(3) == 1 && r.stride(2) == D), kOp, rn.c_str(),
                "must be contiguous in its last two dims");
  s.residual = r.numel() ? r.data_ptr() : nullptr;
  s.res_sb = r.stride(0), s.res_sh = r.stride(1);
  return r;
}

static int64_t residual_tokens(const std::optional<at::Tensor>& res) {
  return res.has_value() && res->defined() ? res->size(2) : 0;
}

HqmqAttentionCall prepare_decode_attention_hqmq(
    const at::Tensor& q_in, const at::Tensor& k_codes, const at::Tensor& k_secondary,
    const at::Tensor& k_outliers, const at::Tensor& k_outlier_ptr, const at::Tensor& v_codes,
    const at::Tensor& v_secondary, const at::Tensor& v_outliers,
    const at::Tensor& v_outlier_ptr, const std::optional<at::Tensor>& mask, int64_t k_radius_bits,
    int64_t v_radius_bits, double scale, const std::optional<at::Tensor>& k_residual,
    const std::optional<at::Tensor>& v_residual) {
  CHECK_FLOATING(kOp, q_in, "q");
  CHECK_DIM(kOp, q_in, "q", 3);
  HqmqAttentionCall c;
  c.q = contiguous_aligned(q_in);
  const auto [B, Hq, D, H] = check_decode_attention_q(kOp, c.q, k_codes);
  KVQ_CHECK_ARG(B * H < ((int64_t)1 << 23), kOp, "k_codes", "has too many rows (B*H must be < 2^23)");
  auto& p = c.params;
  // contiguous copies of the small tensors (secondary, records, index); codes are read
  // through their batch/head strides
  c.k_sec = k_secondary.contiguous(), c.v_sec = v_secondary.contiguous();
  c.k_rec = contiguous_aligned(k_outliers), c.v_rec = contiguous_aligned(v_outliers);  // int4 loads
  c.k_ptr = k_outlier_ptr.contiguous(), c.v_ptr = v_outlier_ptr.contiguous();
  p.k = make_hqmq_role("k", c.q, k_codes, c.k_sec, c.k_rec, c.k_ptr, k_radius_bits, B, H, D);
  p.v = make_hqmq_role("v", c.q, v_codes, c.v_sec, c.v_rec, c.v_ptr, v_radius_bits, B, H, D);
  const int64_t Tc = k_codes.size(2);
  KVQ_CHECK(Tc == v_codes.size(2), "kvq.", kOp, ": keys hold ", Tc, " encoded tokens but values hold ",
            v_codes.size(2));
  c.k_res = attach_residual("k", c.q, k_residual, p.k, B, H, D);
  c.v_res = attach_residual("v", c.q, v_residual, p.v, B, H, D);
  const int64_t Tr = residual_tokens(k_residual);
  KVQ_CHECK(Tr == residual_tokens(v_residual), "kvq.", kOp, ": the key residual holds ", Tr,
            " tokens but the value residual holds ", residual_tokens(v_residual));
  const int64_t T = Tc + Tr;
  KVQ_CHECK(T > 0, "kvq.", kOp, ": the cache layer is empty (T = 0)");
  p.k.secondary = c.k_sec.data_ptr<float>(), p.v.secondary = c.v_sec.data_ptr<float>();
  p.k.outliers = c.k_rec.numel() ? c.k_rec.data_ptr<int32_t>() : nullptr;
  p.v.outliers = c.v_rec.numel() ? c.v_rec.data_ptr<int32_t>() : nullptr;
  p.k.outlier_ptr = c.k_ptr.numel() ? c.k_ptr.data_ptr<int64_t>() : nullptr;
  p.v.outlier_ptr = c.v_ptr.numel() ? c.v_ptr.data_ptr<int64_t>() : nullptr;
  finish_decode_attention_call(kOp, c, mask, B, H, Hq, D, T, scale);
  p.Tc = Tc;
  return c;
}

at::Tensor decode_attention_hqmq_cpu(KVQ_DECODE_ATTN_HQMQ_ARGS) {
  HqmqAttentionCall c = prepare_decode_attention_hqmq(q, k_codes, k_secondary, k_outliers, k_outlier_ptr,
                                                      v_codes, v_secondary, v_outliers, v_outlier_ptr,
                                                      mask, k_radius_bits, v_radius_bits, scale, k_residual,
                                                      v_residual);
  const auto& p = c.params;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.q.scalar_type()), DType, [&] {
      // per (batch, KV head): Hq/H queries x T tokens x D, one key and one value multiply-add each
      at::parallel_for(0, p.B * p.H, parallel_grain(4 * (p.Hq / std::max<int64_t>(p.H, 1)) * p.T * p.D), [&](int64_t b0, int64_t e0) {
        std::vector<float> row, buf;
        for (int64_t bh = b0; bh < e0; ++bh)
          attention::hqmq_decode_attention_cpu<DType>(p, bh / p.H, bh % p.H, row, buf);
      });
    });
  });
  return c.out;
}

}  // namespace kvq
