#include "call_stream.h"

#include <algorithm>
#include <cstdio>

#include "cuda_check.h"

namespace jax_cpgrad {

CallStream::CallStream(int device) : device_(device) {
  DeviceGuard guard(device);
  try {
    CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CPG_CUDA_OR_THROW(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    CPG_CUDA_OR_THROW(cudaEventCreateWithFlags(&started_, cudaEventDisableTiming));
  } catch (...) {
    release();
    throw;
  }
  started_calls_.reserve(kRemembered);
}

CallStream::~CallStream() { release(); }

void CallStream::release() {
  int previous = 0;
  cudaGetDevice(&previous);
  if (cudaSetDevice(device_) != cudaSuccess) return;
  std::vector<std::string> problems;
  if (stream_ != nullptr) CPG_CUDA_OR_NOTE(cudaStreamSynchronize(stream_), problems);
  for (cudaEvent_t* e : {&inputs_ready_, &started_}) {
    if (*e != nullptr) CPG_CUDA_OR_NOTE(cudaEventDestroy(*e), problems);
    *e = nullptr;
  }
  if (stream_ != nullptr) CPG_CUDA_OR_NOTE(cudaStreamDestroy(stream_), problems);
  stream_ = nullptr;
  for (const auto& p : problems) std::fprintf(stderr, "jax_cpgrad: %s\n", p.c_str());
  cudaSetDevice(previous);
}

cudaError_t CallStream::follow(const Lock&, cudaStream_t xla_stream) {
  cudaError_t err = cudaEventRecord(inputs_ready_, xla_stream);
  return err != cudaSuccess ? err : cudaStreamWaitEvent(stream_, inputs_ready_, 0);
}

cudaError_t CallStream::mark_started(const Lock&, const CallBuffers& buffers) {
  if (started_calls_.size() == kRemembered) started_calls_.erase(started_calls_.begin());
  started_calls_.push_back(buffers);
  return cudaEventRecord(started_, stream_);
}

std::string CallStream::join(const Lock& lock, const CallBuffers& buffers,
                             cudaStream_t xla_stream) {
  // A done may run twice for one start (XLA clones custom calls), so the record stays.
  if (std::find(started_calls_.begin(), started_calls_.end(), buffers) == started_calls_.end()) {
    return "the done was not handed the buffers of any of the last " + std::to_string(kRemembered) +
           " starts (XLA copied the results or the inputs between start and done, or more calls "
           "were in flight at once), so it cannot keep them safe";
  }
  cudaError_t err = join_unchecked(lock, xla_stream);
  return err == cudaSuccess ? "" : cuda_error_text(err, "cudaStreamWaitEvent", __FILE__, __LINE__);
}

cudaError_t CallStream::join_unchecked(const Lock&, cudaStream_t xla_stream) {
  return cudaStreamWaitEvent(xla_stream, started_, 0);
}

}  // namespace jax_cpgrad
