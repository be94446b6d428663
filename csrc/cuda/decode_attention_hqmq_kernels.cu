// HQMQ decode-attention entry points: shared-memory plan, split plan (sized by the occupancy of
// the instantiation that will run), launch of HqmqDecodeAttentionKernel and the shared
// split-combine kernel.  Kernels: include/kvq/attention/decode_attention_hqmq.cuh.
#include "kvq/attention/decode_attention_hqmq.cuh"
#include "kvq/build_config.h"
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"

namespace kvq {
namespace attention {

// EXPR(D, FMT) for head dim p.D and launch format fmt (HqmqFmt: 1 = hqmq-3.79, 2 = hqmq-5,
// 0 = runtime field widths, 3 = hqmq-3.79 on the v2 layout).  At D = 64 / 128 the F = 16 format
// always takes the v2 layout (hqmq_launch_fmt), so FMT 1 is instantiated for D = 32 / 256 only.
#define KVQ_HQMQ_FMT(EXPR, D, F16)                \
  switch (fmt) {                                  \
    case F16: return EXPR(D, F16);                \
    case 2: return EXPR(D, 2);                    \
    default: return EXPR(D, 0);                   \
  }
#define KVQ_HQMQ_DISPATCH(EXPR)                   \
  switch (p.D) {                                  \
    case 32: KVQ_HQMQ_FMT(EXPR, 32, 1)            \
    case 64: KVQ_HQMQ_FMT(EXPR, 64, 3)            \
    case 128: KVQ_HQMQ_FMT(EXPR, 128, 3)          \
    default: KVQ_HQMQ_FMT(EXPR, 256, 1)           \
  }

/// Resident CTAs per SM of one instantiation at `smem` bytes (0 on error); cached per size.
template <typename DType, int D, int FMT>
static int hqmq_occupancy(size_t smem) {
  static size_t cached_smem = 0;  // benign race: same value from every thread
  static int cached_n = 0;
  if (cached_n > 0 && cached_smem == smem) return cached_n;
  auto kernel = HqmqDecodeAttentionKernel<DType, D, FMT>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, hqmq_warps(D) * 32, smem) != cudaSuccess) return 0;
  cached_smem = smem, cached_n = n;
  return n;
}

static SplitPlan hqmq_plan(const HqmqAttnParams& p, const HqmqSmem& sm, DTypeId dtype, int fmt) {
#define KVQ_OCC(D, FMT) hqmq_occupancy<DType, D, FMT>(sm.total)
  const int occ = KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> int { KVQ_HQMQ_DISPATCH(KVQ_OCC) });
#undef KVQ_OCC
  const int64_t t_main = sm.mma ? (p.Tc / kTile) * kTile : 0;  // whole tiles of encoded tokens
  return split_plan(t_main, p.T, p.B * p.H, quant::num_sms(), occ, hqmq_warps(p.D));
}

int decode_attention_hqmq_splits(const HqmqAttnParams& p, DTypeId dtype) {
  const int fmt = hqmq_launch_fmt(p);
  return hqmq_plan(p, hqmq_smem_plan(p, fmt), dtype, fmt).splits();
}

template <typename DType, int D, int FMT>
static cudaError_t launch_hqmq(const HqmqAttnParams& p, const SplitPlan& plan, const HqmqSmem& sm,
                               cudaStream_t stream) {
  auto kernel = HqmqDecodeAttentionKernel<DType, D, FMT>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm.total);
  if (e != cudaSuccess) return e;
  if (reinterpret_cast<uintptr_t>(p.ws) % 16 != 0) return cudaErrorMisalignedAddress;
  kernel<<<split_grid(plan, p.B * p.H), hqmq_warps(D) * 32, sm.total, stream>>>(p, plan, sm);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return LaunchDecodeAttentionCombine<DType, D>(p.ws, p.out, p.B * p.Hq, plan.splits(), stream);
}

cudaError_t decode_attention_hqmq_cuda(const HqmqAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  if (!supported_head_dim(p.D)) return cudaErrorInvalidValue;
  const int fmt = hqmq_launch_fmt(p);
  const HqmqSmem sm = hqmq_smem_plan(p, fmt);
  const SplitPlan plan = hqmq_plan(p, sm, dtype, fmt);
  if (plan.splits() != p.splits) return cudaErrorInvalidValue;
#define KVQ_LAUNCH(D, FMT) launch_hqmq<DType, D, FMT>(p, plan, sm, stream)
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t { KVQ_HQMQ_DISPATCH(KVQ_LAUNCH) });
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
