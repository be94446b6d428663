// CUDA implementations of the kvq ops: shared argument checks (prepare_*), device guard,
// current stream, then the torch-free launchers of include/kvq (compiled by nvcc).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kvq/cuda_api.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

// Scratch of the per-channel split-T quantize path (KCVT), when the launch will use it.
static void alloc_quant_ws(QuantizeCall& c, DTypeId dt) {
  const int64_t n = quant::group_quantize_ws_floats(c.params, dt);
  if (n <= 0) return;
  c.ws = at::empty({n}, c.x.options().dtype(at::kFloat));
  c.params.ws = c.ws.data_ptr<float>();
}

#define KVQ_CUDA_CALL(op, expr)                                                  \
  do {                                                                           \
    cudaError_t err_ = translate_errors([&] { return (expr); });                 \
    KVQ_CHECK(err_ == cudaSuccess, "kvq.", op, ": CUDA error: ", cudaGetErrorString(err_)); \
  } while (0)

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits,
                                                             int64_t group_size, bool per_channel,
                                                             bool check_finite) {
  c10::cuda::CUDAGuard guard(x.device());
  QuantizeCall c = prepare_quantize(x, bits, group_size, per_channel, check_finite);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  alloc_quant_ws(c, dtype_id(c.x.scalar_type()));
  KVQ_CUDA_CALL("quantize", quant::group_quantize_cuda(c.params, dtype_id(c.x.scalar_type()), stream));
  if (check_finite) raise_status("quantize", "x", c.status.item<int32_t>());
  return {c.codes, c.scale, c.zero};
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t bits, bool per_channel, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(codes.device());
  DequantizeCall c = prepare_dequantize(codes, scale, zero, bits, per_channel, dtype);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("dequantize", quant::group_dequantize_cuda(c.params, dtype_id(dtype), stream));
  return c.out;
}

// ---- HQMQ (format: include/kvq/hqmq/hqmq.h) ----
std::tuple<at::Tensor, at::Tensor> hqmq_encode_cuda(
    const at::Tensor& x, const at::Tensor& secondary, int64_t radius_bits,
    const c10::optional<at::Tensor>& outlier_threshold, bool check_finite) {
  c10::cuda::CUDAGuard guard(x.device());
  HqmqEncodeCall c = prepare_hqmq_encode(x, secondary, radius_bits, outlier_threshold, check_finite);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto dt = dtype_id(c.x.scalar_type());
  KVQ_CUDA_CALL("hqmq_encode", hqmq::hqmq_encode_cuda(c.params, dt, stream));
  if (check_finite) raise_status("hqmq_encode", "x", c.status.item<int32_t>(), kHqmqOutOfRange);
  if (hqmq_prepare_records(c) > 0)  // syncs once for the record count (Med3x only)
    KVQ_CUDA_CALL("hqmq_encode", hqmq::hqmq_write_records_cuda(c.params, dt, stream));
  return {c.codes, c.outliers};
}

at::Tensor hqmq_decode_cuda(const at::Tensor& codes, const at::Tensor& secondary, const at::Tensor& outliers,
                            int64_t radius_bits, int64_t head_dim, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(codes.device());
  HqmqDecodeCall c =
      prepare_hqmq_decode(codes, secondary, outliers, radius_bits, head_dim, dtype);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("hqmq_decode", hqmq::hqmq_decode_cuda(c.params, dtype_id(dtype), stream));
  return c.out;
}
// ---- end HQMQ ----

// ---- GEAR (prepare_* in gear.cpp) ----
std::tuple<at::Tensor, at::Tensor> outlier_select_cuda(const at::Tensor& x, int64_t k,
                                                       bool per_channel) {
  c10::cuda::CUDAGuard guard(x.device());
  OutlierSelectCall c = prepare_outlier_select(x, k, per_channel, false, "outlier_select");
  at::Tensor ws;
  if (c.params.k > 0 && select::vector_length(c.params) > 256) {
    ws = at::empty({c.x.numel()}, c.x.options().dtype(at::kInt));
    c.params.keys_ws = reinterpret_cast<uint32_t*>(ws.data_ptr());
  }
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("outlier_select", select::outlier_select_cuda(c.params, dtype_id(c.x.scalar_type()),
                                                              c.index_bytes, stream));
  return {c.values, c.indices};
}

std::tuple<at::Tensor, at::Tensor> lowrank_power_iter_cuda(const at::Tensor& x, int64_t rank,
                                                           int64_t iters, int64_t seed) {
  c10::cuda::CUDAGuard guard(x.device());
  PowerIterCall c = prepare_power_iter(x, rank, iters, seed, true, "lowrank_power_iter");
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("lowrank_power_iter",
                linalg::power_iter_cuda(c.params, dtype_id(c.x.scalar_type()), stream));
  return {c.A, c.B};
}

GearTuple gear_compress_cuda(const at::Tensor& x, int64_t bits, int64_t group_size,
                             bool per_channel, double sparsity, int64_t rank, int64_t iters,
                             int64_t seed, bool check_finite) {
  const char* op = "gear_compress";
  c10::cuda::CUDAGuard guard(x.device());
  GearCompressCall c = prepare_gear_compress(x, bits, group_size, per_channel, sparsity, rank,
                                             iters, seed, check_finite, /*cuda=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto dt = dtype_id(c.x.scalar_type());
  if (c.small) {  // T <= 256: the whole compress in one launch
    KVQ_CUDA_CALL(op, gear::gear_compress_small_cuda(c.small_params, dt, stream));
    if (check_finite) raise_status(op, "x", c.status.item<int32_t>());
    return {c.quant.codes, c.quant.scale, c.quant.zero, c.sel.values, c.sel.indices, c.A, c.B};
  }
  if (c.keys.ok) {  // fp16 / bf16 keys: select + clamp + quantize + residual in one launch
    KVQ_CUDA_CALL(op, gear::gear_keys_compress_cuda(c.gear, c.keys, dt, stream));
  } else if (gear::gear_values_fused_ok(c.gear, dt)) {  // values, 16-bit, 1 <= k <= 8: one launch
    KVQ_CUDA_CALL(op, gear::gear_values_compress_cuda(c.gear, dt, stream));
  } else {
    if (c.k > 0) {
      KVQ_CUDA_CALL(op, select::outlier_select_cuda(c.sel.params, dt, c.sel.index_bytes, stream));
      alloc_gear_fill(c);
      KVQ_CUDA_CALL(op, gear::gear_group_bounds_cuda(c.gear, dt, c.sel.index_bytes, stream));
    }
    if (c.cqr) {  // outlier fill + quantize + residual in one pass over x
      KVQ_CUDA_CALL(op, gear::gear_clamp_quant_resid_cuda(c.gear, dt, stream));
    } else {
      if (c.k > 0) KVQ_CUDA_CALL(op, gear::gear_clamp_cuda(c.gear, dt, stream));
      alloc_quant_ws(c.quant, dt);
      KVQ_CUDA_CALL(op, quant::group_quantize_cuda(c.quant.params, dt, stream));
      KVQ_CUDA_CALL(op, gear::gear_residual_cuda(c.gear, dt, stream));
    }
    if (c.k > 0) KVQ_CUDA_CALL(op, gear::gear_zero_outliers_cuda(c.gear, c.sel.index_bytes, stream));
  }
  if (c.rank > 0 && c.gear.T > 0)
    KVQ_CUDA_CALL(op, linalg::power_iter_cuda(c.pi.params, DTypeId::kFloat16, stream));
  if (check_finite) raise_status(op, "x", c.status.item<int32_t>());
  return {c.quant.codes, c.quant.scale, c.quant.zero, c.sel.values, c.sel.indices, c.A, c.B};
}

at::Tensor gear_decompress_cuda(const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, const at::Tensor& outlier_values,
                                const at::Tensor& outlier_indices, const at::Tensor& A,
                                const at::Tensor& B, int64_t bits, bool per_channel,
                                at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(codes.device());
  GearDecompressCall c = prepare_gear_decompress(codes, scale, zero, outlier_values,
                                                 outlier_indices, A, B, bits, per_channel, dtype);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("gear_decompress",
                gear::gear_decompress_cuda(c.gear, dtype_id(dtype), c.index_bytes, stream));
  return c.dq.out;
}
// ---- end GEAR ----


static at::Tensor run_decode_attention_cuda(DecodeAttentionCall& c, const char* op) {
  auto& p = c.params;
  p.splits = attention::decode_attention_splits(p, dtype_id(c.q.scalar_type()));
  c.ws = at::empty({p.B * p.Hq * p.splits * (p.D + 2)}, c.q.options().dtype(at::kFloat));
  p.ws = c.ws.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL(op, attention::decode_attention_cuda(p, dtype_id(c.q.scalar_type()), stream));
  return c.out;
}

at::Tensor decode_attention_gq_cuda(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                    const at::Tensor& k_zero, const at::Tensor& k_residual,
                                    const at::Tensor& v_codes, const at::Tensor& v_scale,
                                    const at::Tensor& v_zero, const at::Tensor& v_residual,
                                    const std::optional<at::Tensor>& mask, int64_t k_bits, bool k_per_channel,
                                    int64_t v_bits, bool v_per_channel, double scale) {
  c10::cuda::CUDAGuard guard(q.device());
  DecodeAttentionCall c = prepare_decode_attention(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale,
                                                   v_zero, v_residual, mask, k_bits, k_per_channel, v_bits,
                                                   v_per_channel, scale);
  return run_decode_attention_cuda(c, "decode_attention_gq");
}

at::Tensor decode_attention_gear_cuda(KVQ_DECODE_ATTN_GEAR_ARGS) {
  c10::cuda::CUDAGuard guard(q.device());
  DecodeAttentionCall c = prepare_decode_attention_gear_cuda(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale,
                                                             v_zero, v_residual, mask, bits, k_gear, v_gear,
                                                             prefill_tokens, block_tokens, scale);
  return run_decode_attention_cuda(c, "decode_attention_gear");
}

at::Tensor decode_attention_hqmq_cuda(KVQ_DECODE_ATTN_HQMQ_ARGS) {
  c10::cuda::CUDAGuard guard(q.device());
  HqmqAttentionCall c = prepare_decode_attention_hqmq(q, k_codes, k_secondary, k_outliers, k_outlier_ptr,
                                                      v_codes, v_secondary, v_outliers, v_outlier_ptr,
                                                      mask, k_radius_bits, v_radius_bits, scale, k_residual,
                                                      v_residual);
  auto& p = c.params;
  const auto dt = dtype_id(c.q.scalar_type());
  p.splits = attention::decode_attention_hqmq_splits(p, dt);
  c.ws = at::empty({p.B * p.Hq * p.splits * (p.D + 2)}, c.q.options().dtype(at::kFloat));
  p.ws = c.ws.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("decode_attention_hqmq", attention::decode_attention_hqmq_cuda(p, dt, stream));
  return c.out;
}

// ---- paged KV ----
void paged_write_rows_on_device(const attention::PagedWriteParams& p, const at::Tensor& pool) {
  c10::cuda::CUDAGuard guard(pool.device());
  KVQ_CUDA_CALL("paged_append", attention::paged_write_rows_cuda(p, c10::cuda::getCurrentCUDAStream().stream()));
}

void paged_compress_on_device(const attention::PagedCompressParams& p, const at::Tensor& pool) {
  c10::cuda::CUDAGuard guard(pool.device());
  KVQ_CUDA_CALL("paged_append", attention::paged_compress_cuda(p, dtype_id(pool.scalar_type()),
                                                               c10::cuda::getCurrentCUDAStream().stream()));
}

at::Tensor paged_decode_plan_cuda(const at::Tensor& seq_lens, const at::Tensor& comp_lens, int64_t max_items) {
  c10::cuda::CUDAGuard guard(seq_lens.device());
  at::Tensor work = paged_decode_plan_prepare(seq_lens, comp_lens, max_items);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("paged_decode_plan",
                attention::paged_decode_plan_cuda(seq_lens.data_ptr<int32_t>(), comp_lens.data_ptr<int32_t>(),
                                                  seq_lens.size(0), max_items, work.data_ptr<int32_t>(), stream));
  return work;
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cuda(KVQ_PAGED_ATTN_ARGS) {
  c10::cuda::CUDAGuard guard(q.device());
  PagedAttentionCall c = prepare_paged_decode_attention(q, k_fp, v_fp, k_codes, k_scale, k_zero, v_codes, v_scale,
                                                        v_zero, block_table, seq_lens, comp_lens, work, bits,
                                                        k_per_channel, v_per_channel, scale);
  auto& p = c.params;
  c.ws = at::empty({p.Hq * p.paged.max_items * (p.D + 2)}, c.q.options().dtype(at::kFloat));
  p.ws = c.ws.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("paged_decode_attention", attention::paged_decode_attention_cuda(p, dtype_id(c.q.scalar_type()), stream));
  return {c.out, c.lse};
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_hqmq_cuda(KVQ_PAGED_ATTN_HQMQ_ARGS) {
  c10::cuda::CUDAGuard guard(q.device());
  PagedHqmqCall c = prepare_paged_decode_attention_hqmq(q, k_fp, v_fp, k_codes, k_secondary, v_codes,
                                                        v_secondary, block_table, seq_lens, comp_lens, work,
                                                        radius_bits, scale);
  auto& p = c.params;
  c.ws = at::empty({p.Hq * p.paged.max_items * (p.D + 2)}, c.q.options().dtype(at::kFloat));
  p.ws = c.ws.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("paged_decode_attention_hqmq",
                attention::paged_decode_attention_hqmq_cuda(c.kernel_params(), dtype_id(c.q.scalar_type()), stream));
  return {c.out, c.lse};
}

}  // namespace kvq

TORCH_LIBRARY_IMPL(kvq, CUDA, m) {
  m.impl("quantize", &kvq::quantize_cuda);
  m.impl("dequantize", &kvq::dequantize_cuda);
  // ---- GEAR CUDA impls ----
  m.impl("outlier_select", &kvq::outlier_select_cuda);
  m.impl("lowrank_power_iter", &kvq::lowrank_power_iter_cuda);
  m.impl("gear_compress", &kvq::gear_compress_cuda);
  m.impl("gear_decompress", &kvq::gear_decompress_cuda);
  // ---- end GEAR CUDA impls ----
  // ---- HQMQ CUDA impls ----
  m.impl("hqmq_encode", &kvq::hqmq_encode_cuda);
  m.impl("hqmq_decode", &kvq::hqmq_decode_cuda);
  // ---- end HQMQ CUDA impls ----
  // ---- decode attention CUDA impls ----
  m.impl("decode_attention_gq", &kvq::decode_attention_gq_cuda);
  m.impl("decode_attention_gear", &kvq::decode_attention_gear_cuda);
  m.impl("decode_attention_hqmq", &kvq::decode_attention_hqmq_cuda);
  // ---- end decode attention CUDA impls ----
  m.impl("paged_decode_plan", &kvq::paged_decode_plan_cuda);
  m.impl("paged_decode_attention", &kvq::paged_decode_attention_cuda);
  m.impl("paged_decode_attention_hqmq", &kvq::paged_decode_attention_hqmq_cuda);
}
