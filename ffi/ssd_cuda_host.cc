// Run-time loading of libcudart; see ssd_cuda_host.h.
#include "ssd_cuda_host.h"

#include <dlfcn.h>

#include <cstdlib>

namespace jaxascend {
namespace {

// Sonames tried in order. RTLD_NOLOAD first: if JAX's GPU plugin already loaded a runtime,
// pinning through that same runtime keeps one CUDA context in the process.
const char* const kSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  return *out != nullptr;
}

CudaRuntimeApi Load() {
  CudaRuntimeApi api;
  void* lib = nullptr;
  if (const char* path = std::getenv("JAXASCEND_CUDART")) {
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib) api.library = path;
  }
  for (int pass = 0; pass < 2 && !lib; ++pass) {
    for (const char* soname : kSonames) {
      lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (lib) {
        api.library = soname;
        break;
      }
    }
  }
  if (!lib) {
    api.status = "no CUDA runtime found (dlopen libcudart.so*: not found)";
    return api;
  }
  const bool all = Resolve(lib, "cudaGetDeviceCount", &api.get_device_count) &&
                   Resolve(lib, "cudaHostRegister", &api.host_register) &&
                   Resolve(lib, "cudaHostUnregister", &api.host_unregister) &&
                   Resolve(lib, "cudaGetErrorString", &api.get_error_string) &&
                   Resolve(lib, "cudaMalloc", &api.malloc) && Resolve(lib, "cudaFree", &api.free) &&
                   Resolve(lib, "cudaMemcpy", &api.memcpy) &&
                   Resolve(lib, "cudaDeviceSynchronize", &api.device_synchronize);
  if (!all) {
    api.status = "CUDA runtime " + api.library + " lacks an expected symbol (cudaHostRegister, ...)";
    return api;
  }
  api.loaded = true;
  const int err = api.get_device_count(&api.device_count);
  if (err != 0) {
    api.device_count = 0;
    api.status = "CUDA runtime " + api.library + " found, but no usable device (cudaGetDeviceCount: " +
                 api.ErrorString(err) + ")";
  } else if (api.device_count == 0) {
    api.status = "CUDA runtime " + api.library + " found, but it sees no device";
  } else {
    api.status = "CUDA runtime " + api.library + " found, " + std::to_string(api.device_count) + " device(s)";
  }
  return api;
}

}  // namespace

std::string CudaRuntimeApi::ErrorString(int error) const {
  const char* text = get_error_string ? get_error_string(error) : nullptr;
  return "error " + std::to_string(error) + (text ? std::string(", ") + text : std::string());
}

const CudaRuntimeApi& CudaRuntime() {
  static const CudaRuntimeApi api = Load();
  return api;
}

}  // namespace jaxascend
