// Pieces the benchmark module's measurements share (benchmarks only).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "call_plan.h"
#include "cuda_check.h"
#include "vmm_memory.h"

namespace jax_cpgrad {

// A cudaMalloc'd buffer on the current device, freed with its owner.
struct DeviceBuffer {
  explicit DeviceBuffer(int64_t bytes) {
    CPG_CUDA_OR_THROW(cudaMalloc(&ptr, std::max<int64_t>(bytes, 256)));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* ptr = nullptr;
};

// Workspace memory (headers and slots) as the workspace allocates it: cuMemCreate at the
// recommended granularity; JAX_CPGRAD_BENCH_ALLOC=cudamalloc measures plain cudaMalloc instead,
// to compare the two in one run.
struct RegionBuffer {
  explicit RegionBuffer(int64_t bytes) {
    const char* alloc = std::getenv("JAX_CPGRAD_BENCH_ALLOC");
    if (alloc != nullptr && std::string(alloc) == "cudamalloc") {
      plain = std::make_unique<DeviceBuffer>(bytes);
      ptr = plain->ptr;
    } else {
      int device = 0;
      CPG_CUDA_OR_THROW(cudaGetDevice(&device));
      vmm = VmmMapping::allocate(device, std::max<int64_t>(bytes, 256), false);
      ptr = vmm->ptr();
    }
  }
  std::unique_ptr<DeviceBuffer> plain;
  std::unique_ptr<VmmMapping> vmm;
  char* ptr = nullptr;
};

// The benchmarks' call: dK and dV in bf16, `global_bytes` each, over R ranks (rank 0's view).
inline CallPlan bf16_pair_plan(int64_t n, int64_t global_bytes, int64_t min_run) {
  CallPlan plan;
  plan.n = n;
  plan.tensors = 2;
  plan.dtype = ElementType::kBF16;
  plan.run = std::max<int64_t>(min_run, global_bytes / 2 / (2 * n));
  plan.slot_bytes = round_up_slot_bytes(plan.tensors * plan.tensor_bytes());
  return plan;
}

// Waits for every member's `stop` event and returns the longest start-to-stop time in ms: one
// repetition of a measurement on several GPUs takes as long as its slowest GPU. A member has
// `device`, `start` and `stop`.
template <typename Members>
float slowest_elapsed_ms(const Members& members) {
  float slowest = 0;
  for (const auto& m : members) {
    DeviceGuard guard(m.device);
    CPG_CUDA_OR_THROW(cudaEventSynchronize(m.stop));
    float ms = 0;
    CPG_CUDA_OR_THROW(cudaEventElapsedTime(&ms, m.start, m.stop));
    slowest = std::max(slowest, ms);
  }
  return slowest;
}

}  // namespace jax_cpgrad
