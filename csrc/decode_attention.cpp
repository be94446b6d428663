// kvq.decode_attention_gq: decode attention over a group-quantized cache layer (codes +
// fp16 scale/zero per role) plus its full-precision residual.  Argument checks, the CPU
// implementation, and (with CUDA) the fused kernels.
#include <ATen/Parallel.h>

#include <cmath>

#include "kvq/attention/decode_attention.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

static const char* kOp = "decode_attention_gq";

static attention::QuantKV make_role(const char* role, const at::Tensor& q, const at::Tensor& codes,
                                    const at::Tensor& scale, const at::Tensor& zero,
                                    const at::Tensor& residual, int64_t bits, bool per_channel,
                                    int64_t B, int64_t H, int64_t D) {
  const std::string r(role);
  const auto cn = r + "_codes", sn = r + "_scale", zn = r + "_zero", rn = r + "_residual";
  KVQ_CHECK_ARG(bits == 2 || bits == 4 || bits == 8, kOp, (r + "_bits").c_str(), "must be 2, 4 or 8, got ", bits);
  CHECK_DTYPE(kOp, codes, cn.c_str(), at::kInt);
  CHECK_DTYPE(kOp, scale, sn.c_str(), at::kHalf);
  CHECK_DTYPE(kOp, zero, zn.c_str(), at::kHalf);
  KVQ_CHECK_ARG(residual.scalar_type() == q.scalar_type(), kOp, rn.c_str(), "must have the dtype of 'q' (",
                q.scalar_type(), "), got ", residual.scalar_type());
  for (const at::Tensor* t : {&codes, &scale, &zero, &residual}) {
    const char* name = t == &codes ? cn.c_str() : t == &scale ? sn.c_str() : t == &zero ? zn.c_str() : rn.c_str();
    CHECK_DIM(kOp, *t, name, 4);
    CHECK_SAME_DEVICE(kOp, q, "q", *t, name);
    KVQ_CHECK_ARG(t->size(0) == B && t->size(1) == H, kOp, name, "must be [B=", B, ", H=", H,
                  ", ...], got ", t->sizes());
    KVQ_CHECK_ARG(t->numel() == 0 || (t->stride(3) == 1 && t->stride(2) == t->size(3)), kOp, name,
                  "must be contiguous in its last two dims");
  }
  const int64_t W = D * bits / 32;
  KVQ_CHECK_ARG(codes.size(3) == W, kOp, cn.c_str(), "must have D*bits/32=", W, " words per token, got ",
                codes.size(3));
  KVQ_CHECK_ARG(residual.size(3) == D, kOp, rn.c_str(), "must have head dim ", D, ", got ", residual.size(3));
  KVQ_CHECK_ARG(scale.sizes() == zero.sizes() && scale.strides() == zero.strides(), kOp, zn.c_str(),
                "must have the shape and strides of '", sn, "'");
  attention::QuantKV s;
  s.Tq = codes.size(2);
  s.Tr = residual.size(2);
  s.bits = (int)bits;
  s.per_channel = per_channel;
  if (per_channel) {
    KVQ_CHECK_ARG(scale.size(3) == D, kOp, sn.c_str(), "must be [B, H, Tq/G, D] for per-channel grouping");
    const int64_t ng = scale.size(2);
    KVQ_CHECK_ARG((s.Tq == 0 && ng == 0) || (ng > 0 && s.Tq % ng == 0), kOp, sn.c_str(), "has ", ng,
                  " groups, which does not divide Tq=", s.Tq);
    s.group = ng > 0 ? s.Tq / ng : 1;
  } else {
    KVQ_CHECK_ARG(scale.size(2) == s.Tq, kOp, sn.c_str(), "must be [B, H, Tq, D/G] for per-token grouping");
    const int64_t ng = scale.size(3);
    KVQ_CHECK_ARG(ng > 0 && D % ng == 0, kOp, sn.c_str(), "has ", ng, " groups per token, not a divisor of D=", D);
    s.group = D / ng;
  }
  s.codes = codes.numel() ? codes.data_ptr<int32_t>() : nullptr;
  s.scale = scale.numel() ? reinterpret_cast<const uint16_t*>(scale.data_ptr()) : nullptr;
  s.zero = zero.numel() ? reinterpret_cast<const uint16_t*>(zero.data_ptr()) : nullptr;
  s.codes_sb = codes.stride(0), s.codes_sh = codes.stride(1);
  s.scale_sb = scale.stride(0), s.scale_sh = scale.stride(1);
  s.residual = residual.numel() ? residual.data_ptr() : nullptr;
  s.res_sb = residual.stride(0), s.res_sh = residual.stride(1);
  return s;
}

DecodeAttentionCall prepare_decode_attention(const at::Tensor& q_in, const at::Tensor& k_codes,
                                             const at::Tensor& k_scale, const at::Tensor& k_zero,
                                             const at::Tensor& k_residual, const at::Tensor& v_codes,
                                             const at::Tensor& v_scale, const at::Tensor& v_zero,
                                             const at::Tensor& v_residual,
                                             const std::optional<at::Tensor>& mask, int64_t k_bits,
                                             bool k_per_channel, int64_t v_bits, bool v_per_channel,
                                             double scale) {
  CHECK_FLOATING(kOp, q_in, "q");
  CHECK_DIM(kOp, q_in, "q", 3);
  DecodeAttentionCall c;
  c.q = q_in.contiguous();
  const int64_t B = c.q.size(0), Hq = c.q.size(1), D = c.q.size(2);
  KVQ_CHECK_ARG(D == 32 || D == 64 || D == 128 || D == 256, kOp, "q", "head dim must be 32, 64, 128 or 256, got ", D);
  CHECK_DIM(kOp, k_codes, "k_codes", 4);
  const int64_t H = k_codes.size(1);
  KVQ_CHECK_ARG(H > 0 && Hq % H == 0, kOp, "q", "has ", Hq, " heads, which is not a multiple of the cache's ", H,
                " KV heads");
  KVQ_CHECK_ARG(Hq / H <= 16, kOp, "q", "has ", Hq / H, " query heads per KV head; at most 16 are supported "
                "per call (split the query heads)");
  auto& p = c.params;
  p.k = make_role("k", c.q, k_codes, k_scale, k_zero, k_residual, k_bits, k_per_channel, B, H, D);
  p.v = make_role("v", c.q, v_codes, v_scale, v_zero, v_residual, v_bits, v_per_channel, B, H, D);
  const int64_t T = p.k.Tq + p.k.Tr;
  KVQ_CHECK(T == p.v.Tq + p.v.Tr, "kvq.", kOp, ": keys hold ", T, " tokens but values hold ",
              p.v.Tq + p.v.Tr);
  KVQ_CHECK(T > 0, "kvq.", kOp, ": the cache layer is empty (T = 0)");
  if (mask.has_value() && mask->defined()) {
    CHECK_DIM(kOp, *mask, "mask", 2);
    CHECK_SAME_DEVICE(kOp, c.q, "q", *mask, "mask");
    KVQ_CHECK_ARG(mask->size(0) == B && mask->size(1) == T, kOp, "mask", "must be [B=", B, ", T=", T, "], got ",
                  mask->sizes());
    c.mask = mask->to(at::kByte).contiguous();
    p.mask = c.mask.data_ptr<uint8_t>();
    p.mask_sb = T;
  }
  c.out = at::empty_like(c.q);
  p.q = c.q.data_ptr();
  p.out = c.out.data_ptr();
  p.B = B, p.H = H, p.Hq = Hq, p.D = D, p.T = T;
  p.scale = (float)scale;
  return c;
}

at::Tensor decode_attention_gq_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                   const at::Tensor& k_zero, const at::Tensor& k_residual,
                                   const at::Tensor& v_codes, const at::Tensor& v_scale,
                                   const at::Tensor& v_zero, const at::Tensor& v_residual,
                                   const std::optional<at::Tensor>& mask, int64_t k_bits, bool k_per_channel,
                                   int64_t v_bits, bool v_per_channel, double scale) {
  DecodeAttentionCall c = prepare_decode_attention(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale,
                                                   v_zero, v_residual, mask, k_bits, k_per_channel, v_bits,
                                                   v_per_channel, scale);
  const auto& p = c.params;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.q.scalar_type()), DType, [&] {
      at::parallel_for(0, p.B * p.H, 1, [&](int64_t b0, int64_t e0) {
        std::vector<float> row, kbuf;
        for (int64_t bh = b0; bh < e0; ++bh)
          attention::decode_attention_cpu<DType>(p, bh / p.H, bh % p.H, row, kbuf);
      });
    });
  });
  return c.out;
}

}  // namespace kvq
