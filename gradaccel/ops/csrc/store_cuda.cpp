// CUDA side of the activation store: the few CUDA runtime calls that gradaccel/ops/csrc/store.cpp and
// gradaccel/ops/csrc/host_pool.cpp make, on raw pointers and `void*` streams/events (gradaccel/ops/csrc/store.h).
//
// The calls are looked up at run time in the CUDA runtime that PyTorch has already loaded
// (its wheel's libcudart.so.<major>), rather than compiled by nvcc against a toolkit: a CUDA
// build of torch brings its runtime as a wheel, not as a toolkit, so building gradaccel needs
// neither nvcc nor CUDA_HOME, only g++ and torch's own headers (gradaccel/ops/extension.py).
// The prototypes below are the runtime API's C ABI, which CUDA keeps stable across releases.
#ifdef GRADACCEL_WITH_CUDA

#include <dlfcn.h>

#include <cstddef>
#include <string>

#include "store.h"

#ifndef GRADACCEL_CUDA_MAJOR
#error "GRADACCEL_CUDA_MAJOR (torch's CUDA major version, e.g. 13) is set by gradaccel/ops/extension.py"
#endif
#define GRADACCEL_STR_(x) #x
#define GRADACCEL_STR(x) GRADACCEL_STR_(x)
// The soname of the runtime that torch's CUDA build links, e.g. "libcudart.so.13".
#define GRADACCEL_CUDART "libcudart.so." GRADACCEL_STR(GRADACCEL_CUDA_MAJOR)

namespace gradaccel::store_cuda {
namespace {

// cudaError_t values and flags that this file needs (driver_types.h).
constexpr int kSuccess = 0;
constexpr int kErrorNotReady = 600;
constexpr int kNoRuntime = -1;  // ours: the runtime library or one of its symbols was not found
constexpr unsigned kHostAllocPortable = 0x01;
constexpr unsigned kEventDisableTiming = 0x02;
constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;

struct Runtime {
  int (*host_alloc)(void**, std::size_t, unsigned) = nullptr;
  int (*free_host)(void*) = nullptr;
  int (*memcpy_async)(void*, const void*, std::size_t, int, void*) = nullptr;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  int (*event_query)(void*) = nullptr;
  int (*event_synchronize)(void*) = nullptr;
  int (*get_last_error)() = nullptr;
  const char* (*error_string)(int) = nullptr;
  std::string missing;  // why the runtime is unusable; empty when every symbol was found

  Runtime() {
    // The soname first without loading anything (the copy torch loaded), then a load by
    // name (a toolkit's runtime on the library path).
    void* lib = dlopen(GRADACCEL_CUDART, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen(GRADACCEL_CUDART, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      missing = std::string("the CUDA runtime ") + GRADACCEL_CUDART + " is not loaded and could not be loaded (" +
                dlerror() + "); the activation store needs the CUDA runtime of the torch gradaccel was built against";
      return;
    }
    find(lib, host_alloc, "cudaHostAlloc");
    find(lib, free_host, "cudaFreeHost");
    find(lib, memcpy_async, "cudaMemcpyAsync");
    find(lib, event_create, "cudaEventCreateWithFlags");
    find(lib, event_destroy, "cudaEventDestroy");
    find(lib, event_record, "cudaEventRecord");
    find(lib, stream_wait_event, "cudaStreamWaitEvent");
    find(lib, event_query, "cudaEventQuery");
    find(lib, event_synchronize, "cudaEventSynchronize");
    find(lib, get_last_error, "cudaGetLastError");
    find(lib, error_string, "cudaGetErrorString");
  }

  template <typename F>
  void find(void* lib, F& fn, const char* name) {
    fn = reinterpret_cast<F>(dlsym(lib, name));
    if (!fn && missing.empty()) missing = std::string("the CUDA runtime ") + GRADACCEL_CUDART + " has no " + name;
  }
};

// Looked up once, on the first call (thread-safe static initialisation).
const Runtime& rt() {
  static const Runtime runtime;
  return runtime;
}

}  // namespace

int host_alloc(void** ptr, std::size_t bytes) {
  *ptr = nullptr;
  if (!rt().missing.empty()) return kNoRuntime;
  int err = rt().host_alloc(ptr, bytes, kHostAllocPortable);
  if (err != kSuccess) {
    *ptr = nullptr;
    rt().get_last_error();  // an allocation failure is not sticky: leave no error for the next call
  }
  return err;
}

int host_free(void* ptr) { return rt().missing.empty() ? rt().free_host(ptr) : kNoRuntime; }

int copy_async(void* dst, const void* src, std::size_t bytes, bool to_host, void* stream) {
  if (!rt().missing.empty()) return kNoRuntime;
  return rt().memcpy_async(dst, src, bytes, to_host ? kMemcpyDeviceToHost : kMemcpyHostToDevice, stream);
}

int event_create(void** event) {
  *event = nullptr;
  if (!rt().missing.empty()) return kNoRuntime;
  int err = rt().event_create(event, kEventDisableTiming);
  if (err != kSuccess) *event = nullptr;
  return err;
}

int event_destroy(void* event) { return rt().missing.empty() ? rt().event_destroy(event) : kNoRuntime; }

int event_record(void* event, void* stream) {
  return rt().missing.empty() ? rt().event_record(event, stream) : kNoRuntime;
}

int stream_wait_event(void* stream, void* event) {
  return rt().missing.empty() ? rt().stream_wait_event(stream, event, 0) : kNoRuntime;
}

int event_query(void* event, bool* done) {
  *done = false;
  if (!rt().missing.empty()) return kNoRuntime;
  int err = rt().event_query(event);
  *done = err == kSuccess;
  if (err == kErrorNotReady) {
    rt().get_last_error();  // "not ready" is an answer, not an error
    return kSuccess;
  }
  return err;
}

int event_synchronize(void* event) { return rt().missing.empty() ? rt().event_synchronize(event) : kNoRuntime; }

const char* error_string(int code) {
  if (code == kNoRuntime) return rt().missing.c_str();
  return rt().error_string(code);
}

}  // namespace gradaccel::store_cuda

#endif  // GRADACCEL_WITH_CUDA
