// The memop protocol's kernels (the fallback where ranks share one GPU and spinning
// kernels of time-sliced processes would crawl): the host enqueues scatter, then the publish and
// wait (stream_protocol.h), then the accumulation or gather. Plain pointers only.
#pragma once

#include <cuda_runtime.h>

#include "call_plan.h"

namespace jax_cpgrad {

// grad_return, step 1: send owner o (for every o != self) its two chunks of every global input.
cudaError_t launch_scatter_owner_chunks(const CallPlan& plan, const void* const* global_inputs,
                                        const PeerTable& peers, cudaStream_t stream);
// all_gather, step 1: send every peer a copy of every local input.
cudaError_t launch_scatter_local_copies(const CallPlan& plan, const void* const* local_inputs,
                                        const PeerTable& peers, cudaStream_t stream);
// grad_return, step 3: sum the R contributions (own from the input, others from our slots) in
// writer order 0..R-1 in float32, rounding once; NaN if our Control::state is not kStateOk.
cudaError_t launch_accumulate(const CallPlan& plan, const void* const* global_inputs,
                              void* const* local_outputs, const PeerTable& peers,
                              cudaStream_t stream);
// all_gather, step 3: lay the R local pieces out in natural order (own piece from the input).
cudaError_t launch_gather(const CallPlan& plan, const void* const* local_inputs,
                          void* const* global_outputs, const PeerTable& peers, cudaStream_t stream);

// Loads every kernel now (CUDA lazy loading would otherwise do it, possibly blocking, at the
// first call, while peers wait on the GPU).
cudaError_t warm_memop_kernels();

}  // namespace jax_cpgrad
