// The ordered float32 sum both protocols end with: out = in_0 + in_1 + ... + in_{R-1}, added in
// writer order 0..R-1 in float32 starting from writer 0's value, rounded once to T (with a reach,
// the writers in reach alone, lowest first). Deterministic, and bitwise equal to
// grad_return_reference (which sums the same way with XLA ops).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace jax_cpgrad {

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
template <>
struct Convert<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Convert<__half> {
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

// All-ones bytes: NaN in every float format. Written where a call failed.
template <typename Word>
__device__ __forceinline__ Word poison_word() {
  Word w;
  memset(&w, 0xff, sizeof(Word));
  return w;
}

// Where the contributions of one stretch of output come from: writers first .. first + count - 1
// (every rank, or those in the call's reach), our own from `own` (the global input), writer w's
// from `slot0 + w * slot_stride` (w != self).
template <typename Word>
struct Contributions {
  const Word* own;
  const char* slot0;
  int64_t slot_stride;  // bytes between two writers' slots
  int64_t first, count, self;
  __device__ const Word* of(int64_t w) const {
    return w == self ? own : reinterpret_cast<const Word*>(slot0 + w * slot_stride);
  }
};

// Sums words base, base + kStride, ..., base + (kUnroll-1) * kStride (those below `words`) of
// the contributions into `out`, in writer order. `Word` is what one load moves (uint4, or T
// itself); loaded words stay packed and are unpacked one element at a time as they are added (a
// struct of T elements made nvcc keep every bf16 in its own register: 213 registers, 35% of a
// copy). The loads of kWriterBatch writers are issued before their adds, so each thread keeps
// kWriterBatch * kUnroll loads in flight.
template <typename T, typename Word, int kUnroll, int kStride>
__device__ __forceinline__ void sum_words(const Contributions<Word>& c, Word* out, int64_t base,
                                          int64_t words) {
  constexpr int kElems = sizeof(Word) / sizeof(T);
  constexpr int kWriterBatch = 4;
  float acc[kUnroll][kElems];
  for (int64_t w0 = 0; w0 < c.count; w0 += kWriterBatch) {
    Word loaded[kWriterBatch][kUnroll];
#pragma unroll
    for (int j = 0; j < kWriterBatch; ++j) {
      if (w0 + j >= c.count) continue;
      const Word* src = c.of(c.first + w0 + j);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kStride;
        if (i < words) loaded[j][u] = __ldcg(src + i);  // L2 only: peers wrote it, not this SM
      }
    }
#pragma unroll
    for (int j = 0; j < kWriterBatch; ++j) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const T* elems = reinterpret_cast<const T*>(&loaded[j][u]);
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
          if (w0 + j >= c.count) continue;
          const float x = Convert<T>::load(elems[e]);
          acc[u][e] = w0 + j == 0 ? x : acc[u][e] + x;
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kStride;
    if (i >= words) continue;
    Word result;
    T* elems = reinterpret_cast<T*>(&result);
#pragma unroll
    for (int e = 0; e < kElems; ++e) elems[e] = Convert<T>::store(acc[u][e]);
    out[i] = result;
  }
}

}  // namespace jax_cpgrad
