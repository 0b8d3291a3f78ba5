// The numpy entry of the fused AdamW kernel (optim_adam.h): jaxascend._native.adamw_update, in
// place on numpy arrays (arena views when streaming), with the GIL released; it checks its
// arguments here and runs RunFusedAdamW, as the FFI target (optim_adam_ffi.cc) does. Plus the
// kernel's queries (adamw_supported_isas, adamw_default_isa, compute_pool_workers) and
// adamw_bandwidth_probe, the memory-bandwidth yardstick of scripts/bench_adam.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optim_adam.h"
#include "optim_compute_pool.h"
#include "registry.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

using HostArray = nb::ndarray<nb::device::cpu>;              // writable
using HostArrayRO = nb::ndarray<nb::ro, nb::device::cpu>;    // may be read-only

bool ParseElem(const std::string& name, AdamElem* e) {
  if (name == "float32") *e = AdamElem::kF32;
  else if (name == "float16") *e = AdamElem::kF16;
  else if (name == "bfloat16") *e = AdamElem::kBF16;
  else return false;
  return true;
}

template <typename Array>
bool IsCContiguous(const Array& a) {
  if (a.size() == 0) return true;  // strides of an empty array are arbitrary
  int64_t expected = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(d));
  }
  return true;
}

struct ArrayView {
  const char* name;
  const void* data;
  int64_t count;
  size_t itemsize;
};

// Throws ValueError naming the argument when `a` is not a C-contiguous array of `itemsize`-byte
// elements (and, when float32_required, of dtype float32).
template <typename Array>
ArrayView CheckArray(const char* name, const Array& a, size_t itemsize, bool float32_required) {
  if (!IsCContiguous(a)) throw nb::value_error((std::string("adamw: ") + name +
                                                " must be C-contiguous").c_str());
  const nb::dlpack::dtype dt = a.dtype();
  const size_t bytes = dt.bits / 8;
  if (bytes != itemsize || (float32_required && dt != nb::dtype<float>())) {
    throw nb::value_error((std::string("adamw: ") + name + " must hold " +
                           (float32_required ? "float32" : std::to_string(itemsize) + "-byte") +
                           " elements, got a " + std::to_string(bytes) + "-byte dtype")
                              .c_str());
  }
  return {name, a.data(), static_cast<int64_t>(a.size()), itemsize};
}

bool ParseState(const std::string& name, AdamState* state) {
  for (AdamState candidate : {AdamState::kF32, AdamState::kBF16, AdamState::kInt8}) {
    if (name == AdamStateName(candidate)) {
      *state = candidate;
      return true;
    }
  }
  return false;
}

// The kernel's choices by the names Python passes.
struct AdamChoices {
  AdamElem grad_type;
  AdamElem param_type;
  AdamIsa isa;
  AdamState state;
  AdamRounding rounding;
};

// Parses adamw_update's names and checks rounding_index, throwing ValueError for the first bad one.
AdamChoices ParseAdamChoices(const std::string& grad_dtype, const std::string& param_dtype,
                             const std::string& isa_name, const std::string& state_dtype,
                             const std::string& rounding, int64_t rounding_index) {
  AdamElem grad_type, param_type;
  if (!ParseElem(grad_dtype, &grad_type)) {
    throw nb::value_error(("adamw: grad_dtype '" + grad_dtype +
                           "' is not supported (float16, bfloat16, float32)").c_str());
  }
  if (!ParseElem(param_dtype, &param_type)) {
    throw nb::value_error(("adamw: param_dtype '" + param_dtype +
                           "' is not supported (float16, bfloat16, float32)").c_str());
  }
  AdamIsa isa;
  if (!ParseAdamIsa(isa_name, &isa)) {
    throw nb::value_error(("adamw: isa '" + isa_name +
                           "' is not one of auto, scalar, avx2, avx512").c_str());
  }
  AdamState state;
  if (!ParseState(state_dtype, &state)) {
    throw nb::value_error(("adamw: state_dtype '" + state_dtype +
                           "' is not one of float32, bfloat16, int8").c_str());
  }
  if (rounding != "nearest" && rounding != "stochastic") {
    throw nb::value_error(("adamw: rounding '" + rounding + "' is not one of nearest, stochastic").c_str());
  }
  if (rounding_index < 0) {
    throw nb::value_error(("adamw: rounding_index=" + std::to_string(rounding_index) + " is negative").c_str());
  }
  return {grad_type, param_type, isa, state,
          rounding == "stochastic" ? AdamRounding::kStochastic : AdamRounding::kNearest};
}

// The master's format by the names Python passes ("float32"; "bfloat16" with "compensated" or
// "stochastic"; a float32 master ignores its rounding), throwing ValueError for a bad one.
AdamMaster ParseMaster(const std::string& dtype, const std::string& rounding) {
  if (dtype == "float32") return AdamMaster::kF32;
  if (dtype != "bfloat16") {
    throw nb::value_error(("adamw: master_dtype '" + dtype + "' is not one of float32, bfloat16").c_str());
  }
  if (rounding == "compensated") return AdamMaster::kBF16Compensated;
  if (rounding == "stochastic") return AdamMaster::kBF16Stochastic;
  throw nb::value_error(("adamw: master_rounding '" + rounding +
                         "' is not one of compensated, stochastic (a bfloat16 master)").c_str());
}

// A bfloat16 master's companion: n 2-byte elements (the float32 master's low halves) when
// compensated, absent otherwise; appended to `views` for the overlap check.
void CheckComp(AdamMaster master, const std::optional<HostArray>& comp, int64_t n, std::vector<ArrayView>* views) {
  if (master != AdamMaster::kBF16Compensated) {
    if (comp) throw nb::value_error("adamw: comp is only for a compensated bfloat16 master");
    return;
  }
  if (!comp) throw nb::value_error("adamw: a compensated bfloat16 master needs comp");
  const ArrayView c = CheckArray("comp", *comp, 2, false);
  if (c.count != n) throw nb::value_error(AdamCountMismatch("comp", c.count, n).c_str());
  views->push_back(c);
}

// The int8 state's block size and its m_scale/v_scale (one float32 per block of the n elements),
// appended to `views` for the overlap check.
void CheckInt8Scales(const std::optional<HostArray>& m_scale, const std::optional<HostArray>& v_scale,
                     int64_t block, int64_t n, std::vector<ArrayView>* views) {
  if (block < kAdamMinBlock || block > kAdamMaxBlock || (block & (block - 1)) != 0) {
    throw nb::value_error(("adamw: int8 state block=" + std::to_string(block) +
                           " must be a power of two in [" + std::to_string(kAdamMinBlock) + ", " +
                           std::to_string(kAdamMaxBlock) + "]").c_str());
  }
  if (!m_scale || !v_scale) throw nb::value_error("adamw: int8 state needs m_scale and v_scale");
  const int64_t blocks = (n + block - 1) / block;
  for (const ArrayView& a : {CheckArray("m_scale", *m_scale, 4, true), CheckArray("v_scale", *v_scale, 4, true)}) {
    if (a.count != blocks) {
      throw nb::value_error((std::string("adamw: ") + a.name + " has " + std::to_string(a.count) +
                             " scales but " + std::to_string(n) + " elements in blocks of " +
                             std::to_string(block) + " need " + std::to_string(blocks)).c_str());
    }
    views->push_back(a);
  }
}

// In place means each buffer is read and written by itself only; two arguments sharing
// memory would read values another stream has already overwritten. The exception: a bfloat16
// master and params_out may be one buffer (both receive the same bits), `alias_ok` names them.
void CheckNoOverlap(const std::vector<ArrayView>& views, const char* alias_ok[2] = nullptr) {
  for (size_t i = 0; i < views.size(); ++i) {
    for (size_t j = i + 1; j < views.size(); ++j) {
      if (alias_ok != nullptr && views[i].name == alias_ok[0] && views[j].name == alias_ok[1] &&
          views[i].data == views[j].data && views[i].count == views[j].count) {
        continue;
      }
      const auto* a = static_cast<const char*>(views[i].data);
      const auto* b = static_cast<const char*>(views[j].data);
      const int64_t a_bytes = views[i].count * static_cast<int64_t>(views[i].itemsize);
      const int64_t b_bytes = views[j].count * static_cast<int64_t>(views[j].itemsize);
      if (a_bytes > 0 && b_bytes > 0 && a < b + b_bytes && b < a + a_bytes) {
        throw nb::value_error((std::string("adamw: ") + views[i].name + " and " + views[j].name +
                               " overlap in memory")
                                  .c_str());
      }
    }
  }
}

// Points b at a bfloat16 master's bits and companion (both in place); a float32 master is
// already there.
void SetMaster(AdamBuffers* b, AdamMaster master_type, void* master, void* comp) {
  b->master_type = master_type;
  if (master_type == AdamMaster::kF32) return;
  b->master16_in = b->master16_out = static_cast<uint16_t*>(master);
  b->comp_in = b->comp_out = static_cast<uint16_t*>(comp);
}

void AdamWUpdateNumpy(HostArray master, HostArray m, HostArray v, HostArrayRO grad,
                      HostArray params_out, HostArrayRO scalars, const std::string& grad_dtype,
                      const std::string& param_dtype, int threads, const std::string& isa_name,
                      const std::string& state_dtype, std::optional<HostArray> m_scale,
                      std::optional<HostArray> v_scale,
                      int64_t block, const std::string& rounding, uint32_t rounding_seed,
                      int64_t rounding_index, const std::string& master_dtype,
                      const std::string& master_rounding, std::optional<HostArray> comp) {
  const AdamChoices c = ParseAdamChoices(grad_dtype, param_dtype, isa_name, state_dtype, rounding, rounding_index);
  const AdamMaster master_type = ParseMaster(master_dtype, master_rounding);
  const bool master16 = master_type != AdamMaster::kF32;
  const AdamElem grad_type = c.grad_type, param_type = c.param_type;
  const AdamState state = c.state;
  const size_t grad_size = grad_type == AdamElem::kF32 ? 4 : 2;
  const size_t param_size = param_type == AdamElem::kF32 ? 4 : 2;
  const size_t state_size = state == AdamState::kF32 ? 4 : (state == AdamState::kBF16 ? 2 : 1);
  const bool int8 = state == AdamState::kInt8;
  std::vector<ArrayView> views = {
      CheckArray("master", master, master16 ? 2 : 4, !master16),
      CheckArray("m", m, state_size, state == AdamState::kF32),
      CheckArray("v", v, state_size, state == AdamState::kF32),
      CheckArray("grad", grad, grad_size, grad_type == AdamElem::kF32),
      CheckArray("params_out", params_out, param_size, param_type == AdamElem::kF32),
  };
  const int64_t n = views[0].count;
  for (const ArrayView& a : views) {
    if (a.count != n) throw nb::value_error(AdamCountMismatch(a.name, a.count, n).c_str());
  }
  if (int8) CheckInt8Scales(m_scale, v_scale, block, n, &views);
  CheckComp(master_type, comp, n, &views);
  const char* master_and_params[2] = {"master", "params_out"};
  CheckNoOverlap(views, master16 ? master_and_params : nullptr);
  const ArrayView sv = CheckArray("scalars", scalars, 4, true);
  if (sv.count != kAdamScalarCount) {
    throw nb::value_error(("adamw: scalars must be float32[" + std::to_string(kAdamScalarCount) +
                           "], got " + std::to_string(sv.count) + " elements")
                              .c_str());
  }
  auto* master_data = master16 ? nullptr : static_cast<float*>(master.data());
  AdamBuffers b{master_data, m.data(), v.data(), grad.data(), master_data, m.data(), v.data(),
                params_out.data(), n, grad_type, param_type};
  SetMaster(&b, master_type, master.data(), comp ? comp->data() : nullptr);
  b.state_type = state;
  b.rounding = c.rounding;
  b.rounding_seed = rounding_seed;
  b.rounding_index = rounding_index;
  if (int8) {
    b.m_scale = static_cast<float*>(m_scale->data());
    b.v_scale = static_cast<float*>(v_scale->data());
    b.block = block;
  }
  const AdamScalars s = AdamScalarsFromArray(static_cast<const float*>(sv.data));
  std::string error;
  {
    nb::gil_scoped_release release;
    error = RunFusedAdamW(b, s, threads, c.isa);
  }
  if (!error.empty()) throw nb::value_error(error.c_str());
}

// The memory traffic of the kernel with no arithmetic to speak of: reads and writes master,
// m and v in place (times `scale`, a run-time 1.0 the compiler cannot fold away) and copies
// the 2-byte gradient into the 2-byte params: 28 bytes per element, the same streams and the
// same threads as the kernel. Compiled per ISA by the compiler (target_clones where available).
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void BandwidthRange(float* master, float* m, float* v, const uint16_t* grad, uint16_t* params,
                    float scale, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    master[i] *= scale;
    m[i] *= scale;
    v[i] *= scale;
    params[i] = grad[i];
  }
}

void BandwidthProbe(HostArray master, HostArray m, HostArray v, HostArrayRO grad,
                    HostArray params_out, float scale, int threads) {
  const ArrayView views[] = {
      CheckArray("master", master, 4, true), CheckArray("m", m, 4, true),
      CheckArray("v", v, 4, true), CheckArray("grad", grad, 2, false),
      CheckArray("params_out", params_out, 2, false)};
  const int64_t n = views[0].count;
  for (const ArrayView& a : views) {
    if (a.count != n) throw nb::value_error(AdamCountMismatch(a.name, a.count, n).c_str());
  }
  if (threads < 1 || threads > kComputePoolMaxThreads) {
    throw nb::value_error(("adamw_bandwidth_probe: threads=" + std::to_string(threads) +
                           " must be in [1, " + std::to_string(kComputePoolMaxThreads) + "]")
                              .c_str());
  }
  auto* master_data = static_cast<float*>(master.data());
  auto* m_data = static_cast<float*>(m.data());
  auto* v_data = static_cast<float*>(v.data());
  auto* grad_data = static_cast<const uint16_t*>(grad.data());
  auto* params_data = static_cast<uint16_t*>(params_out.data());
  nb::gil_scoped_release release;
  ParallelFor(n, threads, 64, 1 << 15, [&](int64_t begin, int64_t end) {
    BandwidthRange(master_data, m_data, v_data, grad_data, params_data, scale, begin, end);
  });
}

std::vector<std::string> SupportedIsas() {
  std::vector<std::string> out;
  for (AdamIsa isa : {AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (AdamIsaSupported(isa)) out.push_back(AdamIsaName(isa));
  }
  return out;
}

std::string DefaultIsa() {
  AdamIsa resolved;
  std::string error = ResolveAdamIsa(AdamIsa::kAuto, &resolved);
  if (!error.empty()) throw nb::value_error(error.c_str());
  return AdamIsaName(resolved);
}

void BindAdamW(nb::module_& m) {
  m.def("adamw_update", &AdamWUpdateNumpy, nb::arg("master"), nb::arg("m"), nb::arg("v"),
        nb::arg("grad"), nb::arg("params_out"), nb::arg("scalars"), nb::kw_only(),
        nb::arg("grad_dtype"), nb::arg("param_dtype"), nb::arg("threads") = 1,
        nb::arg("isa") = "auto", nb::arg("state_dtype") = "float32",
        nb::arg("m_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(), nb::arg("block") = 0,
        nb::arg("rounding") = "nearest", nb::arg("rounding_seed") = 0, nb::arg("rounding_index") = 0,
        nb::arg("master_dtype") = "float32", nb::arg("master_rounding") = "nearest",
        nb::arg("comp").none() = nb::none(),
        "Fused AdamW in place on C-contiguous numpy arrays (see jaxascend.optim.fused_adam). grad and "
        "params_out hold grad_dtype/param_dtype ('float32', 'float16', 'bfloat16'; 16-bit types "
        "may be passed as uint16 views); m and v hold state_dtype ('float32'; 'bfloat16' as uint16; "
        "'int8' as uint8 codes with float32 m_scale/v_scale, one per block of `block`). "
        "rounding: how m and v are narrowed ('nearest' even, or 'stochastic': v, and int8 m, with the bits of element i "
        "hashed from rounding_seed and rounding_index + i). "
        "master_dtype 'float32' (master float32), or 'bfloat16' (master as uint16 bits, params_out bfloat16 and "
        "possibly master itself) with master_rounding 'compensated' (comp: uint16, the float32 master's low halves, in place) "
        "or 'stochastic' (bits from a salted hash of rounding_seed and rounding_index + i); see "
        "jaxascend.optim.master_codes. Releases the GIL.");
  m.def("adamw_supported_isas", &SupportedIsas,
        "Kernel variants this CPU can run, e.g. ['scalar', 'avx2', 'avx512'].");
  m.def("adamw_default_isa", &DefaultIsa,
        "The variant isa='auto' runs: JAXASCEND_ADAM_ISA if set, else the best supported.");
  m.def("adamw_bandwidth_probe", &BandwidthProbe, nb::arg("master"), nb::arg("m"), nb::arg("v"),
        nb::arg("grad"), nb::arg("params_out"), nb::arg("scale") = 1.0f, nb::arg("threads") = 1,
        "Streams the kernel's 28 bytes per element (fp32 master/m/v in place, 2-byte grad -> "
        "2-byte params) with no Adam arithmetic: the memory-bandwidth limit for benchmarks.");
  m.def("compute_pool_workers", &ComputePoolWorkers,
        "Worker threads started so far by the compute pool (created once, reused by calls).");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindAdamW);

}  // namespace jaxascend
