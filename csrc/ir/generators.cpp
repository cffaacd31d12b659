// The overload of an op that takes a Generator where the op takes none.
#include "ir/generators.h"

#include <ATen/Context.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_mgpu::ir {

namespace {

// The overload of `op` that takes a Generator where `op` takes none, its
// other arguments the same (rand -> rand.generator, randint.low_out ->
// randint.low_generator_out), and where that argument goes.
struct GeneratorTwin {
  std::optional<c10::OperatorHandle> op;
  size_t position = 0;
};

std::optional<size_t> generator_position(const c10::FunctionSchema& with, const c10::FunctionSchema& without) {
  const auto& a = with.arguments();
  const auto& b = without.arguments();
  if (a.size() != b.size() + 1 || with.returns().size() != without.returns().size()) return std::nullopt;
  std::optional<size_t> at;
  for (size_t i = 0, j = 0; i < a.size(); ++i) {
    if (!at && a[i].type()->kind() == c10::TypeKind::OptionalType &&
        a[i].type()->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
      at = i;
      continue;
    }
    if (j >= b.size() || a[i].name() != b[j].name() || *a[i].type() != *b[j].type()) return std::nullopt;
    ++j;
  }
  return at;
}

GeneratorTwin find_generator_twin(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  // The overload's name with "generator" put in as one more word.
  std::vector<std::string> words;
  for (size_t i = 0; !name.overload_name.empty();) {
    const size_t k = name.overload_name.find('_', i);
    words.push_back(name.overload_name.substr(i, k == std::string::npos ? std::string::npos : k - i));
    if (k == std::string::npos) break;
    i = k + 1;
  }
  for (size_t at = 0; at <= words.size(); ++at) {
    std::string overload;
    for (size_t w = 0; w <= words.size(); ++w) {
      if (w == at) overload += overload.empty() ? "generator" : "_generator";
      if (w < words.size()) overload += (overload.empty() ? "" : "_") + words[w];
    }
    auto twin = c10::Dispatcher::singleton().findSchema({name.name, overload});
    if (!twin) continue;
    if (auto position = generator_position(twin->schema(), op.schema())) return GeneratorTwin{twin, *position};
  }
  return GeneratorTwin{};
}

const GeneratorTwin& generator_twin(const c10::OperatorHandle& op) {
  static std::mutex m;
  static std::unordered_map<const c10::FunctionSchema*, GeneratorTwin> twins;
  std::lock_guard<std::mutex> lock(m);
  auto it = twins.find(&op.schema());
  if (it == twins.end()) it = twins.emplace(&op.schema(), find_generator_twin(op)).first;
  return it->second;
}

} // namespace

std::mutex& global_generator_mutex() {
  static std::mutex m;
  return m;
}

bool has_generator_overload(const c10::OperatorHandle& op) { return generator_twin(op).op.has_value(); }

void call_with_own_generator(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::Device device,
                             std::optional<uint64_t> seed) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  const GeneratorTwin& twin = generator_twin(op);
  if (twin.op) {
    at::Generator own;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      own = gen.clone();
    }
    if (seed) own.set_current_seed(*seed);
    const size_t nargs = op.schema().arguments().size();
    TORCH_INTERNAL_ASSERT(stack.size() >= nargs);
    stack.insert(stack.end() - static_cast<std::ptrdiff_t>(nargs) + static_cast<std::ptrdiff_t>(twin.position),
                 c10::IValue(std::move(own)));
    twin.op->callBoxed(&stack);
    return;
  }
  // The generator's own mutex is not held while the op runs: the op locks
  // it to draw.
  std::lock_guard<std::mutex> lent(global_generator_mutex());
  at::Generator saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.clone();
    if (seed) gen.set_current_seed(*seed);
  }
  auto restore = [&] {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved.get_state());
  };
  try {
    op.callBoxed(&stack);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

} // namespace torch_mgpu::ir
