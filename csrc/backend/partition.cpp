// The op behind torch.compile's partitions, and the zero-copy bridges the
// compiled backend uses between host (or CUDA) tensors and mgpu values.
//
// `torch_mgpu::partition(Partition p, Tensor[] inputs) -> Tensor[]` has a
// Meta kernel (the geometries `p` was compiled for) and CPU / CUDA kernels
// (call `p->run`). On mgpu tensors it reaches the capture fallback like any
// ATen op: it is recorded as one node, planned and run on a lane.
#include "backend/backend.h"
#include "capture/capture.h"
#include "engine/at_call.h"
#include "engine/engine.h"
#include "ir/partition.h"
#include "runtime/place.h"

#include <torch/custom_class.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

using PartitionPtr = c10::intrusive_ptr<ir::Partition>;

void check_inputs(const ir::Partition& p, at::TensorList inputs) {
  TORCH_CHECK(inputs.size() == p.inputs.size(), p.name, " takes ", p.inputs.size(), " tensors, got ",
              inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& g = p.inputs[i];
    const auto& t = inputs[i];
    TORCH_CHECK(t.defined() && t.scalar_type() == g.dtype && t.sizes() == c10::IntArrayRef(g.sizes), p.name,
                ": input ", i, " must be ", g.dtype, " of shape ", c10::IntArrayRef(g.sizes), ", got ",
                t.defined() ? t.toString() : std::string("an undefined tensor"), " of shape ",
                t.defined() ? t.sizes() : c10::IntArrayRef{});
  }
}

std::vector<at::Tensor> partition_meta(const PartitionPtr& p, at::TensorList inputs) {
  check_inputs(*p, inputs);
  std::vector<at::Tensor> out;
  out.reserve(p->outputs.size());
  for (const auto& g : p->outputs)
    out.push_back(at::empty_strided(g.sizes, g.strides, at::TensorOptions().dtype(g.dtype).device(at::kMeta)));
  return out;
}

std::vector<at::Tensor> partition_run(const PartitionPtr& p, at::TensorList inputs) {
  check_inputs(*p, inputs);
  TORCH_CHECK(p->run, p->name, " has no compiled code");
  std::vector<at::Tensor> out = p->run(std::vector<at::Tensor>(inputs.begin(), inputs.end()));
  TORCH_CHECK(out.size() == p->outputs.size(), p->name, " returned ", out.size(), " tensors, expected ",
              p->outputs.size());
  return out;
}

} // namespace

std::vector<at::Tensor> call_partition(const c10::intrusive_ptr<ir::Partition>& p, at::TensorList inputs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torch_mgpu::partition", "")
                       .typed<std::vector<at::Tensor>(const PartitionPtr&, at::TensorList)>();
  return op.call(p, inputs);
}

at::Tensor alias_tensor(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "mgpu: cannot alias a tensor on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "mgpu: cannot alias a ", t.layout(), " tensor");
  capture::StateLock lock;
  return capture::make_lazy_tensor(capture::new_storage(t.storage().nbytes(), 0, ir::make_data(t.storage())), capture::geometry_of(t));
}

at::Tensor value_view(const at::Tensor& t, c10::Device device) {
  TORCH_CHECK(capture::is_mgpu(t), "mgpu: value_view takes an mgpu tensor, got one on ", t.device());
  engine::at_call::ProgramRead read;
  c10::Storage host = engine::materialize(t.storage());
  if (device.is_cpu()) return runtime::view(host, capture::geometry_of(t));
  c10::Storage on;
  {
    capture::StateLock lock;
    const auto& n = *capture::buffer_of(t)->value.node;
    on = n.replica(device);
    if (!on && n.data.device() == device) on = n.data;
  }
  if (!on) on = runtime::copy_to(host, device, /*wait=*/true);
  return runtime::view(on, capture::geometry_of(t));
}

} // namespace torch_mgpu::backend

TORCH_LIBRARY(torch_mgpu, m) {
  m.class_<torch_mgpu::ir::Partition>("Partition");
  m.def("partition(__torch__.torch.classes.torch_mgpu.Partition p, Tensor[] inputs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(torch_mgpu, Meta, m) {
  m.impl("partition", TORCH_FN(torch_mgpu::backend::partition_meta));
}
TORCH_LIBRARY_IMPL(torch_mgpu, CPU, m) {
  m.impl("partition", TORCH_FN(torch_mgpu::backend::partition_run));
}
TORCH_LIBRARY_IMPL(torch_mgpu, CUDA, m) {
  m.impl("partition", TORCH_FN(torch_mgpu::backend::partition_run));
}
