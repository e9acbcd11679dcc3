// The memop protocol's synchronisation of one call, as stream memory operations on the
// caller's stream: publish epoch e to every peer's flag (tile 0), note arrival, wait until every
// peer's flag is >= e (cyclic), note passage. Plain pointers only, so the handler and the
// benchmarks enqueue the same thing.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "call_plan.h"

namespace jax_cpgrad {

struct ProtocolSite {
  int64_t n = 1;                     // CP size
  int64_t self = 0;                  // this rank
  const PeerTable* peers = nullptr;  // every rank's memory as mapped here
  uint32_t* reached = nullptr;       // device view of HostReport::reached (mapped host memory)
  uint32_t* passed = nullptr;        // and of HostReport::passed
};

// Enqueues the 2(R-1)+2 operations in as few cuStreamBatchMemOp calls as the driver allows.
CUresult enqueue_publish_and_wait(const ProtocolSite& site, uint32_t epoch, cudaStream_t stream);

}  // namespace jax_cpgrad
