// Completion events for the activation store's copies (gradaccel/ops/csrc/store.cpp, gradaccel/ops/csrc/host_pool.cpp), and
// the CUDA helpers they use. Header-only: both translation units share one definition.
#pragma once

#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "store.h"

namespace gradaccel::store {

#ifdef GRADACCEL_WITH_CUDA
inline void cuda_check(int code, const char* what) {
  TORCH_CHECK(code == 0, "gradaccel ActivationStore: ", what, " failed: ", store_cuda::error_string(code));
}

inline const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

inline void* native(const c10::Stream& stream) { return cuda_impl()->getStreamNativeHandle(stream); }
#endif

// Completion of one copy. A CUDA event; or, for CPU copies (synchronous), a flag that is
// complete at birth unless a test deferred it to exercise the paths that wait for copies.
class Event {
 public:
  Event() = default;
  static Event cpu(bool pending) {
    Event e;
    e.cpu_pending_ = pending;
    return e;
  }
#ifdef GRADACCEL_WITH_CUDA
  static Event record(void* stream) {
    Event e;
    cuda_check(store_cuda::event_create(&e.cuda_), "cudaEventCreate");
    cuda_check(store_cuda::event_record(e.cuda_, stream), "cudaEventRecord");
    return e;
  }
#endif
  Event(Event&& o) noexcept : cuda_(o.cuda_), cpu_pending_(o.cpu_pending_) { o.cuda_ = nullptr; }
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      destroy();
      cuda_ = o.cuda_;
      cpu_pending_ = o.cpu_pending_;
      o.cuda_ = nullptr;
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { destroy(); }

  bool recorded() const { return cuda_ != nullptr || cpu_pending_; }

  // True once the copy is done; never blocks.
  bool query() const {
#ifdef GRADACCEL_WITH_CUDA
    if (cuda_) {
      bool done = false;
      cuda_check(store_cuda::event_query(cuda_, &done), "cudaEventQuery");
      return done;
    }
#endif
    return !cpu_pending_;
  }

  // The host waits for the copy.
  void synchronize() {
#ifdef GRADACCEL_WITH_CUDA
    if (cuda_) cuda_check(store_cuda::event_synchronize(cuda_), "cudaEventSynchronize");
#endif
    cpu_pending_ = false;
  }

  // Work queued on `stream` from now on runs after the copy (a CPU "stream" is the host).
  void block(void* stream) {
#ifdef GRADACCEL_WITH_CUDA
    if (cuda_ && stream) {
      cuda_check(store_cuda::stream_wait_event(stream, cuda_), "cudaStreamWaitEvent");
      return;
    }
#endif
    (void)stream;
    synchronize();
  }

 private:
  void destroy() noexcept {
#ifdef GRADACCEL_WITH_CUDA
    // A pending event may be destroyed: CUDA frees it once it completes.
    if (cuda_) store_cuda::event_destroy(cuda_);
#endif
    cuda_ = nullptr;
  }

  void* cuda_ = nullptr;
  bool cpu_pending_ = false;
};

}  // namespace gradaccel::store
