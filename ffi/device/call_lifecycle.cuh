// What every device-protocol kernel does around its data movement, whatever the wire format
// (tile flags or LL words): learn the call's epoch at the start, declare the call failed when a
// wait expires, and, in the last block to finish, poison the outputs of a failed call and advance
// the epoch. The contract is written in fused_kernels.h.
#pragma once

#include <cuda/atomic>

#include "../fused_kernels.h"
#include "row_copy.cuh"
#include "signal.cuh"

namespace jax_cpgrad {

__device__ __forceinline__ Control* own_control(const FusedCall& c) {
  return reinterpret_cast<Control*>(c.peers.header[c.plan.self]);
}

// The slot set (of two) that call e uses: its epoch's parity, so that call e+1 never writes where
// call e may still be read. Test builds can force set 0 (single_buffer: the race tests' negative
// control).
__device__ __forceinline__ int64_t slot_set(const FusedCall& c, uint32_t e) {
  return c.single_buffer ? 0 : e & 1;
}

// What every block learns first: this call's epoch, and whether the workspace is usable.
struct CallStart {
  uint32_t epoch;
  bool ok;
};

__device__ __forceinline__ CallStart start_call(Control* ctrl) {
  __shared__ uint32_t epoch, state;
  if (threadIdx.x == 0) {
    epoch = volatile_load(&ctrl->epoch) + 1;
    state = volatile_load(&ctrl->state);
  }
  __syncthreads();
  return {epoch, state == kStateOk};
}

// Marks call e failed (the caller has recorded the writers it never heard from in
// Control::missing): the state becomes kStateFailed, so every other waiting thread stops, and
// the host hears of it from the thread that made the change. Any thread may call it, several at
// once.
__device__ __forceinline__ void declare_failed(const FusedCall& c, Control* ctrl, uint32_t e) {
  *reinterpret_cast<volatile uint32_t*>(&ctrl->failed_epoch) = e;
  __threadfence();
  if (atomicCAS(&ctrl->state, kStateOk, kStateFailed) != kStateOk) return;
  __threadfence_system();
  static_cast<volatile HostReport*>(c.report)->timed_out = 1;
}

// The last block to finish advances the epoch; if the call failed (or the workspace was failed
// or closed when it started) it fills every output with NaN first. One acq_rel add orders it all:
// after the barrier it releases this block's stores (a release is cumulative), and it lets the
// last block acquire every other block's. No fence.sc (__threadfence): three of them on this path
// cost microseconds per call. The closing stores need no fence either: the next kernel on this
// stream, which starts after this one has ended, is what reads them (the host's status() reads
// the epoch too, for display only).
__device__ __forceinline__ void finish_call(const FusedCall& c, OpKind op, Control* ctrl,
                                            uint32_t e) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    last = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(ctrl->blocks_done)
               .fetch_add(1u, cuda::memory_order_acq_rel) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  if (volatile_load(&ctrl->state) != kStateOk) {
    const int64_t bytes = (op == OpKind::kGradReturn ? 1 : c.plan.n) * c.plan.tensor_bytes();
    for (int64_t k = 0; k < c.plan.tensors; ++k) block_poison(c.t.out[k], bytes);
  }
  if (threadIdx.x == 0) {
    ctrl->blocks_done = 0;
    ctrl->epoch = e;
  }
}

// A device-protocol kernel's frame: learn the call, run body(ctrl, epoch) if the workspace is
// usable, then finish. Every thread reaches finish_call (body must not leave the kernel).
template <typename Body>
__device__ __forceinline__ void run_call(const FusedCall& c, OpKind op, Body body) {
  Control* ctrl = own_control(c);
  const CallStart s = start_call(ctrl);
  if (s.ok) body(ctrl, s.epoch);
  finish_call(c, op, ctrl, s.epoch);
}

template <auto Kernel>
cudaError_t launch_kernel(int32_t blocks, const FusedCall& c, cudaStream_t stream) {
  Kernel<<<blocks, kFusedThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

}  // namespace jax_cpgrad
