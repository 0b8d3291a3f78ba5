// The parameter source FFI target (the source itself: offload_param_source.h).
//
//   jaxascend_param_source(layer; source) -> one layer of every leaf, in leaf order
//
// Called from the layer scan for each layer it is about to compute; it waits for the layer's
// reads (queued ahead by Begin) and copies it into XLA's output buffers.
#include <memory>
#include <string>
#include <vector>

#include "offload_param_source.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxascend {
namespace {

// Dispatch: finds the source, collects the output buffers and fetches the layer into them.
ffi::Error ParamSourceDispatch(ffi::Buffer<ffi::S32> layer, ffi::RemainingRets outs, int64_t source) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("param_source: layer must be a scalar");
  std::shared_ptr<ParamSource> target = ParamSources().Find(source);
  if (!target) return ffi::Error::InvalidArgument("param_source: " + ParamSources().Missing(source));
  std::vector<void*> data;
  std::vector<size_t> sizes;
  std::vector<ffi::DataType> dtypes;
  for (size_t k = 0; k < outs.size(); ++k) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = outs.get<ffi::AnyBuffer>(k);
    if (out.has_error()) return out.error();
    data.push_back((*out)->untyped_data());
    sizes.push_back((*out)->size_bytes());
    dtypes.push_back((*out)->element_type());
  }
  std::string err = target->Fetch(layer.typed_data()[0], data, sizes, dtypes);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kParamSource, ParamSourceDispatch,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: index in the stack
                                  .RemainingRets()               // one layer of every leaf, in leaf order
                                  .Attr<int64_t>("source"));     // handle from register_param_source

JAXASCEND_REGISTER_FFI("jaxascend_param_source", kParamSource);

}  // namespace jaxascend
