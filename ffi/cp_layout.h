// The load-balanced context-parallel layout, in one place for the host, the kernels and Python.
//
// The global sequence of length S is cut into 2R chunks of S/(2R) tokens. CP rank r holds
// chunks r and 2R-1-r, in that order (Megatron-LM's get_batch_on_this_cp_rank).
//
// Every tensor is viewed as [outer, sequence, inner] around its sequence axis. A "run" is one
// chunk of one outer row: run = chunk_len * inner elements, contiguous in both the global
// ([outer, 2R, run]) and the local ([outer, 2, run]) view, so every copy in this library is a
// copy of whole runs.
#pragma once

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define CPG_HOST_DEVICE __host__ __device__
#else
#define CPG_HOST_DEVICE
#endif

namespace jax_cpgrad {

// The largest CP size supported: it bounds the flag array and the batch of stream memory ops.
inline constexpr int64_t kMaxRanks = 128;
// The most tensors (dK, dV, ...) one call moves together.
inline constexpr int64_t kMaxTensors = 8;

// Global chunk held by `rank` at local position `half` (0 or 1).
CPG_HOST_DEVICE constexpr int64_t chunk_of(int64_t rank, int64_t half, int64_t n) {
  return half == 0 ? rank : 2 * n - 1 - rank;
}
// The CP rank that holds global chunk `chunk`.
CPG_HOST_DEVICE constexpr int64_t owner_of(int64_t chunk, int64_t n) {
  return chunk < n ? chunk : 2 * n - 1 - chunk;
}
// Local position (0 or 1) of global chunk `chunk` on its owner.
CPG_HOST_DEVICE constexpr int64_t half_of(int64_t chunk, int64_t n) { return chunk < n ? 0 : 1; }

// Shape of one tensor around its sequence axis, in elements.
struct Geometry {
  int64_t outer = 1;       // product of the dimensions before the sequence axis
  int64_t run = 0;         // elements of one chunk of one outer row: chunk_len * inner
  int64_t chunk_len = 0;   // tokens per chunk, S / (2R)
  int64_t global_len = 0;  // S
  int64_t local_len = 0;   // S / R
};

// Which side of the collective a shape describes.
enum class SeqExtent { kGlobal, kLocal };

// Computes the geometry of a tensor of `rank` dimensions `dims` whose sequence axis is `seq_axis`
// (already made non-negative) and holds the global (S) or the local (S/R) sequence. Returns an
// empty string on success, otherwise a message naming the problem.
inline std::string compute_geometry(const int64_t* dims, int64_t rank, int64_t seq_axis, int64_t n,
                                    SeqExtent extent, Geometry* out) {
  if (n < 1 || n > kMaxRanks) {
    return "CP size must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(n);
  }
  if (seq_axis < 0 || seq_axis >= rank) {
    return "seq_axis " + std::to_string(seq_axis) + " is out of range for an array of rank " +
           std::to_string(rank);
  }
  Geometry g;
  int64_t inner = 1;
  for (int64_t i = 0; i < rank; ++i) {
    if (dims[i] < 0) return "negative dimension";
    if (i < seq_axis) g.outer *= dims[i];
    if (i > seq_axis) inner *= dims[i];
  }
  const int64_t len = dims[seq_axis];
  const int64_t pieces = extent == SeqExtent::kGlobal ? 2 * n : 2;
  if (len % pieces != 0 || len == 0) {
    return std::string(extent == SeqExtent::kGlobal ? "global" : "local") + " sequence length " +
           std::to_string(len) + " (axis " + std::to_string(seq_axis) +
           ") must be a positive multiple of " + std::to_string(pieces) +
           (extent == SeqExtent::kGlobal ? " (2 * CP size " + std::to_string(n) + ")"
                                         : " (each rank holds two chunks)");
  }
  g.chunk_len = len / pieces;
  g.global_len = g.chunk_len * 2 * n;
  g.local_len = g.chunk_len * 2;
  g.run = g.chunk_len * inner;
  *out = g;
  return {};
}

}  // namespace jax_cpgrad
