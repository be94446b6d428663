// HQMQ decode-attention entry points: shared-memory plan, split plan (sized by the occupancy of
// the instantiation that will run), launch of HqmqDecodeAttentionKernel (fused combine) or of it
// and the shared split-combine kernel.  Kernels: include/kvq/attention/decode_attention_hqmq.cuh.
#include "kvq/attention/decode_attention_hqmq.cuh"
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"
#include "env_switch.h"

namespace kvq {
namespace attention {

// EXPR(D, FMT) for head dim p.D and field format fmt (HqmqFmt: 1 = hqmq-3.79, 2 = hqmq-5,
// 0 = runtime field widths, 3 = hqmq-3.79 on the v2 layout, D = 64 / 128 only).
#define KVQ_HQMQ_FMT(EXPR, D)                     \
  switch (fmt) {                                  \
    case 1: return EXPR(D, 1);                    \
    case 2: return EXPR(D, 2);                    \
    default: return EXPR(D, 0);                   \
  }
#define KVQ_HQMQ_FMT_V2(EXPR, D)                  \
  switch (fmt) {                                  \
    case 1: return EXPR(D, 1);                    \
    case 2: return EXPR(D, 2);                    \
    case 3: return EXPR(D, 3);                    \
    default: return EXPR(D, 0);                   \
  }
#define KVQ_HQMQ_DISPATCH(EXPR)                   \
  switch (p.D) {                                  \
    case 32: KVQ_HQMQ_FMT(EXPR, 32)               \
    case 64: KVQ_HQMQ_FMT_V2(EXPR, 64)            \
    case 128: KVQ_HQMQ_FMT_V2(EXPR, 128)          \
    default: KVQ_HQMQ_FMT(EXPR, 256)              \
  }

namespace {
/// v2 layout switch for the F = 16 format (hqmq_warp_mma16): 1 = on (default), 0 = the v1
/// kernel (FMT 1).  Initial value: KVQ_HQMQ_DECODE_V1=1 turns it off.
EnvSwitch g_hqmq_v2{"KVQ_HQMQ_DECODE_V1", 0, 1};
/// Field format of the launch: hqmq_fmt, with F = 16 / b_r = 4 at D = 64 / 128 moved to the v2
/// layout (3) when the switch is on.
int hqmq_launch_fmt(const HqmqAttnParams& p) {
  const int fmt = hqmq_fmt(p);
  return fmt == 1 && hqmq_v2_ok(p) && g_hqmq_v2.get() == 1 ? 3 : fmt;
}
}  // namespace

int decode_attention_hqmq_v2(int mode) { return g_hqmq_v2.exchange(mode); }

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
  const int64_t t_main = sm.mma ? (p.T / kTile) * kTile : 0;
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
  HqmqAttnParams pk = p;
  pk.tickets = fused_combine_tickets(p.B * p.H, (int)(p.Hq / p.H), plan.splits(), sm.total, stream);
  kernel<<<split_grid(plan, p.B * p.H), hqmq_warps(D) * 32, sm.total, stream>>>(pk, plan, sm);
  e = cudaGetLastError();
  if (e != cudaSuccess || pk.tickets != nullptr) return e;
  return LaunchDecodeAttentionCombine<DType, D>(p.ws, p.out, p.B * p.Hq, plan.splits(), stream);
}

cudaError_t decode_attention_hqmq_cuda(const HqmqAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  if (!(p.D == 32 || p.D == 64 || p.D == 128 || p.D == 256)) return cudaErrorInvalidValue;
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
