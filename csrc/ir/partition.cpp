#include "ir/partition.h"

#include <atomic>
#include <sstream>
#include <utility>

namespace torch_mgpu::ir {

namespace {
// "aten::mm.default" -> "mm"
std::string short_op(const std::string& op) {
  std::string s = op;
  if (auto c = s.rfind("::"); c != std::string::npos) s = s.substr(c + 2);
  if (auto d = s.find('.'); d != std::string::npos) s = s.substr(0, d);
  return s;
}
} // namespace

c10::intrusive_ptr<Partition> make_partition(Partition::Fn run, std::vector<std::string> ops, int kernels,
                                             std::vector<TensorGeometry> inputs,
                                             std::vector<TensorGeometry> outputs) {
  static std::atomic<uint64_t> next{1};
  auto p = c10::make_intrusive<Partition>();
  p->run = std::move(run);
  p->id = next++;
  p->kernels = kernels;
  p->inputs = std::move(inputs);
  p->outputs = std::move(outputs);
  // The name lists the distinct ops in order of first use, with counts.
  std::vector<std::pair<std::string, int>> seen;
  for (const auto& op : ops) {
    std::string s = short_op(op);
    bool found = false;
    for (auto& [k, c] : seen)
      if (k == s) found = ++c > 0;
    if (!found) seen.emplace_back(s, 1);
  }
  std::ostringstream os;
  os << "partition#" << p->id << "[";
  for (size_t i = 0; i < seen.size() && i < 4; ++i) {
    os << (i ? ", " : "") << seen[i].first;
    if (seen[i].second > 1) os << " x" << seen[i].second;
  }
  if (seen.size() > 4) os << ", +" << (seen.size() - 4) << " more";
  os << "; " << kernels << (kernels == 1 ? " kernel]" : " kernels]");
  p->name = intern(os.str());
  p->ops = std::move(ops);
  return p;
}

const Partition* partition_of(const c10::IValue& v) {
  if (!v.isObject()) return nullptr;
  const auto& obj = v.toObjectRef();
  if (obj.slots().size() != 1 || !obj.getSlot(0).isCapsule()) return nullptr;
  return dynamic_cast<const Partition*>(obj.getSlot(0).toCapsule().get());
}

const Partition* partition_of(const Node& n) {
  if (n.args.empty() || n.args[0].kind != Arg::Kind::Constant) return nullptr;
  return partition_of(n.args[0].constant);
}

} // namespace torch_mgpu::ir
