// The Python face of the parameter source (offload_param_source.h): the ParamSource class, and
// register_param_source / unregister_param_source, which add it to and remove it from the table
// that the FFI target and the host entry find it in.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>

#include "offload_param_source.h"
#include "registry.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

void BindParamSource(nb::module_& m) {
  nb::class_<ParamSource>(m, "ParamSource", "Reads layers of the stacked weights from SSD ahead of the layer scan.")
      .def(nb::new_([](int64_t store_handle, const std::string& slot_class) {
             return std::make_shared<ParamSource>(store_handle, slot_class);
           }),
           nb::arg("store_handle"), nb::arg("slot_class"))
      .def("add_host_leaf", &ParamSource::AddHostLeaf, nb::arg("buffer"), nb::arg("layer_bytes"), nb::arg("dtype"),
           "Adds one leaf held in host memory (a flat uint8 view of every layer).")
      .def("gate", &ParamSource::Gate, nb::arg("expect_handover") = false,
           "Marks every layer as not yet updated (an optimizer step starts); with expect_handover the optimizer "
           "hands the forward each layer in a slot.")
      .def("acquire_handover", &ParamSource::AcquireHandover, nb::arg("layer"))
      .def("end_handover_waits", &ParamSource::EndHandoverWaits)
      .def("handover_views", &ParamSource::HandoverViews, nb::arg("slot"))
      .def("handover", &ParamSource::Handover, nb::arg("layer"), nb::arg("slot"))
      .def("skip_handover", &ParamSource::SkipHandover, nb::arg("layer"))
      .def("mark_ready", &ParamSource::MarkReady, nb::arg("layer"), "Layer `layer` holds its new weights.")
      .def("fail", &ParamSource::Fail, nb::arg("message"), "Fails every fetch waiting for an update.")
      .def("ready", &ParamSource::ready, nb::arg("layer"))
      .def("set_layer_region", &ParamSource::SetLayerRegion, nb::arg("leaf"), nb::arg("layer"), nb::arg("region"),
           "Layer `layer` of region leaf `leaf` is read from region id `region` from now on.")
      .def("add_leaf", &ParamSource::AddLeaf, nb::arg("regions"), nb::arg("layer_bytes"), nb::arg("dtype"),
           "Adds one leaf of the stack: one region id per layer, each layer_bytes long.")
      .def("begin", &ParamSource::Begin, nb::arg("order"), nb::arg("depth"),
           "Drops what is in flight and starts reading the first `depth` layers of `order`.")
      .def("drain", &ParamSource::Drain, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for the reads in flight and releases their slots.")
      .def("take_events", &ParamSource::TakeEvents,
           "(layer, asked, served) of every fetch since the last call (monotonic-clock seconds).")
      .def("stats", &ParamSource::Stats, "fetches, misses, bytes_read, wait_seconds since creation.")
      .def_prop_ro("slot_bytes", &ParamSource::slot_bytes)
      .def_prop_ro("num_layers", &ParamSource::num_layers)
      .def_prop_ro("num_leaves", &ParamSource::num_leaves);
  m.def(
      "register_param_source", [](std::shared_ptr<ParamSource> source) { return ParamSources().Register(source); },
      nb::arg("source"), "Makes a ParamSource reachable from jaxascend_param_source; returns its handle.");
  m.def(
      "unregister_param_source",
      [](int64_t handle) {
        std::shared_ptr<ParamSource> source = ParamSources().Take(handle);
        if (!source) return false;
        nb::gil_scoped_release release;
        source->Drain();
        return true;
      },
      nb::arg("handle"), "Removes a source (after draining its reads); later calls with its handle fail.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindParamSource);

}  // namespace jaxascend
