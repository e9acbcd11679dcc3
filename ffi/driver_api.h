// CUDA driver entry points, resolved at run time through the runtime: the module never links
// libcuda.so, so a CPU-only machine can import it and the driver XLA already loaded is used.
#pragma once

#include <cuda.h>

namespace jax_cpgrad {

struct DriverApi {
  CUresult (*stream_batch_mem_op)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
};

// Resolves the entry points once (thread-safe). Throws std::runtime_error naming what is
// missing; call it during setup so the handler never pays for it.
const DriverApi& driver_api();

}  // namespace jax_cpgrad
