// CUDA kernels of the batched rank-r power iteration (algorithm: power_svd.h).  Torch-free.
//
// Every iteration is ONE pass over X that computes P = X B~ on the fly (never stored) and
// accumulates both G = P^T P and M = X^T P, so X is read iters + 1 times in total and
// nothing of size [T, *] besides the final A is ever written.
//
//  * Small matrices (T padded to 32 <= 256 and the tile fits in shared memory, e.g. a decode
//    block of 20-64 tokens): one 256-thread block per matrix holds all of X in shared memory
//    (fp32, padded rows) and runs the whole algorithm, including the tiny [r, r] solves, in
//    one launch.
//  * Long matrices (prefill, up to 128k+ tokens): the T axis is split over S blocks per
//    matrix (S from power_iter_splits, ~4 blocks per SM in total); a pass kernel streams
//    32-row tiles through shared memory and writes per-block partial M and G, a finalize
//    kernel (one block per matrix) sums the partials in a fixed order (deterministic),
//    orthonormalizes and writes the next basis.  2 launches per iteration + 1 for A.
//
// Thread mapping (256 threads): P of a 32-row tile = 32 rows x 8 lanes, lane q of a row
// covers channels j = q (mod 8) and the 8 lanes reduce with xor shuffles; M is accumulated
// in registers with thread (j, column group) owning M[j, c] for its columns (the tile row
// is broadcast from shared memory); G by RB*RB threads.  Shared row strides are chosen so
// both access patterns are bank-conflict free (X rows: DMAX + 8 floats; bases: 9 floats).
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "kvq/common/half.h"
#include "kvq/linalg/power_svd.h"

namespace kvq {
namespace linalg {

constexpr int kPowThreads = 256;
constexpr int kPowTile = 32;  // rows per P sub-tile
constexpr int kBStride = 9;   // shared row stride of [d, r] bases and of P tiles
constexpr unsigned kPowFullMask = 0xffffffffu;

/// \brief N elements of T loaded/stored as one aligned vector.
template <typename T, int N>
struct alignas(sizeof(T) * N) PowVec {
  T v[N];
};

template <int DMAX>
struct PowerDims {
  static constexpr int STRIDE = DMAX + 8;
  static constexpr int CG = kPowThreads / DMAX;  // column groups of the M accumulation
};
template <int DMAX, int RB>
struct PowerSlots {
  static constexpr int CG = PowerDims<DMAX>::CG;
  static constexpr int SLOTS = (RB + CG - 1) / CG;
};

/// \brief Rows [t0, t0 + rows_pad) of X ([T, d]) into Rs as floats; rows >= T are zero.
template <typename DType, int DMAX>
__device__ __forceinline__ void pow_load_rows(const DType* X, int64_t T, int d, int64_t t0,
                                              int rows_pad, float* Rs) {
  constexpr int STRIDE = PowerDims<DMAX>::STRIDE;
  constexpr int VEC = 16 / (int)sizeof(DType);  // one 16-byte load per thread and step
  if (d % VEC == 0) {
    // NOTE: rows of X start 16-byte aligned here (d * sizeof(DType) % 16 == 0 and the base
    // pointer comes from an aligned allocation).
    const int vpr = d / VEC, total = rows_pad * vpr;
    for (int idx = threadIdx.x; idx < total; idx += kPowThreads) {
      const int row = idx / vpr, j = (idx - row * vpr) * VEC;
      const int64_t t = t0 + row;
      float* dst = Rs + row * STRIDE + j;
      if (t < T) {
        const PowVec<DType, VEC> v = *reinterpret_cast<const PowVec<DType, VEC>*>(X + t * d + j);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] = to_float(v.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] = 0.f;
      }
    }
    return;
  }
  const int total = rows_pad * d;
  for (int idx = threadIdx.x; idx < total; idx += kPowThreads) {
    const int row = idx / d, j = idx - row * d;
    const int64_t t = t0 + row;
    Rs[row * STRIDE + j] = t < T ? to_float(X[t * d + j]) : 0.f;
  }
}

/// \brief Ps[row0 .. row0 + 32) = Rs rows x Bs ([d, RB], stride 9).  All 256 threads.
template <int DMAX, int RB>
__device__ __forceinline__ void pow_compute_P(const float* Rs, int row0, int d, const float* Bs,
                                              float* Ps) {
  constexpr int STRIDE = PowerDims<DMAX>::STRIDE;
  const int row = threadIdx.x >> 3, q = threadIdx.x & 7;
  const float* xr = Rs + (row0 + row) * STRIDE;
  float acc[RB];
#pragma unroll
  for (int c = 0; c < RB; ++c) acc[c] = 0.f;
  for (int j = q; j < d; j += 8) {
    const float rv = xr[j];
    const float* b = Bs + j * kBStride;
#pragma unroll
    for (int c = 0; c < RB; ++c) acc[c] = fmaf(rv, b[c], acc[c]);
  }
#pragma unroll
  for (int c = 0; c < RB; ++c) {
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) acc[c] += __shfl_xor_sync(kPowFullMask, acc[c], o);
  }
  float mine = 0.f;
#pragma unroll
  for (int c = 0; c < RB; ++c)
    if (c == q) mine = acc[c];
  if (q < RB) Ps[(row0 + row) * kBStride + q] = mine;
}

/// \brief Accumulate M += Rs^T Ps (owned entries, registers) and G += Ps^T Ps (threads < RB^2).
template <int DMAX, int RB>
__device__ __forceinline__ void pow_accumulate(const float* Rs, const float* Ps, int row0,
                                               int nrows, int d,
                                               float (&m)[PowerSlots<DMAX, RB>::SLOTS], float& g) {
  constexpr int STRIDE = PowerDims<DMAX>::STRIDE, CG = PowerDims<DMAX>::CG;
  constexpr int SLOTS = PowerSlots<DMAX, RB>::SLOTS;
  const int j = threadIdx.x % DMAX, grp = threadIdx.x / DMAX;
  if (j < d) {
    for (int row = row0; row < row0 + nrows; ++row) {
      const float rv = Rs[row * STRIDE + j];
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) {
        const int c = grp + s * CG;
        if (c < RB) m[s] = fmaf(rv, Ps[row * kBStride + c], m[s]);
      }
    }
  }
  if (threadIdx.x < RB * RB) {
    const int a = threadIdx.x / RB, b = threadIdx.x % RB;
    for (int row = row0; row < row0 + nrows; ++row)
      g = fmaf(Ps[row * kBStride + a], Ps[row * kBStride + b], g);
  }
}

/// \brief Store the owned M entries into M_out[j * RB + c].
template <int DMAX, int RB>
__device__ __forceinline__ void pow_store_M(const float (&m)[PowerSlots<DMAX, RB>::SLOTS], int d,
                                            float* M_out) {
  constexpr int CG = PowerDims<DMAX>::CG, SLOTS = PowerSlots<DMAX, RB>::SLOTS;
  const int j = threadIdx.x % DMAX, grp = threadIdx.x / DMAX;
  if (j >= d) return;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int c = grp + s * CG;
    if (c < RB) M_out[j * RB + c] = m[s];
  }
}

/// \brief Gd[a * RB + b] (all a, b < RB) = sum_j X[j, a] Y[j, b] in double, symmetrized:
/// CROSS = false needs Y == X (Gram matrix; entries a <= b computed, mirrored); CROSS = true
/// gives 0.5 (X^T Y + Y^T X).  All threads, no barrier inside (the caller syncs before reading
/// Gd).  Warp w owns entries u = w, w + 8, .. of the upper triangle, lane l sums rows
/// j = l (mod 32), then a fixed xor-shuffle tree: deterministic, chain ~ d / 32 DFMAs + 5
/// shuffle steps instead of a d-long DFMA chain on RB^2 threads.
template <int RB, bool CROSS>
__device__ __forceinline__ void pow_gram_dd(const float* X, int ldx, const float* Y, int ldy,
                                            int d, double* Gd) {
  constexpr int NU = RB * (RB + 1) / 2, NW = kPowThreads / 32, EPW = (NU + NW - 1) / NW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int ea[EPW], eb[EPW];
  double s[EPW];
#pragma unroll
  for (int k = 0; k < EPW; ++k) {
    int u = warp + k * NW, a = 0;
    if (u >= NU) u = 0;  // padding entry: computed, never stored
    while (u >= RB - a) {
      u -= RB - a;
      ++a;
    }
    ea[k] = a;
    eb[k] = a + u;
    s[k] = 0.0;
  }
  for (int j = lane; j < d; j += 32) {
#pragma unroll
    for (int k = 0; k < EPW; ++k) {
      const double xa = X[j * ldx + ea[k]], xb = X[j * ldx + eb[k]];
      if (CROSS) {
        s[k] = fma(xa, (double)Y[j * ldy + eb[k]], s[k]);
        s[k] = fma(xb, (double)Y[j * ldy + ea[k]], s[k]);
      } else {
        s[k] = fma(xa, xb, s[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < EPW; ++k) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) s[k] += __shfl_xor_sync(kPowFullMask, s[k], o);
    if (lane == 0 && warp + k * NW < NU) {
      const double v = CROSS ? 0.5 * s[k] : s[k];
      Gd[ea[k] * RB + eb[k]] = v;
      Gd[eb[k] * RB + ea[k]] = v;
    }
  }
}

/// \brief gram_orthonormalizer (power_svd.h) for the compile-time width N = RB, register
/// resident (fully unrolled: no stack, no local memory).  Same pivot rule and drop tests;
/// 1 / sqrt(pivot) is one rsqrt (<= 1 ulp in double) instead of sqrt + divide, so K agrees
/// with the generic version to ~1e-16 relative.  Reads G ([N, N], shared), writes all of K.
/// One thread.
template <int N>
__device__ __forceinline__ void pow_chol_orth(const double* G, double tr_rel, double* K) {
  double L[N][N], inv[N], k[N][N];  // L: strictly lower part used
  double tr = 0.0;
#pragma unroll
  for (int c = 0; c < N; ++c) tr += G[c * N + c];
#pragma unroll
  for (int c = 0; c < N; ++c) {
    double s = G[c * N + c];
#pragma unroll
    for (int a = 0; a < c; ++a) s -= L[c][a] * L[c][a];
    const double own = G[c * N + c];
    const bool dead = !(tr > 0.0) || !(s > 1e-6 * own) || !(s > tr_rel * tr);
    const double is = dead ? 0.0 : rsqrt(s);
    inv[c] = is;
#pragma unroll
    for (int i = c + 1; i < N; ++i) {
      double v = G[i * N + c];
#pragma unroll
      for (int a = 0; a < c; ++a) v -= L[i][a] * L[c][a];
      L[i][c] = v * is;
    }
  }
  // K = (L^T)^+ : upper triangular, back substitution (dead rows / columns -> 0).
#pragma unroll
  for (int c = 0; c < N; ++c) {
#pragma unroll
    for (int i = 0; i < N; ++i) k[i][c] = 0.0;
    k[c][c] = inv[c];
#pragma unroll
    for (int i = c - 1; i >= 0; --i) {
      double v = 0.0;
#pragma unroll
      for (int a = i + 1; a <= c; ++a) v += L[a][i] * k[a][c];
      k[i][c] = inv[i] == 0.0 ? 0.0 : -v * inv[i];  // dead row -> 0
    }
    if (inv[c] == 0.0) {  // dead column -> 0
#pragma unroll
      for (int i = 0; i < N; ++i) k[i][c] = 0.0;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int c = 0; c < N; ++c) K[i * N + c] = k[i][c];
}

/// \brief Pair m (0 <= m < N / 2) of round `rnd` of the round-robin (circle) schedule of N
/// (even) indices: N - 1 rounds of N / 2 disjoint pairs that together cover every pair once.
/// Index N - 1 is fixed; with h = rnd * N / 2 mod (N - 1) (so 2 h = rnd), pair 0 is
/// (h, N - 1) and pair m is (h - m, h + m) mod (N - 1).  Returns the smaller (first) or the
/// larger index.
template <int N>
__host__ __device__ constexpr int pow_rr_index(int rnd, int m, bool larger) {
  const int h = (rnd * (N / 2)) % (N - 1);
  const int a = m == 0 ? h : ((h - m) % (N - 1) + (N - 1)) % (N - 1);
  const int b = m == 0 ? N - 1 : (h + m) % (N - 1);
  return larger ? (a > b ? a : b) : (a < b ? a : b);
}

/// \brief Top eigenvectors for the truncation: S = G / max diag(G) in float, parallel-order
/// Jacobi, register resident, fully unrolled.  A sweep is N - 1 rounds of the round-robin
/// schedule; the N / 2 rotations of a round act on disjoint index pairs, so their angles come
/// from the same S and are independent (one thread, but N / 2 independent dependency chains:
/// the cyclic order measured ~16 us on the H200 for N = 6 -- 15 rotations in series per sweep,
/// each a chain of MUFU / FMA latencies -- while the block's other warps waited).  Same
/// rotation formula, skip test and stopping rule as before (sym_eig_desc's rule), so the
/// eigenvectors agree with the CPU twin's to rounding (the rotation order differs).
/// Rotation of pair (p, q): t = sgn(theta) 2|a| / (|tau| + sqrt(tau^2 + 4 a^2)) (the textbook
/// sgn(theta) / (|theta| + sqrt(theta^2 + 1)), theta = tau / 2a, tau = S_qq - S_pp, a = S_pq,
/// without overflow), c = rsqrt(1 + t^2), s = t c; |a| < 1e-18 (S is scaled to max diag 1)
/// counts as 0 (identity).  A round applies S <- J^T S J for J the product of its rotations:
/// within a pair S_pp -= t a, S_qq += t a, S_pq = 0 exactly; between pairs i, j the 2 x 2 block
/// becomes R_i^T B R_j (computed once, mirrored: S stays exactly symmetric).  Writes the
/// eigenvectors as the columns of K ([N, N] double), sorted by decreasing eigenvalue (ties:
/// smaller index first, as sym_eig_desc).  One thread.
template <int N>
__device__ __forceinline__ void pow_eig_desc(const double* G, double* K) {
  static_assert(N % 2 == 0 && N >= 2, "even width");
  constexpr int NP = N / 2;
  float S[N][N], V[N][N];
  double gmax = 0.0;
#pragma unroll
  for (int i = 0; i < N; ++i) gmax = G[i * N + i] > gmax ? G[i * N + i] : gmax;
  const double sc = gmax > 0.0 ? 1.0 / gmax : 1.0;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) {
      S[i][j] = (float)(G[i * N + j] * sc);
      V[i][j] = i == j ? 1.f : 0.f;
    }
  for (int sweep = 0; sweep < 30; ++sweep) {
    float off = 0.f, diag = 0.f;
#pragma unroll
    for (int p = 0; p < N; ++p) {
      diag += S[p][p] * S[p][p];
#pragma unroll
      for (int q = p + 1; q < N; ++q) off += S[p][q] * S[p][q];
    }
    if (!(off > 1e-14f * diag)) break;
#pragma unroll
    for (int rnd = 0; rnd < N - 1; ++rnd) {
      float c[NP], s[NP];
#pragma unroll
      for (int m = 0; m < NP; ++m) {
        const int p = pow_rr_index<N>(rnd, m, false), q = pow_rr_index<N>(rnd, m, true);
        const float a = S[p][q];
        const float tau = S[q][q] - S[p][p];
        const float a2 = 2.f * fabsf(a);
        const float h = fmaf(tau, tau, a2 * a2);
        const float root = h * rsqrtf(h);
        // sgn(theta): theta = tau / 2a >= 0 (also for tau = -0 / +0) -> +1
        const bool neg = tau != 0.f && (signbit(tau) != signbit(a));
        float t = __fdividef(a2, fabsf(tau) + root);
        t = neg ? -t : t;
        const bool rot = fabsf(a) >= 1e-18f;  // (NaN: no rotation)
        t = rot ? t : 0.f;
        c[m] = rot ? rsqrtf(fmaf(t, t, 1.f)) : 1.f;
        s[m] = t * c[m];
        const float ta = rot ? t * a : 0.f;
        S[p][p] -= ta;
        S[q][q] += ta;
        if (rot) {
          S[p][q] = 0.f;
          S[q][p] = 0.f;
        }
      }
#pragma unroll
      for (int mi = 0; mi < NP; ++mi)
#pragma unroll
        for (int mj = mi + 1; mj < NP; ++mj) {
          const int pi = pow_rr_index<N>(rnd, mi, false), qi = pow_rr_index<N>(rnd, mi, true);
          const int pj = pow_rr_index<N>(rnd, mj, false), qj = pow_rr_index<N>(rnd, mj, true);
          const float b00 = S[pi][pj], b01 = S[pi][qj], b10 = S[qi][pj], b11 = S[qi][qj];
          // B R_j (columns pj, qj), then R_i^T (rows pi, qi)
          const float x0 = c[mj] * b00 - s[mj] * b01, x1 = s[mj] * b00 + c[mj] * b01;
          const float y0 = c[mj] * b10 - s[mj] * b11, y1 = s[mj] * b10 + c[mj] * b11;
          const float n00 = c[mi] * x0 - s[mi] * y0, n10 = s[mi] * x0 + c[mi] * y0;
          const float n01 = c[mi] * x1 - s[mi] * y1, n11 = s[mi] * x1 + c[mi] * y1;
          S[pi][pj] = n00;
          S[pj][pi] = n00;
          S[qi][pj] = n10;
          S[pj][qi] = n10;
          S[pi][qj] = n01;
          S[qj][pi] = n01;
          S[qi][qj] = n11;
          S[qj][qi] = n11;
        }
#pragma unroll
      for (int m = 0; m < NP; ++m)
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const int p = pow_rr_index<N>(rnd, m, false), q = pow_rr_index<N>(rnd, m, true);
          const float kp = V[k][p], kq = V[k][q];
          V[k][p] = c[m] * kp - s[m] * kq;
          V[k][q] = s[m] * kp + c[m] * kq;
        }
    }
  }
  // Column i goes to position #{j : S_jj > S_ii} + #{j < i : S_jj == S_ii}.
#pragma unroll
  for (int i = 0; i < N; ++i) {
    int pos = 0;
#pragma unroll
    for (int j = 0; j < N; ++j)
      pos += (S[j][j] > S[i][i] || (j < i && S[j][j] == S[i][i])) ? 1 : 0;
    pos = pos < N ? pos : N - 1;
#pragma unroll
    for (int a = 0; a < N; ++a) K[a * N + pos] = (double)V[a][i];
  }
}

/// \brief Orthonormalize the RB columns of Bs in place (refill all-zero columns from Omega
/// first).  Starts and ends with a barrier-consistent Bs.
template <int RB>
__device__ void pow_orth_block(float* Bs, int d, uint64_t seed, double* Gd, double* Kd,
                               int* s_flag) {
  __syncthreads();
  pow_gram_dd<RB, false>(Bs, kBStride, Bs, kBStride, d, Gd);
  __syncthreads();
  if (threadIdx.x == 0) {
    int m = 0;
#pragma unroll
    for (int c = 0; c < RB; ++c)
      if (Gd[c * RB + c] == 0.0) m |= 1 << c;
    *s_flag = m;
    if (m == 0) pow_chol_orth<RB>(Gd, 0.0, Kd);  // common case: no refill round
  }
  __syncthreads();
  const int mask = *s_flag;
  if (mask) {  // block-uniform
    for (int j = threadIdx.x; j < d; j += kPowThreads)
      for (int c = 0; c < RB; ++c)
        if ((mask >> c) & 1) Bs[j * kBStride + c] = init_value(seed, j, c);
    __syncthreads();
    pow_gram_dd<RB, false>(Bs, kBStride, Bs, kBStride, d, Gd);
    __syncthreads();
    if (threadIdx.x == 0) pow_chol_orth<RB>(Gd, 0.0, Kd);
    __syncthreads();
  }
  for (int j = threadIdx.x; j < d; j += kPowThreads) {
    float row[RB];
#pragma unroll
    for (int c = 0; c < RB; ++c) row[c] = Bs[j * kBStride + c];
#pragma unroll
    for (int c = 0; c < RB; ++c) {
      double s = 0.0;
#pragma unroll
      for (int a = 0; a <= c; ++a) s += (double)row[a] * Kd[a * RB + c];
      Bs[j * kBStride + c] = (float)s;
    }
  }
  __syncthreads();
}

/// \brief Bs = orth(Omega): the start basis (all RB columns).
template <int RB>
__device__ void pow_init_basis(float* Bs, int d, uint64_t seed, double* Gd, double* Kd,
                               int* s_flag) {
  for (int j = threadIdx.x; j < d; j += kPowThreads)
#pragma unroll
    for (int c = 0; c < RB; ++c) Bs[j * kBStride + c] = init_value(seed, j, c);
  pow_orth_block<RB>(Bs, d, seed, Gd, Kd, s_flag);
}

/// \brief From M (Ms, [d, RB]) and G (Gd) of this iteration and the basis Bs it used:
/// K = orthonormalizer(G); B_i = M K; W = Bs K (all RB wide).  Not last: leave orth(B_i) in
/// Bs.  Last: truncate to rank r (U = top-r eigenvectors of B_i^T B_i), write B_i U to Bout
/// ([d, r]) and leave W U (columns >= r zero) in Bs.  Ms is overwritten.  Ends with a barrier.
/// The w x w work (Cholesky, Jacobi) is one thread's register-resident code; the d x w Gram
/// matrices use all threads (pow_gram_dd).
template <typename DType, int RB>
__device__ void pow_finalize(float* Ms, const double* Gd, double* Kd, float* Bs, int d, int r,
                             bool last, uint64_t seed, DType* Bout, double* Gtmp, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) pow_chol_orth<RB>(Gd, 1e-7, Kd);
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += kPowThreads) {  // each thread owns whole rows j
    float bn[RB], w[RB];
#pragma unroll
    for (int c = 0; c < RB; ++c) {
      double sb = 0.0, sw = 0.0;
#pragma unroll
      for (int a = 0; a <= c; ++a) {
        sb += (double)Ms[j * RB + a] * Kd[a * RB + c];
        sw += (double)Bs[j * kBStride + a] * Kd[a * RB + c];
      }
      bn[c] = (float)sb;
      w[c] = (float)sw;
    }
#pragma unroll
    for (int c = 0; c < RB; ++c) {
      Bs[j * kBStride + c] = last ? w[c] : bn[c];
      Ms[j * RB + c] = bn[c];
    }
  }
  if (!last) {
    pow_orth_block<RB>(Bs, d, seed, Gtmp, Kd, s_flag);
    return;
  }
  __syncthreads();
  pow_gram_dd<RB, false>(Ms, RB, Ms, RB, d, Gtmp);  // Gram of B_i (now in Ms)
  __syncthreads();
  if (threadIdx.x == 0) pow_eig_desc<RB>(Gtmp, Kd);
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += kPowThreads) {
    float bo[RB], wo[RB];
#pragma unroll
    for (int c = 0; c < RB; ++c) {
      double sb = 0.0, sw = 0.0;
      if (c < r) {
#pragma unroll
        for (int a = 0; a < RB; ++a) {
          sb += (double)Ms[j * RB + a] * Kd[a * RB + c];
          sw += (double)Bs[j * kBStride + a] * Kd[a * RB + c];
        }
      }
      bo[c] = (float)sb;
      wo[c] = (float)sw;
    }
    for (int c = 0; c < r; ++c) Bout[j * r + c] = from_float<DType>(bo[c]);
#pragma unroll
    for (int c = 0; c < RB; ++c) Bs[j * kBStride + c] = wo[c];
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// Small path: one block per matrix, X resident in shared memory.
// ---------------------------------------------------------------------------

/// \brief The whole algorithm on one matrix already in shared memory: Rs holds X as floats
/// ([rows_pad, STRIDE], rows >= T zero), Ps has rows_pad * kBStride floats.  Writes
/// A ([T, r]) and Bout ([d, r]).  All kPowThreads threads; Rs must be complete on entry
/// (or become complete before the first barrier: pow_init_basis starts with barriers).
/// Shared by PowerIterSmallKernel and the fused GEAR compress kernel (gear_small.cuh), so
/// both produce bit-identical factors from the same residual.
template <typename OutT, int DMAX, int RB>
__device__ __forceinline__ void pow_small_run(const float* Rs, float* Ps, int rows_pad, int64_t T,
                                              int d, int r, int iters, uint64_t seed, OutT* A,
                                              OutT* Bout) {
  constexpr int SLOTS = PowerSlots<DMAX, RB>::SLOTS;
  __shared__ float Bs[DMAX * kBStride];
  __shared__ float Ms[DMAX * RB];
  __shared__ double Gd[RB * RB], Kd[RB * RB], Gtmp[RB * RB];
  __shared__ int s_flag;
  pow_init_basis<RB>(Bs, d, seed, Gtmp, Kd, &s_flag);  // ends with a barrier
  for (int it = 1; it <= iters; ++it) {
    for (int row0 = 0; row0 < rows_pad; row0 += kPowTile) pow_compute_P<DMAX, RB>(Rs, row0, d, Bs, Ps);
    __syncthreads();
    float m[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) m[s] = 0.f;
    float g = 0.f;
    pow_accumulate<DMAX, RB>(Rs, Ps, 0, rows_pad, d, m, g);
    pow_store_M<DMAX, RB>(m, d, Ms);
    if (threadIdx.x < RB * RB) Gd[threadIdx.x] = (double)g;
    pow_finalize<OutT, RB>(Ms, Gd, Kd, Bs, d, r, it == iters, seed, Bout, Gtmp, &s_flag);
  }
  // Bs now holds W: A = X W.
  for (int row0 = 0; row0 < rows_pad; row0 += kPowTile) pow_compute_P<DMAX, RB>(Rs, row0, d, Bs, Ps);
  __syncthreads();
  for (int idx = threadIdx.x; idx < T * r; idx += kPowThreads) {
    const int t = idx / r, c = idx - t * r;
    A[idx] = from_float<OutT>(Ps[t * kBStride + c]);
  }
}

template <typename DType, int DMAX, int RB>
__global__ void __launch_bounds__(kPowThreads) PowerIterSmallKernel(PowerIterParams p,
                                                                    int rows_pad) {
  constexpr int STRIDE = PowerDims<DMAX>::STRIDE;
  extern __shared__ float pow_smem[];
  float* Rs = pow_smem;
  float* Ps = pow_smem + (size_t)rows_pad * STRIDE;
  const int64_t n = blockIdx.x, T = p.T;
  const int d = (int)p.d, r = p.rank;
  const DType* X = static_cast<const DType*>(p.x) + n * T * d;
  pow_load_rows<DType, DMAX>(X, T, d, 0, rows_pad, Rs);
  pow_small_run<DType, DMAX, RB>(Rs, Ps, rows_pad, T, d, r, p.iters, p.seed,
                                 static_cast<DType*>(p.A) + n * T * r,
                                 static_cast<DType*>(p.B) + n * d * r);
}

// ---------------------------------------------------------------------------
// Split path: grid (S, N) pass kernels + one finalize block per matrix.
// Workspace (floats): Bt [N, d, RB] | W [N, d, RB] | partials [N, S, d*RB + RB*RB].
// ---------------------------------------------------------------------------
template <typename DType, int DMAX, int RB>
__global__ void __launch_bounds__(kPowThreads) PowerIterPassKernel(PowerIterParams p, int it,
                                                                   int64_t rows_per_split) {
  constexpr int STRIDE = PowerDims<DMAX>::STRIDE, SLOTS = PowerSlots<DMAX, RB>::SLOTS;
  __shared__ float Rs[kPowTile * STRIDE];
  __shared__ float Ps[kPowTile * kBStride];
  __shared__ float Bs[DMAX * kBStride];
  __shared__ double Gd[RB * RB], Kd[RB * RB];
  __shared__ int s_flag;
  const int64_t s = blockIdx.x, n = blockIdx.y, S = gridDim.x, N = p.N, T = p.T;
  const int d = (int)p.d, r = p.rank;
  const DType* X = static_cast<const DType*>(p.x) + n * T * d;
  if (it == 1) {
    pow_init_basis<RB>(Bs, d, p.seed, Gd, Kd, &s_flag);
  } else {
    const float* src = p.ws + (it == 0 ? N * d * RB : 0) + n * d * RB;
    for (int idx = threadIdx.x; idx < d * RB; idx += kPowThreads)
      Bs[(idx / RB) * kBStride + idx % RB] = src[idx];
  }
  const int64_t t_begin = s * rows_per_split;
  const int64_t t_end = t_begin + rows_per_split < T ? t_begin + rows_per_split : T;
  float m[SLOTS];
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) m[i] = 0.f;
  float g = 0.f;
  DType* A = static_cast<DType*>(p.A) + n * T * r;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kPowTile) {
    const int rows = (int)(t_end - t0 < kPowTile ? t_end - t0 : kPowTile);
    __syncthreads();  // previous tile fully consumed (and Bs loaded)
    pow_load_rows<DType, DMAX>(X, t_end, d, t0, kPowTile, Rs);
    __syncthreads();
    pow_compute_P<DMAX, RB>(Rs, 0, d, Bs, Ps);
    __syncthreads();
    if (it == 0) {
      for (int idx = threadIdx.x; idx < rows * r; idx += kPowThreads) {
        const int row = idx / r, c = idx - row * r;
        A[(t0 + row) * r + c] = from_float<DType>(Ps[row * kBStride + c]);
      }
    } else {
      pow_accumulate<DMAX, RB>(Rs, Ps, 0, rows, d, m, g);
    }
  }
  if (it != 0) {
    float* part = p.ws + 2 * N * d * RB + (n * S + s) * (int64_t)(d * RB + RB * RB);
    pow_store_M<DMAX, RB>(m, d, part);
    if (threadIdx.x < RB * RB) part[d * RB + threadIdx.x] = g;
  }
}

/// \brief Register-resident pass (16-bit inputs, d == DMAX): no shared-memory tile.
/// Thread (row slot, seg) owns channels [8 seg, 8 seg + 8) of one row per step (one 16-byte
/// load), keeps its 8 x RB slice of B~ and its 8 x RB slice of M in registers; P of the row
/// is reduced over the SEGS = d / 8 lanes of the row with xor shuffles, lane seg < RB
/// accumulates row seg of G.  Per element: RB FMAs for P, RB for M, ~log2(SEGS) * RB / 8
/// shuffles; the shared-memory version spent ~10 shared-memory wavefronts per element and was
/// bound by them.  End: M and G reduced over the row slots (shuffles, then warps in a fixed
/// order through shared memory: deterministic), written as the same partials as
/// PowerIterPassKernel.  it == 0: A = X W (lane seg < r writes column seg).
template <typename DType, int DMAX, int RB>
__global__ void __launch_bounds__(kPowThreads, 1) PowerIterPassRegKernel(PowerIterParams p, int it,
                                                                      int64_t rows_per_split) {
  static_assert(sizeof(DType) == 2, "16-bit inputs only");
  constexpr int SEGS = DMAX / 8;             // lanes per row
  constexpr int RPS = kPowThreads / SEGS;    // rows per step
  constexpr int U = RB >= 8 ? 2 : 4;         // steps per batch (16-byte loads in flight)
  constexpr int NWARPS = kPowThreads / 32;
  __shared__ float Bs[DMAX * kBStride];
  __shared__ double Gd[RB * RB], Kd[RB * RB];
  __shared__ int s_flag;
  __shared__ float red[DMAX * RB + RB * RB];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int seg = tid % SEGS, rsub = tid / SEGS;
  const int64_t s = blockIdx.x, n = blockIdx.y, S = gridDim.x, N = p.N, T = p.T;
  const int d = DMAX, r = p.rank;
  const DType* X = static_cast<const DType*>(p.x) + n * T * d;
  if (it == 1) {
    pow_init_basis<RB>(Bs, d, p.seed, Gd, Kd, &s_flag);  // ends with a barrier
  } else {
    const float* src = p.ws + (it == 0 ? N * d * RB : 0) + n * d * RB;
    for (int idx = tid; idx < d * RB; idx += kPowThreads)
      Bs[(idx / RB) * kBStride + idx % RB] = src[idx];
    __syncthreads();
  }
  float bt[8][RB], m[8][RB], g[RB];
#pragma unroll
  for (int e = 0; e < 8; ++e)
#pragma unroll
    for (int c = 0; c < RB; ++c) {
      bt[e][c] = Bs[(seg * 8 + e) * kBStride + c];
      m[e][c] = 0.f;
    }
#pragma unroll
  for (int c = 0; c < RB; ++c) g[c] = 0.f;
  const int64_t t_begin = s * rows_per_split;
  const int64_t t_end = t_begin + rows_per_split < T ? t_begin + rows_per_split : T;
  DType* A = static_cast<DType*>(p.A) + n * T * r;
  // Software pipeline: the next batch's U loads are in flight while this batch is processed.
  PowVec<DType, 8> raw[U], nxt[U];
  auto load_batch = [&](int64_t t0, PowVec<DType, 8>(&dst)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + u * RPS + rsub;
      if (t < t_end) {
        dst[u] = *reinterpret_cast<const PowVec<DType, 8>*>(X + t * d + seg * 8);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[u].v[e] = from_float<DType>(0.f);
      }
    }
  };
  load_batch(t_begin, raw);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += RPS * U) {  // uniform trip count
    if (t0 + RPS * U < t_end) load_batch(t0 + RPS * U, nxt);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float x[8], pc[RB];
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = to_float(raw[u].v[e]);
#pragma unroll
      for (int c = 0; c < RB; ++c) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(x[e], bt[e][c], acc);
        pc[c] = acc;
      }
#pragma unroll
      for (int o = 1; o < SEGS; o <<= 1)
#pragma unroll
        for (int c = 0; c < RB; ++c) pc[c] += __shfl_xor_sync(kPowFullMask, pc[c], o);
      float pa = 0.f;  // P[row][seg] (lanes seg < RB)
#pragma unroll
      for (int c = 0; c < RB; ++c)
        if (c == seg) pa = pc[c];
      if (it == 0) {
        const int64_t t = t0 + u * RPS + rsub;
        if (t < t_end && seg < r) A[t * r + seg] = from_float<DType>(pa);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
          for (int c = 0; c < RB; ++c) m[e][c] = fmaf(x[e], pc[c], m[e][c]);
#pragma unroll
        for (int c = 0; c < RB; ++c) g[c] = fmaf(pa, pc[c], g[c]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) raw[u] = nxt[u];
  }
  if (it == 0) return;
  // Reduce over the row slots: lanes with the same seg in a warp, then warps in order.
#pragma unroll
  for (int o = SEGS; o < 32; o <<= 1) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int c = 0; c < RB; ++c) m[e][c] += __shfl_xor_sync(kPowFullMask, m[e][c], o);
#pragma unroll
    for (int c = 0; c < RB; ++c) g[c] += __shfl_xor_sync(kPowFullMask, g[c], o);
  }
  for (int w = 0; w < NWARPS; ++w) {
    if (warp == w && lane < SEGS) {
#pragma unroll
      for (int e = 0; e < 8; ++e)
#pragma unroll
        for (int c = 0; c < RB; ++c) {
          float* dst = red + (seg * 8 + e) * RB + c;
          *dst = w == 0 ? m[e][c] : *dst + m[e][c];
        }
      if (seg < RB) {
#pragma unroll
        for (int c = 0; c < RB; ++c) {
          float* dst = red + d * RB + seg * RB + c;
          *dst = w == 0 ? g[c] : *dst + g[c];
        }
      }
    }
    __syncthreads();
  }
  float* part = p.ws + 2 * N * d * RB + (n * S + s) * (int64_t)(d * RB + RB * RB);
  for (int idx = tid; idx < d * RB + RB * RB; idx += kPowThreads) part[idx] = red[idx];
}

template <typename DType, int DMAX, int RB>
__global__ void __launch_bounds__(kPowThreads) PowerIterFinalizeKernel(PowerIterParams p, int it,
                                                                       int64_t S) {
  __shared__ float Bs[DMAX * kBStride];
  __shared__ float Ms[DMAX * RB];
  __shared__ double Gd[RB * RB], Kd[RB * RB], Gtmp[RB * RB];
  __shared__ int s_flag;
  const int64_t n = blockIdx.x, N = p.N;
  const int d = (int)p.d, r = p.rank;
  const int PS = d * RB + RB * RB;
  const float* part = p.ws + 2 * N * d * RB + n * S * PS;
  for (int e = threadIdx.x; e < PS; e += kPowThreads) {
    float acc = 0.f;
    for (int64_t sp = 0; sp < S; ++sp) acc += part[sp * PS + e];
    if (e < d * RB) Ms[e] = acc;
    else Gd[e - d * RB] = (double)acc;
  }
  float* Bt = p.ws + n * d * RB;
  float* W = p.ws + N * d * RB + n * d * RB;
  if (it == 1) {
    pow_init_basis<RB>(Bs, d, p.seed, Gtmp, Kd, &s_flag);
  } else {
    for (int idx = threadIdx.x; idx < d * RB; idx += kPowThreads)
      Bs[(idx / RB) * kBStride + idx % RB] = Bt[idx];
  }
  const bool last = it == p.iters;
  DType* Bout = static_cast<DType*>(p.B) + n * d * r;
  pow_finalize<DType, RB>(Ms, Gd, Kd, Bs, d, r, last, p.seed, Bout, Gtmp, &s_flag);
  float* dst = last ? W : Bt;
  for (int idx = threadIdx.x; idx < d * RB; idx += kPowThreads)
    dst[idx] = Bs[(idx / RB) * kBStride + idx % RB];
}

// ---------------------------------------------------------------------------
// Gram path (16-bit inputs, d in {64, 128}, T above the one-block path): every iteration
// only needs C = X^T X ([d, d]): M = X^T X B~ = C B~ and G = P^T P = B~^T C B~.  So X is
// read twice in total, in 3 launches:
//  1. PowerGramKernel, grid (S, N): C of a T-slice on tensor cores (mma.sync m16n8k16,
//     16-bit products exact, fp32 accumulation), upper-triangle 16x16 blocks only, written
//     as one packed partial per block (power_gram_packed_floats).  X tiles of 64 rows stream
//     through a 4-stage cp.async pipeline (rows padded by 8 halfs: conflict-free ldmatrix).
//     Warp w owns the block rows i0 = w % NP and NB-1-i0 (NB + 1 blocks, balanced) and the
//     k16-steps ks = w / NP (mod KG) of every tile; the KG warp groups are summed in a fixed
//     order through shared memory (deterministic).
//  2. PowerGramIterateKernel, one block per matrix: sums the S partials in a fixed order into
//     a full symmetric C in shared memory and runs all iterations on it (M = C B~,
//     G = B~^T M, then pow_finalize: the same Cholesky-QR / orth / Jacobi truncation as the
//     pass path); writes B and W (workspace).
//  3. PowerGramApplyKernel, grid (SA, N): A = X W on tensor cores (mma.sync m16n8k16, X
//     straight from global memory into A fragments, W as a split hi + lo B operand held in
//     registers, fp32 accumulation).
// Workspace (floats): Bt [N, d, RB] (unused) | W [N, d, RB] | partials [N, S, packed].
// ---------------------------------------------------------------------------
constexpr int kGramRows = 64;    // rows per pipeline stage
constexpr int kGramStages = 4;   // cp.async stages

template <int D>
struct GramDims {
  static constexpr int NB = D / 16;                        // 16-channel blocks
  static constexpr int NP = NB / 2;                        // block-row pairs (warps per group)
  static constexpr int KG = (kPowThreads / 32) / NP;       // warp groups splitting k-steps
  static constexpr int NBLK = NB * (NB + 1) / 2;           // upper-triangle blocks
  static constexpr int PACK = NBLK * 256;                  // floats of one packed partial
  static constexpr int RS = D + 8;                         // shared row stride (16-bit units)
  static constexpr int STAGE = kGramRows * RS;             // 16-bit units per stage
  static constexpr size_t SMEM = (size_t)kGramStages * STAGE * 2;
  static_assert(NP * KG * 32 == kPowThreads, "warp layout");
  static_assert((size_t)PACK * 4 <= SMEM, "reduction buffer reuses the pipeline");
};

KVQ_HOST_DEVICE constexpr int gram_blk(int i, int j, int NB) {
  return i * NB - i * (i - 1) / 2 + (j - i);
}

__device__ __forceinline__ void gram_cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = pred ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void gram_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void gram_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void gram_ldsm_x4_t(unsigned (&r)[4], const void* smem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <typename DType>
__device__ __forceinline__ void gram_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  if constexpr (std::is_same<DType, bf16_t>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// \brief One k16-step of warp pair PR: base points at (row ks*16 + lane row, column
/// lane half * 8) of the stage.  ldmatrix.trans of the 16x16 (rows t, channels 16 j) block
/// gives, as registers {0, 1, 2, 3}, the m16k16 A fragment of X^T for channel block j; its
/// registers {0, 2} / {1, 3} are the k16n8 B fragments of channels 16 j + [0, 8) / [8, 16).
/// acc slots: [0, NB - I0) = blocks (I0, j >= I0), then blocks (I1, j >= I1).
template <typename DType, int D, int PR>
__device__ __forceinline__ void gram_kstep(const uint16_t* base,
                                           float (&acc)[GramDims<D>::NB + 1][2][4]) {
  constexpr int NB = GramDims<D>::NB, I0 = PR, I1 = NB - 1 - PR;
  unsigned f[NB][4];
#pragma unroll
  for (int j = I0; j < NB; ++j) gram_ldsm_x4_t(f[j], base + j * 16);
#pragma unroll
  for (int j = I0; j < NB; ++j) {
    gram_mma<DType>(acc[j - I0][0], f[I0], f[j][0], f[j][2]);
    gram_mma<DType>(acc[j - I0][1], f[I0], f[j][1], f[j][3]);
  }
#pragma unroll
  for (int j = I1; j < NB; ++j) {
    gram_mma<DType>(acc[NB - I0 + j - I1][0], f[I1], f[j][0], f[j][2]);
    gram_mma<DType>(acc[NB - I0 + j - I1][1], f[I1], f[j][1], f[j][3]);
  }
}

/// \brief Store (add == false) or add the accumulators of warp pair PR into the packed
/// buffer red.  Accumulator layout of m16n8: {0, 1} row g, columns 2 tig + {0, 1};
/// {2, 3} row g + 8.
template <int D, int PR>
__device__ __forceinline__ void gram_store(float* red, const float (&acc)[GramDims<D>::NB + 1][2][4],
                                           int lane, bool add) {
  constexpr int NB = GramDims<D>::NB, I0 = PR, I1 = NB - 1 - PR;
  const int g = lane >> 2, tig = lane & 3;
  auto put = [&](float* blk, const float (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* p0 = blk + g * 16 + h * 8 + 2 * tig;
      float* p1 = p0 + 8 * 16;
      if (add) {
        p0[0] += a[h][0];
        p0[1] += a[h][1];
        p1[0] += a[h][2];
        p1[1] += a[h][3];
      } else {
        p0[0] = a[h][0];
        p0[1] = a[h][1];
        p1[0] = a[h][2];
        p1[1] = a[h][3];
      }
    }
  };
#pragma unroll
  for (int j = I0; j < NB; ++j) put(red + gram_blk(I0, j, NB) * 256, acc[j - I0]);
#pragma unroll
  for (int j = I1; j < NB; ++j) put(red + gram_blk(I1, j, NB) * 256, acc[NB - I0 + j - I1]);
}

template <typename DType, int D>
__global__ void __launch_bounds__(kPowThreads, 1) PowerGramKernel(PowerIterParams p,
                                                                  int64_t rows_per_split,
                                                                  int64_t part_off) {
  static_assert(sizeof(DType) == 2, "16-bit inputs only");
  using GD = GramDims<D>;
  constexpr int NB = GD::NB, NP = GD::NP, KG = GD::KG, RS = GD::RS;
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  constexpr int LOADS = kGramRows * CPR / kPowThreads;
  static_assert(LOADS * kPowThreads == kGramRows * CPR, "tile load layout");
  extern __shared__ __align__(16) unsigned char gram_smem[];
  uint16_t* Xs = reinterpret_cast<uint16_t*>(gram_smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pr = warp % NP, kg = warp / NP;
  const int64_t s = blockIdx.x, n = blockIdx.y, S = gridDim.x, T = p.T;
  const DType* X = static_cast<const DType*>(p.x) + n * T * D;
  const int64_t t_begin = s * rows_per_split;
  const int64_t t_end = t_begin + rows_per_split < T ? t_begin + rows_per_split : T;
  const int ntiles = t_end > t_begin ? (int)((t_end - t_begin + kGramRows - 1) / kGramRows) : 0;
  auto load_tile = [&](int tile) {
    uint16_t* dst = Xs + (tile % kGramStages) * GD::STAGE;
    const int64_t t0 = t_begin + (int64_t)tile * kGramRows;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kPowThreads, row = idx / CPR, ch = (idx % CPR) * 8;
      const int64_t t = t0 + row;
      const bool ok = t < t_end;
      // NOTE: rows are 16-byte aligned (D * 2 % 16 == 0, aligned base); rows past the
      // slice are zero-filled (src-size 0) from a valid address.
      gram_cp_async16(dst + row * RS + ch, X + (ok ? t : t_begin) * D + ch, ok);
    }
  };
  float acc[NB + 1][2][4];
#pragma unroll
  for (int b = 0; b < NB + 1; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[b][h][e] = 0.f;
#pragma unroll
  for (int st = 0; st < kGramStages - 1; ++st) {
    if (st < ntiles) load_tile(st);
    gram_cp_commit();
  }
  // Lane address inside a 16x16 block: matrices {rows 0-7, 8-15} x {channels 0-7, 8-15},
  // lanes 8 m .. 8 m + 7 give the rows of matrix m (m = 2 * row half + channel half).
  const int lrow = (lane >> 4) * 8 + (lane & 7), lcol = ((lane >> 3) & 1) * 8;
  for (int tile = 0; tile < ntiles; ++tile) {
    gram_cp_wait<kGramStages - 2>();
    __syncthreads();  // stage `tile` landed for all threads; stage tile - 1 fully consumed
    if (tile + kGramStages - 1 < ntiles) load_tile(tile + kGramStages - 1);
    gram_cp_commit();
    const uint16_t* buf = Xs + (tile % kGramStages) * GD::STAGE + lrow * RS + lcol;
#pragma unroll
    for (int ks = 0; ks < kGramRows / 16; ks += KG) {
      const uint16_t* base = buf + (ks + kg) * 16 * RS;
      switch (pr) {  // warp-uniform: compile-time accumulator slots per pair
        case 0: gram_kstep<DType, D, 0>(base, acc); break;
        case 1: gram_kstep<DType, D, 1>(base, acc); break;
        case 2: if constexpr (NP > 2) gram_kstep<DType, D, 2>(base, acc); break;
        case 3: if constexpr (NP > 3) gram_kstep<DType, D, 3>(base, acc); break;
        default: break;
      }
    }
  }
  gram_cp_wait<0>();
  __syncthreads();  // pipeline buffers free: reuse as the packed reduction buffer
  float* red = reinterpret_cast<float*>(gram_smem);
  for (int g2 = 0; g2 < KG; ++g2) {  // fixed order over the warp groups: deterministic
    if (kg == g2) {
      switch (pr) {
        case 0: gram_store<D, 0>(red, acc, lane, g2 > 0); break;
        case 1: gram_store<D, 1>(red, acc, lane, g2 > 0); break;
        case 2: if constexpr (NP > 2) gram_store<D, 2>(red, acc, lane, g2 > 0); break;
        case 3: if constexpr (NP > 3) gram_store<D, 3>(red, acc, lane, g2 > 0); break;
        default: break;
      }
    }
    __syncthreads();
  }
  float4* part = reinterpret_cast<float4*>(p.ws + part_off + (n * S + s) * (int64_t)GD::PACK);
  const float4* red4 = reinterpret_cast<const float4*>(red);
  for (int idx = tid; idx < GD::PACK / 4; idx += kPowThreads) part[idx] = red4[idx];
}

template <typename DType, int D, int RB>
__global__ void __maxnreg__(224) PowerGramIterateKernel(PowerIterParams p, int64_t S) {
  using GD = GramDims<D>;
  constexpr int NB = GD::NB, LD = D + 1, PACK = GD::PACK, KS = kPowThreads / D, KL = D / KS;
  extern __shared__ float gram_C[];  // [D, LD]: the full symmetric Gram matrix
  __shared__ float Bs[D * kBStride];
  __shared__ float Ms[D * RB];
  __shared__ float Mred[KS * D * RB];
  __shared__ double Gd[RB * RB], Kd[RB * RB], Gtmp[RB * RB];
  __shared__ int s_flag;
  const int64_t n = blockIdx.x, N = p.N;
  const int r = p.rank, tid = threadIdx.x;
  const float* part = p.ws + 2 * N * D * RB + n * S * PACK;
  {  // sum the partials, fixed order over sp (deterministic); all VPT float4 loads of a
     // partial in flight (the scalar loop waited one L2 round trip per element)
    constexpr int P4 = PACK / 4, VPT = (P4 + kPowThreads - 1) / kPowThreads;
    const float4* part4 = reinterpret_cast<const float4*>(part);  // 16-byte aligned (PACK % 4 == 0)
    float4 acc[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t sp = 0; sp < S; ++sp) {
      float4 v[VPT];
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int e4 = tid + i * kPowThreads;
        v[i] = e4 < P4 ? part4[sp * P4 + e4] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        acc[i].x += v[i].x;
        acc[i].y += v[i].y;
        acc[i].z += v[i].z;
        acc[i].w += v[i].w;
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int e4 = tid + i * kPowThreads;
      if (e4 < P4) {
        const int e = e4 * 4, b = e >> 8, rr = (e >> 4) & 15, cc = e & 15;
        int bi = 0, rem = b;
        while (rem >= NB - bi) {
          rem -= NB - bi;
          ++bi;
        }
        const int row = bi * 16 + rr, col = (bi + rem) * 16 + cc;
        const float vals[4] = {acc[i].x, acc[i].y, acc[i].z, acc[i].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          gram_C[row * LD + col + q] = vals[q];
          gram_C[(col + q) * LD + row] = vals[q];
        }
      }
    }
  }
  pow_init_basis<RB>(Bs, D, p.seed, Gtmp, Kd, &s_flag);  // barriers: gram_C complete
  DType* Bout = static_cast<DType*>(p.B) + n * D * r;
  for (int it = 1; it <= p.iters; ++it) {
    {  // M = C B~: thread (j, k-slice), reading C[k][j] (= C[j][k]) along j: conflict-free
      const int j = tid % D, ks = tid / D;
      float acc[RB];
#pragma unroll
      for (int c = 0; c < RB; ++c) acc[c] = 0.f;
#pragma unroll 4
      for (int k = ks * KL; k < ks * KL + KL; ++k) {
        const float cv = gram_C[k * LD + j];
        const float* b = Bs + k * kBStride;
#pragma unroll
        for (int c = 0; c < RB; ++c) acc[c] = fmaf(cv, b[c], acc[c]);
      }
#pragma unroll
      for (int c = 0; c < RB; ++c) Mred[(ks * D + j) * RB + c] = acc[c];
    }
    __syncthreads();
    for (int e = tid; e < D * RB; e += kPowThreads) {
      float sum = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) sum += Mred[ks * D * RB + e];
      Ms[e] = sum;
    }
    __syncthreads();
    // G = 0.5 (B~^T M + M^T B~) = B~^T C B~ (double sums; pow_finalize syncs first)
    pow_gram_dd<RB, true>(Bs, kBStride, Ms, RB, D, Gd);
    pow_finalize<DType, RB>(Ms, Gd, Kd, Bs, D, r, it == p.iters, p.seed, Bout, Gtmp, &s_flag);
  }
  float* W = p.ws + N * D * RB + n * D * RB;
  for (int idx = tid; idx < D * RB; idx += kPowThreads) W[idx] = Bs[(idx / RB) * kBStride + idx % RB];
}

/// \brief 16-row tiles per warp and batch of PowerGramApplyKernel: 8 KB of X in flight per
/// warp (16 warps per SM: ~128 KB per SM), 64 registers of X per thread.
KVQ_HOST_DEVICE constexpr int gram_apply_tiles(int d) { return d == 64 ? 4 : 2; }
constexpr int kGramApplyWarps = kPowThreads / 32;

/// \brief Two 16-bit values (lo: lower channel) as one mma operand register.
template <typename DType>
__device__ __forceinline__ unsigned gram_pack2(DType lo, DType hi) {
  return (unsigned)lo.bits | ((unsigned)hi.bits << 16);
}

/// \brief *dst = bits if pred, as one predicated store (a C++ `if` makes nvcc sink the whole
/// 64-bit address computation into a branch per store).
__device__ __forceinline__ void gram_st16_if(void* dst, uint16_t bits, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p st.global.b16 [%0], %1;\n}\n" ::"l"(dst),
      "h"(bits), "r"((int)pred)
      : "memory");
}

/// \brief A = X W for the Gram path on tensor cores (mma.sync m16n8k16, fp32 accumulate),
/// computed transposed: A^T (16 x 8 rows) = [W_hi | W_lo]^T (16 x 16 channels) X^T (16
/// channels x 8 rows).  W s = W_hi + W_lo (W_hi = DType(W s), W_lo = DType(W s - W_hi); s a
/// per-column power of two with max |W[:, c]| s_c in [0.5, 1): no fp16 overflow/underflow
/// whatever the singular values); mma rows m = c take W_hi[:, c], rows 8 + c take W_lo[:, c]
/// (c < 8, columns >= RB zero), so one mma gives both halves of the product in separate
/// accumulators, summed and unscaled (exact) before the single rounding to DType.
/// Warp = U tiles of 16 rows (two 8-row groups) per batch, chunks warp, warp + 8, ... of the
/// split.  Lane (g = lane / 4, tig = lane % 4) loads row 8 h + g of group h, channels
/// [32 ss + 8 tig, +8) per 32-channel super-step ss: one 16-byte load (a warp load is 8 rows
/// x 64 contiguous bytes, full sectors).  The k order inside an mma is free as long as both
/// operands agree: k-step ks of super-step ss maps k = 2 tig + e to channel
/// 32 ss + 8 tig + 4 ks + e and k = 2 tig + 8 + e to channel 32 ss + 8 tig + 4 ks + 2 + e
/// (e in {0, 1}), so the B fragment is words {2 ks, 2 ks + 1} of the load (a register pair,
/// no moves) and lane (g, tig) needs W[:, g] only at the channels of its own loads.
/// Result: lane (g, tig) holds A[rows 2 tig + {0, 1} of the group, column g] (hi in acc
/// {0, 1}, lo in {2, 3}).  Fixed order everywhere: deterministic.
template <typename DType, int D, int RB>
__global__ void __launch_bounds__(kPowThreads, 2) PowerGramApplyKernel(PowerIterParams p,
                                                                       int64_t rows_per_split) {
  static_assert(sizeof(DType) == 2, "16-bit inputs only");
  static_assert(D % 32 == 0 && RB <= 8, "apply tile layout");
  constexpr int SS = D / 32;                   // 32-channel super-steps
  constexpr int U = gram_apply_tiles(D);       // 16-row tiles per warp and batch
  constexpr int CHUNK = 16 * U;                // rows per warp and batch
  constexpr int STRIDE = kGramApplyWarps * CHUNK;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int64_t s = blockIdx.x, n = blockIdx.y, N = p.N, T = p.T;
  const int r = p.rank;
  const int64_t t_begin = s * rows_per_split;
  const int64_t t_end = t_begin + rows_per_split < T ? t_begin + rows_per_split : T;
  const DType* X = static_cast<const DType*>(p.x) + n * T * D;
  DType* A = static_cast<DType*>(p.A) + n * T * r;
  uint4 xa[U][2][SS];  // [tile][8-row group][super-step]
  // Rows past the end (T not a multiple of 16, end of the split) load a valid row instead
  // (the last one): row n of X^T only reaches column n of the product, which is not stored.
  auto load = [&](int64_t t0) {
    const int last = (int)((t_end - t0 < CHUNK ? t_end - t0 : CHUNK) - 1);
    const DType* Xb = X + t0 * D + 8 * tig;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int lr = 16 * u + 8 * h + g;
        // NOTE: rows are 16-byte aligned (D * 2 % 16 == 0, aligned base)
        const uint4* src = reinterpret_cast<const uint4*>(Xb + (lr < last ? lr : last) * D);
#pragma unroll
        for (int ss = 0; ss < SS; ++ss) xa[u][h][ss] = src[ss * 4];
      }
  };
  int64_t t0 = t_begin + (int64_t)warp * CHUNK;
  if (t0 < t_end) load(t0);  // the first batch is in flight while W is read
  unsigned wa[SS][2][4];     // A fragments [super-step][k-step]: {hi k lo, lo k lo, hi k hi, lo k hi}
  float inv;                 // 1 / s_g
  {
    const float* Wg = p.ws + N * D * RB + n * D * RB;
    float wv[SS][8];
    float m = 0.f;
#pragma unroll
    for (int ss = 0; ss < SS; ++ss)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        wv[ss][e] = g < RB ? Wg[(ss * 32 + 8 * tig + e) * RB + g] : 0.f;
        m = fmaxf(m, fabsf(wv[ss][e]));
      }
    m = fmaxf(m, __shfl_xor_sync(kPowFullMask, m, 1));  // column max over the 4 lanes of g
    m = fmaxf(m, __shfl_xor_sync(kPowFullMask, m, 2));
    int ex = 0;
    if (m > 0.f && m <= 3.4028235e38f) {  // zero / non-finite columns: scale 1
      (void)frexpf(m, &ex);
      ex = ex < -126 ? -126 : (ex > 126 ? 126 : ex);
    }
    const float scale = __int_as_float((127 - ex) << 23);
    inv = __int_as_float((127 + ex) << 23);
#pragma unroll
    for (int ss = 0; ss < SS; ++ss)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float w0 = wv[ss][4 * ks + 2 * q] * scale, w1 = wv[ss][4 * ks + 2 * q + 1] * scale;
          const DType h0 = from_float<DType>(w0), h1 = from_float<DType>(w1);
          wa[ss][ks][2 * q] = gram_pack2<DType>(h0, h1);
          wa[ss][ks][2 * q + 1] = gram_pack2<DType>(from_float<DType>(w0 - to_float(h0)),
                                                    from_float<DType>(w1 - to_float(h1)));
        }
  }
  const bool col_ok = g < r;
  for (; t0 < t_end; t0 += STRIDE) {  // warp-uniform trip count (mma.sync: whole warp)
    float acc[U][2][4];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[u][h][e] = 0.f;
#pragma unroll
    for (int ss = 0; ss < SS; ++ss)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 x = xa[u][h][ss];
            gram_mma<DType>(acc[u][h], wa[ss][ks], ks == 0 ? x.x : x.z, ks == 0 ? x.y : x.w);
          }
    const int rows = (int)(t_end - t0 < CHUNK ? t_end - t0 : CHUNK);
    DType* Ab = A + t0 * r + g;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int lr = 16 * u + 8 * h + 2 * tig + e;
          const DType v = from_float<DType>((acc[u][h][e] + acc[u][h][2 + e]) * inv);
          gram_st16_if(Ab + lr * r, v.bits, col_ok && lr < rows);
        }
    // next batch (after the stores: the X registers are free, no address rematerialization)
    if (t0 + STRIDE < t_end) load(t0 + STRIDE);
  }
}

/// \brief The Gram path launcher (3 launches).
template <typename DType, int D, int RB>
cudaError_t PowerIterGram(const PowerIterParams& p, cudaStream_t stream) {
  using GD = GramDims<D>;
  const size_t c_smem = (size_t)D * (D + 1) * sizeof(float);
  static const cudaError_t attr_pass = cudaFuncSetAttribute(
      PowerGramKernel<DType, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)GD::SMEM);
  if (attr_pass != cudaSuccess) return attr_pass;
  static const cudaError_t attr_it = cudaFuncSetAttribute(
      PowerGramIterateKernel<DType, D, RB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      (int)c_smem);
  if (attr_it != cudaSuccess) return attr_it;
  const int64_t S = power_gram_splits(p.N, p.T);
  const int64_t rps = ((p.T + S - 1) / S + kGramRows - 1) / kGramRows * kGramRows;
  PowerGramKernel<DType, D><<<dim3((unsigned)S, (unsigned)p.N), kPowThreads, GD::SMEM, stream>>>(
      p, rps, 2 * p.N * D * RB);
  PowerGramIterateKernel<DType, D, RB><<<(unsigned)p.N, kPowThreads, c_smem, stream>>>(p, S);
  // Apply: ~2 blocks per SM of an H200 in total (16 warps x 8 KB of X in flight per SM);
  // splits are whole warp chunks (only the matrix's last tile is partial).
  constexpr int64_t kChunk = 16 * gram_apply_tiles(D);
  constexpr int64_t kApplyRows = kGramApplyWarps * kChunk;  // rows per block and batch
  int64_t SA = 264 / p.N;
  const int64_t by_rows = (p.T + kApplyRows - 1) / kApplyRows;
  SA = SA < by_rows ? SA : by_rows;
  SA = SA < 1 ? 1 : SA;
  const int64_t rows_a = ((p.T + SA - 1) / SA + kChunk - 1) / kChunk * kChunk;
  PowerGramApplyKernel<DType, D, RB>
      <<<dim3((unsigned)SA, (unsigned)p.N), kPowThreads, 0, stream>>>(p, rows_a);
  return cudaGetLastError();
}

/// \brief Small-path dynamic shared memory (bytes) for T rows, or 0 if it does not fit.
template <int DMAX>
inline size_t power_small_smem(int64_t T) {
  constexpr size_t kLimit = 160 * 1024;
  const int64_t rows_pad = (T + kPowTile - 1) / kPowTile * kPowTile;
  if (rows_pad > 256) return 0;
  const size_t bytes = (size_t)rows_pad * (PowerDims<DMAX>::STRIDE + kBStride) * sizeof(float);
  return bytes <= kLimit ? bytes : 0;
}

/// \brief Rank-r factors of every [T, d] matrix (see power_svd.h).  Needs p.ws with
/// power_iter_workspace_floats(N, T, d, r) floats on the split path (always pass it).
template <typename DType, int DMAX, int RB>
cudaError_t PowerIter(const PowerIterParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  if (p.T == 0) {  // A is empty; B = X^T A = 0
    return cudaMemsetAsync(p.B, 0, (size_t)(p.N * p.d * p.rank) * sizeof(DType), stream);
  }
  if (p.d > DMAX || p.rank > RB || p.rank < 1 || p.iters < 1) return cudaErrorInvalidValue;
  const size_t smem = power_small_smem<DMAX>(p.T);
  if (smem > 0) {
    static const cudaError_t attr = cudaFuncSetAttribute(
        PowerIterSmallKernel<DType, DMAX, RB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        160 * 1024);
    if (attr != cudaSuccess) return attr;
    const int rows_pad = (int)((p.T + kPowTile - 1) / kPowTile * kPowTile);
    PowerIterSmallKernel<DType, DMAX, RB><<<(unsigned)p.N, kPowThreads, smem, stream>>>(p, rows_pad);
    return cudaGetLastError();
  }
  if (p.ws == nullptr) return cudaErrorInvalidValue;
  if (p.N > 65535) return cudaErrorInvalidConfiguration;
  // 16-bit inputs with d in {64, 128} (GEAR residuals): Gram path, X read twice.
  if constexpr (sizeof(DType) == 2 && (DMAX == 64 || DMAX == 128)) {
    if (p.d == DMAX) return PowerIterGram<DType, DMAX, RB>(p, stream);
  }
  const int64_t S = power_iter_splits(p.N, p.T);
  const int64_t rps = ((p.T + S - 1) / S + kPowTile - 1) / kPowTile * kPowTile;
  const dim3 grid((unsigned)S, (unsigned)p.N);
  // 16-bit inputs with d == DMAX (64 / 128 / 256: GEAR residuals): register-resident passes.
  constexpr bool kReg = sizeof(DType) == 2;
  const bool reg = kReg && p.d == DMAX;
  auto pass = [&](int it) {
    if constexpr (kReg) {
      if (reg) {
        PowerIterPassRegKernel<DType, DMAX, RB><<<grid, kPowThreads, 0, stream>>>(p, it, rps);
        return;
      }
    }
    PowerIterPassKernel<DType, DMAX, RB><<<grid, kPowThreads, 0, stream>>>(p, it, rps);
  };
  for (int it = 1; it <= p.iters; ++it) {
    pass(it);
    PowerIterFinalizeKernel<DType, DMAX, RB><<<(unsigned)p.N, kPowThreads, 0, stream>>>(p, it, S);
  }
  pass(0);
  return cudaGetLastError();
}

}  // namespace linalg
}  // namespace kvq
