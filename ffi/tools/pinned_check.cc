// Checks the arena's pinned-memory path on a machine with an NVIDIA GPU (built and run by
// scripts/gpu_check.sh; not part of the Python extension).
//
// Creates an arena exactly as jaxascend does (posix_memalign + mlock + cudaHostRegister through
// the run-time-loaded libcudart), then does a host->device->host round trip with cudaMemcpy
// through the dlsym'd entry points and verifies every byte. It also times H2D copies from the
// pinned arena and from an ordinary (pageable) buffer: DMA from registered memory should be
// clearly faster. Prints one JSON object. Exit status: 0 when the path works, or when there is
// no CUDA runtime/device to test (then "skipped" says why); 1 when a device is present but
// registration or the round trip fails.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ssd_arena.h"
#include "ssd_cuda_host.h"

using namespace jaxascend;

namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return out + "\"";
}

// Seconds per H2D copy of `bytes` from `host`, best of `reps`.
double TimeH2D(const CudaRuntimeApi& cuda, void* dev, const void* host, size_t bytes, int reps, int* err) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    *err = cuda.memcpy(dev, host, bytes, kCudaMemcpyHostToDevice);
    if (*err == 0) *err = cuda.device_synchronize();
    if (*err != 0) return 0.0;
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  const size_t bytes = mib << 20;
  const CudaRuntimeApi& cuda = CudaRuntime();
  std::shared_ptr<Arena> arena;
  const Status created = Arena::Create({static_cast<int64_t>(bytes), true, true},
                                       {{"check", static_cast<int64_t>(bytes), 1}}, &arena);
  std::printf("{\n  \"cuda_runtime\": %s,\n  \"device_count\": %d,\n", Quote(cuda.status).c_str(), cuda.device_count);
  if (!created.ok()) {
    std::printf("  \"ok\": false,\n  \"error\": %s\n}\n", Quote(created.message()).c_str());
    return 1;
  }
  std::printf("  \"arena_bytes\": %lld,\n  \"locked\": %s,\n  \"lock_status\": %s,\n  \"pinned\": %s,\n"
              "  \"pin_status\": %s,\n",
              static_cast<long long>(arena->capacity()), arena->locked() ? "true" : "false",
              Quote(arena->lock_status()).c_str(), arena->pinned() ? "true" : "false",
              Quote(arena->pin_status()).c_str());
  if (!cuda.loaded || cuda.device_count == 0) {
    // A GPU device node with no usable device means a broken setup (e.g. a runtime newer than
    // the driver), not a machine without a GPU: that must not pass as "skipped".
    if (access("/dev/nvidia0", F_OK) == 0) {
      std::printf("  \"ok\": false,\n  \"error\": %s\n}\n",
                  Quote("/dev/nvidia0 exists but the CUDA runtime sees no usable device").c_str());
      return 1;
    }
    std::printf("  \"ok\": true,\n  \"skipped\": %s\n}\n",
                Quote("no CUDA runtime or device here, the pinned path was not exercised").c_str());
    return 0;
  }
  if (!arena->pinned()) {
    std::printf("  \"ok\": false,\n  \"error\": %s\n}\n", Quote("cudaHostRegister did not pin the arena").c_str());
    return 1;
  }
  uint8_t* host = arena->slots()[0].data;
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  void* dev = nullptr;
  int err = cuda.malloc(&dev, bytes);
  std::string error;
  double pinned_s = 0.0, pageable_s = 0.0;
  size_t mismatches = 0;
  if (err != 0) {
    error = "cudaMalloc: " + cuda.ErrorString(err);
  } else {
    pinned_s = TimeH2D(cuda, dev, host, bytes, 5, &err);
    if (err == 0) {
      std::memset(host, 0, bytes);
      err = cuda.memcpy(host, dev, bytes, kCudaMemcpyDeviceToHost);
    }
    if (err != 0) {
      error = "cudaMemcpy with the pinned arena: " + cuda.ErrorString(err);
    } else {
      for (size_t i = 0; i < bytes; ++i) mismatches += host[i] != static_cast<uint8_t>((i * 2654435761u) >> 13);
      std::vector<uint8_t> pageable(bytes, 1);
      pageable_s = TimeH2D(cuda, dev, pageable.data(), bytes, 5, &err);
      if (err != 0) error = "cudaMemcpy from pageable memory: " + cuda.ErrorString(err);
    }
    cuda.free(dev);
  }
  const bool ok = error.empty() && mismatches == 0;
  std::printf("  \"round_trip_bytes\": %zu,\n  \"round_trip_mismatches\": %zu,\n", bytes, mismatches);
  std::printf("  \"h2d_pinned_gbps\": %.2f,\n  \"h2d_pageable_gbps\": %.2f,\n",
              pinned_s > 0 ? bytes / pinned_s / 1e9 : 0.0, pageable_s > 0 ? bytes / pageable_s / 1e9 : 0.0);
  std::printf("  \"ok\": %s,\n  \"error\": %s\n}\n", ok ? "true" : "false", Quote(error).c_str());
  return ok ? 0 : 1;
}
