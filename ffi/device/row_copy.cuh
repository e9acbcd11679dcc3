// Copies of byte ranges through "row maps", run by all threads of one block. Every copy in this
// library moves whole or partial rows: a row is contiguous in both source and destination (a
// chunk of one outer index of one tensor, or a whole local tensor), and a map gives each row's
// two addresses.
#pragma once

#include <cstdint>

namespace jax_cpgrad {

// Calls fn(row, first byte in the row, end byte in the row) for every row that bytes
// [begin, end) of a stream of `row_bytes`-byte rows touch.
template <typename Fn>
__device__ __forceinline__ void for_each_row_segment(int64_t row_bytes, int64_t begin, int64_t end,
                                                     Fn fn) {
  for (int64_t row = begin / row_bytes; row * row_bytes < end; ++row) {
    const int64_t row_begin = row * row_bytes;
    fn(row, max(begin, row_begin) - row_begin, min(end, row_begin + row_bytes) - row_begin);
  }
}

// Copies bytes [begin, end) of the row stream, in units of `Unit` (every offset involved must be
// a multiple of sizeof(Unit)), kUnroll units in flight per thread. A row whose source the map
// gives as null is filled with zeros.
template <typename Unit, int kUnroll, typename RowMap>
__device__ __forceinline__ void block_copy_range(const RowMap& map, int64_t row_bytes,
                                                 int64_t begin, int64_t end) {
  for_each_row_segment(row_bytes, begin, end, [&](int64_t row, int64_t a, int64_t b) {
    const char* src_row;
    char* dst_row;
    map(row, &src_row, &dst_row);
    const Unit* src = src_row == nullptr ? nullptr : reinterpret_cast<const Unit*>(src_row + a);
    Unit* dst = reinterpret_cast<Unit*>(dst_row + a);
    const int64_t units = (b - a) / static_cast<int64_t>(sizeof(Unit));
    for (int64_t base = threadIdx.x; base < units; base += int64_t(blockDim.x) * kUnroll) {
      Unit v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * int64_t(blockDim.x);
        if (i >= units) continue;
        v[u] = src == nullptr ? Unit{} : __ldcg(src + i);  // L2 only: a peer may have written it
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * int64_t(blockDim.x);
        if (i < units) dst[i] = v[u];
      }
    }
  });
}

// Fills `bytes` bytes at `dst` with all-ones (NaN in every float format), block-wide.
__device__ __forceinline__ void block_poison(char* dst, int64_t bytes) {
  for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = static_cast<char>(0xff);
}

}  // namespace jax_cpgrad
