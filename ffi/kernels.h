// Launchers for the transport's kernels. Plain pointers only: no FFI types, no registry.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cp_layout.h"

namespace jax_cpgrad {

enum class ElementType { kF32, kBF16, kF16 };

CPG_HOST_DEVICE inline int64_t element_bytes(ElementType t) { return t == ElementType::kF32 ? 4 : 2; }

// One call of the collective as the kernels see it.
struct CallPlan {
  int64_t n = 1;           // CP size
  int64_t self = 0;        // this device's CP rank
  int64_t tensors = 1;     // how many tensors move together
  int64_t outer = 1;       // see Geometry
  int64_t run = 0;         // elements of one run
  int64_t set = 0;         // slot set of this call (epoch parity)
  int64_t slot_bytes = 0;  // stride between slots in a region
  ElementType dtype = ElementType::kF32;
  CPG_HOST_DEVICE int64_t run_bytes() const { return run * element_bytes(dtype); }
  CPG_HOST_DEVICE int64_t tensor_bytes() const { return outer * 2 * run_bytes(); }  // one tensor, local layout
};

// Every rank's region as mapped on this device (raw or IPC pointers); [self] is our own.
struct RegionTable {
  char* region[kMaxRanks];
};

// grad_return, step 1: send owner o (for every o != self) its two chunks of every global input.
cudaError_t launch_scatter_owner_chunks(const CallPlan& plan, const void* const* global_inputs,
                                        const RegionTable& regions, cudaStream_t stream);
// all_gather, step 1: send every peer a copy of every local input.
cudaError_t launch_scatter_local_copies(const CallPlan& plan, const void* const* local_inputs,
                                        const RegionTable& regions, cudaStream_t stream);
// grad_return, step 4: sum the N contributions (own from the input, others from the slots) in
// writer order 0..N-1 in float32, rounding once; all-ones (NaN) if the error word is set.
cudaError_t launch_accumulate(const CallPlan& plan, const void* const* global_inputs,
                              void* const* local_outputs, const char* own_region,
                              cudaStream_t stream);
// all_gather, step 4: lay the N local pieces out in natural order (own piece from the input).
cudaError_t launch_gather(const CallPlan& plan, const void* const* local_inputs,
                          void* const* global_outputs, const char* own_region,
                          cudaStream_t stream);

// Loads every kernel now (CUDA lazy loading would otherwise do it, possibly blocking, at the
// first call, while peers wait on the GPU).
cudaError_t warm_kernels();

}  // namespace jax_cpgrad
