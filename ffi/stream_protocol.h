// The synchronisation of one call, as stream memory operations on the caller's stream: publish
// epoch e to every peer's flag, note arrival, wait until every peer's flag is >= e (cyclic),
// note passage. Plain pointers only, so the handler and the benchmarks enqueue the same thing.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels.h"

namespace jax_cpgrad {

struct ProtocolSite {
  int64_t n = 1;                       // CP size
  int64_t self = 0;                    // this rank
  const RegionTable* regions = nullptr;  // every rank's region as mapped here
  char* own_region = nullptr;          // regions->region[self]
  uint32_t* reached = nullptr;         // device view of the progress words (mapped host memory)
  uint32_t* passed = nullptr;
};

// Enqueues the 2(N-1)+2 operations in as few cuStreamBatchMemOp calls as the driver allows.
CUresult enqueue_publish_and_wait(const ProtocolSite& site, uint32_t epoch, cudaStream_t stream);

}  // namespace jax_cpgrad
