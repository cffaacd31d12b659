// The cost model (cost_model.h): figures, GPU profiles, the work of an op,
// and seconds of work and of moving bytes between lanes.
#include "plan/cost_model.h"
#include "ir/partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace torch_mgpu::plan {

const std::vector<CostFigure>& cost_figures() {
  static const std::vector<CostFigure> figures = {
      {"gemm_flops_per_s", &CostModel::gemm_flops_per_s},
      {"small_gemm_flops_per_s", &CostModel::small_gemm_flops_per_s},
      {"elem_per_s", &CostModel::elem_per_s},
      {"transcendental_per_s", &CostModel::transcendental_per_s},
      {"bytes_per_s", &CostModel::bytes_per_s},
      {"op_overhead_s", &CostModel::op_overhead_s},
      {"lane_sync_s", &CostModel::lane_sync_s},
      {"launch_s", &CostModel::launch_s},
      {"transfer_bytes_per_s", &CostModel::transfer_bytes_per_s},
      {"network_latency_s", &CostModel::network_latency_s},
      {"network_bytes_per_s", &CostModel::network_bytes_per_s},
      {"remote_call_s", &CostModel::remote_call_s},
      {"parallel_min_flops", &CostModel::parallel_min_flops},
      {"parallel_efficiency", &CostModel::parallel_efficiency},
      {"partition_call_s", &CostModel::partition_call_s},
  };
  return figures;
}

namespace {
double numel(const ir::TensorGeometry& g) {
  double n = 1;
  for (auto s : g.sizes) n *= static_cast<double>(s);
  return n;
}
// What the estimates read of a node: its op's name, arguments and outputs
// (a recorded node, or an op of another compiler's graph).
struct OpDesc {
  std::string_view name;
  c10::ArrayRef<ir::Arg> args;
  c10::ArrayRef<ir::Output> outputs;
};

const ir::TensorGeometry* tensor_arg(const OpDesc& n, size_t i) {
  if (i >= n.args.size() || n.args[i].kind != ir::Arg::Kind::Tensor || !n.args[i].tensors[0]) return nullptr;
  return &n.args[i].tensors[0]->geom;
}
double out_numel(const OpDesc& n) {
  double m = 0;
  for (const auto& o : n.outputs)
    if (o.mutated_operand < 0) m = std::max(m, numel(o.geom));
  if (m == 0) {
    for (const auto& a : n.args)
      if (a.kind == ir::Arg::Kind::Tensor && a.tensors[0]) m = std::max(m, numel(a.tensors[0]->geom));
  }
  return m;
}

// The textbook flop counts of dense factorizations and triangular solves.
double textbook_linalg_flops(const OpDesc& n, std::string_view name) {
  if (name.rfind("aten::", 0) != 0) return 0;
  name.remove_prefix(6);
  name = name.substr(0, name.find('.'));
  // The square matrix's order and batch, from argument `i`.
  auto square = [&](size_t i, double& order, double& batch) {
    const auto* a = tensor_arg(n, i);
    if (!a || a->sizes.size() < 2) return false;
    order = static_cast<double>(a->sizes.back());
    batch = order > 0 ? numel(*a) / (order * order) : 0;
    return true;
  };
  // Right-hand sides: the last dimension of argument `i` (a vector: 1).
  auto columns = [&](size_t i) {
    const auto* b = tensor_arg(n, i);
    return b && b->sizes.size() >= 2 ? static_cast<double>(b->sizes.back()) : 1.0;
  };
  double order = 0, batch = 0;
  const double cube = 1.0 / 3.0;
  if (name == "linalg_cholesky" || name == "linalg_cholesky_ex" || name == "cholesky" ||
      name == "linalg_ldl_factor" || name == "linalg_ldl_factor_ex") {
    if (square(0, order, batch)) return batch * cube * order * order * order;
  } else if (name == "linalg_lu_factor" || name == "linalg_lu_factor_ex" || name == "linalg_lu") {
    if (square(0, order, batch)) return batch * 2 * cube * order * order * order;
  } else if (name == "linalg_inv" || name == "linalg_inv_ex" || name == "inverse" || name == "cholesky_inverse") {
    if (square(0, order, batch)) return batch * 2 * order * order * order;
  } else if (name == "linalg_solve" || name == "linalg_solve_ex" || name == "_linalg_solve_ex") {
    if (square(0, order, batch)) return batch * (2 * cube * order * order * order + 2 * order * order * columns(1));
  } else if (name == "cholesky_solve" || name == "_cholesky_solve_helper" || name == "triangular_solve") {  // (B, A)
    if (square(1, order, batch)) return batch * 2 * order * order * columns(0);
  } else if (name == "linalg_solve_triangular") {  // (A, B)
    if (square(0, order, batch)) return batch * order * order * columns(1);
  } else if (name == "linalg_lu_solve") {  // (LU, pivots, B)
    if (square(0, order, batch)) return batch * 2 * order * order * columns(2);
  }
  return 0;
}

// Floating-point work of dense factorizations and triangular solves, 0 for
// other ops, in GEMM-equivalent flops: the textbook counts times 3, since
// LAPACK runs at a third of the GEMM rate or less on such sizes (measured on
// two cores with GEMM at 86 GFLOP/s: a 256 Cholesky at 23 GFLOP/s on two
// threads, 1024 at 49 on two threads and 27-32 on one).
// `name` is "aten::op" or "aten::op.overload".
double linalg_flops(const OpDesc& n, std::string_view name) {
  return 3 * textbook_linalg_flops(n, name);
}

Work op_work(const OpDesc& n) {
  Work w;
  for (const auto& a : n.args)
    for (const auto& t : a.tensors)
      if (t) w.bytes += numel(t->geom) * c10::elementSize(t->geom.dtype);
  for (const auto& o : n.outputs) w.bytes += static_cast<double>(o.nbytes);
  w.out_elems = out_numel(n);
  const std::string_view name = n.name;
  auto mm_flops = [](const ir::TensorGeometry* a, const ir::TensorGeometry* b) {
    if (!a || !b || a->sizes.size() < 2 || b->sizes.size() < 2) return 0.0;
    double batch = 1;
    for (size_t i = 0; i + 2 < a->sizes.size(); ++i) batch *= static_cast<double>(a->sizes[i]);
    return 2.0 * batch * static_cast<double>(a->sizes[a->sizes.size() - 2]) *
        static_cast<double>(a->sizes.back()) * static_cast<double>(b->sizes.back());
  };
  if (name == "aten::mm" || name == "aten::bmm" || name == "aten::mm.out" || name == "aten::bmm.out") {
    w.flops = mm_flops(tensor_arg(n, 0), tensor_arg(n, 1));
    w.gemm = true;
  } else if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::addmm.out") {
    w.flops = mm_flops(tensor_arg(n, 1), tensor_arg(n, 2));
    w.gemm = true;
  } else if (name.rfind("aten::convolution", 0) == 0) {
    const auto* weight = tensor_arg(n, name == "aten::convolution" ? 1 : 2);
    double per_out = weight && !weight->sizes.empty() ? numel(*weight) / static_cast<double>(weight->sizes[0]) : 1;
    w.flops = 2.0 * out_numel(n) * per_out * (name == "aten::convolution" ? 1.0 : 2.0);
    w.gemm = true;
  } else if (name.find("scaled_dot_product") != std::string::npos) {
    const auto* q = tensor_arg(n, 0);
    const auto* k = tensor_arg(n, 1);
    if (q && k && q->sizes.size() >= 2) {
      double bh = numel(*q) / static_cast<double>(q->sizes.back());  // B*H*L
      w.flops = 4.0 * bh * static_cast<double>(k->sizes[k->sizes.size() - 2]) * static_cast<double>(q->sizes.back());
    }
    w.gemm = true;
  } else if (const double f = linalg_flops(n, name); f > 0) {
    w.flops = f;
    w.gemm = true;  // blocked LAPACK: GEMM-like rates, threaded when large
  } else if (name.find("pool") != std::string::npos && name.find("adaptive") == std::string::npos) {
    // Windowed ops: every output element reads a window (kernel_size, the
    // second argument), at about the transcendental rate per window element.
    double window = 1;
    for (const auto& a : n.args)
      if (a.kind == ir::Arg::Kind::Constant && a.constant.isIntList()) {
        for (auto k : a.constant.toIntVector()) window *= static_cast<double>(std::max<int64_t>(k, 1));
        break;
      }
    w.flops = out_numel(n) * window;
    w.transcendental = true;
  } else if (name.find("topk") != std::string::npos || name.find("sort") != std::string::npos ||
             name.find("kthvalue") != std::string::npos || name.find("median") != std::string::npos) {
    // Selection and sorting read every input element with compares and
    // data movement: about the transcendental rate per input element.
    const auto* in = tensor_arg(n, 0);
    w.flops = in ? numel(*in) : out_numel(n);
    w.transcendental = true;
  } else {
    w.flops = out_numel(n);  // one "flop" per produced element
    // sqrt and div are single vector instructions: elementwise rates.
    static const char* slow[] = {"tanh", "exp", "log", "sigmoid", "softmax", "erf", "gelu", "sin", "cos", "pow",
                                 "silu", "cdist", "norm"};
    for (const char* k : slow)
      if (name.find(k) != std::string::npos) w.transcendental = true;
  }
  return w;
}

} // namespace

Work estimate_work(const ir::Node& n) {
  if (const auto* p = ir::partition_of(n)) {
    // A compiled partition: the figures its compiler's input graph gave.
    Work w = partition_work(p->gemm_flops, p->elem, p->transcendental, p->bytes);
    w.loop_threads = p->threads;
    w.out_elems = out_numel(OpDesc{n.name, n.args, n.outputs});
    return w;
  }
  return op_work(OpDesc{n.name, n.args, n.outputs});
}

Work estimate_op_work(const c10::FunctionSchema& schema, c10::ArrayRef<ir::Arg> args,
                      c10::ArrayRef<ir::Output> outputs) {
  // A view (its first result aliases an argument that it does not write)
  // moves no data: no work.
  const auto& returns = schema.returns();
  if (!returns.empty() && returns[0].alias_info() && !returns[0].alias_info()->isWrite()) return Work{};
  std::string name = schema.name();
  if (!schema.overload_name().empty()) name += "." + schema.overload_name();
  return op_work(OpDesc{ir::intern(name), args, outputs});
}

Work partition_work(double gemm_flops, double elem, double transcendental, double bytes) {
  Work w;
  w.flops = gemm_flops;
  w.gemm = gemm_flops > 0;
  w.elem = elem;
  w.transcendental_elems = transcendental;
  w.bytes = bytes;
  return w;
}

double device_fill(const Work& w, const CostModel& cm) {
  if (cm.sms <= 0) return 1.0;
  const double sms = cm.sms;
  const double units = w.gemm ? w.out_elems / (128.0 * 128.0) : w.out_elems;
  const double per_sm = w.gemm ? 1.0 : 16.0 * 512.0;
  return std::clamp(units / (sms * per_sm), 1.0 / sms, 1.0);
}

double launch_seconds(const Work& w, const CostModel& cm) { return w.fused ? 0.0 : w.scale * cm.op_overhead_s; }

double node_seconds(const Work& w, const CostModel& cm, int threads) {
  if (cm.sms > 0) {
    // A GPU kernel: the device's rates, at the share of it the kernel fills.
    const double rate = w.gemm ? cm.gemm_flops_per_s : w.transcendental ? cm.transcendental_per_s : cm.elem_per_s;
    const double compute = w.flops / rate + w.elem / cm.elem_per_s + w.transcendental_elems / cm.transcendental_per_s;
    const double memory = w.bytes / cm.bytes_per_s;
    return w.scale * (cm.op_overhead_s + std::max(compute, memory) / device_fill(w, cm));
  }
  // A fused step works on blocks in cache: a cost per 1024-element block,
  // split over the threads when the pass is (ATen's grain: 32768 elements).
  if (w.fused) {
    const double blocks = std::max(1.0, std::ceil(w.flops / 1024.0));
    return w.scale * cm.fused_step_s * blocks / (threads > 1 && w.flops >= 32768 ? threads : 1);
  }
  double rate;
  if (w.gemm) rate = w.flops < cm.parallel_min_flops ? cm.small_gemm_flops_per_s : cm.gemm_flops_per_s;
  else rate = w.transcendental ? cm.transcendental_per_s : cm.elem_per_s;
  const double all = w.flops + w.elem + w.transcendental_elems;
  auto speedup_on = [&](int t) { return t > 1 && all >= cm.parallel_min_flops ? 1.0 + (t - 1) * cm.parallel_efficiency : 1.0; };
  const double speedup = speedup_on(threads);
  const int loops = w.loop_threads > 0 ? std::min(threads, w.loop_threads) : threads;
  double compute = w.flops / rate / speedup +
      (w.elem / cm.elem_per_s + w.transcendental_elems / cm.transcendental_per_s) / speedup_on(loops);
  double memory = w.bytes / (cm.bytes_per_s * speedup);
  return w.scale * (cm.op_overhead_s + std::max(compute, memory));
}

double edge_seconds(double bytes, const Lane& a, const Lane& b, const CostModel& cm) {
  if (a.device == b.device && a.index == b.index) return 0.0;
  if (a.device == b.device) return cm.lane_sync_s;
  if (a.rank != b.rank) {
    // Straight from rank to rank (workers forward to each other): the
    // message wakes a receiving thread, then the reading lane.
    return 2 * cm.lane_sync_s + 2 * cm.network_latency_s + bytes / cm.network_bytes_per_s;
  }
  const double rate = cm.peer_bytes_per_s > 0 ? cm.peer_bytes_per_s : cm.transfer_bytes_per_s;
  return cm.lane_sync_s + cm.transfer_latency_s + bytes / rate;
}

CostModel with_link(CostModel cm, const Topology& t) {
  if (t.link_latency_s > 0) cm.network_latency_s = t.link_latency_s;
  if (t.link_bytes_per_s > 0) cm.network_bytes_per_s = t.link_bytes_per_s;
  return cm;
}

const std::vector<DeviceProfile>& device_profiles() {
  // Sustained figures: dense FP32 at ~80% of the datasheet peak, memory at
  // ~85%, PCIe and NVLink at ~80% of one direction's peak.
  static const std::vector<DeviceProfile> profiles = {
      {"v100", "NVIDIA V100 SXM2 16 GB (80 SMs, 15.7 TFLOP/s FP32, 900 GB/s, NVLink 2)", 80, 12.6e12, 765e9, 5e-6,
       12e9, 120e9, 16e9},
      {"a100", "NVIDIA A100 SXM4 80 GB (108 SMs, 19.5 TFLOP/s FP32, 2.0 TB/s, NVLink 3)", 108, 15.6e12, 1.73e12, 4e-6,
       25e9, 240e9, 80e9},
      {"h100", "NVIDIA H100 SXM5 80 GB (132 SMs, 67 TFLOP/s FP32, 3.35 TB/s, NVLink 4)", 132, 53.5e12, 2.85e12, 4e-6,
       50e9, 360e9, 80e9},
      {"h200", "NVIDIA H200 SXM 141 GB (132 SMs, 67 TFLOP/s FP32, 4.8 TB/s, NVLink 4)", 132, 53.5e12, 4.1e12, 4e-6,
       50e9, 360e9, 141e9},
      {"l4", "NVIDIA L4 24 GB (58 SMs, 30.3 TFLOP/s FP32, 300 GB/s, PCIe only)", 58, 24.2e12, 255e9, 5e-6, 20e9, 0,
       24e9},
  };
  return profiles;
}

const DeviceProfile& device_profile(const std::string& name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string known;
  for (const auto& d : device_profiles()) {
    if (d.name == lower) return d;
    known += (known.empty() ? "'" : ", '") + d.name + "'";
  }
  TORCH_CHECK(false, "torch_mgpu: unknown device profile '", name, "' (known: ", known, ")");
}

CostModel gpu_cost_model(const DeviceProfile& d) {
  CostModel cm;
  cm.profile = d.name;
  cm.sms = d.sms;
  cm.gemm_flops_per_s = d.fp32_flops_per_s;
  cm.small_gemm_flops_per_s = d.fp32_flops_per_s;  // small products: by their fill, not a rate of their own
  // Elementwise kernels are bound by memory: 3 float32 accesses per output
  // (two reads, one write); a transcendental costs a few more instructions.
  cm.bytes_per_s = d.memory_bytes_per_s;
  cm.elem_per_s = d.memory_bytes_per_s / 12.0;
  cm.transcendental_per_s = d.memory_bytes_per_s / 16.0;
  cm.op_overhead_s = d.launch_s;
  cm.lane_sync_s = 10e-6;  // an event recorded on one stream, waited for on another
  cm.launch_s = 20e-6;
  cm.transfer_bytes_per_s = d.host_bytes_per_s;
  cm.peer_bytes_per_s = d.peer_bytes_per_s;
  cm.transfer_latency_s = 10e-6;
  cm.parallel_min_flops = 0;
  cm.parallel_efficiency = 0;  // no intra-op threads: the device is the parallelism
  return cm;
}

} // namespace torch_mgpu::plan
