// Device-side signalling between GPUs: a flag is one 32-bit word holding the last epoch a writer
// published; publishing is a system-scope release store after the data, waiting an acquire load
// loop with a deadline. The same shape as XLA's collective_signal.cu.h, with a cyclic comparison
// so that the 32-bit epoch may wrap.
#pragma once

#include <cstdint>
#include <cuda/atomic>

namespace jax_cpgrad {

// a >= b on a 32-bit circle: right across the wrap as long as the two are within 2^31.
__device__ __forceinline__ bool epoch_reached(uint32_t value, uint32_t epoch) {
  return static_cast<int32_t>(value - epoch) >= 0;
}

// Makes the stores this block made before the call visible (system scope) before `flag` holds
// `epoch`. Call from every thread of the block: the barrier orders every thread's stores before
// thread 0's release, and a release is cumulative, so no separate fence.sc.sys is needed (it
// cost several microseconds per tile on H200s).
__device__ __forceinline__ void block_publish(uint32_t* flag, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*flag).store(epoch,
                                                                       cuda::memory_order_release);
  }
}

__device__ __forceinline__ uint32_t acquire_load(const uint32_t* flag) {
  return cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*const_cast<uint32_t*>(flag))
      .load(cuda::memory_order_acquire);
}

__device__ __forceinline__ uint32_t volatile_load(const uint32_t* word) {
  return *reinterpret_cast<const volatile uint32_t*>(word);
}

// Nanoseconds of the GPU's global timer (coarse, but monotonic and the same on every SM).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for `ns` nanoseconds (test builds' delay hook; returns at once for 0).
__device__ __forceinline__ void spin_for_ns(uint32_t ns) {
  if (ns == 0) return;
  const uint64_t until = global_timer_ns() + ns;
  while (global_timer_ns() < until) {
  }
}

}  // namespace jax_cpgrad
