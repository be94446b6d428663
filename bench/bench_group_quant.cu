// C++ microbenchmark of the group quantize/dequantize kernels (nvbench-style report).
//   bench_group_quant [B H T D]     default 8 8 4096 128 (fp16)
#include <cstdlib>
#include <string>

#include "bench_harness.cuh"
#include "kvq/cuda_api.h"

using namespace kvq;

__global__ void FillKernel(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    float v = ((h & 0xffff) / 65535.0f - 0.5f) * 8.0f;  // uniform in [-4, 4]
    x[i] = __half_as_ushort(__float2half(v));
  }
}

int main(int argc, char** argv) {
  int64_t B = 8, H = 8, T = 4096, D = 128;
  if (argc == 5) {
    B = std::atoll(argv[1]);
    H = std::atoll(argv[2]);
    T = std::atoll(argv[3]);
    D = std::atoll(argv[4]);
  }
  const int64_t n = B * H * T * D;
  kvq_bench::Harness h;
  uint16_t *x, *zero, *scale, *out;
  int32_t* codes;
  BENCH_CUDA_CHECK(cudaMalloc(&x, n * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&out, n * 2));
  BENCH_CUDA_CHECK(cudaMalloc(&codes, n));       // enough for 8-bit codes
  BENCH_CUDA_CHECK(cudaMalloc(&scale, n * 2 / 8));  // enough for G >= 8
  BENCH_CUDA_CHECK(cudaMalloc(&zero, n * 2 / 8));
  FillKernel<<<1024, 256>>>(x, n, 1234u);
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  const double copy_bw = h.copy_bandwidth(n * 2);
  std::printf("# %s, device-to-device copy %.0f GB/s (read + write)\n", h.device_name().c_str(), copy_bw / 1e9);
  const std::string shape = std::to_string(B) + "x" + std::to_string(H) + "x" + std::to_string(T) + "x" +
                            std::to_string(D) + " fp16";
  kvq_bench::print_header();
  struct Case { const char* name; bool per_channel; int64_t group; int bits; };
  const Case cases[] = {{"quantize key per-channel G=32 2b", true, 32, 2},
                        {"quantize key per-channel G=64 2b", true, 64, 2},
                        {"quantize key per-channel G=128 2b", true, 128, 2},
                        {"quantize key KCVT G=T 2b", true, T, 2},
                        {"quantize key KCVT G=T 4b", true, T, 4},
                        {"quantize key per-channel G=32 4b", true, 32, 4},
                        {"quantize value per-token G=32 2b", false, 32, 2},
                        {"quantize value per-token G=32 4b", false, 32, 4},
                        {"quantize value per-token G=D 4b", false, D, 4}};
  for (const Case& c : cases) {
    quant::GroupQuantParams p;
    p.x = x;
    p.codes = codes;
    p.scale = scale;
    p.zero = zero;
    p.status = nullptr;
    p.N = B * H;
    p.T = T;
    p.D = D;
    p.group = c.group;
    p.bits = c.bits;
    p.per_channel = c.per_channel;
    float* ws = nullptr;  // scratch of the split-T (KCVT) path
    const int64_t ws_floats = quant::group_quantize_ws_floats(p, DTypeId::kFloat16);
    if (ws_floats > 0) BENCH_CUDA_CHECK(cudaMalloc(&ws, ws_floats * sizeof(float)));
    p.ws = ws;
    const double groups = c.per_channel ? (double)B * H * (T / c.group) * D : (double)B * H * T * (D / c.group);
    const double bytes = n * 2.0 + n * c.bits / 8.0 + groups * 4.0;
    auto r = h.time([&](cudaStream_t s) { BENCH_CUDA_CHECK(quant::group_quantize_cuda(p, DTypeId::kFloat16, s)); });
    kvq_bench::print_row(c.name, shape, r, bytes, copy_bw);
    p.out = out;
    auto rd = h.time([&](cudaStream_t s) { BENCH_CUDA_CHECK(quant::group_dequantize_cuda(p, DTypeId::kFloat16, s)); });
    kvq_bench::print_row(std::string("de") + c.name, shape, rd, bytes, copy_bw);
    if (ws) cudaFree(ws);
  }
  cudaFree(x);
  cudaFree(out);
  cudaFree(codes);
  cudaFree(scale);
  cudaFree(zero);
  return 0;
}
