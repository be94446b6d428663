// Paged decode attention on CUDA: plan, split and combine kernels.  Torch-free.  Storage and
// work-list layout: paged_decode_attention.h.
//
// plan    one CTA reads seq_lens / comp_lens (device), picks the chunk sizes (paged_chunks)
//         and writes the work list: no host synchronisation, so a captured CUDA graph stays
//         valid when the lengths change.  Run once per batch; every layer reuses it.
// split   grid (H, max_items): CTA (h, item) runs KV head h over the item's token range with the
//         decode mainloop of decode_attention.cuh -- compressed tokens through the tensor-core
//         path (warp_mma, its tile addresses from the block table), full-precision tokens
//         through the CUDA-core loop, split over the CTA's warps -- and writes its partial
//         (m, l, acc) of the g query heads to the workspace [Hq, max_items, D] (+ (m, l)).
//         CTAs past the plan's item count return at once.
// combine one CTA per (sequence, query head) merges the sequence's items (a programmatic
//         dependent launch) and writes out (and the log-sum-exp).
// HQMQ pages (PagedHqmqParams) have their own split kernel over the same work list and
// workspace: the contiguous HQMQ kernel's tensor-core tile loop (decode_attention_hqmq.cuh) with
// tile addresses from the block table, the rest through the CUDA-core loop.
#pragma once
#include "kvq/attention/decode_attention.cuh"
#include "kvq/attention/decode_attention_hqmq.cuh"
#include "kvq/attention/paged_decode_attention.h"

namespace kvq {
namespace attention {

constexpr int kPlanThreads = 256;
static_assert(kPagedMaxGroup == kMaxGroup, "the CUDA-core kernels take kMaxGroup heads");

/// \brief The plan (paged_plan_host's list) on the device, one CTA of kPlanThreads threads
/// (a template so that every translation unit that includes this header may instantiate it).
template <int THREADS = kPlanThreads>
__global__ void __launch_bounds__(THREADS) PagedDecodePlanKernel(const int32_t* seq_lens, const int32_t* comp_lens,
                                                                      int64_t num_seqs, int64_t max_items,
                                                                      int32_t* work) {
  static_assert(THREADS == kPlanThreads, "one block size");
  __shared__ long long s_red[2][kPlanThreads / 32];
  __shared__ int s_scan[kPlanThreads / 32];
  __shared__ int s_carry;
  const int tid = threadIdx.x, lane = tid % 32, wid = tid / 32;
  const PagedWork wl{max_items, num_seqs};
  long long tc = 0, tf = 0;
  for (int64_t s = tid; s < num_seqs; s += kPlanThreads) {
    const int64_t len = seq_lens[s] > 0 ? seq_lens[s] : 0, c = paged_comp_len(len, comp_lens[s]);
    tc += c, tf += len - c;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tc += __shfl_xor_sync(0xffffffffu, tc, o), tf += __shfl_xor_sync(0xffffffffu, tf, o);
  if (lane == 0) s_red[0][wid] = tc, s_red[1][wid] = tf;
  if (tid == 0) s_carry = 0;
  __syncthreads();
  tc = 0, tf = 0;
#pragma unroll
  for (int w = 0; w < kPlanThreads / 32; ++w) tc += s_red[0][w], tf += s_red[1][w];
  int64_t cc = 0, cf = 0;
  paged_chunks(tc, tf, num_seqs, max_items, cc, cf);
  // exclusive scan of the items per sequence, kPlanThreads sequences at a time
  for (int64_t base = 0; base < num_seqs; base += kPlanThreads) {
    const int64_t s = base + tid;
    const int64_t len = s < num_seqs ? (seq_lens[s] > 0 ? seq_lens[s] : 0) : 0;
    const int64_t comp = s < num_seqs ? comp_lens[s] : 0;
    const int ni = s < num_seqs ? (int)paged_seq_items(len, comp, cc, cf) : 0;
    int incl = ni;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_scan[wid] = incl;
    __syncthreads();
    int before = s_carry;
    for (int w = 0; w < wid; ++w) before += s_scan[w];
    const int first = before + incl - ni;
    if (s < num_seqs) {
      work[wl.seq_first(s)] = first;
      work[wl.seq_count(s)] = ni;
      for (int j = 0; j < ni; ++j) {
        int64_t t0 = 0, t1 = 0;
        paged_seq_item(len, comp, cc, cf, j, t0, t1);
        work[wl.item_seq(first + j)] = (int32_t)s;
        work[wl.item_t0(first + j)] = (int32_t)t0;
        work[wl.item_t1(first + j)] = (int32_t)t1;
      }
    }
    __syncthreads();
    if (tid == kPlanThreads - 1) s_carry = first + ni;
    __syncthreads();
  }
  if (tid == 0) work[0] = s_carry, work[1] = (int32_t)cc, work[2] = (int32_t)cf, work[3] = 0;
}

inline cudaError_t LaunchPagedDecodePlan(const int32_t* seq_lens, const int32_t* comp_lens, int64_t num_seqs,
                                         int64_t max_items, int32_t* work, cudaStream_t stream) {
  PagedDecodePlanKernel<kPlanThreads><<<1, kPlanThreads, 0, stream>>>(seq_lens, comp_lens, num_seqs, max_items, work);
  return cudaGetLastError();
}

/// \brief Per-warp ring of the full-precision tile path: K and V tiles of 32 tokens, rows padded
/// by 16 bytes so that the 8 rows of an ldmatrix land in distinct banks.
template <int D>
struct FpTiles {
  static constexpr int ROW = 2 * D + 16;           // bytes per padded fp16 row
  static constexpr int ROLE = kTile * ROW;         // one role's tile
  static constexpr int STAGE = 2 * ROLE;           // K then V
  static constexpr int STAGES = D <= 128 ? 2 : 1;  // 4 warps x ring <= 140 KB
  static constexpr int RING = STAGES * STAGE;
};

/// Bytes of one warp's region in a paged split kernel (its slot and ring).
template <typename DType, int D, int BITS, bool KPC, bool MMA, bool FPT>
KVQ_HOST_DEVICE constexpr size_t paged_warp_region_bytes(int g) {
  if constexpr (FPT) {
    const size_t slot = sizeof(float) * (size_t)kMmaMaxGroup * (D + 2);
    return ((size_t)FpTiles<D>::RING > slot ? (size_t)FpTiles<D>::RING : slot + 15) / 16 * 16;
  } else {
    return warp_region_bytes<D, BITS, KPC, MMA, false, sizeof(DType)>(g);
  }
}

/// \brief Full-precision fp16 pages on the tensor cores: tokens [t_begin, t_end) (whole 32-token
/// tiles, t_begin a multiple of 32) of (sequence s, KV head h), this warp's tiles
/// t_begin + (warp + kWarps k) 32.  Scores S^T = K (q / max|q|)^T and O^T += V^T P^T by m16n8k16
/// mma with the K and V A-fragments loaded by ldmatrix (.trans for V) from the tile, the g <= 8
/// query heads as the N columns; the online softmax of tile_online_softmax.  Leaves the warp's
/// (m, l, acc) in `slot` (which aliases the start of `ring`).
template <int D>
__device__ void warp_mma_fp_pages(const DecodeAttnParams& p, int64_t s, int64_t h, int g, int64_t t_begin,
                                  int64_t t_end, int warp, float* slot, char* ring) {
  using FT = FpTiles<D>;
  constexpr int NK = D / 16, MV = D / 16, CPR = 2 * D / 16;  // k-steps, m-tiles, 16-byte chunks per row
  constexpr int64_t kStep = (int64_t)kWarps * kTile;
  const int lane = threadIdx.x % 32, i = lane >> 2, c = lane & 3, lj = lane >> 3, lr = lane & 7;
  const half_t* q = static_cast<const half_t*>(p.q) + (s * p.Hq + h * g) * D;
  const int32_t* bt = p.paged.block_table + s * p.paged.bt_stride;
  const int ps = p.paged.page_shift, pm = (1 << ps) - 1;
  const char* kb = static_cast<const char*>(p.k.residual);
  const char* vb = static_cast<const char*>(p.v.residual);
  const int64_t first = t_begin + warp * kTile;
  const int ntiles = first < t_end ? (int)((t_end - first + kStep - 1) / kStep) : 0;
  auto issue = [&](int k) {
    if (k < ntiles) {
      const int64_t t0 = first + (int64_t)k * kStep;
      const int64_t pg = __ldg(bt + (int)(t0 >> ps));
      const int r = (int)t0 & pm;
      const int64_t ko = 2 * (pg * p.k.res_sb + h * p.k.res_sh + (int64_t)r * D);
      const int64_t vo = 2 * (pg * p.v.res_sb + h * p.v.res_sh + (int64_t)r * D);
      char* st = ring + (k % FT::STAGES) * FT::STAGE;
#pragma unroll
      for (int x = lane; x < kTile * CPR; x += 32) {
        const int row = x / CPR, col = x % CPR;
        cp_async16(st + row * FT::ROW + col * 16, kb + ko + x * 16);
        cp_async16(st + FT::ROLE + row * FT::ROW + col * 16, vb + vo + x * 16);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < FT::STAGES - 1; ++k) issue(k);
  // q^T B-fragments (natural channel order), normalised per head so fp16 cannot overflow
  float qm = 0.f;
  if (i < g)
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
#pragma unroll
      for (int u = 0; u < 4; ++u) qm = fmaxf(qm, fabsf(to_float(q[i * D + 16 * kk + 2 * c + (u & 1) + 8 * (u >> 1)])));
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 1));
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 2));
  qm = qm > 0.f ? qm : 1.f;
  const float rq = 1.f / qm;
  uint32_t qb[NK][2];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int ch = 16 * kk + 2 * c + 8 * r;
      qb[kk][r] = i < g ? pack_half2(to_float(q[i * D + ch]) * rq, to_float(q[i * D + ch + 1]) * rq) : 0u;
    }
  const float sl = p.scale * kLog2e;
  const float sfA = __shfl_sync(0xffffffffu, qm, (2 * c) * 4) * sl;
  const float sfB = __shfl_sync(0xffffffffu, qm, (2 * c + 1) * 4) * sl;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  float acc[MV][4];
#pragma unroll
  for (int n = 0; n < MV; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  for (int k = 0; k < ntiles; ++k) {
    issue(k + FT::STAGES - 1);
    cp_async_wait<FT::STAGES - 1>();
    __syncwarp();
    const unsigned sk = (unsigned)__cvta_generic_to_shared(ring + (k % FT::STAGES) * FT::STAGE);
    const unsigned sv = sk + FT::ROLE;
    float sc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        uint32_t a[4];  // rows = tokens 16 mt + (lr, lr + 8), cols = channels 16 kk + (0..7, 8..15)
        ldmatrix_x4<false>(a, sk + (16 * mt + lr + 8 * (lj & 1)) * FT::ROW + (16 * kk + 8 * (lj >> 1)) * 2);
        mma16816(sc[mt], a, qb[kk][0], qb[kk][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] *= (e & 1) ? sfB : sfA;
    }
    float alA, alB;
    tile_online_softmax(sc, nullptr, i, mA, mB, lA, lB, alA, alB);
#pragma unroll
    for (int n = 0; n < MV; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] *= (e & 1) ? alB : alA;
    uint32_t pt[2][2];
    tile_pt_fragments(sc, pt);
#pragma unroll
    for (int M = 0; M < MV; ++M)
#pragma unroll
      for (int kst = 0; kst < 2; ++kst) {
        uint32_t a[4];  // V^T: rows = channels 16 M + (0..7, 8..15), cols = tokens 16 kst + (0..7, 8..15)
        ldmatrix_x4<true>(a, sv + (16 * kst + lr + 8 * (lj >> 1)) * FT::ROW + (16 * M + 8 * (lj & 1)) * 2);
        mma16816(acc[M], a, pt[kst][0], pt[kst][1]);
      }
    __syncwarp();  // this stage is read before it is refilled
  }
  cp_async_wait<0>();
  __syncwarp();
  warp_store_ml(slot, D, g, i, c, mA, mB, lA, lB);
#pragma unroll
  for (int M = 0; M < MV; ++M)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      if (head < g) slot[head * (D + 2) + 2 + 16 * M + i + 8 * (e >> 1)] = acc[M][e];
    }
  __syncwarp();
}

/// The work item of a split CTA: its sequence, token range [t_begin, t_end) and the sequence's
/// compressed tokens (paged_comp_len).
struct PagedItem {
  int64_t s, t_begin, t_end, comp;
};
__device__ __forceinline__ PagedItem paged_item(const DecodeAttnParams& p, int64_t item) {
  const PagedWork wl{p.paged.max_items, p.B};
  const int32_t* work = p.paged.work;
  PagedItem it;
  it.s = work[wl.item_seq(item)], it.t_begin = work[wl.item_t0(item)], it.t_end = work[wl.item_t1(item)];
  const int64_t len = p.paged.seq_lens[it.s] > 0 ? p.paged.seq_lens[it.s] : 0;
  it.comp = paged_comp_len(len, p.paged.comp_lens[it.s]);
  return it;
}

/// \brief The CUDA-core part of a split CTA of any page format: tokens [a, t_end) of (sequence
/// s, KV head h) split over the CTA's NW warps, each continuing the (m, l, acc) in its `slot`;
/// compressed rows (t < comp) come from load_comp(page, row, lane, kx, vx), full-precision rows
/// from the pools p.k / p.v .residual.
template <typename DType, int D, int MAXG, int C, int NW = kWarps, typename LoadComp>
__device__ __forceinline__ void paged_generic_range(const DecodeAttnParams& p, int64_t s, int64_t h, int g, int64_t a,
                                                    int64_t t_end, int64_t comp, float* slot, const float* s_q,
                                                    LoadComp&& load_comp) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t per = (t_end - a + NW - 1) / NW;
  const int64_t wa = a + warp * per, we = wa + per < t_end ? wa + per : t_end;
  const int32_t* bt = p.paged.block_table + s * p.paged.bt_stride;
  const int ps = p.paged.page_shift, pm = (1 << ps) - 1;
  if (wa < we)
    warp_generic_loop<D, MAXG, C>(nullptr, 0, p.scale, s, g, wa, we, slot, s_q,
                                  [&](int64_t t, float (&kx)[D / 32], float (&vx)[D / 32]) {
                                    const int64_t pg = __ldg(bt + (int)(t >> ps));
                                    const int r = (int)t & pm;
                                    if (t < comp) {
                                      load_comp(pg, r, lane, kx, vx);
                                    } else {
                                      load_residual_row<DType, D>(p.k, pg, h, r, lane, kx);
                                      load_residual_row<DType, D>(p.v, pg, h, r, lane, vx);
                                    }
                                  });
}

/// \brief Split kernel: CTA (h = blockIdx.x, item = blockIdx.y).  MMA: compressed tokens on
/// the tensor cores (decode_attention_mma_ok holds for p); otherwise every token goes through
/// the CUDA-core loop (up to kMaxGroup query heads per KV head).  FPT (fp16 pages, no compressed
/// pool, g <= 8): whole full-precision tiles on the tensor cores (warp_mma_fp_pages), the last
/// partial tile of a sequence through the CUDA-core loop.
template <typename DType, int D, int BITS, bool KPC, bool MMA, int NGV = 0, bool FPT = false>
__global__ void __launch_bounds__(kWarps * 32, D <= 128 ? KVQ_MINB : 1) PagedDecodeAttentionKernel(DecodeAttnParams p) {
  pdl_allow_dependents();
  const int64_t item = blockIdx.y, h = blockIdx.x;
  if (item >= p.paged.work[0]) return;  // uniform per CTA
  extern __shared__ __align__(16) char smem[];
  const PagedItem it = paged_item(p, item);
  const int64_t s = it.s, t_begin = it.t_begin, t_end = it.t_end, comp = it.comp;
  const int g = (int)(p.Hq / p.H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_q = reinterpret_cast<float*>(smem);  // [g][D]
  const size_t qbytes = head_region_bytes<MMA || FPT, false>(g, D);
  const size_t wbytes = paged_warp_region_bytes<DType, D, BITS, KPC, MMA, FPT>(g);
  char* region = smem + qbytes + warp * wbytes;
  float* slot = reinterpret_cast<float*>(region);
  const int64_t m_end = MMA ? (t_end < comp ? t_end : comp) : t_begin;
  bool have_mma = false;
  if constexpr (MMA) {
    if (t_begin < m_end) {
      warp_mma<DType, D, BITS, KPC, false, NGV, true>(p, s, h, g, t_begin, m_end, warp, slot, region, nullptr, s_q,
                                                      nullptr);
      have_mma = true;
    }
  }
  int64_t a = m_end > t_begin ? m_end : t_begin;  // past the tensor-core part
  if constexpr (FPT) {
    const int64_t f_end = a + (t_end - a) / kTile * kTile;  // whole tiles
    if (a < f_end) {
      warp_mma_fp_pages<D>(p, s, h, g, a, f_end, warp, slot, region);
      have_mma = true;
      a = f_end;
    }
  }
  if (!have_mma) {
    for (int x = lane; x < g * (D + 2); x += 32) slot[x] = (x % (D + 2)) == 0 ? -INFINITY : 0.f;
    __syncwarp();
  }
  if (a < t_end) {  // uniform per CTA: the rest of the range, split over the warps
    const DType* qg = static_cast<const DType*>(p.q) + (s * p.Hq + h * g) * D;
    for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(qg[x]);
    __syncthreads();
    constexpr int kChunk = MMA || FPT ? generic_chunk<D>() : (generic_chunk<D>() + 1) / 2;
    paged_generic_range<DType, D, MMA || FPT ? 8 : kMaxGroup, kChunk>(
        p, s, h, g, a, t_end, comp, slot, s_q,
        [&](int64_t pg, int r, int ln, float (&kx)[D / 32], float (&vx)[D / 32]) {
          load_quant_row<DType, D>(p.k, pg, h, r, ln, kx);
          load_quant_row<DType, D>(p.v, pg, h, r, ln, vx);
        });
  }
  __syncthreads();
  // partial rows (h g + j) of split `item`: the workspace is [Hq, max_items, D] + (m, l)
  const SplitWs ws(p.ws, p.Hq, p.paged.max_items, D);
  write_split_partial<D, kWarps>(ws, smem + qbytes, wbytes, h * g, g, p.paged.max_items, (int)item);
}

/// \brief Combine: CTA (sequence s, query head hq) = blockIdx.x / Hq, % Hq merges the partials
/// of the sequence's items in item order (max_items splits per row of the workspace).
template <typename DType, int D>
__global__ void PagedDecodeCombineKernel(const float* ws, const int32_t* work, void* out, float* lse, int64_t num_seqs,
                                         int64_t Hq, int64_t max_items) {
  pdl_wait_prerequisites();
  const int64_t s = blockIdx.x / Hq, hq = blockIdx.x % Hq;
  const PagedWork wl{max_items, num_seqs};
  const int64_t first = work[wl.seq_first(s)], cnt = work[wl.seq_count(s)];
  const SplitWs sw(const_cast<float*>(ws), Hq, max_items, D);
  const int64_t row = hq * max_items + first;
  float M = -INFINITY;
  for (int64_t j = 0; j < cnt; ++j) M = fmaxf(M, __ldcg(&sw.ml[row + j].x));
  float L = 0.f;
  constexpr int DV = D / 4;
  const int x = threadIdx.x;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t j = 0; j < cnt; ++j) {
    const float2 ml = __ldcg(&sw.ml[row + j]);
    const float w = M == -INFINITY ? 0.f : exp2f(ml.x - M);
    L += w * ml.y;
    if (x < DV) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(sw.acc + (row + j) * D) + x);
      acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
    }
  }
  if (x < DV) {
    DType* o = static_cast<DType*>(out) + (s * Hq + hq) * D + 4 * x;
    o[0] = from_float<DType>(L > 0.f ? acc.x / L : 0.f);
    o[1] = from_float<DType>(L > 0.f ? acc.y / L : 0.f);
    o[2] = from_float<DType>(L > 0.f ? acc.z / L : 0.f);
    o[3] = from_float<DType>(L > 0.f ? acc.w / L : 0.f);
  }
  if (x == 0 && lse != nullptr) lse[s * Hq + hq] = L > 0.f ? (M + log2f(L)) * 0.69314718055994531f : -INFINITY;
}

/// \brief Shared memory of a paged split kernel instantiation: the contiguous kernel's layout
/// (no GEAR), or with FPT q and per warp the full-precision tile ring.
template <typename DType, int D, int BITS, bool KPC, bool MMA, bool FPT = false>
size_t paged_decode_smem_bytes(int g) {
  if constexpr (FPT)
    return head_region_bytes<true, false>(g, D) + kWarps * paged_warp_region_bytes<DType, D, BITS, KPC, MMA, FPT>(g);
  return decode_attention_smem_bytes<D, BITS, KPC, MMA, false, sizeof(DType)>(g);
}

/// \brief Tile source of the HQMQ tensor-core paths over pages: the 32-token tile at t0 (a
/// multiple of 32; pages hold whole tiles, P >= 32) of (sequence s, KV head h) is rows
/// t0 & (P - 1) .. + 31 of page block_table[s][t0 >> page_shift].
struct HqmqPageTiles {
  const int32_t* bt;   // the sequence's block-table row
  int ps;              // page_shift
  HqmqTilePtrs head;   // head h of page 0
  int64_t kc_sb, vc_sb, uk, uv;  // page strides, units per row
  __device__ __forceinline__ HqmqTilePtrs at(int64_t t0) const {
    const int64_t pg = __ldg(bt + (int)(t0 >> ps)), r = t0 & ((int64_t(1) << ps) - 1);
    return {head.kc + pg * kc_sb + r * uk, head.vc + pg * vc_sb + r * uv};
  }
};
__device__ __forceinline__ HqmqPageTiles hqmq_page_tiles(const PagedHqmqParams& hp, int64_t s, int64_t h) {
  const PagedKV& pk = hp.base.paged;
  HqmqPageTiles t;
  t.bt = pk.block_table + s * pk.bt_stride, t.ps = pk.page_shift;
  t.head = {hp.k.codes + h * hp.k.codes_sh, hp.v.codes + h * hp.v.codes_sh};
  t.kc_sb = hp.k.codes_sb, t.vc_sb = hp.v.codes_sb;
  t.uk = hp.k.row.units, t.uv = hp.v.row.units;
  return t;
}

/// \brief The paged call as the HQMQ tensor-core code sees it: B = num_seqs rows, no mask, no
/// Med3x records; Tc = kTile stands for "pages hold whole tiles" (P >= 32), 0 otherwise, so that
/// hqmq_smem_plan picks the tensor-core path only where tiles never cross a page.
KVQ_HOST_DEVICE HqmqAttnParams paged_hqmq_view(const PagedHqmqParams& hp) {
  const DecodeAttnParams& p = hp.base;
  HqmqAttnParams a;
  a.q = p.q, a.out = p.out, a.k = hp.k, a.v = hp.v;
  a.k.outliers = a.v.outliers = nullptr, a.k.outlier_ptr = a.v.outlier_ptr = nullptr;
  a.k.num_outliers = a.v.num_outliers = 0;
  a.B = p.B, a.H = p.H, a.Hq = p.Hq, a.D = p.D, a.scale = p.scale, a.ws = p.ws;
  a.T = a.Tc = p.paged.page_shift >= 5 ? kTile : 0;
  return a;
}

/// \brief HQMQ split kernel: CTA (h = blockIdx.x, item = blockIdx.y) of hqmq_warps(D) warps runs
/// KV head h over the item's token range.  Whole 32-token tiles of compressed tokens run the
/// contiguous HQMQ tensor-core path (hqmq_cta_mma: the head's codebooks in shared memory, tile
/// addresses from the block table) when sm.mma; the rest (full-precision tokens, a partial tile,
/// or every token where the tensor cores cannot take the call) goes through the CUDA-core loop in
/// passes of <= 8 query heads, compressed rows decoded by hqmq_load_row.  Shared memory: the
/// layout of hqmq_smem_plan.  Writes the partials as PagedDecodeAttentionKernel does.
template <typename DType, int D, int FMT>
__global__ void __launch_bounds__(hqmq_warps(D) * 32, 1) PagedHqmqAttentionKernel(PagedHqmqParams hp, HqmqSmem sm) {
  constexpr int NW = hqmq_warps(D);
  pdl_allow_dependents();
  const DecodeAttnParams& p = hp.base;
  const int64_t item = blockIdx.y, h = blockIdx.x;
  if (item >= p.paged.work[0]) return;  // uniform per CTA
  extern __shared__ __align__(16) char smem[];
  const PagedItem it = paged_item(p, item);
  const int64_t s = it.s;
  const int g = (int)(p.Hq / p.H);
  const int warp = threadIdx.x / 32;
  float* s_q = reinterpret_cast<float*>(smem + sm.cb_k + sm.cb_v);  // [g][D]
  char* regions = smem + sm.cb_k + sm.cb_v + sm.q;
  char* region = regions + warp * sm.region;
  float* slot = reinterpret_cast<float*>(region);
  const DType* qg = static_cast<const DType*>(p.q) + (s * p.Hq + h * g) * D;
  for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(qg[x]);
  // whole tiles of compressed tokens (t_begin is a multiple of the chunk step, hence of 32)
  const int64_t c_end = it.t_end < it.comp ? it.t_end : it.comp;
  const int64_t m_end = sm.mma && it.t_begin < c_end ? it.t_begin + (c_end - it.t_begin) / kTile * kTile : it.t_begin;
  hqmq_cta_mma<DType, D, FMT>(paged_hqmq_view(hp), sm, hqmq_page_tiles(hp, s, h), s, h, g, it.t_begin, m_end, smem,
                              region, s_q);
  if (m_end < it.t_end) {  // uniform per CTA
    for (int j0 = 0; j0 < g; j0 += 8)
      paged_generic_range<DType, D, 8, kHqmqTailChunk, NW>(
          p, s, h, g - j0 < 8 ? g - j0 : 8, m_end, it.t_end, it.comp, slot + j0 * (D + 2), s_q + j0 * D,
          [&](int64_t pg, int r, int ln, float (&kx)[D / 32], float (&vx)[D / 32]) {
            hqmq_load_row<D>(hp.k, pg, h, r, ln, kx);
            hqmq_load_row<D>(hp.v, pg, h, r, ln, vx);
          });
  }
  __syncthreads();
  const SplitWs ws(p.ws, p.Hq, p.paged.max_items, D);
  write_split_partial<D, NW>(ws, regions, sm.region, h * g, g, p.paged.max_items, (int)item);
}

/// \brief The combine launch after a split kernel of this family.
template <typename DType, int D>
cudaError_t LaunchPagedCombine(const DecodeAttnParams& p, cudaStream_t stream) {
  const float* ws = p.ws;
  const int32_t* work = p.paged.work;
  void* out = p.out;
  float* lse = p.paged.lse;
  const int64_t n = p.B, Hq = p.Hq, mi = p.paged.max_items;
  return launch_programmatic_dependent(PagedDecodeCombineKernel<DType, D>, dim3((unsigned)(n * Hq)),
                                       dim3(D / 4 > 32 ? D / 4 : 32), 0, stream, ws, work, out, lse, n, Hq, mi);
}

/// \brief A split kernel(args...) of grid (H, max_items), `threads` threads and `smem` bytes, then
/// the combine.
/// p.paged.work holds the plan; p.ws Hq * max_items * (D + 2) floats (16-byte aligned).
template <typename DType, int D, typename Kernel, typename... Args>
cudaError_t LaunchPagedSplitCombine(Kernel kernel, const DecodeAttnParams& p, size_t smem, int threads,
                                    cudaStream_t stream, const Args&... args) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  if (reinterpret_cast<uintptr_t>(p.ws) % 16 != 0) return cudaErrorMisalignedAddress;
  if (p.paged.max_items <= 0 || p.paged.max_items > 65535) return cudaErrorInvalidValue;
  kernel<<<dim3((unsigned)p.H, (unsigned)p.paged.max_items), threads, smem, stream>>>(args...);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return LaunchPagedCombine<DType, D>(p, stream);
}

/// \brief Split kernel + combine for one instantiation of the group-quantized / fp16 family.
template <typename DType, int D, int BITS, bool KPC, bool MMA, int NGV = 0, bool FPT = false>
cudaError_t LaunchPagedDecodeAttention(const DecodeAttnParams& p, cudaStream_t stream) {
  const size_t smem = paged_decode_smem_bytes<DType, D, BITS, KPC, MMA, FPT>((int)(p.Hq / p.H));
  return LaunchPagedSplitCombine<DType, D>(PagedDecodeAttentionKernel<DType, D, BITS, KPC, MMA, NGV, FPT>, p, smem,
                                           kWarps * 32, stream, p);
}

/// \brief HQMQ pages: split kernel (launch format FMT, shared memory sm = hqmq_smem_plan of
/// paged_hqmq_view) + combine.
template <typename DType, int D, int FMT>
cudaError_t LaunchPagedHqmqAttention(const PagedHqmqParams& hp, const HqmqSmem& sm, cudaStream_t stream) {
  return LaunchPagedSplitCombine<DType, D>(PagedHqmqAttentionKernel<DType, D, FMT>, hp.base, sm.total,
                                           hqmq_warps(D) * 32, stream, hp, sm);
}

}  // namespace attention
}  // namespace kvq
