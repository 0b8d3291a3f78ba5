// The CUDA runtime, found at run time: nothing from CUDA is needed to build jaxascend.
//
// CudaRuntime() dlopen()s libcudart (one JAX already loaded first, then the usual sonames, or
// the path in JAXASCEND_CUDART) and resolves the few entry points the arena and the
// pinned-memory check need. Every call is guarded: with no runtime or no device the arena
// simply stays unpinned and says why.
#pragma once

#include <cstddef>
#include <string>

namespace jaxascend {

struct CudaRuntimeApi {
  // cudaError_t is an int-sized enum; 0 is cudaSuccess.
  int (*get_device_count)(int* count) = nullptr;
  int (*host_register)(void* ptr, size_t size, unsigned int flags) = nullptr;
  int (*host_unregister)(void* ptr) = nullptr;
  const char* (*get_error_string)(int error) = nullptr;
  int (*malloc)(void** ptr, size_t size) = nullptr;
  int (*free)(void* ptr) = nullptr;
  int (*memcpy)(void* dst, const void* src, size_t count, int kind) = nullptr;
  int (*device_synchronize)() = nullptr;

  bool loaded = false;     // libcudart was found and every symbol resolved
  int device_count = 0;    // devices visible (0 when the driver is missing)
  std::string library;     // which library was loaded
  std::string status;      // one line: what was found, or why nothing was

  std::string ErrorString(int error) const;
};

constexpr unsigned int kCudaHostRegisterPortable = 1;  // pinned for every CUDA context
constexpr int kCudaMemcpyHostToDevice = 1;
constexpr int kCudaMemcpyDeviceToHost = 2;

// Loads the runtime once per process (thread-safe) and returns the result.
const CudaRuntimeApi& CudaRuntime();

}  // namespace jaxascend
