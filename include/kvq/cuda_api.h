// Host entry points of the CUDA kernels, compiled by nvcc in csrc/cuda/*.cu and called
// from the torch bindings.  Torch-free; each returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include "kvq/common/dispatch.h"
#include "kvq/quant/group_quant.h"
#include "kvq/hqmq/hqmq.h"

namespace kvq {
namespace quant {

/// \brief Floats of scratch p.ws that group_quantize_cuda uses for p (0: none; p.ws may stay
/// null, and a null p.ws always works, through a slower kernel).
int64_t group_quantize_ws_floats(const GroupQuantParams& p, DTypeId dtype);
/// \brief Group-quantize and pack p.x into p.codes / p.scale / p.zero (scratch: p.ws).
cudaError_t group_quantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Unpack and dequantize p.codes / p.scale / p.zero into p.out.
cudaError_t group_dequantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream);

}  // namespace quant
}  // namespace kvq

// ---- HQMQ (csrc/cuda/hqmq_kernels.cu) ----
namespace kvq {
namespace hqmq {

/// \brief Dense HQMQ encode of p.x into p.codes / p.scale (+ outlier mask/count scratch).
cudaError_t hqmq_encode_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Write the Med3x outlier records (needs p.offsets, p.flag_mask, p.outliers).
cudaError_t hqmq_write_records_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Decode p.codes / p.scale and apply the outlier records into p.out.
cudaError_t hqmq_decode_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream);

}  // namespace hqmq
}  // namespace kvq

// ---- GEAR (csrc/cuda/{outlier_topk,power_svd,gear}_kernels.cu) ----
#include "kvq/gear/gear.h"
#include "kvq/gear/gear_keys.h"
#include "kvq/linalg/power_svd.h"
#include "kvq/select/outlier_topk.h"

namespace kvq {
namespace select {
/// \brief Top/bottom-k of every vector into p.values / p.indices (+ p.bounds if set).
cudaError_t outlier_select_cuda(const OutlierSelectParams& p, DTypeId dtype, int index_bytes,
                                cudaStream_t stream);
}  // namespace select
namespace linalg {
/// \brief Rank-r factors A, B of every [T, d] matrix of p.x (power iteration).
cudaError_t power_iter_cuda(const PowerIterParams& p, DTypeId dtype, cudaStream_t stream);
}  // namespace linalg
namespace gear {
/// \brief p.omask (zeroed by the caller) and p.gbounds from the selected outliers (k > 0).
cudaError_t gear_group_bounds_cuda(const GearParams& p, DTypeId dtype, int index_bytes,
                                   cudaStream_t stream);
/// \brief p.xc = p.x with the outliers filled within their groups (gear_clamp_cpu) (+ finite
/// check of p.x into p.status).
cudaError_t gear_clamp_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Long-matrix path: outlier fill + quantize (p.q) + fp16 residual in one launch
/// (gear_cqr_rows(...) > 0); outliers still need gear_zero_outliers_cuda.
cudaError_t gear_clamp_quant_resid_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief p.resid = fp16(xc - dequant(p.q)).
cudaError_t gear_residual_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief p.resid = 0 at the outlier positions.
cudaError_t gear_zero_outliers_cuda(const GearParams& p, int index_bytes, cudaStream_t stream);
/// \brief Does gear_values_compress_cuda handle this long-path value compress?  (fp16 / bf16,
/// per-token groups, D in {64, 128, 256}, 1 <= k <= 8.)
bool gear_values_fused_ok(const GearParams& p, DTypeId dtype);
/// \brief Value side in one launch: outlier select + clamp + quantize (p.q) + fp16 residual
/// (0 at outliers) + finite check, the outputs of the select / clamp-quant-resid /
/// zero-outliers chain (include/kvq/gear/gear_values.cuh).
cudaError_t gear_values_compress_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Key side (per-channel, fp16 / bf16) of the long-matrix compress in one launch:
/// outliers (p.ovalues / p.oindices), codes / scale / zero (p.q), residual, status
/// (gear_keys.h; plan = gear_keys_plan(...) with plan.ok).
cudaError_t gear_keys_compress_cuda(const GearParams& p, const GearKeysPlan& plan, DTypeId dtype,
                                    cudaStream_t stream);
/// \brief Whole compress of short matrices in one launch (gear_small_smem(T, D) > 0).
cudaError_t gear_compress_small_cuda(const GearSmallParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief p.out = dequant(p.q) + A B^T, then outliers scattered in.
cudaError_t gear_decompress_cuda(const GearParams& p, DTypeId dtype, int index_bytes,
                                 cudaStream_t stream);
}  // namespace gear
}  // namespace kvq

// ---- decode attention (csrc/cuda/decode_attention_kernels.cu) ----
#include "kvq/attention/decode_attention.h"

namespace kvq {
namespace attention {
/// \brief Number of token splits (partials in p.ws) the launch will use for p.
int decode_attention_splits(const DecodeAttnParams& p, DTypeId dtype);
/// \brief Fused decode attention; p.ws must hold B * Hq * splits * (D + 2) floats (16-byte aligned).
cudaError_t decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Can the CUDA kernels run this GEAR layer (p.gear)?  (Its compressed tokens need the
/// tensor-core path.)
bool decode_attention_gear_cuda_ok(const DecodeAttnParams& p);
}  // namespace attention
}  // namespace kvq

// ---- decode attention over HQMQ caches (csrc/cuda/decode_attention_hqmq_kernels.cu) ----
#include "kvq/attention/decode_attention_hqmq.h"

namespace kvq {
namespace attention {
/// \brief Number of token splits (partials in p.ws) the HQMQ launch will use for p.
int decode_attention_hqmq_splits(const HqmqAttnParams& p, DTypeId dtype);
/// \brief Fused HQMQ decode attention; p.ws must hold B * Hq * splits * (D + 2) floats (16-byte aligned).
cudaError_t decode_attention_hqmq_cuda(const HqmqAttnParams& p, DTypeId dtype, cudaStream_t stream);
}  // namespace attention
}  // namespace kvq

// ---- paged decode attention (csrc/cuda/paged_decode_attention_kernels.cu) ----
#include "kvq/attention/paged_decode_attention.h"
namespace kvq {
namespace attention {
/// \brief Write the work list (PagedWork{max_items, num_seqs} ints at `work`) of a batch from its
/// device lengths; max_items >= paged_min_items(num_seqs).  One small kernel, no host sync.
cudaError_t paged_decode_plan_cuda(const int32_t* seq_lens, const int32_t* comp_lens, int64_t num_seqs,
                                   int64_t max_items, int32_t* work, cudaStream_t stream);
/// \brief Does the tensor-core path read these pages?  (fp16 / bf16, a compressed pool, and
/// decode_attention_mma_ok's formats and alignment; pages of whole 32-token tiles.)
bool paged_decode_attention_mma_ok(const DecodeAttnParams& p, DTypeId dtype);
/// \brief Paged decode attention (p.paged set; p.ws holds Hq * max_items * (D + 2) floats).
cudaError_t paged_decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Paged decode attention over HQMQ pages (hp.base.ws as above).
cudaError_t paged_decode_attention_hqmq_cuda(const PagedHqmqParams& hp, DTypeId dtype, cudaStream_t stream);
/// \brief The token write of kvq.paged_append (PagedWriteParams): one kernel for keys and values.
cudaError_t paged_write_rows_cuda(const PagedWriteParams& p, cudaStream_t stream);
/// \brief The page compression of kvq.paged_append (PagedCompressParams): one launch for every
/// pair of both roles; `dtype` is the full-precision pools'.
cudaError_t paged_compress_cuda(const PagedCompressParams& p, DTypeId dtype, cudaStream_t stream);
}  // namespace attention
}  // namespace kvq
