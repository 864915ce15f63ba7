// CUDA runtime calls used by the activation store (gradaccel/ops/csrc/store.cpp, gradaccel/ops/csrc/host_pool.cpp), defined in
// gradaccel/ops/csrc/store_cuda.cpp on raw pointers and `void*` streams/events.
//
// Plain C++ on purpose: no CUDA header is needed anywhere (the CPU torch wheel ships no
// c10/cuda headers, and a CUDA torch needs no toolkit to build gradaccel). Every function
// returns the cudaError_t value as an int (0 = success); error_string() turns it into text.
#pragma once

#include <cstddef>

namespace gradaccel::store_cuda {

// Page-locked (pinned) host memory, portable across devices. On failure *ptr is null and the
// CUDA error state is cleared, so the caller can free memory and try again.
int host_alloc(void** ptr, std::size_t bytes);
int host_free(void* ptr);

// One asynchronous copy on `stream` between pinned host memory and device memory.
int copy_async(void* dst, const void* src, std::size_t bytes, bool to_host, void* stream);

// Events without timing (cheapest kind), recorded on and waited for by streams.
int event_create(void** event);
int event_destroy(void* event);
int event_record(void* event, void* stream);
int stream_wait_event(void* stream, void* event);  // the stream waits; the host does not
int event_query(void* event, bool* done);           // never blocks
int event_synchronize(void* event);                 // the host waits

const char* error_string(int code);

}  // namespace gradaccel::store_cuda
