// Self-registration of FFI handlers and nanobind bindings.
//
// Each ffi/*.cc file registers what it defines with a static object, so adding a
// concern means adding one file: module.cc never needs editing.
//
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(kGradStats, GradStatsDispatch, ...);
//   JAXASCEND_REGISTER_FFI("jaxascend_grad_stats", kGradStats);
//   JAXASCEND_REGISTER_BINDINGS(BindArena);   // void BindArena(nanobind::module_&)
#pragma once

#include <vector>

namespace nanobind { class module_; }

namespace jaxascend {

struct FfiTarget {
  const char* name;  // target name passed to jax.ffi.register_ffi_target
  void* handler;     // XLA_FFI_Handler*
};

using Binder = void (*)(nanobind::module_&);

std::vector<FfiTarget>& FfiTargets();
std::vector<Binder>& Binders();

struct FfiRegistration {
  FfiRegistration(const char* name, void* handler) { FfiTargets().push_back({name, handler}); }
};
struct BinderRegistration {
  explicit BinderRegistration(Binder binder) { Binders().push_back(binder); }
};

}  // namespace jaxascend

#define JAXASCEND_CONCAT_INNER(a, b) a##b
#define JAXASCEND_CONCAT(a, b) JAXASCEND_CONCAT_INNER(a, b)
#define JAXASCEND_REGISTER_FFI(name, symbol)                                 \
  static ::jaxascend::FfiRegistration JAXASCEND_CONCAT(jaxascend_ffi_reg_, \
                                                       __LINE__)(          \
      name, reinterpret_cast<void*>(symbol))
#define JAXASCEND_REGISTER_BINDINGS(fn)                                         \
  static ::jaxascend::BinderRegistration JAXASCEND_CONCAT(jaxascend_bind_reg_, \
                                                          __LINE__)(fn)
