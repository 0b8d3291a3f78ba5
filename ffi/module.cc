// The Python extension: exports registrations() and whatever bindings the
// concerns registered (see registry.h).
#include <nanobind/nanobind.h>

#include "registry.h"

namespace nb = nanobind;

namespace jaxascend {

std::vector<FfiTarget>& FfiTargets() {
  static std::vector<FfiTarget> targets;
  return targets;
}

std::vector<Binder>& Binders() {
  static std::vector<Binder> binders;
  return binders;
}

}  // namespace jaxascend

NB_MODULE(_native, m) {
  m.doc() = "jaxascend native extension: XLA FFI handlers (CPU) and the SSD engine";
  m.def(
      "registrations",
      []() {
        nb::dict out;
        for (const auto& t : jaxascend::FfiTargets()) out[t.name] = nb::capsule(t.handler);
        return out;
      },
      "Maps each FFI target name to a capsule holding its XLA_FFI_Handler*.");
  for (auto binder : jaxascend::Binders()) binder(m);
  // Sinks and stores registered for FFI calls are owned by process-wide tables that live until
  // exit, after the interpreter's own teardown; that is intended, not a leak.
  nb::set_leak_warnings(false);
}
