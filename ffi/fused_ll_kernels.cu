// The device protocol's small calls, as LL words: every 8-byte unit of payload travels with the
// call's epoch beside it, so the owner learns that it arrived from the data itself. One remote
// store per unit and no flag round trip (tile flags cost a system-scope release after the data,
// then the flag's own trip). The contract is in fused_kernels.h, the slots in region_layout.h.
#include <cstdint>

#include "device/call_lifecycle.cuh"
#include "device/ordered_sum.cuh"
#include "fused_kernels.h"

namespace jax_cpgrad {
namespace {

constexpr uint32_t kUnitBytes = 8;        // payload per LL word
constexpr uint32_t kWordBytes = 16;       // {data, epoch, data, epoch}
constexpr uint32_t kSpinsPerCheck = 256;  // polls between looks at the state and the clock

// Where unit u of a payload of `row_bytes`-byte rows lies. Rows are numbered (k * outer + b) * 2
// + h (tensor k, outer index b, half h) in both ops. LL payloads are below kLLMaxPayload, so
// 32-bit arithmetic is exact and cheap (64-bit division dominated the tile kernels' small calls).
struct UnitPlace {
  uint32_t k, b, h, offset;
};

__device__ __forceinline__ UnitPlace place_of(uint32_t u, uint32_t row_bytes, uint32_t outer) {
  const uint32_t byte = u * kUnitBytes;
  const uint32_t row = byte / row_bytes;
  const uint32_t kb = row >> 1;
  return {kb / outer, kb % outer, row & 1u, byte - row * row_bytes};
}

__device__ __forceinline__ void ll_send(char* slot, uint32_t u, uint2 data, uint32_t e) {
  asm volatile(
      "st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(slot + uint64_t(u) * kWordBytes),
      "r"(data.x), "r"(e), "r"(data.y), "r"(e)
      : "memory");
}

__device__ __forceinline__ uint4 ll_peek(const char* slot, uint32_t u) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(slot + uint64_t(u) * kWordBytes)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 load_unit(const char* p) {
  return *reinterpret_cast<const uint2*>(p);
}

// What one thread needs while it waits: the call, and the deadline of its first wait.
struct Receiver {
  const FusedCall& c;
  Control* ctrl;
  uint32_t e;
  uint64_t deadline = 0;

  // Waits until unit u of writer w's LL slot holds epoch e (both halves: the 16-byte store may
  // land as two 8-byte ones) and gives its data; false when the call failed: our deadline
  // expired (then writer w is recorded missing) or another thread's did.
  __device__ bool receive(const char* slot, uint32_t u, int64_t w, uint2* data) {
    for (uint32_t spins = 1;; ++spins) {
      const uint4 v = ll_peek(slot, u);
      if (v.y == e && v.w == e) {
        *data = make_uint2(v.x, v.z);
        return true;
      }
      if (spins % kSpinsPerCheck != 0) continue;
      if (volatile_load(&ctrl->state) != kStateOk) return false;
      if (c.timeout_ns == 0) continue;
      const uint64_t now = global_timer_ns();
      if (deadline == 0) {
        deadline = now + c.timeout_ns;
      } else if (now > deadline) {
        atomicOr(&ctrl->missing[w / 32], 1u << (w % 32));
        declare_failed(c, ctrl, e);
        return false;
      }
    }
  }
};

// This thread's units: u = first_unit(), += unit_stride(), while u < units.
__device__ __forceinline__ uint32_t first_unit() { return blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ uint32_t unit_stride() { return gridDim.x * blockDim.x; }

// ---------------------------------------------------------------------------------------------
// grad_return: unit u for owner o is chunk chunk_of(o, h) of our global input at (k, b, offset);
// the owner sums the N writers' units in writer order, in float32, and rounds once.

__device__ void ll_push_owner_chunks(const FusedCall& c, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const uint32_t rb = static_cast<uint32_t>(p.run_bytes()), outer = static_cast<uint32_t>(p.outer);
  const uint32_t units = static_cast<uint32_t>(p.payload_bytes() / kUnitBytes);
  for (uint32_t u = first_unit(); u < units; u += unit_stride()) {
    const UnitPlace at = place_of(u, rb, outer);
    const char* row0 = c.t.in[at.k] + int64_t(at.b) * 2 * p.n * rb + at.offset;
    for (int64_t q = 0; q < p.n - 1; ++q) {
      const int64_t owner = rotated_owner(p.self, p.n, q);
      const uint2 data = load_unit(row0 + chunk_of(owner, at.h, p.n) * rb);
      ll_send(ll_slot_of(c.peers.header[owner], p.n, set, p.self), u, data, e);
    }
  }
}

template <typename T>
__device__ void ll_sum_units(const FusedCall& c, Receiver& rx, int64_t set) {
  constexpr int kElems = kUnitBytes / sizeof(T);
  const CallPlan& p = c.plan;
  const uint32_t rb = static_cast<uint32_t>(p.run_bytes()), outer = static_cast<uint32_t>(p.outer);
  const uint32_t units = static_cast<uint32_t>(p.payload_bytes() / kUnitBytes);
  for (uint32_t u = first_unit(); u < units; u += unit_stride()) {
    const UnitPlace at = place_of(u, rb, outer);
    float acc[kElems];
    for (int64_t w = 0; w < p.n; ++w) {
      uint2 data;
      if (w == p.self) {
        data = load_unit(c.t.in[at.k] +
                         (int64_t(at.b) * 2 * p.n + chunk_of(p.self, at.h, p.n)) * rb + at.offset);
      } else if (!rx.receive(ll_slot_of(c.peers.header[p.self], p.n, set, w), u, w, &data)) {
        return;
      }
      const T* elems = reinterpret_cast<const T*>(&data);
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const float x = Convert<T>::load(elems[i]);
        acc[i] = w == 0 ? x : acc[i] + x;
      }
    }
    uint2 result;
    T* elems = reinterpret_cast<T*>(&result);
#pragma unroll
    for (int i = 0; i < kElems; ++i) elems[i] = Convert<T>::store(acc[i]);
    *reinterpret_cast<uint2*>(c.t.out[at.k] + (int64_t(at.b) * 2 + at.h) * rb + at.offset) = result;
  }
}

template <typename T>
__global__ void __launch_bounds__(kFusedThreads) ll_grad_return(FusedCall c) {
  Control* ctrl = own_control(c);
  const CallStart s = start_call(ctrl);
  if (s.ok) {
    const int64_t set = s.epoch & 1;
    ll_push_owner_chunks(c, s.epoch, set);
    Receiver rx{c, ctrl, s.epoch};
    ll_sum_units<T>(c, rx, set);
  }
  finish_call(c, OpKind::kGradReturn, ctrl, s.epoch);
}

// ---------------------------------------------------------------------------------------------
// all_gather: unit u is our local input at (k, b, h, offset), the same for every owner; the
// owner places writer w's unit at chunk chunk_of(w, h) of its output.

__device__ void ll_push_local_copies(const FusedCall& c, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const uint32_t rb = static_cast<uint32_t>(p.run_bytes()), outer = static_cast<uint32_t>(p.outer);
  const uint32_t units = static_cast<uint32_t>(p.payload_bytes() / kUnitBytes);
  for (uint32_t u = first_unit(); u < units; u += unit_stride()) {
    const UnitPlace at = place_of(u, rb, outer);
    const uint2 data = load_unit(c.t.in[at.k] + (int64_t(at.b) * 2 + at.h) * rb + at.offset);
    for (int64_t q = 0; q < p.n - 1; ++q) {
      const int64_t owner = rotated_owner(p.self, p.n, q);
      ll_send(ll_slot_of(c.peers.header[owner], p.n, set, p.self), u, data, e);
    }
  }
}

__device__ void ll_place_units(const FusedCall& c, Receiver& rx, int64_t set) {
  const CallPlan& p = c.plan;
  const uint32_t rb = static_cast<uint32_t>(p.run_bytes()), outer = static_cast<uint32_t>(p.outer);
  const uint32_t units = static_cast<uint32_t>(p.payload_bytes() / kUnitBytes);
  for (uint32_t u = first_unit(); u < units; u += unit_stride()) {
    const UnitPlace at = place_of(u, rb, outer);
    char* out_row = c.t.out[at.k] + int64_t(at.b) * 2 * p.n * rb + at.offset;
    for (int64_t i = 0; i < p.n; ++i) {
      const int64_t w = (p.self + i) % p.n;  // our own unit first: it needs no wait
      uint2 data;
      if (w == p.self) {
        data = load_unit(c.t.in[at.k] + (int64_t(at.b) * 2 + at.h) * rb + at.offset);
      } else if (!rx.receive(ll_slot_of(c.peers.header[p.self], p.n, set, w), u, w, &data)) {
        return;
      }
      *reinterpret_cast<uint2*>(out_row + chunk_of(w, at.h, p.n) * rb) = data;
    }
  }
}

__global__ void __launch_bounds__(kFusedThreads) ll_all_gather(FusedCall c) {
  Control* ctrl = own_control(c);
  const CallStart s = start_call(ctrl);
  if (s.ok) {
    const int64_t set = s.epoch & 1;
    ll_push_local_copies(c, s.epoch, set);
    Receiver rx{c, ctrl, s.epoch};
    ll_place_units(c, rx, set);
  }
  finish_call(c, OpKind::kAllGather, ctrl, s.epoch);
}

template <auto Kernel>
cudaError_t launch(const FusedCall& c, cudaStream_t stream) {
  Kernel<<<c.shape.ll_blocks, kFusedThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

}  // namespace

bool ll_possible(const CallPlan& plan) {
  return plan.n > 1 && plan.payload_bytes() <= kLLMaxPayload && plan.run_bytes() % kUnitBytes == 0;
}

cudaError_t launch_fused_ll(OpKind op, const FusedCall& c, cudaStream_t stream) {
  if (op == OpKind::kAllGather) return launch<ll_all_gather>(c, stream);
  switch (c.plan.dtype) {
    case ElementType::kF32:
      return launch<ll_grad_return<float>>(c, stream);
    case ElementType::kBF16:
      return launch<ll_grad_return<__nv_bfloat16>>(c, stream);
    case ElementType::kF16:
      return launch<ll_grad_return<__half>>(c, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t warm_fused_ll_kernels() {
  cudaFuncAttributes attr;
  for (const void* kernel : {reinterpret_cast<const void*>(ll_all_gather),
                             reinterpret_cast<const void*>(ll_grad_return<float>),
                             reinterpret_cast<const void*>(ll_grad_return<__nv_bfloat16>),
                             reinterpret_cast<const void*>(ll_grad_return<__half>)}) {
    if (cudaError_t err = cudaFuncGetAttributes(&attr, kernel); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_cpgrad
