// C++ microbenchmark of the fused decode-attention kernels over KIVI caches (nvbench-style
// report, same harness as bench_group_quant: CUDA events, L2 flushed before every sample,
// warm-up, noise, % of a device-to-device copy measured in the same run).  Torch-free: the
// caches are built on the device through the public entry points of kvq/cuda_api.h.
//
//   bench_decode_attention [--batch 1 8] [--len 4096 32768] [--no-check]
//
// Llama-3-8B attention shape: Hq = 32 query heads, H = 8 KV heads, D = 128, fp16.  For each
// (B, L) and preset (KIVI-2 / KIVI-4: keys per-channel G = 32, values per-token G = 32, the
// last 128 tokens an fp16 residual), random K, V [B, H, L, D] are quantized with
// group_quantize_cuda and decode_attention_cuda is timed.  Rows:
//   "FP16 KV bytes (D2D copy)"  a cudaMemcpy of half the FP16 KV size, so that the bytes it
//                               moves (read + write) equal the FP16 KV an FP16 decode reads:
//                               the time a copy-bound FP16 decode would take (no SDPA here)
//   "fused kivi-N"              decode_attention_cuda (split kernel + combine kernel);
//                               bytes = codes + scales + zeros + residual of both roles
//                               (computed from the layout)
// Before timing, every launch runs once into a NaN-filled output, which is copied back and
// scanned for non-finite values; unless --no-check, batch B - 1 (all KV heads) is also
// compared with the CPU twin (decode_attention_cpu) on the same stored data.  Any failure
// exits non-zero (after the table, for a reference mismatch).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_harness.cuh"
#include "kvq/cuda_api.h"

using namespace kvq;

namespace {

constexpr int64_t kHq = 32, kH = 8, kD = 128;
constexpr int64_t kResidual = 128;  // fp16 tokens kept unquantized (KIVI residual length R)
constexpr int64_t kGroup = 32;      // KIVI group (key tokens per channel group, value channels per group)
constexpr double kTol = 1e-2;       // relative L2 error vs the CPU twin (tests use 4e-3 on short caches)

#define BENCH_FAIL(...)                  \
  do {                                   \
    std::fprintf(stderr, "error: ");     \
    std::fprintf(stderr, __VA_ARGS__);   \
    std::fprintf(stderr, "\n");          \
    std::exit(1);                        \
  } while (0)

__device__ __forceinline__ uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

/// x[i] ~ approximately N(0, 1): sum of four hashed uniforms on [-0.5, 0.5), times sqrt(3).
__global__ void FillGaussianKernel(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = mix32((uint32_t)i ^ mix32(seed ^ (uint32_t)(i >> 32)));
    float s = 0.f;
    for (int j = 0; j < 4; ++j) {
      s += (h & 0xffff) * (1.f / 65536.f) - 0.5f;
      h = mix32(h + 0x9e3779b9u);
    }
    x[i] = __half_as_ushort(__float2half(s * 1.7320508f));
  }
}

void fill(uint16_t* x, int64_t n, uint32_t seed, cudaStream_t s) {
  FillGaussianKernel<<<1024, 256, 0, s>>>(x, n, seed);
  BENCH_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
T* dev_alloc(int64_t count, const char* what) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, (size_t)count * sizeof(T));
  if (e != cudaSuccess)
    BENCH_FAIL("cudaMalloc of %s (%.1f MB): %s", what, count * sizeof(T) / 1e6, cudaGetErrorString(e));
  return static_cast<T*>(p);
}

/// One role (keys or values) of a KIVI layer on the device.
struct Role {
  int32_t* codes = nullptr;
  uint16_t *scale = nullptr, *zero = nullptr, *res = nullptr;
  attention::QuantKV kv;
  double bytes = 0;  // what the fused kernel must read of this role
  void free_all() {
    BENCH_CUDA_CHECK(cudaFree(codes));
    BENCH_CUDA_CHECK(cudaFree(scale));
    BENCH_CUDA_CHECK(cudaFree(zero));
    BENCH_CUDA_CHECK(cudaFree(res));
  }
};

/// Quantize tokens [0, L - R) of full [B, H, L, D] (gathered into `scratch`, [B * H, Tq, D])
/// and copy tokens [L - R, L) into a contiguous fp16 residual [B, H, R, D].
Role build_role(const uint16_t* full, uint16_t* scratch, int64_t B, int64_t L, int bits, bool per_channel,
                cudaStream_t s) {
  const int64_t H = kH, D = kD, Tr = kResidual, Tq = L - Tr, G = kGroup, W = D * bits / 32;
  const int64_t ngroups = per_channel ? Tq / G : D / G;  // per (b, h): [Tq / G, D] or per token [D / G]
  const int64_t sc_per_head = per_channel ? ngroups * D : Tq * ngroups;
  Role r;
  r.codes = dev_alloc<int32_t>(B * H * Tq * W, "codes");
  r.scale = dev_alloc<uint16_t>(B * H * sc_per_head, "scale");
  r.zero = dev_alloc<uint16_t>(B * H * sc_per_head, "zero");
  r.res = dev_alloc<uint16_t>(B * H * Tr * D, "residual");
  // [B * H] rows of L * D elements -> the first Tq * D of each (quantizer input), the last Tr * D
  BENCH_CUDA_CHECK(cudaMemcpy2DAsync(scratch, Tq * D * 2, full, L * D * 2, Tq * D * 2, B * H,
                                     cudaMemcpyDeviceToDevice, s));
  BENCH_CUDA_CHECK(cudaMemcpy2DAsync(r.res, Tr * D * 2, full + Tq * D, L * D * 2, Tr * D * 2, B * H,
                                     cudaMemcpyDeviceToDevice, s));
  quant::GroupQuantParams p;
  p.x = scratch;
  p.out = nullptr;
  p.codes = r.codes;
  p.scale = r.scale;
  p.zero = r.zero;
  p.status = nullptr;  // inputs are finite by construction
  p.N = B * H;
  p.T = Tq;
  p.D = D;
  p.group = G;
  p.bits = bits;
  p.per_channel = per_channel;
  float* ws = nullptr;
  const int64_t ws_floats = quant::group_quantize_ws_floats(p, DTypeId::kFloat16);
  if (ws_floats > 0) ws = dev_alloc<float>(ws_floats, "group-quantize workspace");
  p.ws = ws;
  BENCH_CUDA_CHECK(quant::group_quantize_cuda(p, DTypeId::kFloat16, s));
  BENCH_CUDA_CHECK(cudaStreamSynchronize(s));
  if (ws) BENCH_CUDA_CHECK(cudaFree(ws));
  // the same fields, strides and group the torch binding (csrc/decode_attention.cpp make_role) sets
  attention::QuantKV& k = r.kv;
  k.codes = r.codes;
  k.scale = r.scale;
  k.zero = r.zero;
  k.codes_sh = Tq * W, k.codes_sb = H * Tq * W;
  k.scale_sh = sc_per_head, k.scale_sb = H * sc_per_head;
  k.Tq = Tq;
  k.group = G;
  k.bits = bits;
  k.per_channel = per_channel;
  k.residual = r.res;
  k.res_sh = Tr * D, k.res_sb = H * Tr * D;
  k.Tr = Tr;
  r.bytes = (double)B * H * (Tq * W * 4.0 + 2.0 * sc_per_head * 2.0 + Tr * D * 2.0);
  return r;
}

template <typename T>
std::vector<T> to_host(const T* d, int64_t count) {
  std::vector<T> h((size_t)count);
  BENCH_CUDA_CHECK(cudaMemcpy(h.data(), d, (size_t)count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

/// Host copy of batch `b` of a role, as a QuantKV whose batch stride is 0 (read with b = 0).
struct HostRole {
  std::vector<int32_t> codes;
  std::vector<uint16_t> scale, zero, res;
  attention::QuantKV kv;
  HostRole(const attention::QuantKV& d, int64_t b) : kv(d) {
    const int64_t H = kH;
    codes = to_host(d.codes + b * d.codes_sb, H * d.codes_sh);
    scale = to_host(d.scale + b * d.scale_sb, H * d.scale_sh);
    zero = to_host(d.zero + b * d.scale_sb, H * d.scale_sh);
    res = to_host(static_cast<const uint16_t*>(d.residual) + b * d.res_sb, H * d.res_sh);
    kv.codes = codes.data();
    kv.scale = scale.data();
    kv.zero = zero.data();
    kv.residual = res.data();
    kv.codes_sb = kv.scale_sb = kv.res_sb = 0;
  }
};

bool finite_half(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/// Relative L2 error of batch b of the device output vs the CPU twin on the same stored data.
double cpu_check(const attention::DecodeAttnParams& dp, const std::vector<uint16_t>& out_dev, int64_t b) {
  HostRole hk(dp.k, b), hv(dp.v, b);
  std::vector<uint16_t> q = to_host(static_cast<const uint16_t*>(dp.q) + b * dp.Hq * dp.D, dp.Hq * dp.D);
  std::vector<uint16_t> out((size_t)(dp.Hq * dp.D), 0);
  attention::DecodeAttnParams hp = dp;
  hp.k = hk.kv;
  hp.v = hv.kv;
  hp.q = q.data();
  hp.out = out.data();
  hp.B = 1;
  hp.ws = nullptr;
  std::vector<float> row, kbuf;
  for (int64_t h = 0; h < dp.H; ++h) attention::decode_attention_cpu<half_t>(hp, 0, h, row, kbuf);
  double num = 0, den = 0;
  for (int64_t i = 0; i < dp.Hq * dp.D; ++i) {
    const double r = half_bits_to_float(out[i]);
    const double o = half_bits_to_float(out_dev[b * dp.Hq * dp.D + i]);
    num += (o - r) * (o - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

std::vector<int64_t> parse_list(int& i, int argc, char** argv) {
  std::vector<int64_t> v;
  while (i + 1 < argc && argv[i + 1][0] != '-') {
    char* end = nullptr;
    const long long x = std::strtoll(argv[++i], &end, 10);
    if (*end != '\0' || x <= 0) BENCH_FAIL("bad value '%s' (positive integers expected)", argv[i]);
    v.push_back(x);
  }
  if (v.empty()) BENCH_FAIL("%s needs at least one value", argv[i]);
  return v;
}

void print_header() {
  std::printf("| benchmark | B | L | samples | GPU time (us) | noise | MB read | GB/s | %% of copy | "
              "speedup vs FP16 bytes | check |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
}

void print_row(const char* name, int64_t B, int64_t L, const kvq_bench::Result& r, double bytes, double copy_bw,
               double ref_us, const std::string& check) {
  const double bw = bytes / (r.median_us * 1e-6);
  std::printf("| %s | %lld | %lld | %d | %.2f | %.1f%% | %.1f | %.0f | %.1f%% | %.2fx | %s |\n", name, (long long)B,
              (long long)L, r.samples, r.median_us, 100 * r.noise, bytes / 1e6, bw / 1e9, 100 * bw / copy_bw,
              ref_us / r.median_us, check.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> batches = {1, 8}, lens = {4096, 32768};
  bool check = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--batch")) {
      batches = parse_list(i, argc, argv);
    } else if (!std::strcmp(argv[i], "--len")) {
      lens = parse_list(i, argc, argv);
    } else if (!std::strcmp(argv[i], "--no-check")) {
      check = false;
    } else {
      std::fprintf(stderr, "usage: %s [--batch B...] [--len L...] [--no-check]\n", argv[0]);
      return 2;
    }
  }
  for (int64_t L : lens)
    if (L < kResidual + kGroup || (L - kResidual) % kGroup != 0)
      BENCH_FAIL("--len %lld: L - %lld must be a positive multiple of the key group %lld", (long long)L,
                 (long long)kResidual, (long long)kGroup);

  kvq_bench::Harness h;
  cudaStream_t s = h.stream();
  const double copy_bw = h.copy_bandwidth((size_t)1 << 30);
  std::printf("# decode attention (C++), %s, Hq=%lld H=%lld D=%lld fp16, KIVI G=%lld R=%lld; "
              "device-to-device copy %.0f GB/s (read + write)\n",
              h.device_name().c_str(), (long long)kHq, (long long)kH, (long long)kD, (long long)kGroup,
              (long long)kResidual, copy_bw / 1e9);
  print_header();

  struct Preset { const char* name; int bits; };
  const Preset presets[] = {{"fused kivi-2", 2}, {"fused kivi-4", 4}};
  bool all_ok = true;
  for (int64_t B : batches) {
    for (int64_t L : lens) {
      const int64_t n_kv = B * kH * L * kD;
      const double fp16_bytes = 2.0 * n_kv * 2.0;  // K and V
      // FP16 bytes reference: copy half the FP16 KV (read + write = the KV size)
      kvq_bench::Result ref;
      {
        uint16_t* a = dev_alloc<uint16_t>(n_kv, "copy source");
        uint16_t* c = dev_alloc<uint16_t>(n_kv, "copy destination");
        BENCH_CUDA_CHECK(cudaMemset(a, 1, (size_t)n_kv * 2));
        ref = h.time([&](cudaStream_t st) {
          BENCH_CUDA_CHECK(cudaMemcpyAsync(c, a, (size_t)n_kv * 2, cudaMemcpyDeviceToDevice, st));
        });
        BENCH_CUDA_CHECK(cudaFree(a));
        BENCH_CUDA_CHECK(cudaFree(c));
      }
      print_row("FP16 KV bytes (D2D copy)", B, L, ref, fp16_bytes, copy_bw, ref.median_us, "-");

      uint16_t* q = dev_alloc<uint16_t>(B * kHq * kD, "q");
      uint16_t* out = dev_alloc<uint16_t>(B * kHq * kD, "out");
      fill(q, B * kHq * kD, 7u, s);
      for (const Preset& pr : presets) {
        Role kr, vr;
        {
          uint16_t* full = dev_alloc<uint16_t>(n_kv, "K/V [B, H, L, D]");
          uint16_t* scratch = dev_alloc<uint16_t>(B * kH * (L - kResidual) * kD, "quantizer input");
          fill(full, n_kv, 1u, s);  // same K and V for every preset
          kr = build_role(full, scratch, B, L, pr.bits, /*per_channel=*/true, s);
          fill(full, n_kv, 2u, s);
          vr = build_role(full, scratch, B, L, pr.bits, /*per_channel=*/false, s);
          BENCH_CUDA_CHECK(cudaFree(full));
          BENCH_CUDA_CHECK(cudaFree(scratch));
        }
        // as csrc/decode_attention.cpp (prepare_decode_attention + finish_decode_attention_call)
        // and csrc/cuda_bindings.cpp (run_decode_attention_cuda) fill it
        attention::DecodeAttnParams p;
        p.q = q;
        p.out = out;
        p.mask = nullptr;
        p.mask_sb = 0;
        p.k = kr.kv;
        p.v = vr.kv;
        p.B = B, p.H = kH, p.Hq = kHq, p.D = kD, p.T = L;
        p.scale = (float)(1.0 / std::sqrt((double)kD));
        p.dtype_bytes = 2;
        p.gear = false;
        p.splits = attention::decode_attention_splits(p, DTypeId::kFloat16);
        if (p.splits < 1) BENCH_FAIL("decode_attention_splits returned %d", p.splits);
        float* ws = dev_alloc<float>(B * kHq * p.splits * (kD + 2), "split workspace");
        p.ws = ws;

        // one launch into a NaN-filled output (0xFFFF), copied back and scanned
        BENCH_CUDA_CHECK(cudaMemsetAsync(out, 0xff, (size_t)B * kHq * kD * 2, s));
        BENCH_CUDA_CHECK(attention::decode_attention_cuda(p, DTypeId::kFloat16, s));
        BENCH_CUDA_CHECK(cudaStreamSynchronize(s));
        BENCH_CUDA_CHECK(cudaGetLastError());
        const std::vector<uint16_t> o = to_host(out, B * kHq * kD);
        int64_t bad = 0, nonzero = 0;
        for (uint16_t x : o) bad += !finite_half(x), nonzero += (x & 0x7fffu) != 0;
        if (bad > 0)
          BENCH_FAIL("%s B=%lld L=%lld: %lld of %lld outputs are NaN/Inf (unwritten or broken launch)", pr.name,
                     (long long)B, (long long)L, (long long)bad, (long long)o.size());
        if (nonzero == 0) BENCH_FAIL("%s B=%lld L=%lld: the output is all zeros", pr.name, (long long)B, (long long)L);
        char note[96];
        std::snprintf(note, sizeof note, "finite, splits=%d", p.splits);
        std::string chk = note;
        if (check) {
          const double err = cpu_check(p, o, B - 1);
          const bool ok = err < kTol;
          all_ok &= ok;
          std::snprintf(note, sizeof note, "; b=%lld vs CPU rel err %.1e%s", (long long)(B - 1), err,
                        ok ? "" : " FAIL");
          chk += note;
        }

        const auto r = h.time([&](cudaStream_t st) {
          BENCH_CUDA_CHECK(attention::decode_attention_cuda(p, DTypeId::kFloat16, st));
        });
        print_row(pr.name, B, L, r, kr.bytes + vr.bytes, copy_bw, ref.median_us, chk);
        BENCH_CUDA_CHECK(cudaFree(ws));
        kr.free_all();
        vr.free_all();
      }
      BENCH_CUDA_CHECK(cudaFree(q));
      BENCH_CUDA_CHECK(cudaFree(out));
    }
  }
  if (!all_ok) {
    std::fprintf(stderr, "error: a fused output differs from the CPU twin by more than %.0e (see 'check')\n", kTol);
    return 1;
  }
  return 0;
}
