// The optimizer-state shape the tiering benchmarks share: TIDEPOOL_BENCH_BYTES of tensors
// (default 1 GiB on the cuda backend, 256 MiB on the host backend) whose sizes are drawn
// log-uniformly from 64 KiB to 64 MiB with a fixed seed (many small tensors, most bytes in
// large ones), and the backend choice TIDEPOOL_BENCH_BACKEND=host|cuda (default: cuda when
// a GPU exists).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/backend.h"

namespace tidepool::bench_state {

inline constexpr std::size_t kMinTensor = std::size_t{64} << 10;
inline constexpr std::size_t kMaxTensor = std::size_t{64} << 20;
inline constexpr std::size_t kTensorAlign = 4096;

// "268435456", "256M", "1G", "512K" (powers of 1024).
inline std::size_t parse_bytes(const char* name, const std::string& text) {
  std::size_t pos = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string(name) + "=" + text + " is not a byte count");
  }
  const std::string unit = text.substr(pos);
  int shift = 0;
  if (unit == "K" || unit == "KiB") shift = 10;
  else if (unit == "M" || unit == "MiB") shift = 20;
  else if (unit == "G" || unit == "GiB") shift = 30;
  else if (!unit.empty())
    throw std::invalid_argument(std::string(name) + "=" + text + ": unknown unit");
  const std::size_t bytes = static_cast<std::size_t>(n) << shift;
  if (bytes < kMinTensor) {
    throw std::invalid_argument(std::string(name) + "=" + text + " is below one 64 KiB tensor");
  }
  return bytes / kTensorAlign * kTensorAlign;
}

inline BackendKind choose_backend() {
  if (const char* env = std::getenv("TIDEPOOL_BENCH_BACKEND")) {
    const std::string v = env;
    if (v == "host") return BackendKind::host;
    if (v == "cuda") return BackendKind::cuda;
    throw std::invalid_argument("TIDEPOOL_BENCH_BACKEND=" + v + ": expected host or cuda");
  }
  return cuda_device_count() > 0 ? BackendKind::cuda : BackendKind::host;
}

inline std::size_t choose_total_bytes(BackendKind kind) {
  if (const char* env = std::getenv("TIDEPOOL_BENCH_BYTES"))
    return parse_bytes("TIDEPOOL_BENCH_BYTES", env);
  return kind == BackendKind::cuda ? std::size_t{1} << 30 : std::size_t{256} << 20;
}

// TIDEPOOL_BENCH_MODELED_LINK_GBPS (host backend): GB/s each way of a modelled PCIe link
// (link_model_backend.h) the benchmark's backend sits behind; 0 (the default): none.
inline double modeled_link_bytes_per_second() {
  const char* env = std::getenv("TIDEPOOL_BENCH_MODELED_LINK_GBPS");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const double gbps = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(gbps >= 0)) {
    throw std::invalid_argument(std::string("TIDEPOOL_BENCH_MODELED_LINK_GBPS=") + env +
                                ": expected a rate in GB/s");
  }
  return gbps * 1e9;
}

// Sizes in [kMinTensor, kMaxTensor], multiples of 4 KiB, log-uniform, summing to `total`.
inline std::vector<std::size_t> mixed_tensor_sizes(std::size_t total) {
  std::mt19937_64 rng(20261129);
  std::uniform_real_distribution<double> log_size(std::log(double(kMinTensor)),
                                                  std::log(double(kMaxTensor)));
  std::vector<std::size_t> sizes;
  std::size_t remaining = total;
  while (remaining > 0) {
    std::size_t s = static_cast<std::size_t>(std::exp(log_size(rng))) / kTensorAlign * kTensorAlign;
    s = std::clamp(s, kMinTensor, kMaxTensor);
    if (s >= remaining) {
      s = remaining;
    } else if (remaining - s < kMinTensor) {
      // Never leave a sliver: take all of it, or leave exactly one smallest tensor.
      s = remaining <= kMaxTensor ? remaining : remaining - kMinTensor;
    }
    sizes.push_back(s);
    remaining -= s;
  }
  return sizes;
}

}  // namespace tidepool::bench_state
