// HostPool (gradaccel/ops/csrc/host_pool.h): size classes, reuse, the host budget and failure handling.

#include "host_pool.h"

#include <cstdlib>

namespace gradaccel::store {
namespace {

// Eight size classes per power of two: a buffer wastes under 12.5 %, and a tensor of the same
// size as one released earlier always finds that buffer again, so steady steps never grow the pool.
std::size_t size_class(std::size_t nbytes) {
  constexpr std::size_t kMin = 512;
  if (nbytes <= kMin) return kMin;
  const std::size_t pow2 = std::size_t{1} << (63 - __builtin_clzll(nbytes - 1));  // pow2 < n <= 2 pow2
  const std::size_t step = pow2 / 8;
  return (nbytes + step - 1) / step * step;
}

}  // namespace

HostPool::~HostPool() {
  // No buffer may go back to the system while a copy still uses it. A destructor must not
  // throw: a CUDA error here (the runtime already torn down at exit) is ignored.
  for (auto& [buf, last_use] : pending_) {
    try {
      last_use.synchronize();
    } catch (...) {
    }
    free_buffer(buf);
  }
  pending_.clear();
  trim_to(0);
}

std::optional<Buffer> HostPool::acquire(std::size_t nbytes) {
  const std::size_t cap = size_class(nbytes);
  collect();
  auto idle = free_.find(cap);
  if (idle != free_.end() && !idle->second.empty()) {
    void* ptr = idle->second.back();
    idle->second.pop_back();
    ++hits_;
    return Buffer{ptr, cap};
  }
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->first.capacity != cap) continue;
    it->second.synchronize();
    Buffer buf = it->first;
    pending_.erase(it);
    ++hits_;
    ++waits_;
    return buf;
  }
  if (budget_ >= 0) {
    const auto budget = static_cast<std::size_t>(budget_);
    if (cap > budget) return std::nullopt;
    if (reserved_ + cap > budget) trim_to(budget - cap);
    if (reserved_ + cap > budget) return std::nullopt;
  }
  void* ptr = allocate(cap);
  if (!ptr) {  // idle buffers of other sizes may be what the system misses: free them, try again
    const std::size_t before = reserved_;
    trim_to(0);
    if (reserved_ < before) ptr = allocate(cap);
  }
  if (!ptr) {
    ++alloc_failures_;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "gradaccel ActivationStore: could not allocate ", cap, " bytes of ",
                     pinned_ ? "pinned host" : "host", " memory (", reserved_,
                     " bytes already held by the store); nothing leaked and the store is still usable");
  }
  reserved_ += cap;
  ++buffers_;
  ++misses_;
  return Buffer{ptr, cap};
}

void HostPool::put_back(const Buffer& buf, Event last_use) {
  if (last_use.query()) {
    free_[buf.capacity].push_back(buf.ptr);
  } else {
    pending_.emplace_back(buf, std::move(last_use));
  }
}

void HostPool::synchronize() {
  for (auto& p : pending_) p.second.synchronize();
  collect();
}

std::size_t HostPool::trim() {
  collect();
  const std::size_t before = reserved_;
  trim_to(0);
  return before - reserved_;
}

PoolStats HostPool::stats() {
  collect();
  PoolStats s;
  for (auto& [cap, ptrs] : free_) {
    s.buffers_idle += static_cast<int64_t>(ptrs.size());
    s.bytes_idle += cap * ptrs.size();
  }
  s.bytes_reserved = reserved_;
  s.buffers = buffers_;
  s.buffers_pending = static_cast<int64_t>(pending_.size());
  s.hits = hits_;
  s.misses = misses_;
  s.waits = waits_;
  s.alloc_failures = alloc_failures_;
  return s;
}

void* HostPool::allocate(std::size_t cap) {
  if (fail_next_ > 0) {
    --fail_next_;
    return nullptr;
  }
#ifdef GRADACCEL_WITH_CUDA
  if (pinned_) {
    void* ptr = nullptr;
    return store_cuda::host_alloc(&ptr, cap) == 0 ? ptr : nullptr;
  }
#endif
  return std::malloc(cap);
}

void HostPool::free_buffer(const Buffer& buf) noexcept {
#ifdef GRADACCEL_WITH_CUDA
  if (pinned_) {
    store_cuda::host_free(buf.ptr);
  } else {
    std::free(buf.ptr);
  }
#else
  std::free(buf.ptr);
#endif
  reserved_ -= buf.capacity;
  --buffers_;
}

void HostPool::collect() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.query()) {
      free_[it->first.capacity].push_back(it->first.ptr);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

void HostPool::trim_to(std::size_t limit) {
  for (auto it = free_.rbegin(); it != free_.rend() && reserved_ > limit; ++it) {
    auto& ptrs = it->second;
    while (!ptrs.empty() && reserved_ > limit) {
      free_buffer(Buffer{ptrs.back(), it->first});
      ptrs.pop_back();
    }
  }
  std::erase_if(free_, [](const auto& kv) { return kv.second.empty(); });
}

}  // namespace gradaccel::store
