// Decode-attention entry points: split planning (sized by the occupancy of the kernel that
// will run), the generic (CUDA-core) instantiations, and dispatch to the tensor-core
// instantiations generated from decode_attention_mma_kernels.cu.in (one file per code width).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kvq/attention/decode_attention.cuh"
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"
#include "env_switch.h"

namespace kvq {
namespace attention {

// ---- the fused split combine: its switch and the per-device split tickets ----
namespace {
// The fused combine is opt-in (default 0): on the H200 it measured no faster than the
// two-launch path (bench/NOTES.md, decode v7), and a CUDA graph that captured it must not be
// replayed on two streams at once (its tickets are fixed at capture).
EnvSwitch g_fused_combine{"KVQ_DECODE_FUSED_COMBINE"};

// One ticket buffer per device, handed out in consecutive slices (round robin), so that
// launches close in time -- e.g. on two streams -- do not share tickets.  Launches on one
// stream never overlap (the fused kernel is not launched as a programmatic dependent), so
// within a stream reuse is safe: every launch leaves its tickets at 0.  Buffers are never
// freed: captured CUDA graphs keep their pointers.
constexpr int kMaxDevices = 64;
constexpr int64_t kMinTickets = int64_t(1) << 16;  // 256 KB: B * H up to 65536 per launch
struct TicketPool {
  int* ptr = nullptr;
  int64_t cap = 0, next = 0;
};
std::mutex g_pool_mutex;
TicketPool g_pools[kMaxDevices];
}  // namespace

int decode_attention_fused_combine(int mode) { return g_fused_combine.exchange(mode); }

int* decode_attention_tickets(int64_t n, cudaStream_t stream) {
  if (n <= 0 || g_fused_combine.get() == 0) return nullptr;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  TicketPool& pool = g_pools[dev];
  if (n > pool.cap) {
    // allocate (once per device, or to grow): not while this stream is being captured, where
    // cudaMalloc / a host synchronization are not allowed -- the caller then uses two launches
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &st) != cudaSuccess || st != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return nullptr;
    }
    int64_t cap = kMinTickets;
    while (cap < n) cap *= 2;
    int* ptr = nullptr;
    if (cudaMalloc(&ptr, (size_t)cap * sizeof(int)) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    // zeroed before any kernel on any stream can use it
    if (cudaMemsetAsync(ptr, 0, (size_t)cap * sizeof(int), stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaFree(ptr);
      return nullptr;
    }
    pool.ptr = ptr, pool.cap = cap, pool.next = 0;
  }
  if (pool.next + n > pool.cap) pool.next = 0;
  int* t = pool.ptr + pool.next;
  pool.next += n;
  return t;
}

#define KVQ_DECLARE_MMA(B)                                                                              \
  cudaError_t decode_attention_mma_b##B(const DecodeAttnParams&, const SplitPlan&, DTypeId, cudaStream_t); \
  int decode_attention_mma_occupancy_b##B(const DecodeAttnParams&, DTypeId);
KVQ_DECLARE_MMA(2)
KVQ_DECLARE_MMA(4)
KVQ_DECLARE_MMA(8)
#undef KVQ_DECLARE_MMA

#define KVQ_GENERIC_DISPATCH(EXPR)                 \
  switch (p.D) {                                   \
    case 32: return EXPR(32);                      \
    case 64: return EXPR(64);                      \
    case 128: return EXPR(128);                    \
    case 256: return EXPR(256);                    \
    default: return EXPR(0);                       \
  }

static int occupancy(const DecodeAttnParams& p, DTypeId dtype) {
  if (decode_attention_mma_ok(p)) {
    switch (p.k.bits) {
      case 2: return decode_attention_mma_occupancy_b2(p, dtype);
      case 4: return decode_attention_mma_occupancy_b4(p, dtype);
      case 8: return decode_attention_mma_occupancy_b8(p, dtype);
      default: return 0;
    }
  }
  const int g = (int)(p.Hq / p.H);
#define KVQ_OCC(D) (D == 0 ? 0 : DecodeAttentionOccupancy<DType, (D == 0 ? 32 : D), 2, true, false>(g))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> int { KVQ_GENERIC_DISPATCH(KVQ_OCC) });
#undef KVQ_OCC
}

static SplitPlan plan_for(const DecodeAttnParams& p, DTypeId dtype) {
  return decode_attention_plan(p, quant::num_sms(), occupancy(p, dtype));
}

bool decode_attention_gear_cuda_ok(const DecodeAttnParams& p) { return decode_attention_mma_ok(p); }

int decode_attention_splits(const DecodeAttnParams& p, DTypeId dtype) { return plan_for(p, dtype).splits(); }

cudaError_t decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  const SplitPlan plan = plan_for(p, dtype);
  if (plan.splits() != p.splits) return cudaErrorInvalidValue;
  if (p.gear && plan.t_main != p.k.Tq) return cudaErrorInvalidValue;  // GEAR tokens need the mma path
  if (plan.t_main > 0) {
    switch (p.k.bits) {
      case 2: return decode_attention_mma_b2(p, plan, dtype, stream);
      case 4: return decode_attention_mma_b4(p, plan, dtype, stream);
      case 8: return decode_attention_mma_b8(p, plan, dtype, stream);
      default: return cudaErrorInvalidValue;
    }
  }
#define KVQ_LAUNCH(D) \
  (D == 0 ? cudaErrorInvalidValue : LaunchDecodeAttention<DType, (D == 0 ? 32 : D), 2, true, false>(p, plan, stream))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t { KVQ_GENERIC_DISPATCH(KVQ_LAUNCH) });
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
