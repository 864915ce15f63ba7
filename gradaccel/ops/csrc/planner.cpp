// The checkpoint planner: which saved activations to keep under a byte budget so that the
// cost of recomputing the others in backward is least.
//
// The problem comes from a trace of one region (gradaccel/recompute/trace.py): ops read and write
// *values* (a storage at one version; in-place ops make new versions of the same storage).
// Backward needs the final value of every saved storage. A kept storage is a leaf; a dropped
// one must be replayed from its producer, whose inputs are in turn leaves or replayed, and so
// on. The cost of a plan is the summed cost of every op that replay has to run: a shared
// ancestor is paid once, so costs are not additive per tensor and this is no plain knapsack.
//
// Search: branch and bound over keep/drop of each candidate storage, largest first. Dropping
// more never makes replay cheaper, so the replay cost with every undecided candidate kept is a
// lower bound, and a node whose undecided candidates all fit is a leaf. Exact within a node
// limit; past it, the best plan found (seeded by a greedy plan) is returned, marked inexact.
//
// One call plans a region whole (PlanProblem.plan): the generator state that a replay of random
// ops needs is charged to the budget, and with offload, storages left out go to host memory
// where the copy costs less than their replay (greedy, best saving per byte first).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

namespace {

constexpr double kInfeasible = std::numeric_limits<double>::infinity();

struct Problem {
  std::vector<double> op_cost;
  std::vector<bool> op_replayable;
  std::vector<std::vector<int64_t>> op_inputs;  // value ids read by each op
  std::vector<int64_t> value_producer;         // op id, or -1 for a value that exists before the region
  std::vector<int64_t> value_storage;
  std::vector<bool> value_leaf;        // usable as a leaf whenever its storage is available
  std::vector<bool> storage_available;  // available regardless of the plan (inputs, outputs, ...)
  std::vector<int64_t> candidates;     // storages the plan decides on
  std::vector<int64_t> candidate_bytes;
  std::vector<int64_t> candidate_value;  // the value backward needs if the candidate is dropped
  std::vector<bool> op_random;           // draws random numbers (replay needs the generator state)

  // What does not depend on the budget, found by the first plan (prepare()): the candidates
  // that must be kept, and the greedy seed's drops in order.
  mutable bool prepared = false;
  mutable std::vector<char> forced;
  mutable std::vector<size_t> drops;
  // replay_cost's working arrays, reused: the memory planner plans one problem at dozens of
  // budgets, and each plan evaluates hundreds of keep sets.
  mutable std::vector<char> available_, seen_, needed_;
  mutable std::vector<int64_t> stack_;

  // Replay cost when candidate i is kept iff kept[i]; fills `ops` (as a mask) when given.
  double replay_cost(const std::vector<char>& kept, std::vector<char>* ops = nullptr) const {
    std::vector<char>& available = available_;
    available.assign(storage_available.begin(), storage_available.end());
    for (size_t i = 0; i < candidates.size(); ++i)
      if (kept[i]) available[candidates[i]] = 1;
    std::vector<char>&seen = seen_, &needed = needed_;
    seen.assign(value_producer.size(), 0);
    needed.assign(op_cost.size(), 0);
    std::vector<int64_t>& stack = stack_;
    stack.clear();
    for (size_t i = 0; i < candidates.size(); ++i)
      if (!kept[i]) stack.push_back(candidate_value[i]);
    double cost = 0.0;
    while (!stack.empty()) {
      int64_t v = stack.back();
      stack.pop_back();
      if (seen[v]) continue;
      seen[v] = 1;
      if (value_leaf[v] && available[value_storage[v]]) continue;
      int64_t op = value_producer[v];
      if (op < 0 || !op_replayable[op]) return kInfeasible;
      if (needed[op]) continue;
      needed[op] = 1;
      cost += op_cost[op];
      for (int64_t in : op_inputs[op]) stack.push_back(in);
    }
    if (ops) *ops = needed;
    return cost;
  }

  void prepare() const;
};

struct Search {
  const Problem& p;
  int64_t budget;
  int64_t node_limit;
  std::vector<size_t> order;  // undecided candidates, largest first
  std::vector<char> kept, best_kept;
  double best = kInfeasible;
  bool found = false;  // best_kept holds a plan within the budget (possibly one with no candidates)
  int64_t nodes = 0;
  bool exhausted = false;

  // suffix_bytes[d]: bytes of order[d:], to spot nodes whose undecided candidates all fit.
  std::vector<int64_t> suffix_bytes;

  void run(size_t depth, int64_t kept_bytes) {
    if (++nodes > node_limit) {
      exhausted = true;
      return;
    }
    // Everything still undecided is provisionally kept: a lower bound on any completion.
    double bound = p.replay_cost(kept);
    if (bound >= best) return;
    if (kept_bytes + suffix_bytes[depth] <= budget) {
      best = bound;
      best_kept = kept;
      found = true;
      return;
    }
    if (depth == order.size()) return;
    size_t c = order[depth];
    if (kept_bytes + p.candidate_bytes[c] <= budget) {
      run(depth + 1, kept_bytes + p.candidate_bytes[c]);
      if (exhausted) return;
    }
    kept[c] = 0;
    run(depth + 1, kept_bytes);
    kept[c] = 1;
  }
};

// A candidate that cannot be rebuilt even with every other one kept must be kept. And the greedy
// seed: from keeping everything, drop candidates one at a time, each time the one whose drop adds
// least cost per byte freed. Each pick depends only on what is kept so far, so the order of drops
// is the same for every budget: found once here, and a budget stops it at the first prefix that
// fits (seed()).
void Problem::prepare() const {
  if (prepared) return;
  const size_t n = candidates.size();
  std::vector<char> kept(n, 1);
  forced.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    kept[i] = 0;
    if (replay_cost(kept) == kInfeasible) forced[i] = 1;
    kept[i] = 1;
  }
  double cost = replay_cost(kept);
  while (true) {
    size_t pick = n;
    double pick_rate = kInfeasible;
    for (size_t i = 0; i < n; ++i) {
      if (!kept[i] || forced[i] || candidate_bytes[i] == 0) continue;
      kept[i] = 0;
      double c = replay_cost(kept);
      kept[i] = 1;
      double rate = (c - cost) / static_cast<double>(candidate_bytes[i]);
      if (c < kInfeasible && rate < pick_rate) {
        pick_rate = rate;
        pick = i;
      }
    }
    if (pick == n) break;  // nothing more can be dropped
    kept[pick] = 0;
    drops.push_back(pick);
    cost = replay_cost(kept);
  }
  prepared = true;
}

// A quick feasible plan that seeds the exact search's bound: the greedy drops until the kept
// bytes fit (all of them where they never do).
std::vector<char> seed(const Problem& p, int64_t budget) {
  std::vector<char> kept(p.candidates.size(), 1);
  int64_t kept_bytes = std::accumulate(p.candidate_bytes.begin(), p.candidate_bytes.end(), int64_t{0});
  for (size_t i = 0; i < p.drops.size() && kept_bytes > budget; ++i) {
    kept[p.drops[i]] = 0;
    kept_bytes -= p.candidate_bytes[p.drops[i]];
  }
  return kept;
}

Problem make_problem(std::vector<double> op_cost, std::vector<bool> op_replayable,
                     std::vector<std::vector<int64_t>> op_inputs, std::vector<int64_t> value_producer,
                     std::vector<int64_t> value_storage, std::vector<bool> value_leaf,
                     std::vector<bool> storage_available, std::vector<int64_t> candidates,
                     std::vector<int64_t> candidate_bytes, std::vector<int64_t> candidate_value,
                     std::vector<bool> op_random) {
  const size_t n_ops = op_cost.size(), n_values = value_producer.size();
  if (op_random.empty()) op_random.assign(n_ops, false);
  TORCH_CHECK(op_replayable.size() == n_ops && op_inputs.size() == n_ops && op_random.size() == n_ops,
              "gradaccel planner: op arrays differ in length");
  TORCH_CHECK(value_storage.size() == n_values && value_leaf.size() == n_values,
              "gradaccel planner: value arrays differ in length");
  TORCH_CHECK(candidate_bytes.size() == candidates.size() && candidate_value.size() == candidates.size(),
              "gradaccel planner: candidate arrays differ in length");
  for (auto& ins : op_inputs)
    for (int64_t v : ins) TORCH_CHECK(v >= 0 && static_cast<size_t>(v) < n_values, "gradaccel planner: bad value id ", v);
  for (int64_t v : value_producer) TORCH_CHECK(v >= -1 && v < static_cast<int64_t>(n_ops), "gradaccel planner: bad op id ", v);
  for (int64_t s : value_storage)
    TORCH_CHECK(s >= 0 && static_cast<size_t>(s) < storage_available.size(), "gradaccel planner: bad storage id ", s);
  for (size_t i = 0; i < candidates.size(); ++i) {
    TORCH_CHECK(candidates[i] >= 0 && static_cast<size_t>(candidates[i]) < storage_available.size(),
                "gradaccel planner: bad candidate storage ", candidates[i]);
    TORCH_CHECK(candidate_value[i] >= 0 && static_cast<size_t>(candidate_value[i]) < n_values,
                "gradaccel planner: bad candidate value ", candidate_value[i]);
    TORCH_CHECK(candidate_bytes[i] >= 0, "gradaccel planner: negative bytes");
  }
  return Problem{std::move(op_cost),        std::move(op_replayable),     std::move(op_inputs),
                 std::move(value_producer), std::move(value_storage),     std::move(value_leaf),
                 std::move(storage_available), std::move(candidates), std::move(candidate_bytes),
                 std::move(candidate_value), std::move(op_random)};
}

std::vector<int64_t> op_ids(const std::vector<char>& mask) {
  std::vector<int64_t> ops;
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i]) ops.push_back(static_cast<int64_t>(i));
  return ops;
}

// One keep/drop choice within a budget.
struct Choice {
  std::vector<char> kept;      // per candidate
  std::vector<int64_t> steps;  // replayed op ids, in order
  double cost = 0.0;
  bool exact = false, fits = false;
};

Choice choose(const Problem& p, int64_t budget, int64_t node_limit) {
  const size_t n = p.candidates.size();
  p.prepare();
  const std::vector<char>& forced = p.forced;
  std::vector<char> kept(n, 1);
  int64_t forced_bytes = 0;
  for (size_t i = 0; i < n; ++i)
    if (forced[i]) forced_bytes += p.candidate_bytes[i];

  Search s{p, budget - forced_bytes, node_limit};
  for (size_t i = 0; i < n; ++i)
    if (!forced[i]) s.order.push_back(i);
  std::stable_sort(s.order.begin(), s.order.end(),
                   [&](size_t a, size_t b) { return p.candidate_bytes[a] > p.candidate_bytes[b]; });
  s.suffix_bytes.assign(s.order.size() + 1, 0);
  for (size_t d = s.order.size(); d-- > 0;) s.suffix_bytes[d] = s.suffix_bytes[d + 1] + p.candidate_bytes[s.order[d]];

  bool fits = forced_bytes <= budget;
  std::vector<char> start = seed(p, budget);
  int64_t seed_bytes = 0;
  for (size_t i = 0; i < n; ++i)
    if (start[i]) seed_bytes += p.candidate_bytes[i];
  if (seed_bytes <= budget) {
    s.best = p.replay_cost(start);
    s.best_kept = start;
    s.found = true;
  }
  if (fits) {
    s.kept = kept;
    // The seed's own cost stays a valid incumbent: accept a search result only if strictly better.
    s.run(0, 0);
  }
  Choice c;
  c.kept = s.found ? s.best_kept : start;
  std::vector<char> ops_mask;
  c.cost = p.replay_cost(c.kept, &ops_mask);
  c.steps = op_ids(ops_mask);
  c.exact = fits && !s.exhausted;
  c.fits = fits && s.found;
  return c;
}

// Offload on top of `c`: while some dropped candidate's replay saving beats its copy cost, send
// the one that saves most per byte (net of the copy) to host memory. Returns the offloaded mask
// and updates `steps` and `cost` to the replay that remains.
std::vector<char> offload(const Problem& p, const std::vector<char>& kept, double copy_cost_per_byte,
                          std::vector<int64_t>& steps, double& cost) {
  const size_t n = kept.size();
  std::vector<char> at_hand(kept), offloaded(n, 0);
  while (true) {
    size_t pick = n;
    double pick_gain = 0.0;
    for (size_t i = 0; i < n; ++i) {
      if (at_hand[i] || p.candidate_bytes[i] == 0) continue;
      const double bytes = static_cast<double>(p.candidate_bytes[i]);
      at_hand[i] = 1;
      double saved = cost - p.replay_cost(at_hand);
      at_hand[i] = 0;
      double gain = (saved - copy_cost_per_byte * bytes) / bytes;
      if (gain > 0 && (pick == n || gain > pick_gain)) {
        pick = i;
        pick_gain = gain;
      }
    }
    if (pick == n) break;
    at_hand[pick] = 1;
    offloaded[pick] = 1;
    std::vector<char> ops_mask;
    cost = p.replay_cost(at_hand, &ops_mask);
    steps = op_ids(ops_mask);
  }
  return offloaded;
}

// What PlanProblem.plan returns (fields documented at the binding).
struct PlanResult {
  std::vector<bool> kept, offloaded;
  std::vector<int64_t> steps, fallback_steps;
  double cost = 0.0, fallback_cost = 0.0;
  bool exact = false, fits = false, uses_rng = false;
  int64_t budget = 0;
};

PlanResult plan_at(const Problem& p, int64_t budget, int64_t node_limit, std::optional<double> copy_cost_per_byte) {
  Choice c = choose(p, budget, node_limit);
  PlanResult r;
  r.kept.assign(c.kept.begin(), c.kept.end());
  r.fallback_steps = r.steps = c.steps;
  r.fallback_cost = r.cost = c.cost;
  r.exact = c.exact;
  r.fits = c.fits;
  r.budget = budget;
  std::vector<char> offloaded(c.kept.size(), 0);
  if (copy_cost_per_byte) offloaded = offload(p, c.kept, *copy_cost_per_byte, r.steps, r.cost);
  r.offloaded.assign(offloaded.begin(), offloaded.end());
  // The fallback (no offload) replays a superset of the offload plan's ops.
  for (int64_t op : r.fallback_steps) r.uses_rng = r.uses_rng || p.op_random[op];
  return r;
}

PlanResult plan(const Problem& p, int64_t budget, int64_t node_limit, int64_t rng_bytes,
                std::optional<double> copy_cost_per_byte) {
  TORCH_CHECK(budget >= 0 && rng_bytes >= 0, "gradaccel planner: negative budget or rng_bytes");
  TORCH_CHECK(!copy_cost_per_byte || *copy_cost_per_byte >= 0, "gradaccel planner: negative copy cost");
  PlanResult r = plan_at(p, budget, node_limit, copy_cost_per_byte);
  // A replay of random ops needs the generator state at region entry, which the region then
  // holds too: plan again with those bytes taken off the budget.
  if (r.uses_rng && rng_bytes > 0) r = plan_at(p, std::max<int64_t>(0, budget - rng_bytes), node_limit, copy_cost_per_byte);
  return r;
}

// (replay cost, replayed ops in order) when candidate i is available iff available[i].
pybind11::tuple replay(const Problem& p, const std::vector<bool>& available) {
  TORCH_CHECK(available.size() == p.candidates.size(), "gradaccel planner: one flag per candidate expected");
  std::vector<char> mask(available.begin(), available.end()), ops_mask;
  double cost = p.replay_cost(mask, &ops_mask);
  return pybind11::make_tuple(cost, op_ids(ops_mask));
}

}  // namespace

void init_planner(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<PlanResult>(m, "PlanResult",
                         "A region's plan: kept/offloaded (masks over the candidates), steps (replayed op ids,\n"
                         "in order), cost (their summed cost), exact (proven least-cost), fits (within budget),\n"
                         "budget (what was planned for: the budget less the generator state when the replay\n"
                         "draws random numbers), uses_rng, and fallback_steps/fallback_cost: the replay\n"
                         "without offload (equal to steps/cost when nothing is offloaded).")
      .def_readonly("kept", &PlanResult::kept)
      .def_readonly("offloaded", &PlanResult::offloaded)
      .def_readonly("steps", &PlanResult::steps)
      .def_readonly("cost", &PlanResult::cost)
      .def_readonly("exact", &PlanResult::exact)
      .def_readonly("fits", &PlanResult::fits)
      .def_readonly("budget", &PlanResult::budget)
      .def_readonly("uses_rng", &PlanResult::uses_rng)
      .def_readonly("fallback_steps", &PlanResult::fallback_steps)
      .def_readonly("fallback_cost", &PlanResult::fallback_cost);
  py::class_<Problem>(m, "PlanProblem",
                      "A traced region as the planner sees it: ops (cost, replayable, input values), values\n"
                      "(producer op, storage, usable as a leaf), storages available regardless of the plan,\n"
                      "the candidate storages with their bytes and the value backward needs of each, and\n"
                      "which ops draw random numbers (default: none).")
      .def(py::init(&make_problem), py::arg("op_cost"), py::arg("op_replayable"), py::arg("op_inputs"),
           py::arg("value_producer"), py::arg("value_storage"), py::arg("value_leaf"),
           py::arg("storage_available"), py::arg("candidates"), py::arg("candidate_bytes"),
           py::arg("candidate_value"), py::arg("op_random") = std::vector<bool>{})
      .def("plan", &plan, py::arg("budget"), py::arg("node_limit") = 200000, py::arg("rng_bytes") = 0,
           py::arg("copy_cost_per_byte") = py::none(),
           "Choose which candidates to keep within `budget` bytes so replay cost is least. `rng_bytes`:\n"
           "the generator state a replay of random ops holds, charged to the budget when the plan\n"
           "replays one (the region is planned again at budget - rng_bytes). `copy_cost_per_byte`\n"
           "(None: no offload): a round trip to host memory, in op-cost units per byte. Returns a PlanResult.")
      .def("replay", &replay, py::arg("available"),
           "(replay cost, replayed op ids) when the flagged candidates are available.");
}
