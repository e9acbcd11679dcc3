// A cudaMalloc'd buffer on the current device, freed with its owner (benchmarks only).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"

namespace jax_cpgrad {

struct DeviceBuffer {
  explicit DeviceBuffer(int64_t bytes) {
    CPG_CUDA_OR_THROW(cudaMalloc(&ptr, std::max<int64_t>(bytes, 256)));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* ptr = nullptr;
};

}  // namespace jax_cpgrad
