#include "call_stream.h"

#include <cstdio>
#include <string>
#include <vector>

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

cudaError_t CallStream::follow(cudaStream_t xla_stream) {
  std::lock_guard lock(mu_);
  cudaError_t err = cudaEventRecord(inputs_ready_, xla_stream);
  return err != cudaSuccess ? err : cudaStreamWaitEvent(stream_, inputs_ready_, 0);
}

cudaError_t CallStream::mark_started() {
  std::lock_guard lock(mu_);
  return cudaEventRecord(started_, stream_);
}

cudaError_t CallStream::join(cudaStream_t xla_stream) {
  std::lock_guard lock(mu_);
  return cudaStreamWaitEvent(xla_stream, started_, 0);
}

}  // namespace jax_cpgrad
