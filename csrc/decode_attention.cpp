// kvq.decode_attention_gq: decode attention over a group-quantized cache layer (codes +
// fp16 scale/zero per role) plus its full-precision residual.  Argument checks, the CPU
// implementation, and (with CUDA) the fused kernels.
#include <ATen/Parallel.h>

#include <cmath>

#include "kvq/attention/decode_attention.h"
#ifdef KVQ_WITH_CUDA
#include "kvq/cuda_api.h"
#endif
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
  KVQ_CHECK_ARG(supported_bits(bits), kOp, (r + "_bits").c_str(), "must be ", kBitsText, ", got ", bits);
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
  const auto [B, Hq, D, H] = check_decode_attention_q(kOp, c.q, k_codes);
  auto& p = c.params;
  p.k = make_role("k", c.q, k_codes, k_scale, k_zero, k_residual, k_bits, k_per_channel, B, H, D);
  p.v = make_role("v", c.q, v_codes, v_scale, v_zero, v_residual, v_bits, v_per_channel, B, H, D);
  const int64_t T = p.k.Tq + p.k.Tr;
  KVQ_CHECK(T == p.v.Tq + p.v.Tr, "kvq.", kOp, ": keys hold ", T, " tokens but values hold ",
              p.v.Tq + p.v.Tr);
  KVQ_CHECK(T > 0, "kvq.", kOp, ": the cache layer is empty (T = 0)");
  finish_decode_attention_call(kOp, c, mask, B, H, Hq, D, T, scale);
  p.dtype_bytes = (int)c.q.element_size();
  return c;
}

// ---------------------------------------------------------------------------------------------
// kvq.decode_attention_gear: the same op over a GEAR layer (KIVI backbone of all blocks
// concatenated + per-segment low-rank factors and outliers; layout in decode_attention.h).
// ---------------------------------------------------------------------------------------------
static const char* kGearOp = "decode_attention_gear";

static int index_bytes(const at::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kByte: return 1;
    case at::kShort: return 2;
    case at::kInt: return 4;
    default:
      KVQ_CHECK_ARG(false, kGearOp, name.c_str(), "must be uint8, int16 or int32, got ", t.scalar_type());
  }
  return 0;
}

/// Parse one role's list [A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1] (empty
/// tensors where absent; off only for keys).  od: the outlier corrections v - xhat (cache dtype,
/// the shape of ov); the kernels read od, not the exact values ov (checked for shape only).
static attention::GearKV parse_gear_role(const char* role, const std::vector<at::Tensor>& L, const at::Tensor& q,
                                         bool keys, int64_t B, int64_t H, int64_t D, int64_t T0, int64_t T1,
                                         int64_t nb, bool check_indices) {
  const std::string r(role);
  KVQ_CHECK_ARG(L.size() == 12, kGearOp, (r + "_gear").c_str(),
                "must hold 12 tensors [A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1], got ",
                (int64_t)L.size());
  attention::GearKV g;
  const int64_t nblk1 = nb > 0 ? T1 / nb : 0;
  for (int sg = 0; sg < 2; ++sg) {
    const std::string sfx = std::to_string(sg);
    const at::Tensor &A = L[6 * sg], &Bf = L[6 * sg + 1], &ov = L[6 * sg + 2], &oi = L[6 * sg + 3],
                     &off = L[6 * sg + 4], &od = L[6 * sg + 5];
    const std::string an = r + "_gear A" + sfx, bn = r + "_gear B" + sfx, vn = r + "_gear ov" + sfx,
                      in = r + "_gear oi" + sfx, fn = r + "_gear off" + sfx, dn = r + "_gear od" + sfx;
    const int64_t tseg = sg == 0 ? T0 : T1, nblk = sg == 0 ? 1 : nblk1, tblk = sg == 0 ? T0 : nb;
    attention::GearSeg& s = g.seg[sg];
    for (const at::Tensor* t : {&A, &Bf, &ov, &oi, &off, &od})
      if (t->numel() > 0 || t->dim() > 1) CHECK_SAME_DEVICE(kGearOp, q, "q", *t, (r + "_gear").c_str());
    // low rank: A [B, H, tseg, r], B [B, H, D, r] (segment 0) or [B, H, nblk, D, r]
    if (A.numel() > 0 && tseg > 0) {
      CHECK_DTYPE(kGearOp, A, an.c_str(), at::kHalf);
      CHECK_DTYPE(kGearOp, Bf, bn.c_str(), at::kHalf);
      CHECK_DIM(kGearOp, A, an.c_str(), 4);
      const int64_t rk = A.size(3);
      KVQ_CHECK_ARG(rk >= 1 && rk <= 8, kGearOp, an.c_str(), "must have rank 1..8, got ", rk);
      KVQ_CHECK_ARG(A.size(0) == B && A.size(1) == H && A.size(2) == tseg && A.stride(3) == 1 && A.stride(2) == rk,
                    kGearOp, an.c_str(), "must be [B=", B, ", H=", H, ", T=", tseg, ", r] with contiguous rows, got ",
                    A.sizes());
      if (sg == 0) {
        CHECK_DIM(kGearOp, Bf, bn.c_str(), 4);
        KVQ_CHECK_ARG(Bf.size(0) == B && Bf.size(1) == H && Bf.size(2) == D && Bf.size(3) == rk && Bf.stride(3) == 1 &&
                          Bf.stride(2) == rk,
                      kGearOp, bn.c_str(), "must be [B, H, D=", D, ", r=", rk, "] with contiguous rows, got ", Bf.sizes());
      } else {
        CHECK_DIM(kGearOp, Bf, bn.c_str(), 5);
        KVQ_CHECK_ARG(Bf.size(0) == B && Bf.size(1) == H && Bf.size(2) == nblk && Bf.size(3) == D && Bf.size(4) == rk &&
                          Bf.stride(4) == 1 && Bf.stride(3) == rk && Bf.stride(2) == D * rk,
                      kGearOp, bn.c_str(), "must be [B, H, blocks=", nblk, ", D=", D, ", r=", rk,
                      "] with contiguous blocks, got ", Bf.sizes());
        s.B_sblk = Bf.stride(2);
      }
      s.r = (int)rk;
      s.A = reinterpret_cast<const uint16_t*>(A.data_ptr());
      s.Bf = reinterpret_cast<const uint16_t*>(Bf.data_ptr());
      s.A_sb = A.stride(0), s.A_sh = A.stride(1), s.B_sb = Bf.stride(0), s.B_sh = Bf.stride(1);
    }
    if (ov.numel() == 0 || tseg == 0) continue;
    KVQ_CHECK_ARG(ov.scalar_type() == q.scalar_type(), kGearOp, vn.c_str(), "must have the dtype of 'q' (",
                  q.scalar_type(), "), got ", ov.scalar_type());
    KVQ_CHECK_ARG(oi.sizes() == ov.sizes() && oi.strides() == ov.strides(), kGearOp, in.c_str(),
                  "must have the shape and strides of '", vn, "'");
    CHECK_DIM(kGearOp, ov, vn.c_str(), 4);
    KVQ_CHECK_ARG(ov.stride(3) == 1 && ov.size(0) == B && ov.size(1) == H, kGearOp, vn.c_str(),
                  "must be [B=", B, ", H=", H, ", ...] with a contiguous last dim, got ", ov.sizes());
    KVQ_CHECK_ARG(od.sizes() == ov.sizes(), kGearOp, dn.c_str(), "must hold the outlier corrections v - xhat, ",
                  "one per entry of '", vn, "' (shape ", ov.sizes(), "), got ", od.sizes());
    KVQ_CHECK_ARG(od.scalar_type() == q.scalar_type(), kGearOp, dn.c_str(), "must have the dtype of 'q' (",
                  q.scalar_type(), "), got ", od.scalar_type());
    KVQ_CHECK_ARG(od.stride(3) == 1 && (keys || od.stride(2) == od.size(3)), kGearOp, dn.c_str(),
                  "must have contiguous ", keys ? "rows" : "vectors", ", got strides ", od.strides());
    s.od = od.data_ptr();
    s.oi = oi.data_ptr();
    s.o_sb = ov.stride(0), s.o_sh = ov.stride(1);
    s.d_sb = od.stride(0), s.d_sh = od.stride(1);
    if (keys) {  // [B, H, nblk, M] sorted by token + off [B, H, nblk, tiles + 1]
      CHECK_DTYPE(kGearOp, oi, in.c_str(), at::kShort);
      CHECK_DTYPE(kGearOp, off, fn.c_str(), at::kInt);
      const int64_t M = ov.size(3), ntile = (tblk + 31) / 32;
      KVQ_CHECK_ARG(ov.size(2) == nblk && M % (2 * D) == 0, kGearOp, vn.c_str(), "must be [B, H, blocks=", nblk,
                    ", D*2k], got ", ov.sizes());
      CHECK_DIM(kGearOp, off, fn.c_str(), 4);
      KVQ_CHECK_ARG(off.size(0) == B && off.size(1) == H && off.size(2) == nblk && off.size(3) >= ntile + 1 &&
                        off.stride(3) == 1,
                    kGearOp, fn.c_str(), "must be [B, H, blocks=", nblk, ", >= tiles+1=", ntile + 1, "], got ",
                    off.sizes());
      if (check_indices) {
        const auto o = off.to(at::kLong);
        const bool ok = o.select(3, 0).eq(0).all().item<bool>() && o.select(3, ntile).eq(M).all().item<bool>() &&
                        (ntile == 0 || o.diff(1, 3).ge(0).all().item<bool>());
        KVQ_CHECK_ARG(ok, kGearOp, fn.c_str(), "must be non-decreasing tile offsets from 0 to ", M);
        const auto pk = oi.to(at::kLong).bitwise_and(0xFFFF);
        KVQ_CHECK_ARG(pk.bitwise_and(255).lt(D).all().item<bool>(), kGearOp, in.c_str(), "holds channels outside [0, ",
                      D, ")");
        KVQ_CHECK_ARG(pk.bitwise_right_shift(8).lt(32).all().item<bool>(), kGearOp, in.c_str(),
                      "holds tokens outside [0, 32) of their tile (index = token << 8 | channel)");
      }
      s.k = (int)(M / (2 * D));
      s.ibytes = 2;
      s.o_sblk = ov.stride(2);
      s.d_sblk = od.stride(2);
      s.off = off.data_ptr<int32_t>();
      s.f_sb = off.stride(0), s.f_sh = off.stride(1), s.f_sblk = off.stride(2);
      s.off_len = off.size(3);
    } else {  // [B, H, tseg, 2k], index = channel
      const int64_t twok = ov.size(3);
      KVQ_CHECK_ARG(twok % 2 == 0 && ov.size(2) == tseg && ov.stride(2) == twok, kGearOp, vn.c_str(),
                    "must be [B, H, T=", tseg, ", 2k] with contiguous vectors, got ", ov.sizes());
      // the CUDA kernel keeps 2k in 8 bits of its per-segment flags
      KVQ_CHECK_ARG(twok <= D && twok <= 254, kGearOp, vn.c_str(), "must have 2k <= min(D, 254) outliers per token, got ",
                    twok);
      s.ibytes = index_bytes(oi, in);
      if (check_indices) {
        const auto mm = oi.to(at::kLong).aminmax();
        KVQ_CHECK_ARG(std::get<0>(mm).item<int64_t>() >= 0 && std::get<1>(mm).item<int64_t>() < D, kGearOp,
                      in.c_str(), "holds channels outside [0, ", D, ")");
      }
      s.k = (int)(twok / 2);
    }
  }
  return g;
}

static DecodeAttentionCall prepare_gear(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                        const at::Tensor& k_zero, const at::Tensor& k_residual,
                                        const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                        const at::Tensor& v_residual, const std::optional<at::Tensor>& mask,
                                        int64_t bits, const std::vector<at::Tensor>& k_gear,
                                        const std::vector<at::Tensor>& v_gear, int64_t t0, int64_t nb, double scale,
                                        bool check_indices) {
  DecodeAttentionCall c = prepare_decode_attention(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero,
                                                   v_residual, mask, bits, true, bits, false, scale);
  auto& p = c.params;
  const int64_t Tq = p.k.Tq;
  KVQ_CHECK_ARG(p.v.Tq == Tq, kGearOp, "v_codes", "must hold as many compressed tokens as 'k_codes' (", Tq,
                "), got ", p.v.Tq);
  KVQ_CHECK_ARG(nb >= 1, kGearOp, "block_tokens", "must be >= 1, got ", nb);
  KVQ_CHECK_ARG(t0 >= 0 && t0 <= Tq && (Tq - t0) % nb == 0, kGearOp, "prefill_tokens", "must be in [0, ", Tq,
                "] with the rest a whole number of ", nb, "-token blocks, got ", t0);
  KVQ_CHECK_ARG(Tq == 0 || (t0 % p.k.group == 0 && nb % p.k.group == 0), kGearOp, "prefill_tokens",
                "and 'block_tokens' must be multiples of the key group ", p.k.group);
  p.gear = true;
  p.gear_t0 = t0, p.gear_nb = nb;
  p.gk = parse_gear_role("k", k_gear, c.q, true, p.B, p.H, p.D, t0, Tq - t0, nb, check_indices);
  p.gv = parse_gear_role("v", v_gear, c.q, false, p.B, p.H, p.D, t0, Tq - t0, nb, check_indices);
  return c;
}

static void run_cpu(DecodeAttentionCall& c) {
  const auto& p = c.params;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.q.scalar_type()), DType, [&] {
      // per (batch, KV head): Hq/H queries x T tokens x D, one key and one value multiply-add each
      at::parallel_for(0, p.B * p.H, parallel_grain(4 * (p.Hq / std::max<int64_t>(p.H, 1)) * p.T * p.D), [&](int64_t b0, int64_t e0) {
        std::vector<float> row, kbuf;
        for (int64_t bh = b0; bh < e0; ++bh)
          attention::decode_attention_cpu<DType>(p, bh / p.H, bh % p.H, row, kbuf);
      });
    });
  });
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
  run_cpu(c);
  return c.out;
}

at::Tensor decode_attention_gear_cpu(KVQ_DECODE_ATTN_GEAR_ARGS) {
  DecodeAttentionCall c = prepare_gear(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero, v_residual,
                                       mask, bits, k_gear, v_gear, prefill_tokens, block_tokens, scale, true);
  run_cpu(c);
  return c.out;
}

#ifdef KVQ_WITH_CUDA
DecodeAttentionCall prepare_decode_attention_gear_cuda(KVQ_DECODE_ATTN_GEAR_ARGS) {
  DecodeAttentionCall c = prepare_gear(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero, v_residual,
                                       mask, bits, k_gear, v_gear, prefill_tokens, block_tokens, scale, false);
  const auto& p = c.params;
  KVQ_CHECK(p.k.Tq == 0 || attention::decode_attention_gear_cuda_ok(p), "kvq.", kGearOp,
            ": this GEAR layer is not supported by the CUDA kernel (needs head dim 64/128/256, at most 8 query "
            "heads per KV head, KIVI key groups and blocks of whole 32-token tiles, 16-byte aligned rows); "
            "kvq.decode_attention checks this and dequantizes such layers instead");
  return c;
}
#endif

}  // namespace kvq
