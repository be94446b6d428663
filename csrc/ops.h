// Declarations of every torch-facing function (CPU and CUDA implementations).
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <tuple>

#include "kvq/gear/gear.h"
#include "kvq/gear/gear_keys.h"
#include "kvq/linalg/power_svd.h"
#include "kvq/attention/decode_attention.h"
#include "kvq/attention/decode_attention_hqmq.h"
#include "kvq/attention/paged_decode_attention.h"
#include "kvq/quant/group_quant.h"
#include "kvq/select/outlier_topk.h"
#include "kvq/hqmq/hqmq.h"
#include "utils.h"

namespace kvq {

// ----- group quantization (csrc/group_quant.cpp) -----
/// Validated arguments and freshly allocated outputs of one quantize call.
struct QuantizeCall {
  at::Tensor x, codes, scale, zero, status;
  at::Tensor ws;  // CUDA scratch (per-channel split-T path), allocated by the CUDA binding
  quant::GroupQuantParams params;
};
QuantizeCall prepare_quantize(const at::Tensor& x, int64_t bits, int64_t group_size,
                              bool per_channel, bool check_finite);
struct DequantizeCall {
  at::Tensor codes, scale, zero, out;
  quant::GroupQuantParams params;
};
DequantizeCall prepare_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& zero, int64_t bits, bool per_channel,
                                  at::ScalarType dtype);

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t bits,
                                                            int64_t group_size, bool per_channel,
                                                            bool check_finite);
at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                          int64_t bits, bool per_channel, at::ScalarType dtype);

#ifdef KVQ_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits,
                                                             int64_t group_size, bool per_channel,
                                                             bool check_finite);
at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t bits, bool per_channel, at::ScalarType dtype);
#endif

// ----- HQMQ (csrc/hqmq.cpp) -----
/// Validated arguments, outputs and scratch of one hqmq_encode call.
struct HqmqEncodeCall {
  at::Tensor x, secondary, threshold, codes, status, flag_mask, flag_count, offsets, outliers;
  hqmq::HqmqParams params;
};
HqmqEncodeCall prepare_hqmq_encode(const at::Tensor& x, const at::Tensor& secondary,
                                   int64_t radius_bits,
                                   const c10::optional<at::Tensor>& outlier_threshold,
                                   bool check_finite);
/// Exclusive prefix of the outlier counts (syncs once: the record count M) and the
/// [M, 4] record output; returns M.
int64_t hqmq_prepare_records(HqmqEncodeCall& c);
struct HqmqDecodeCall {
  at::Tensor codes, secondary, outliers, out;
  hqmq::HqmqParams params;
};
HqmqDecodeCall prepare_hqmq_decode(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                                   int64_t radius_bits, int64_t head_dim, at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> hqmq_encode_cpu(
    const at::Tensor& x, const at::Tensor& secondary, int64_t radius_bits,
    const c10::optional<at::Tensor>& outlier_threshold, bool check_finite);
at::Tensor hqmq_decode_cpu(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                           int64_t radius_bits, int64_t head_dim, at::ScalarType dtype);
#ifdef KVQ_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> hqmq_encode_cuda(
    const at::Tensor& x, const at::Tensor& secondary, int64_t radius_bits,
    const c10::optional<at::Tensor>& outlier_threshold, bool check_finite);
at::Tensor hqmq_decode_cuda(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                            int64_t radius_bits, int64_t head_dim, at::ScalarType dtype);
#endif
// ----- end HQMQ -----

// ----- GEAR (csrc/gear.cpp) -----
struct OutlierSelectCall {
  at::Tensor x, values, indices, bounds;
  select::OutlierSelectParams params;
  int index_bytes = 1;
};
OutlierSelectCall prepare_outlier_select(const at::Tensor& x, int64_t k, bool per_channel,
                                         bool want_bounds, const char* op);
struct PowerIterCall {
  at::Tensor x, A, B, ws;
  linalg::PowerIterParams params;
};
PowerIterCall prepare_power_iter(const at::Tensor& x, int64_t rank, int64_t iters, int64_t seed,
                                 bool want_ws, const char* op);
struct GearCompressCall {
  at::Tensor x, xc, keys_ws, keys_sel, resid, status, A, B;
  at::Tensor omask, gbounds;  // alloc_gear_fill: outlier mask and group bounds (GearParams)
  OutlierSelectCall sel;
  QuantizeCall quant;
  PowerIterCall pi;
  gear::GearParams gear;
  gear::GearSmallParams small_params;  // fused one-launch CUDA path (small == true)
  int64_t k = 0, rank = 0;
  bool check_finite = true;
  bool small = false;  // CUDA, T <= 256: gear_compress_small_cuda (no xc / resid / bounds)
  bool cqr = false;    // CUDA long path: gear_clamp_quant_resid_cuda (no xc)
  gear::GearKeysPlan keys;  // CUDA long path, fp16 / bf16 keys: gear_keys_compress_cuda if keys.ok
};
GearCompressCall prepare_gear_compress(const at::Tensor& x, int64_t bits, int64_t group_size,
                                       bool per_channel, double sparsity, int64_t rank,
                                       int64_t iters, int64_t seed, bool check_finite, bool cuda);
/// Outlier mask [N, T, D] (zeroed) and group bounds of the CPU / multi-kernel CUDA path.
void alloc_gear_fill(GearCompressCall& c);
struct GearDecompressCall {
  DequantizeCall dq;
  at::Tensor ovalues, oindices, A, B;
  gear::GearParams gear;
  int index_bytes = 1;
};
GearDecompressCall prepare_gear_decompress(const at::Tensor& codes, const at::Tensor& scale,
                                           const at::Tensor& zero, const at::Tensor& outlier_values,
                                           const at::Tensor& outlier_indices, const at::Tensor& A,
                                           const at::Tensor& B, int64_t bits, bool per_channel,
                                           at::ScalarType dtype);
using GearTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor>;
#define KVQ_GEAR_DECLS(SUFFIX)                                                                   \
  std::tuple<at::Tensor, at::Tensor> outlier_select_##SUFFIX(const at::Tensor& x, int64_t k,     \
                                                              bool per_channel);                 \
  std::tuple<at::Tensor, at::Tensor> lowrank_power_iter_##SUFFIX(                                \
      const at::Tensor& x, int64_t rank, int64_t iters, int64_t seed);                           \
  GearTuple gear_compress_##SUFFIX(const at::Tensor& x, int64_t bits, int64_t group_size,        \
                                   bool per_channel, double sparsity, int64_t rank,              \
                                   int64_t iters, int64_t seed, bool check_finite);              \
  at::Tensor gear_decompress_##SUFFIX(const at::Tensor& codes, const at::Tensor& scale,          \
                                      const at::Tensor& zero, const at::Tensor& outlier_values,  \
                                      const at::Tensor& outlier_indices, const at::Tensor& A,    \
                                      const at::Tensor& B, int64_t bits, bool per_channel,       \
                                      at::ScalarType dtype);
KVQ_GEAR_DECLS(cpu)
#ifdef KVQ_WITH_CUDA
KVQ_GEAR_DECLS(cuda)
#endif
#undef KVQ_GEAR_DECLS
// ----- end GEAR -----


// ----- decode attention over group-quantized caches (csrc/decode_attention.cpp) -----
struct DecodeAttentionCall {
  at::Tensor q, out, mask, ws;
  attention::DecodeAttnParams params;
};
#define KVQ_DECODE_ATTN_GQ_ARGS                                                              \
  const at::Tensor &q, const at::Tensor &k_codes, const at::Tensor &k_scale,                 \
      const at::Tensor &k_zero, const at::Tensor &k_residual, const at::Tensor &v_codes,     \
      const at::Tensor &v_scale, const at::Tensor &v_zero, const at::Tensor &v_residual,     \
      const std::optional<at::Tensor>&mask, int64_t k_bits, bool k_per_channel, int64_t v_bits, \
      bool v_per_channel, double scale
DecodeAttentionCall prepare_decode_attention(KVQ_DECODE_ATTN_GQ_ARGS);
at::Tensor decode_attention_gq_cpu(KVQ_DECODE_ATTN_GQ_ARGS);
#ifdef KVQ_WITH_CUDA
at::Tensor decode_attention_gq_cuda(KVQ_DECODE_ATTN_GQ_ARGS);
#endif
// GEAR layers: KIVI backbone (2 per-channel key / per-token value stores, one bit width) plus
// per role the list [A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1] (12 tensors;
// decode_attention.h, GearSeg; docs/ops.md).
#define KVQ_DECODE_ATTN_GEAR_ARGS                                                                \
  const at::Tensor &q, const at::Tensor &k_codes, const at::Tensor &k_scale,                     \
      const at::Tensor &k_zero, const at::Tensor &k_residual, const at::Tensor &v_codes,         \
      const at::Tensor &v_scale, const at::Tensor &v_zero, const at::Tensor &v_residual,         \
      const std::optional<at::Tensor>&mask, int64_t bits, const std::vector<at::Tensor>&k_gear,  \
      const std::vector<at::Tensor>&v_gear, int64_t prefill_tokens, int64_t block_tokens, double scale
at::Tensor decode_attention_gear_cpu(KVQ_DECODE_ATTN_GEAR_ARGS);
#ifdef KVQ_WITH_CUDA
DecodeAttentionCall prepare_decode_attention_gear_cuda(KVQ_DECODE_ATTN_GEAR_ARGS);
at::Tensor decode_attention_gear_cuda(KVQ_DECODE_ATTN_GEAR_ARGS);
#endif

// ----- decode attention over HQMQ caches (csrc/decode_attention_hqmq.cpp) -----
/// \brief Shared head of the decode-attention argument checks: q [B, Hq, D] floating, D in
/// kHeadDims, k_codes [B, H, ...] with Hq a multiple of H and at most 16 query heads
/// per KV head.  Returns {B, Hq, D, H} (q already made contiguous by the caller).
inline std::array<int64_t, 4> check_decode_attention_q(const char* op, const at::Tensor& q,
                                                       const at::Tensor& k_codes) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  KVQ_CHECK_ARG(supported_head_dim(D), op, "q", "head dim must be ", kHeadDimsText, ", got ", D);
  CHECK_DIM(op, k_codes, "k_codes", 4);
  const int64_t H = k_codes.size(1);
  KVQ_CHECK_ARG(H > 0 && Hq % H == 0, op, "q", "has ", Hq, " heads, which is not a multiple of the cache's ", H,
                " KV heads");
  KVQ_CHECK_ARG(Hq / H <= 16, op, "q", "has ", Hq / H, " query heads per KV head; at most 16 are supported "
                "per call (split the query heads)");
  return {B, Hq, D, H};
}

/// \brief Shared tail of the decode-attention argument checks: validates and attaches the
/// optional [B, T] mask, allocates the output and fills the common params fields.
template <typename Call>
void finish_decode_attention_call(const char* op, Call& c, const std::optional<at::Tensor>& mask, int64_t B,
                                  int64_t H, int64_t Hq, int64_t D, int64_t T, double scale) {
  auto& p = c.params;
  if (mask.has_value() && mask->defined()) {
    CHECK_DIM(op, *mask, "mask", 2);
    CHECK_SAME_DEVICE(op, c.q, "q", *mask, "mask");
    KVQ_CHECK_ARG(mask->size(0) == B && mask->size(1) == T, op, "mask", "must be [B=", B, ", T=", T, "], got ",
                  mask->sizes());
    c.mask = mask->to(at::kByte).contiguous();
    p.mask = c.mask.template data_ptr<uint8_t>();
    p.mask_sb = T;
  }
  c.out = at::empty_like(c.q);
  p.q = c.q.data_ptr();
  p.out = c.out.data_ptr();
  p.B = B, p.H = H, p.Hq = Hq, p.D = D, p.T = T;
  p.scale = (float)scale;
}

struct HqmqAttentionCall {
  at::Tensor q, out, mask, ws, k_sec, v_sec, k_rec, v_rec, k_ptr, v_ptr, k_res, v_res;
  attention::HqmqAttnParams params;
};
#define KVQ_DECODE_ATTN_HQMQ_ARGS                                                               \
  const at::Tensor &q, const at::Tensor &k_codes,                                               \
      const at::Tensor &k_secondary, const at::Tensor &k_outliers, const at::Tensor &k_outlier_ptr, \
      const at::Tensor &v_codes, const at::Tensor &v_secondary,                                 \
      const at::Tensor &v_outliers, const at::Tensor &v_outlier_ptr,                            \
      const std::optional<at::Tensor>&mask, int64_t k_radius_bits, int64_t v_radius_bits, double scale, \
      const std::optional<at::Tensor>&k_residual, const std::optional<at::Tensor>&v_residual
HqmqAttentionCall prepare_decode_attention_hqmq(KVQ_DECODE_ATTN_HQMQ_ARGS);
/// One HQMQ role's shared checks and fields (csrc/decode_attention_hqmq.cpp): codes int16
/// [N, H, R, U], secondary fp32 [H, S, 4] on the device of `ref`.
attention::HqmqKV hqmq_role_fields(const char* op, const std::string& role, const char* rb_name, const at::Tensor& ref,
                                   const char* ref_name, const at::Tensor& codes, const at::Tensor& secondary, int64_t radius_bits, int64_t H, int64_t D);
at::Tensor decode_attention_hqmq_cpu(KVQ_DECODE_ATTN_HQMQ_ARGS);
#ifdef KVQ_WITH_CUDA
at::Tensor decode_attention_hqmq_cuda(KVQ_DECODE_ATTN_HQMQ_ARGS);
#endif

// ----- paged KV (csrc/paged.cpp) -----
#ifdef KVQ_WITH_CUDA
/// The token write and the page compression of kvq.paged_append on the device of `pool`
/// (csrc/cuda_bindings.cpp).
void paged_write_rows_on_device(const attention::PagedWriteParams& p, const at::Tensor& pool);
void paged_compress_on_device(const attention::PagedCompressParams& p, const at::Tensor& pool);
#endif
void paged_append(const at::Tensor& k_fp, const at::Tensor& v_fp, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_codes,
                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
                  const std::optional<at::Tensor>& v_codes, const std::optional<at::Tensor>& v_scale,
                  const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& compress_src,
                  const std::optional<at::Tensor>& compress_dst, int64_t bits, bool k_per_channel,
                  bool v_per_channel);
/// Validated arguments and the (uninitialised) work tensor of a plan call.
at::Tensor paged_decode_plan_prepare(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items);
at::Tensor paged_decode_plan_cpu(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items);
struct PagedAttentionCall {
  at::Tensor q, out, lse, ws;
  attention::DecodeAttnParams params;
};
#define KVQ_PAGED_ATTN_ARGS                                                                            \
  const at::Tensor &q, const at::Tensor &k_fp, const at::Tensor &v_fp, const std::optional<at::Tensor>&k_codes, \
      const std::optional<at::Tensor>&k_scale, const std::optional<at::Tensor>&k_zero,                 \
      const std::optional<at::Tensor>&v_codes, const std::optional<at::Tensor>&v_scale,                \
      const std::optional<at::Tensor>&v_zero, const at::Tensor &block_table, const at::Tensor &seq_lens, \
      const at::Tensor &comp_lens, const at::Tensor &work, int64_t bits, bool k_per_channel, bool v_per_channel, \
      double scale
PagedAttentionCall prepare_paged_decode_attention(KVQ_PAGED_ATTN_ARGS);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cpu(KVQ_PAGED_ATTN_ARGS);
struct PagedHqmqCall : PagedAttentionCall {
  attention::HqmqKV k, v;  // the HQMQ pools; `params` holds q, the tables and the rest
  attention::PagedHqmqParams kernel_params() const { return {params, k, v}; }
};
#define KVQ_PAGED_ATTN_HQMQ_ARGS                                                                         \
  const at::Tensor &q, const at::Tensor &k_fp, const at::Tensor &v_fp, const at::Tensor &k_codes,        \
      const at::Tensor &k_secondary, const at::Tensor &v_codes,                                          \
      const at::Tensor &v_secondary, const at::Tensor &block_table,                                      \
      const at::Tensor &seq_lens, const at::Tensor &comp_lens, const at::Tensor &work, int64_t radius_bits, \
      double scale
PagedHqmqCall prepare_paged_decode_attention_hqmq(KVQ_PAGED_ATTN_HQMQ_ARGS);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_hqmq_cpu(KVQ_PAGED_ATTN_HQMQ_ARGS);
#ifdef KVQ_WITH_CUDA
at::Tensor paged_decode_plan_cuda(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cuda(KVQ_PAGED_ATTN_ARGS);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_hqmq_cuda(KVQ_PAGED_ATTN_HQMQ_ARGS);
#endif

}  // namespace kvq
