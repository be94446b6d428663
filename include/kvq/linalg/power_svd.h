// Batched rank-r approximation by power (subspace) iteration: params, the small dense
// helpers shared by host and device, and the CPU twin.  Torch-free.
//
// For each matrix X_n ([T, d], n < N) and rank r <= 8, with an oversampled internal width
// w = power_width(r) >= r:
//   B~_0 = orth(Omega)  [d, w]       Omega[j, c] = init_value(seed, j, c), uniform in [-1, 1)
//   for i = 1 .. iters:
//     P   = X B~_{i-1}                [T, r]   (never stored)
//     G   = P^T P,  M = X^T P         [r, r], [d, r]   (one pass over X)
//     K   = gram_orthonormalizer(G)   upper-triangular [r, r] with Q = P K orthonormal
//                                     (Gram-Schmidt carried out on the Gram matrix, i.e.
//                                     a Cholesky QR; dependent columns get a zero column)
//     B_i = M K = X^T Q,   W_i = B~_{i-1} K   (so Q = X W_i)
//     B~_i = orth(B_i)                (Gram-Schmidt again; an all-zero column is refilled
//                                     from Omega so a lost direction can come back)
//   truncation to rank r: U_r = top-r eigenvectors of B_iters^T B_iters ([w, w], Jacobi),
//   A = X W_iters U_r  (= Q U_r, orthonormal columns),  B = B_iters U_r = X^T A,
//   so A B^T is the best rank-r approximation of X within the w-dimensional subspace.
// Each iteration is one pass over X (plus one final pass for A).  The same Omega is used
// for every matrix, so a matrix's factors do not depend on the other matrices of the call.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"

namespace kvq {
namespace linalg {

constexpr int kMaxRank = 8;

/// \brief Parameters of one lowrank_power_iter call.
struct PowerIterParams {
  const void* x;   // [N, T, d] input (DType), contiguous
  void* A;         // [N, T, r] output (DType)
  void* B;         // [N, d, r] output (DType)
  float* ws;       // CUDA workspace, power_iter_workspace_floats() floats
  int64_t N = 0;
  int64_t T = 0;
  int64_t d = 0;   // 1 <= d <= 256
  int rank = 0;    // 1 <= rank <= min(8, T, d)
  int iters = 0;   // >= 1
  uint64_t seed = 0;
};

/// \brief Compile-time width bucket used by the CUDA kernels (2, 4, 6 or 8).
inline int rank_bucket(int r) { return r <= 2 ? 2 : (r <= 4 ? 4 : (r <= 6 ? 6 : 8)); }

/// \brief Internal subspace width w for output rank r: oversampled (r=1 -> 2, r=2 -> 4,
/// r=3,4 -> 6, r>=5 -> 8).  The extra columns make 3 iterations land within ~1% of the
/// optimal rank-r error on decaying spectra, where width r alone can be 5-50% off when
/// sigma_r ~ sigma_{r+1}; they cost (w/r - 1) more flops in the passes.
inline int power_width(int r) { return r <= 1 ? 2 : (r <= 2 ? 4 : (r <= 4 ? 6 : 8)); }

/// \brief Number of T-splits of the multi-block CUDA path (device independent).
inline int64_t power_iter_splits(int64_t N, int64_t T) {
  int64_t by_rows = (T + 127) / 128;
  int64_t by_blocks = N > 0 ? (528 + N - 1) / N : 1;
  int64_t s = by_rows < by_blocks ? by_rows : by_blocks;
  return s < 1 ? 1 : s;
}

/// \brief Whether the CUDA Gram path can serve head dim d (it also needs 16-bit inputs and
/// T above the one-block path; the launcher checks those).
inline bool power_gram_dim(int64_t d) { return d == 64 || d == 128; }

/// \brief T-splits of the CUDA Gram pass (device independent): about one 256-thread block
/// per SM of an H100/H200 in total, >= 256 rows per block, at most 64 partials per matrix.
inline int64_t power_gram_splits(int64_t N, int64_t T) {
  const int64_t by_rows = (T + 255) / 256;
  int64_t by_blocks = N > 0 ? 132 / N : 1;
  if (by_blocks < 1) by_blocks = 1;
  int64_t s = by_rows < by_blocks ? by_rows : by_blocks;
  if (s > 64) s = 64;
  return s < 1 ? 1 : s;
}

/// \brief Floats of one packed Gram partial: the upper-triangle 16x16 blocks of the [d, d]
/// Gram matrix, block (i, j >= i) row-major inside, blocks in row-major order.
inline int64_t power_gram_packed_floats(int64_t d) {
  const int64_t nb = d / 16;
  return nb * (nb + 1) / 2 * 256;
}

/// \brief Workspace (floats) of the CUDA launcher.
inline int64_t power_iter_workspace_floats(int64_t N, int64_t T, int64_t d, int r) {
  const int64_t rb = power_width(r);
  const int64_t pass_parts = N * power_iter_splits(N, T) * (d * rb + rb * rb);
  const int64_t gram_parts =
      power_gram_dim(d) ? N * power_gram_splits(N, T) * power_gram_packed_floats(d) : 0;
  return 2 * N * d * rb + (pass_parts > gram_parts ? pass_parts : gram_parts);
}

/// \brief Deterministic start vector entry in [-1, 1) (splitmix64 of seed, row, column).
KVQ_HOST_DEVICE float init_value(uint64_t seed, int64_t j, int c) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t)j * 0xBF58476D1CE4E5B9ull +
               (uint64_t)c * 0x94D049BB133111EBull + 0x2545F4914F6CDD1Dull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;  // 24 bits -> [0, 2) - 1
}

/// \brief Gram-Schmidt in Gram form, computed as a pivot-dropping Cholesky factorization.
/// G: [r, r] (leading dim ldg) = P^T P.  Writes the upper-triangular K ([r, r], leading dim
/// ldk) with P K = Q: the nonzero columns of Q are orthonormal, Q spans P's columns.  A column
/// whose remaining norm^2 (its Cholesky pivot) is <= 1e-6 of its own norm^2 (dependent) or
/// <= tr_rel * trace(G) (negligible) is dropped: zero column of K.  O(r^3 / 3) flops, so a
/// single thread handles r = 8 quickly.
KVQ_HOST_DEVICE void gram_orthonormalizer(const double* G, int ldg, int r, double* K, int ldk,
                                          double tr_rel) {
  double L[kMaxRank * kMaxRank], inv[kMaxRank];
  double tr = 0.0;
  for (int c = 0; c < r; ++c) tr += G[c * ldg + c];
  for (int c = 0; c < r; ++c) {
    double s = G[c * ldg + c];
    for (int a = 0; a < c; ++a) s -= L[c * kMaxRank + a] * L[c * kMaxRank + a];
    const double own = G[c * ldg + c];
    const bool dead = !(tr > 0.0) || !(s > 1e-6 * own) || !(s > tr_rel * tr);
    const double lcc = dead ? 0.0 : sqrt(s);
    inv[c] = dead ? 0.0 : 1.0 / lcc;
    L[c * kMaxRank + c] = lcc;
    for (int i = c + 1; i < r; ++i) {
      double v = G[i * ldg + c];
      for (int a = 0; a < c; ++a) v -= L[i * kMaxRank + a] * L[c * kMaxRank + a];
      L[i * kMaxRank + c] = v * inv[c];
    }
  }
  // K = (L^T)^+ : upper triangular, back substitution column by column (dead rows -> 0).
  for (int a = 0; a < r; ++a)
    for (int c = 0; c < r; ++c) K[a * ldk + c] = 0.0;
  for (int c = 0; c < r; ++c) {
    if (inv[c] == 0.0) continue;
    K[c * ldk + c] = inv[c];
    for (int i = c - 1; i >= 0; --i) {
      if (inv[i] == 0.0) continue;
      double v = 0.0;
      for (int a = i + 1; a <= c; ++a) v += L[a * kMaxRank + i] * K[a * ldk + c];
      K[i * ldk + c] = -v * inv[i];
    }
  }
}

/// \brief Eigen-decomposition of a symmetric [n, n] matrix S (leading dim lds; destroyed)
/// by cyclic Jacobi rotations (Real = float on the GPU, double on the CPU).  Writes the
/// eigenvectors as the columns of U ([n, n], leading dim ldu) sorted by decreasing eigenvalue.
template <typename Real>
KVQ_HOST_DEVICE void sym_eig_desc(Real* S, int lds, int n, Real* U, int ldu) {
  Real V[kMaxRank * kMaxRank];
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) V[a * kMaxRank + b] = a == b ? 1.0 : 0.0;
  const Real eps = sizeof(Real) == 8 ? Real(1e-30) : Real(1e-14);
  for (int sweep = 0; sweep < 30; ++sweep) {
    Real off = 0, diag = 0;
    for (int p = 0; p < n; ++p) {
      diag += S[p * lds + p] * S[p * lds + p];
      for (int q = p + 1; q < n; ++q) off += S[p * lds + q] * S[p * lds + q];
    }
    if (!(off > eps * diag)) break;
    for (int p = 0; p < n - 1; ++p)
      for (int q = p + 1; q < n; ++q) {
        const Real apq = S[p * lds + q];
        if (apq == Real(0)) continue;
        const Real theta = (S[q * lds + q] - S[p * lds + p]) / (Real(2) * apq);
        const Real t = (theta >= Real(0) ? Real(1) : Real(-1)) /
                       (fabs(theta) + sqrt(theta * theta + Real(1)));
        const Real c = Real(1) / sqrt(t * t + Real(1)), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const Real kp = S[k * lds + p], kq = S[k * lds + q];
          S[k * lds + p] = c * kp - s * kq;
          S[k * lds + q] = s * kp + c * kq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const Real pk = S[p * lds + k], qk = S[q * lds + k];
          S[p * lds + k] = c * pk - s * qk;
          S[q * lds + k] = s * pk + c * qk;
        }
        for (int k = 0; k < n; ++k) {
          const Real kp = V[k * kMaxRank + p], kq = V[k * kMaxRank + q];
          V[k * kMaxRank + p] = c * kp - s * kq;
          V[k * kMaxRank + q] = s * kp + c * kq;
        }
      }
  }
  bool used[kMaxRank] = {false};
  for (int c = 0; c < n; ++c) {
    int best = -1;
    for (int i = 0; i < n; ++i)
      if (!used[i] && (best < 0 || S[i * lds + i] > S[best * lds + best])) best = i;
    used[best] = true;
    for (int a = 0; a < n; ++a) U[a * ldu + c] = V[a * kMaxRank + best];
  }
}

// ---------------------------------------------------------------------------
// CPU twin (double accumulation), matrices [n_begin, n_end).
// ---------------------------------------------------------------------------

/// \brief Orthonormalize the r columns of B ([d, r], row-major) in place; all-zero columns
/// are first refilled from the start vectors.
inline void orth_basis_cpu(double* B, int64_t d, int r, uint64_t seed) {
  double G[kMaxRank * kMaxRank], K[kMaxRank * kMaxRank];
  for (int c = 0; c < r; ++c) {
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += B[j * r + c] * B[j * r + c];
    if (s == 0.0)
      for (int64_t j = 0; j < d; ++j) B[j * r + c] = init_value(seed, j, c);
  }
  for (int a = 0; a < r; ++a)
    for (int b = 0; b < r; ++b) {
      double s = 0.0;
      for (int64_t j = 0; j < d; ++j) s += B[j * r + a] * B[j * r + b];
      G[a * r + b] = s;
    }
  gram_orthonormalizer(G, r, r, K, r, 0.0);
  for (int64_t j = 0; j < d; ++j) {
    double row[kMaxRank];
    for (int c = 0; c < r; ++c) {
      double s = 0.0;
      for (int a = 0; a <= c; ++a) s += B[j * r + a] * K[a * r + c];
      row[c] = s;
    }
    for (int c = 0; c < r; ++c) B[j * r + c] = row[c];
  }
}

template <typename DType>
void power_iter_cpu(const PowerIterParams& p, int64_t n_begin, int64_t n_end) {
  const int64_t T = p.T, d = p.d;
  const int r = p.rank, w = power_width(p.rank);
  std::vector<double> Bt((size_t)(d * w)), W((size_t)(d * w)), M((size_t)(d * w)),
      Bn((size_t)(d * w)), xr((size_t)d);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const DType* X = static_cast<const DType*>(p.x) + n * T * d;
    for (int64_t j = 0; j < d; ++j)
      for (int c = 0; c < w; ++c) Bt[j * w + c] = init_value(p.seed, j, c);
    orth_basis_cpu(Bt.data(), d, w, p.seed);
    for (int it = 1; it <= p.iters; ++it) {
      double G[kMaxRank * kMaxRank] = {0}, K[kMaxRank * kMaxRank];
      std::fill(M.begin(), M.end(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        double P[kMaxRank] = {0};
        for (int64_t j = 0; j < d; ++j) {
          xr[j] = to_float(X[t * d + j]);
          for (int c = 0; c < w; ++c) P[c] += xr[j] * Bt[j * w + c];
        }
        for (int a = 0; a < w; ++a)
          for (int b = 0; b < w; ++b) G[a * w + b] += P[a] * P[b];
        for (int64_t j = 0; j < d; ++j)
          for (int c = 0; c < w; ++c) M[j * w + c] += xr[j] * P[c];
      }
      gram_orthonormalizer(G, w, w, K, w, 1e-7);
      for (int64_t j = 0; j < d; ++j)
        for (int c = 0; c < w; ++c) {
          double bn = 0.0, wv = 0.0;
          for (int a = 0; a <= c; ++a) {
            bn += M[j * w + a] * K[a * w + c];
            wv += Bt[j * w + a] * K[a * w + c];
          }
          Bn[j * w + c] = bn;
          W[j * w + c] = wv;
        }
      if (it < p.iters) {
        Bt = Bn;
        orth_basis_cpu(Bt.data(), d, w, p.seed);
      }
    }
    // Truncate the w-dimensional subspace to the best rank r.
    double GB[kMaxRank * kMaxRank], U[kMaxRank * kMaxRank];
    for (int a = 0; a < w; ++a)
      for (int b = 0; b < w; ++b) {
        double s = 0.0;
        for (int64_t j = 0; j < d; ++j) s += Bn[j * w + a] * Bn[j * w + b];
        GB[a * w + b] = s;
      }
    sym_eig_desc(GB, w, w, U, w);
    DType* A = static_cast<DType*>(p.A) + n * T * r;
    DType* B = static_cast<DType*>(p.B) + n * d * r;
    std::vector<double> Wr((size_t)(d * r));
    for (int64_t j = 0; j < d; ++j)
      for (int c = 0; c < r; ++c) {
        double sb = 0.0, sw = 0.0;
        for (int a = 0; a < w; ++a) {
          sb += Bn[j * w + a] * U[a * w + c];
          sw += W[j * w + a] * U[a * w + c];
        }
        B[j * r + c] = from_float<DType>((float)sb);
        Wr[j * r + c] = sw;
      }
    for (int64_t t = 0; t < T; ++t)
      for (int c = 0; c < r; ++c) {
        double s = 0.0;
        for (int64_t j = 0; j < d; ++j) s += (double)to_float(X[t * d + j]) * Wr[j * r + c];
        A[t * r + c] = from_float<DType>((float)s);
      }
  }
}

}  // namespace linalg
}  // namespace kvq
