// The XLA FFI target of the fused AdamW kernel (optim_adam.h), for jax arrays inside jit (CPU):
//
//   jaxascend_adamw(master, m, v, grad, scalars; threads) -> (master, m, v, params)
//
// The dispatch checks dtypes and element counts and returns an ffi::Error naming the argument;
// the work is RunFusedAdamW, as for the numpy entry (optim_adam_bindings.cc). The master is
// float32 here (a bfloat16 master is refused as "master must be float32"); the numpy entry takes
// the bfloat16 ones.
#include <cstdint>
#include <string>

#include "optim_adam.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxascend {
namespace {

const char* FfiTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::F32: return "float32";
    case ffi::F16: return "float16";
    case ffi::BF16: return "bfloat16";
    case ffi::F64: return "float64";
    case ffi::S32: return "int32";
    case ffi::S64: return "int64";
    case ffi::U16: return "uint16";
    default: return "another dtype";
  }
}

bool FfiElem(ffi::DataType t, AdamElem* e) {
  switch (t) {
    case ffi::F32: *e = AdamElem::kF32; return true;
    case ffi::F16: *e = AdamElem::kF16; return true;
    case ffi::BF16: *e = AdamElem::kBF16; return true;
    default: return false;
  }
}

// master/m/v and their aliased outputs: float32 with n elements.
std::string CheckFfiState(const char* name, ffi::DataType type, int64_t count, int64_t n) {
  if (type != ffi::F32) {
    return std::string("adamw: ") + name + " must be float32, got " + FfiTypeName(type);
  }
  return count == n ? "" : AdamCountMismatch(name, count, n);
}

ffi::Error AdamWDispatch(ffi::AnyBuffer master, ffi::AnyBuffer m, ffi::AnyBuffer v,
                         ffi::AnyBuffer grad, ffi::AnyBuffer scalars,
                         ffi::Result<ffi::AnyBuffer> master_out, ffi::Result<ffi::AnyBuffer> m_out,
                         ffi::Result<ffi::AnyBuffer> v_out,
                         ffi::Result<ffi::AnyBuffer> params_out, int64_t threads) {
  const int64_t n = static_cast<int64_t>(master.element_count());
  const struct {
    const char* name;
    ffi::DataType type;
    int64_t count;
  } state[] = {
      {"master", master.element_type(), n},
      {"m", m.element_type(), static_cast<int64_t>(m.element_count())},
      {"v", v.element_type(), static_cast<int64_t>(v.element_count())},
      {"master_out", master_out->element_type(), static_cast<int64_t>(master_out->element_count())},
      {"m_out", m_out->element_type(), static_cast<int64_t>(m_out->element_count())},
      {"v_out", v_out->element_type(), static_cast<int64_t>(v_out->element_count())},
  };
  for (const auto& s : state) {
    std::string error = CheckFfiState(s.name, s.type, s.count, n);
    if (!error.empty()) return ffi::Error::InvalidArgument(error);
  }
  AdamElem grad_type, param_type;
  if (!FfiElem(grad.element_type(), &grad_type)) {
    return ffi::Error::InvalidArgument(std::string("adamw: grad dtype ") +
                                       FfiTypeName(grad.element_type()) +
                                       " is not supported (float16, bfloat16, float32)");
  }
  if (!FfiElem(params_out->element_type(), &param_type)) {
    return ffi::Error::InvalidArgument(std::string("adamw: params dtype ") +
                                       FfiTypeName(params_out->element_type()) +
                                       " is not supported (float16, bfloat16, float32)");
  }
  if (static_cast<int64_t>(grad.element_count()) != n) {
    return ffi::Error::InvalidArgument(AdamCountMismatch("grad", grad.element_count(), n));
  }
  if (static_cast<int64_t>(params_out->element_count()) != n) {
    return ffi::Error::InvalidArgument(AdamCountMismatch("params", params_out->element_count(), n));
  }
  if (scalars.element_type() != ffi::F32 ||
      static_cast<int64_t>(scalars.element_count()) != kAdamScalarCount) {
    return ffi::Error::InvalidArgument(
        std::string("adamw: scalars must be float32[") + std::to_string(kAdamScalarCount) +
        "], got " + FfiTypeName(scalars.element_type()) + " with " +
        std::to_string(scalars.element_count()) + " elements");
  }
  const AdamBuffers b{static_cast<const float*>(master.untyped_data()),
                      static_cast<const float*>(m.untyped_data()),
                      static_cast<const float*>(v.untyped_data()),
                      grad.untyped_data(),
                      static_cast<float*>(master_out->untyped_data()),
                      static_cast<float*>(m_out->untyped_data()),
                      static_cast<float*>(v_out->untyped_data()),
                      params_out->untyped_data(),
                      n,
                      grad_type,
                      param_type};
  const AdamScalars s = AdamScalarsFromArray(static_cast<const float*>(scalars.untyped_data()));
  if (threads < 1 || threads > kAdamMaxThreads) {
    return ffi::Error::InvalidArgument("adamw: threads=" + std::to_string(threads) +
                                       " must be in [1, " + std::to_string(kAdamMaxThreads) + "]");
  }
  std::string error = RunFusedAdamW(b, s, static_cast<int>(threads), AdamIsa::kAuto);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAdamW, AdamWDispatch,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // master: f32[n]
                                  .Arg<ffi::AnyBuffer>()  // m: f32[n]
                                  .Arg<ffi::AnyBuffer>()  // v: f32[n]
                                  .Arg<ffi::AnyBuffer>()  // grad: f16/bf16/f32[n]
                                  .Arg<ffi::AnyBuffer>()  // scalars: f32[10], see optim_adam.h
                                  .Ret<ffi::AnyBuffer>()  // new master (aliases master)
                                  .Ret<ffi::AnyBuffer>()  // new m (aliases m)
                                  .Ret<ffi::AnyBuffer>()  // new v (aliases v)
                                  .Ret<ffi::AnyBuffer>()  // new params: f16/bf16/f32[n]
                                  .Attr<int64_t>("threads"));  // compute-pool threads

JAXASCEND_REGISTER_FFI("jaxascend_adamw", kAdamW);

}  // namespace jaxascend
