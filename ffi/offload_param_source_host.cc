// The host half of the parameter source for backends whose FFI calls cannot run on the host
// (GPU): a pure_callback copies layer `layer` of every leaf into host buffers (uint8 views, e.g.
// of pinned memory) through fetch_params_to_host; the same ParamSource::Fetch as the FFI target
// jaxascend_param_source (offload_param_source_ffi.cc), with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "offload_grad_sink.h"
#include "offload_param_source.h"
#include "registry.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

void FetchParamsToHost(int64_t handle, int64_t layer, std::vector<nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>> outs,
                       std::vector<std::string> dtype_names) {
  std::shared_ptr<ParamSource> target = ParamSources().Find(handle);
  if (!target) throw nb::value_error(("param_source: " + ParamSources().Missing(handle)).c_str());
  if (dtype_names.size() != outs.size()) throw nb::value_error("param_source: one dtype per output is needed");
  std::vector<void*> data;
  std::vector<size_t> sizes;
  std::vector<ffi::DataType> dtypes(outs.size());
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!ParseGradDtype(dtype_names[k], &dtypes[k])) {
      throw nb::value_error(("param_source: unsupported dtype " + dtype_names[k]).c_str());
    }
    data.push_back(outs[k].data());
    sizes.push_back(outs[k].size());
  }
  std::string err;
  {
    nb::gil_scoped_release release;
    err = target->Fetch(layer, data, sizes, dtypes);
  }
  if (!err.empty()) throw std::runtime_error(err);
}

void BindParamSourceHost(nb::module_& m) {
  m.def("fetch_params_to_host", &FetchParamsToHost, nb::arg("handle"), nb::arg("layer"), nb::arg("outs"),
        nb::arg("dtypes"), "Copies one layer of every leaf into host byte buffers (the GPU path's host side).");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindParamSourceHost);

}  // namespace jaxascend
