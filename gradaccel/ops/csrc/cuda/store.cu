// CUDA side of the activation store: thin wrappers over the CUDA runtime for gradaccel/ops/csrc/store.cpp.
// No kernels: the store only moves bytes. Includes no ATen/c10 header (see store.h).
#include <cuda_runtime.h>

#include "../store.h"

namespace gradaccel::store_cuda {

int host_alloc(void** ptr, std::size_t bytes) {
  *ptr = nullptr;
  cudaError_t err = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    *ptr = nullptr;
    cudaGetLastError();  // an allocation failure is not sticky: leave no error for the next call
  }
  return static_cast<int>(err);
}

int host_free(void* ptr) { return static_cast<int>(cudaFreeHost(ptr)); }

int copy_async(void* dst, const void* src, std::size_t bytes, bool to_host, void* stream) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  return static_cast<int>(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)));
}

int event_create(void** event) {
  cudaEvent_t ev = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  *event = err == cudaSuccess ? static_cast<void*>(ev) : nullptr;
  return static_cast<int>(err);
}

int event_destroy(void* event) { return static_cast<int>(cudaEventDestroy(static_cast<cudaEvent_t>(event))); }

int event_record(void* event, void* stream) {
  return static_cast<int>(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

int stream_wait_event(void* stream, void* event) {
  return static_cast<int>(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

int event_query(void* event, bool* done) {
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  *done = err == cudaSuccess;
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not an error
    return 0;
  }
  return static_cast<int>(err);
}

int event_synchronize(void* event) {
  return static_cast<int>(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace gradaccel::store_cuda
