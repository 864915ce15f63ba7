// Activation store: parks tensors in a pool of host buffers and brings them back, for
// offloading saved activations (issue 7). Registered as the TorchScript class
// torch.classes.gradaccel.ActivationStore; gradaccel/recompute/offload.py is the Python API.
//
// CUDA tensors: device-to-host copies go to pinned buffers on a side stream and
// host-to-device copies on another, ordered by events, so the compute stream never waits on a
// copy except where fetch() hands the tensor back. CPU tensors run the same logic with
// synchronous memcpy and events that are complete at birth, so it is all tested without a GPU.
// The host buffers come from HostPool (gradaccel/ops/csrc/host_pool.h); completion events from store_event.h.

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_pool.h"

namespace gradaccel {
namespace {

using store::Buffer;
using store::Event;
using store::HostPool;
using store::PoolStats;
#ifdef GRADACCEL_WITH_CUDA
using store::cuda_check;
using store::cuda_impl;
using store::native;
#endif

// One offloaded tensor.
struct Entry {
  Buffer buf;  // null for a tensor of 0 bytes
  std::size_t nbytes = 0;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  Event written;      // the device-to-host copy into buf is done
  Event read;         // the latest host-to-device copy out of buf is done (it waited for `written`)
  at::Tensor staged;  // brought back by prefetch(), not yet handed out by fetch()

  Event& last_use() { return read.recorded() ? read : written; }
};

// Side streams of one CUDA device, taken from PyTorch's pool so that record_stream() knows them.
struct Lanes {
  c10::Stream d2h, h2d;
  void* order = nullptr;  // event to make a side stream wait for the compute stream
};

class ActivationStore : public torch::CustomClassHolder {
 public:
  ActivationStore(int64_t host_budget, bool pin_memory, int64_t max_inflight_bytes)
      : pool_(host_budget, pin_memory), budget_(host_budget), max_inflight_(max_inflight_bytes), pin_(pin_memory) {
    TORCH_CHECK(host_budget >= -1, "ActivationStore: host_budget must be >= 0 bytes (or -1 for no bound), got ",
                host_budget);
    TORCH_CHECK(max_inflight_bytes >= -1,
                "ActivationStore: max_inflight_bytes must be >= 0 bytes (or -1 for no bound), got ", max_inflight_bytes);
#ifndef GRADACCEL_WITH_CUDA
    TORCH_CHECK(!pin_memory, "ActivationStore: pin_memory needs gradaccel built with CUDA");
#endif
  }

  ~ActivationStore() override {
    std::lock_guard<std::mutex> lock(mu_);
    // No buffer may go back to the system while a copy still uses it. A destructor must not
    // throw: a CUDA error here (the runtime already torn down at exit) is ignored.
    for (auto& [handle, e] : entries_) {
      try {
        e.last_use().synchronize();
      } catch (...) {
      }
      if (e.buf.ptr) pool_.put_back(e.buf, Event());
    }
    entries_.clear();
#ifdef GRADACCEL_WITH_CUDA
    for (auto& [index, lanes] : lanes_) store_cuda::event_destroy(lanes.order);
#endif
  }

  // Starts copying `t` to a host buffer; returns its handle, or -1 when host_budget refuses the
  // bytes (the caller keeps or recomputes the tensor). The caller may drop `t` right away.
  int64_t offload(const at::Tensor& t) {
    TORCH_CHECK(t.layout() == at::kStrided, "ActivationStore.offload: needs a strided tensor, got ", t.layout());
    TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "ActivationStore.offload: needs a CPU or CUDA tensor, got ",
                t.device());
#ifndef GRADACCEL_WITH_CUDA
    TORCH_CHECK(t.device().is_cpu(), "ActivationStore.offload: gradaccel was built without CUDA; ",
                "rebuild it with CUDA to offload ", t.device(), " tensors");
#endif
    TORCH_CHECK(t.device().is_cpu() || pin_,
                "ActivationStore.offload: offloading a CUDA tensor needs a store with pin_memory=True");
    std::lock_guard<std::mutex> lock(mu_);
    // Raw bytes in memory order: dense layouts keep their strides; others become contiguous.
    at::Tensor src = t.resolve_conj().resolve_neg();
    if (!src.is_non_overlapping_and_dense()) src = src.contiguous();

    Entry e;
    e.nbytes = src.nbytes();
    e.sizes = src.sizes().vec();
    e.strides = src.strides().vec();
    e.dtype = src.scalar_type();
    e.device = src.device();
    throttle(e.nbytes);
    if (e.nbytes > 0) {
      std::optional<Buffer> buf = pool_.acquire(e.nbytes);
      if (!buf) {
        ++refused_;
        return -1;
      }
      e.buf = *buf;
      try {
        copy_to_host(e, src);
      } catch (...) {
        pool_.put_back(e.buf, Event());
        throw;
      }
    }
    const int64_t handle = next_handle_++;
    bytes_in_use_ += e.nbytes;
    bytes_offloaded_ += e.nbytes;
    if (max_inflight_ >= 0 && e.nbytes > 0) {
      inflight_.emplace_back(handle, e.nbytes);
      inflight_bytes_ += e.nbytes;
    }
    entries_.emplace(handle, std::move(e));
    return handle;
  }

  // Starts bringing the tensor back to its device early (CUDA: asynchronously on a side stream).
  void prefetch(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    stage(entry(handle));
  }

  // The tensor back on its device: same shape, dtype and values; same strides if it was dense.
  // The current stream waits for the copy; the host does not.
  at::Tensor fetch(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entry(handle);
    stage(e);
    e.read.block(current_stream(e.device));
#ifdef GRADACCEL_WITH_CUDA
    if (e.device.is_cuda() && e.nbytes > 0) e.staged.record_stream(cuda_impl()->getStream(e.device));
#endif
    return std::move(e.staged);
  }

  // Gives the buffer back to the pool; it is reused once no copy reads it any more.
  void release(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(handle);
    TORCH_CHECK(it != entries_.end(), "ActivationStore.release: unknown or already released handle ", handle);
    Entry e = std::move(it->second);
    entries_.erase(it);
    bytes_in_use_ -= e.nbytes;
    // Prefetched, never fetched: that memory belongs to the side stream, which reuses it in order.
    e.staged.reset();
    if (e.buf.ptr) pool_.put_back(e.buf, std::move(e.last_use()));
  }

  // Waits for every copy in flight; afterwards every released buffer is free for reuse.
  void synchronize() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [handle, e] : entries_) {
      e.written.synchronize();
      e.read.synchronize();
    }
    pool_.synchronize();
  }

  // Returns the idle buffers to the system; returns the bytes freed.
  int64_t trim() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(pool_.trim());
  }

  c10::Dict<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    drop_finished();
    const PoolStats p = pool_.stats();
    c10::Dict<std::string, int64_t> d;
    d.insert("handles", static_cast<int64_t>(entries_.size()));
    d.insert("bytes_in_use", static_cast<int64_t>(bytes_in_use_));
    d.insert("bytes_reserved", static_cast<int64_t>(p.bytes_reserved));
    d.insert("bytes_idle", static_cast<int64_t>(p.bytes_idle));
    d.insert("buffers", p.buffers);
    d.insert("buffers_idle", p.buffers_idle);
    d.insert("buffers_pending", p.buffers_pending);
    d.insert("hits", p.hits);
    d.insert("misses", p.misses);
    d.insert("waits", p.waits);
    d.insert("refused", refused_);
    d.insert("alloc_failures", p.alloc_failures);
    d.insert("bytes_offloaded", static_cast<int64_t>(bytes_offloaded_));
    d.insert("host_budget", budget_);
    d.insert("bytes_inflight", static_cast<int64_t>(inflight_bytes_));
    d.insert("throttled", throttled_);
    d.insert("max_inflight_bytes", max_inflight_);
    d.insert("pinned", pin_ ? 1 : 0);
    return d;
  }

  // Test hooks. The next `n` host allocations fail as if the system refused them.
  void fail_next_allocations(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.fail_next_allocations(n);
  }
  // CPU copies report "still in flight" until something waits for them, like CUDA copies.
  void defer_cpu_events(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    defer_cpu_ = on;
  }

 private:
  Entry& entry(int64_t handle) {
    auto it = entries_.find(handle);
    TORCH_CHECK(it != entries_.end(), "ActivationStore: unknown or already released handle ", handle);
    return it->second;
  }

  // Finished copies (oldest first) leave the in-flight count; waits for none.
  void drop_finished() {
    while (!inflight_.empty()) {
      const auto [handle, nbytes] = inflight_.front();
      auto it = entries_.find(handle);  // a released entry's source is no longer ours to count
      if (it != entries_.end() && !it->second.written.query()) break;
      inflight_bytes_ -= nbytes;
      inflight_.pop_front();
    }
  }

  // The device memory of an offloaded tensor is free only once its copy is done. A forward that
  // runs ahead of the copies would hold it all; past max_inflight bytes of copies in flight,
  // the host waits for the oldest ones (copies on one stream finish in order).
  void throttle(std::size_t incoming) {
    drop_finished();
    // The front copy is unfinished now (finished ones were dropped): wait for it while over.
    while (!inflight_.empty() && inflight_bytes_ + incoming > static_cast<std::size_t>(max_inflight_)) {
      entries_.at(inflight_.front().first).written.synchronize();
      ++throttled_;
      drop_finished();
    }
  }

  // ---- copies -------------------------------------------------------------------------------

  void copy_to_host(Entry& e, const at::Tensor& src) {
    if (src.device().is_cpu()) {
      std::memcpy(e.buf.ptr, src.const_data_ptr(), e.nbytes);
      e.written = Event::cpu(defer_cpu_);
      return;
    }
#ifdef GRADACCEL_WITH_CUDA
    c10::DeviceGuard guard(src.device());
    Lanes& lanes = lanes_for(src.device());
    wait_for_compute(lanes, lanes.d2h);  // src is produced by work queued on the compute stream
    cuda_check(store_cuda::copy_async(e.buf.ptr, src.const_data_ptr(), e.nbytes, /*to_host=*/true, native(lanes.d2h)),
               "device-to-host cudaMemcpyAsync");
    e.written = Event::record(native(lanes.d2h));
    // The caller may free src now: the caching allocator keeps its block until the copy is done.
    src.record_stream(lanes.d2h);
#endif
  }

  // Makes sure e.staged holds the tensor on its device (or a copy into it is under way).
  void stage(Entry& e) {
    if (e.staged.defined()) return;
    const auto options = at::TensorOptions().dtype(e.dtype).device(e.device);
    if (e.device.is_cpu()) {
      at::Tensor dst = at::empty_strided(e.sizes, e.strides, options);
      if (e.nbytes > 0) {
        e.written.synchronize();
        std::memcpy(dst.mutable_data_ptr(), e.buf.ptr, e.nbytes);
        e.read = Event::cpu(defer_cpu_);
      }
      e.staged = std::move(dst);
      return;
    }
#ifdef GRADACCEL_WITH_CUDA
    c10::DeviceGuard guard(e.device);
    Lanes& lanes = lanes_for(e.device);
    at::Tensor dst;
    {
      // The side stream's own memory: the copy into it need not wait for the compute stream
      // (memory that stream allocates may still be read by its queued work). fetch() records
      // the compute stream's use, so the block outlives that use too.
      c10::StreamGuard on_side(lanes.h2d);
      dst = at::empty_strided(e.sizes, e.strides, options);
    }
    if (e.nbytes > 0) {
      e.written.block(native(lanes.h2d));
      cuda_check(store_cuda::copy_async(dst.mutable_data_ptr(), e.buf.ptr, e.nbytes, /*to_host=*/false,
                                        native(lanes.h2d)),
                 "host-to-device cudaMemcpyAsync");
      e.read = Event::record(native(lanes.h2d));
    }
    e.staged = std::move(dst);
#endif
  }

  void* current_stream(const at::Device& device) {
#ifdef GRADACCEL_WITH_CUDA
    if (device.is_cuda()) return native(cuda_impl()->getStream(device));
#endif
    (void)device;
    return nullptr;
  }

#ifdef GRADACCEL_WITH_CUDA
  Lanes& lanes_for(const at::Device& device) {
    auto it = lanes_.find(device.index());
    if (it != lanes_.end()) return it->second;
    const auto* impl = cuda_impl();
    Lanes lanes{impl->getStreamFromGlobalPool(device), impl->getStreamFromGlobalPool(device), nullptr};
    cuda_check(store_cuda::event_create(&lanes.order), "cudaEventCreate");
    return lanes_.emplace(device.index(), lanes).first->second;
  }

  // `side` runs what is queued on it from now on after the work queued so far on the compute stream.
  void wait_for_compute(Lanes& lanes, const c10::Stream& side) {
    cuda_check(store_cuda::event_record(lanes.order, native(cuda_impl()->getStream(side.device()))), "cudaEventRecord");
    cuda_check(store_cuda::stream_wait_event(native(side), lanes.order), "cudaStreamWaitEvent");
  }

  std::unordered_map<c10::DeviceIndex, Lanes> lanes_;
#endif

  std::mutex mu_;
  HostPool pool_;  // declared first: destroyed last, after the entries gave their buffers back
  const int64_t budget_;        // bytes of host buffers the store may hold; -1 = no bound
  const int64_t max_inflight_;  // bytes of device-to-host copies in flight; -1 = no bound
  const bool pin_;
  bool defer_cpu_ = false;

  std::map<int64_t, Entry> entries_;
  int64_t next_handle_ = 0;
  std::size_t bytes_in_use_ = 0, bytes_offloaded_ = 0;
  int64_t refused_ = 0, throttled_ = 0;
  std::deque<std::pair<int64_t, std::size_t>> inflight_;  // (handle, bytes) of copies maybe in flight, oldest first
  std::size_t inflight_bytes_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gradaccel, m) {
  m.class_<ActivationStore>("ActivationStore")
      .def(torch::init<int64_t, bool, int64_t>())
      .def("offload", &ActivationStore::offload)
      .def("prefetch", &ActivationStore::prefetch)
      .def("fetch", &ActivationStore::fetch)
      .def("release", &ActivationStore::release)
      .def("synchronize", &ActivationStore::synchronize)
      .def("trim", &ActivationStore::trim)
      .def("stats", &ActivationStore::stats)
      .def("_fail_next_allocations", &ActivationStore::fail_next_allocations)
      .def("_defer_cpu_events", &ActivationStore::defer_cpu_events);
}

}  // namespace gradaccel
