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

constexpr uint32_t kUnitBytes = kLLUnitBytes;
constexpr uint32_t kWordBytes = kLLWordBytes;
constexpr uint32_t kSpinsPerCheck = 256;  // polls between looks at the state and the clock

__device__ __forceinline__ void ll_send(char* slot, uint32_t u, uint2 data, uint32_t e) {
  asm volatile(
      "st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(slot + uint64_t(u) * kWordBytes),
      "r"(data.x), "r"(e), "r"(data.y), "r"(~e)
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

__device__ __forceinline__ bool ll_arrived(uint4 v, uint32_t e) { return v.y == e && v.w == ~e; }

// One 8-byte unit of a tensor: in one load or store where the tensors are 8-byte aligned, else
// in four 2-byte ones (every dtype is at least 2-byte aligned). The wire format is the same.
template <bool kAligned>
__device__ __forceinline__ uint2 load_unit(const char* p) {
  if (kAligned) return *reinterpret_cast<const uint2*>(p);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return make_uint2(h[0] | uint32_t(h[1]) << 16, h[2] | uint32_t(h[3]) << 16);
}

template <bool kAligned>
__device__ __forceinline__ void store_unit(char* p, uint2 v) {
  if (kAligned) {
    *reinterpret_cast<uint2*>(p) = v;
    return;
  }
  uint16_t* h = reinterpret_cast<uint16_t*>(p);
  h[0] = uint16_t(v.x), h[1] = uint16_t(v.x >> 16), h[2] = uint16_t(v.y),
  h[3] = uint16_t(v.y >> 16);
}

// Where unit u of a payload of `row_bytes`-byte rows lies. Rows are numbered (k * outer + b) * 2
// + h (tensor k, outer index b, half h) in both ops, and a row is a run, so `local` (its offset
// in tensor k's local layout [outer, 2, run]) and `global_row0` (the offset of outer index b's
// first chunk in the global layout [outer, 2R, run]) place it in either. LL payloads are at most
// kLLMaxPayload, so 32-bit arithmetic is exact and cheap (64-bit division dominated the tile
// kernels' small calls).
struct UnitPlace {
  uint32_t k, h;
  int64_t local, global_row0;
};

// Calls fn(u, place) for every unit this thread owns (the same units in the push and the finish,
// on every rank), until fn returns false.
template <typename Fn>
__device__ __forceinline__ void for_each_own_unit(const CallPlan& p, Fn fn) {
  const uint32_t rb = static_cast<uint32_t>(p.run_bytes()), outer = static_cast<uint32_t>(p.outer);
  const uint32_t units = static_cast<uint32_t>(p.payload_bytes() / kUnitBytes);
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
    const uint32_t byte = u * kUnitBytes, row = byte / rb, kb = row >> 1;
    const uint32_t k = kb / outer, b = kb % outer, h = row & 1u, offset = byte - row * rb;
    const UnitPlace at{k, h, (int64_t(b) * 2 + h) * rb + offset,
                       int64_t(b) * 2 * p.n * rb + offset};
    if (!fn(u, at)) return;
  }
}

// What one thread needs while it waits: the call, our LL slots of this call's set, and the
// deadline of its first wait.
struct Receiver {
  const FusedCall& c;
  Control* ctrl;
  uint32_t e;
  int64_t set;
  uint64_t deadline = 0;

  __device__ const char* slot_of(int64_t w) const {
    return ll_slot_of(c.peers.header[c.plan.self], c.plan.n, c.plan.slot_bytes, set, w);
  }

  // Waits until unit u from writer w has arrived and gives its data; false when the call failed:
  // our deadline expired (then every writer whose unit u is missing is recorded) or another
  // thread's did.
  __device__ bool receive(uint32_t u, int64_t w, uint2* data) {
    for (uint32_t spins = 1;; ++spins) {
      const uint4 v = ll_peek(slot_of(w), u);
      if (ll_arrived(v, e)) {
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
        for (int64_t x = 0; x < c.plan.n; ++x) {
          if (x != c.plan.self && !ll_arrived(ll_peek(slot_of(x), u), e))
            atomicOr(&ctrl->missing[x / 32], 1u << (x % 32));
        }
        declare_failed(c, ctrl, e);
        return false;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// grad_return: unit u for owner o is chunk chunk_of(o, h) of our global input; the owner sums the
// R writers' units (those in the call's reach) in writer order, in float32, and rounds once.
// LL units carry their epoch, so every writer sends every owner all of its units whatever the
// reach: a small call's bytes do not matter, its order does.

template <bool kAligned>
__device__ void ll_push_owner_chunks(const FusedCall& c, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  for_each_own_unit(p, [&](uint32_t u, const UnitPlace& at) {
    const char* row0 = c.t.in[at.k] + at.global_row0;
    for (int64_t q = 0; q < p.n - 1; ++q) {
      const int64_t owner = rotated_owner(p.self, p.n, q);
      const uint2 data = load_unit<kAligned>(row0 + chunk_of(owner, at.h, p.n) * rb);
      ll_send(ll_slot_of(c.peers.header[owner], p.n, p.slot_bytes, set, p.self), u, data, e);
    }
    return true;
  });
}

template <typename T, bool kAligned>
__device__ void ll_sum_units(const FusedCall& c, Receiver& rx) {
  constexpr int kElems = kUnitBytes / sizeof(T);
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  for_each_own_unit(p, [&](uint32_t u, const UnitPlace& at) {
    float acc[kElems];
    for (int64_t w = 0; w < p.n; ++w) {
      uint2 data;
      if (w == p.self) {
        data =
            load_unit<kAligned>(c.t.in[at.k] + at.global_row0 + chunk_of(p.self, at.h, p.n) * rb);
      } else if (!rx.receive(u, w, &data)) {
        return false;
      }
      if (!p.in_reach(w)) continue;  // received all the same: the epoch's order
      const T* elems = reinterpret_cast<const T*>(&data);
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const float x = Convert<T>::load(elems[i]);
        acc[i] = w == p.first_in_reach() ? x : acc[i] + x;
      }
    }
    uint2 result;
    T* elems = reinterpret_cast<T*>(&result);
#pragma unroll
    for (int i = 0; i < kElems; ++i) elems[i] = Convert<T>::store(acc[i]);
    store_unit<kAligned>(c.t.out[at.k] + at.local, result);
    return true;
  });
}

template <typename T, bool kAligned>
__global__ void __launch_bounds__(kFusedThreads) ll_grad_return(FusedCall c) {
  run_call(c, OpKind::kGradReturn, [&](Control* ctrl, uint32_t e) {
    Receiver rx{c, ctrl, e, slot_set(c, e)};
    ll_push_owner_chunks<kAligned>(c, e, rx.set);
    spin_for_ns(c.plan.test_finish_delay_ns);
    ll_sum_units<T, kAligned>(c, rx);
  });
}

// ---------------------------------------------------------------------------------------------
// all_gather: unit u is our local input, the same for every owner; the owner places writer w's
// unit at chunk chunk_of(w, h) of its output (zeros for a writer out of the call's reach).

template <bool kAligned>
__device__ void ll_push_local_copies(const FusedCall& c, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  for_each_own_unit(p, [&](uint32_t u, const UnitPlace& at) {
    const uint2 data = load_unit<kAligned>(c.t.in[at.k] + at.local);
    for (int64_t q = 0; q < p.n - 1; ++q) {
      const int64_t owner = rotated_owner(p.self, p.n, q);
      ll_send(ll_slot_of(c.peers.header[owner], p.n, p.slot_bytes, set, p.self), u, data, e);
    }
    return true;
  });
}

template <bool kAligned>
__device__ void ll_place_units(const FusedCall& c, Receiver& rx) {
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  for_each_own_unit(p, [&](uint32_t u, const UnitPlace& at) {
    for (int64_t i = 0; i < p.n; ++i) {
      const int64_t w = (p.self + i) % p.n;  // our own unit first: it needs no wait
      uint2 data;
      if (w == p.self) {
        data = load_unit<kAligned>(c.t.in[at.k] + at.local);
      } else if (!rx.receive(u, w, &data)) {
        return false;
      }
      if (!p.in_reach(w)) data = make_uint2(0, 0);  // received all the same: the epoch's order
      store_unit<kAligned>(c.t.out[at.k] + at.global_row0 + chunk_of(w, at.h, p.n) * rb, data);
    }
    return true;
  });
}

template <bool kAligned>
__global__ void __launch_bounds__(kFusedThreads) ll_all_gather(FusedCall c) {
  run_call(c, OpKind::kAllGather, [&](Control* ctrl, uint32_t e) {
    Receiver rx{c, ctrl, e, slot_set(c, e)};
    ll_push_local_copies<kAligned>(c, e, rx.set);
    spin_for_ns(c.plan.test_finish_delay_ns);
    ll_place_units<kAligned>(c, rx);
  });
}

template <bool kAligned>
cudaError_t launch_ll(OpKind op, const FusedCall& c, cudaStream_t stream) {
  const int32_t blocks = c.shape.ll_blocks;
  if (op == OpKind::kAllGather) return launch_kernel<ll_all_gather<kAligned>>(blocks, c, stream);
  switch (c.plan.dtype) {
    case ElementType::kF32:
      return launch_kernel<ll_grad_return<float, kAligned>>(blocks, c, stream);
    case ElementType::kBF16:
      return launch_kernel<ll_grad_return<__nv_bfloat16, kAligned>>(blocks, c, stream);
    case ElementType::kF16:
      return launch_kernel<ll_grad_return<__half, kAligned>>(blocks, c, stream);
  }
  return cudaErrorInvalidValue;
}

bool tensors_aligned_8(const FusedCall& c) {
  for (int64_t k = 0; k < c.plan.tensors; ++k) {
    if (reinterpret_cast<uintptr_t>(c.t.in[k]) % kUnitBytes != 0 ||
        reinterpret_cast<uintptr_t>(c.t.out[k]) % kUnitBytes != 0)
      return false;
  }
  return true;
}

template <bool kAligned>
cudaError_t warm() {
  return load_kernels({reinterpret_cast<const void*>(ll_all_gather<kAligned>),
                       reinterpret_cast<const void*>(ll_grad_return<float, kAligned>),
                       reinterpret_cast<const void*>(ll_grad_return<__nv_bfloat16, kAligned>),
                       reinterpret_cast<const void*>(ll_grad_return<__half, kAligned>)});
}

}  // namespace

bool ll_possible(const CallPlan& plan) {
  return plan.n > 1 && plan.payload_bytes() <= kLLMaxPayload &&
         plan.payload_bytes() <= plan.slot_bytes && plan.run_bytes() % kUnitBytes == 0;
}

cudaError_t launch_fused_ll(OpKind op, const FusedCall& c, cudaStream_t stream) {
  // Alignment is this rank's own business: both variants put the same words on the wire.
  return tensors_aligned_8(c) ? launch_ll<true>(op, c, stream) : launch_ll<false>(op, c, stream);
}

cudaError_t warm_fused_ll_kernels() {
  if (cudaError_t err = warm<true>(); err != cudaSuccess) return err;
  return warm<false>();
}

}  // namespace jax_cpgrad
