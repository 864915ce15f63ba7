// The activation store's pool of host buffers (pinned for CUDA tensors), reused from step to
// step. A released buffer returns to the pool only once the copy that last used it is done.
// Not thread-safe: ActivationStore holds its lock around every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "store_event.h"

namespace gradaccel::store {

struct Buffer {
  void* ptr = nullptr;
  std::size_t capacity = 0;
};

struct PoolStats {
  std::size_t bytes_reserved = 0, bytes_idle = 0;
  int64_t buffers = 0, buffers_idle = 0, buffers_pending = 0;
  int64_t hits = 0, misses = 0, waits = 0, alloc_failures = 0;
};

class HostPool {
 public:
  // budget: bytes of buffers the pool may hold, idle ones included; -1 = no bound.
  HostPool(int64_t budget, bool pinned) : budget_(budget), pinned_(pinned) {}
  ~HostPool();  // waits for the copies still using buffers, then frees every buffer
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A buffer of at least `nbytes`: an idle one of the same size class, else one of that class
  // that a copy still uses (waiting for the copy rather than growing the pool), else a new one
  // if the budget allows (idle buffers of other classes are freed to make room). nullopt: the
  // budget refuses. Throws c10::OutOfMemoryError if the system refuses the memory.
  std::optional<Buffer> acquire(std::size_t nbytes);

  // Back to the pool: idle now if no copy uses it, else once `last_use` completes.
  void put_back(const Buffer& buf, Event last_use);

  void synchronize();       // waits for every copy using a released buffer; all become idle
  std::size_t trim();       // frees the idle buffers; returns the bytes freed
  PoolStats stats();

  void fail_next_allocations(int64_t n) { fail_next_ = n; }  // test hook: the system "refuses"

 private:
  void* allocate(std::size_t cap);
  void free_buffer(const Buffer& buf) noexcept;
  void collect();                      // released buffers whose copies are done become idle
  void trim_to(std::size_t limit);     // frees idle buffers, largest first, down to `limit` bytes

  const int64_t budget_;
  const bool pinned_;
  int64_t fail_next_ = 0;
  std::map<std::size_t, std::vector<void*>> free_;  // idle buffers by size class
  std::deque<std::pair<Buffer, Event>> pending_;    // released, but a copy may still use them
  std::size_t reserved_ = 0;
  int64_t buffers_ = 0, hits_ = 0, misses_ = 0, waits_ = 0, alloc_failures_ = 0;
};

}  // namespace gradaccel::store
