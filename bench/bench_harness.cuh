// A small nvbench-style timing harness (used where NVIDIA nvbench cannot be built: it
// needs CMake >= 3.30 and NVML).  Reports what nvbench reports: GPU time (median of
// samples, CUDA events), noise (relative stddev), global-memory bandwidth and its
// fraction of a device-to-device copy measured in the same process, with an L2 flush
// before every sample.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define BENCH_CUDA_CHECK(expr)                                                        \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,              \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace kvq_bench {

struct Result {
  double median_us = 0, mean_us = 0, noise = 0;
  int samples = 0;
};

class Harness {
 public:
  Harness() {
    BENCH_CUDA_CHECK(cudaStreamCreate(&stream_));
    int dev = 0;
    BENCH_CUDA_CHECK(cudaGetDevice(&dev));
    BENCH_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes_, cudaDevAttrL2CacheSize, dev));
    BENCH_CUDA_CHECK(cudaMalloc(&flush_, 2 * (size_t)l2_bytes_));
    BENCH_CUDA_CHECK(cudaEventCreate(&start_));
    BENCH_CUDA_CHECK(cudaEventCreate(&stop_));
    cudaDeviceProp prop;
    BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    device_name_ = prop.name;
  }
  ~Harness() {
    cudaFree(flush_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }
  cudaStream_t stream() const { return stream_; }
  const std::string& device_name() const { return device_name_; }

  /// \brief Time `launch(stream)`: warm-up, then samples until both min_samples and
  /// min_seconds of GPU time are reached; L2 flushed before each sample.
  template <typename F>
  Result time(F&& launch, int min_samples = 50, double min_seconds = 0.25) {
    for (int i = 0; i < 3; ++i) launch(stream_);
    BENCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    BENCH_CUDA_CHECK(cudaGetLastError());
    std::vector<double> us;
    double total = 0;
    while ((int)us.size() < min_samples || total < min_seconds * 1e6) {
      BENCH_CUDA_CHECK(cudaMemsetAsync(flush_, (int)us.size() & 0xff, 2 * (size_t)l2_bytes_, stream_));
      BENCH_CUDA_CHECK(cudaEventRecord(start_, stream_));
      launch(stream_);
      BENCH_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      BENCH_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      us.push_back(ms * 1e3);
      total += ms * 1e3;
      if (us.size() > 10000) break;
    }
    BENCH_CUDA_CHECK(cudaGetLastError());
    Result r;
    r.samples = (int)us.size();
    std::vector<double> s = us;
    std::sort(s.begin(), s.end());
    r.median_us = s[s.size() / 2];
    for (double v : us) r.mean_us += v;
    r.mean_us /= us.size();
    double var = 0;
    for (double v : us) var += (v - r.mean_us) * (v - r.mean_us);
    r.noise = std::sqrt(var / us.size()) / r.mean_us;
    return r;
  }

  /// \brief Device-to-device copy bandwidth (bytes read + written per second).
  double copy_bandwidth(size_t bytes) {
    void *a, *b;
    BENCH_CUDA_CHECK(cudaMalloc(&a, bytes));
    BENCH_CUDA_CHECK(cudaMalloc(&b, bytes));
    BENCH_CUDA_CHECK(cudaMemset(a, 1, bytes));
    Result r = time([&](cudaStream_t s) { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s); });
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (r.median_us * 1e-6);
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_, stop_;
  int l2_bytes_ = 0;
  void* flush_ = nullptr;
  std::string device_name_;
};

inline void print_header() {
  std::printf("| benchmark | shape | samples | GPU time (us) | noise | GB/s | %% of copy |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
}

inline void print_row(const std::string& name, const std::string& shape, const Result& r,
                      double bytes, double copy_bw) {
  const double bw = bytes / (r.median_us * 1e-6);
  std::printf("| %s | %s | %d | %.2f | %.1f%% | %.0f | %.1f%% |\n", name.c_str(), shape.c_str(),
              r.samples, r.median_us, 100 * r.noise, bw / 1e9, 100 * bw / copy_bw);
}

}  // namespace kvq_bench
