// The memop protocol's kernels: run copies (scatter, gather) and the ordered float32
// accumulation, each its own launch; the host orders them around the publish and wait.
#include <algorithm>
#include <cstdint>

#include "device/ordered_sum.cuh"
#include "device/signal.cuh"
#include "memop_kernels.h"

namespace jax_cpgrad {
namespace {

constexpr int kThreads = 256;
constexpr int kCopyUnroll = 2;  // vectors in flight per thread in a copy (see copy_rows)
// Vectors per thread per writer in the accumulation. With 4 (and packed loads, see sum_words)
// benchmarks/kernels.py on one H200 went from 77-84% to 88-93% of a device copy at 64 MiB per
// tensor; experiments/kernel_variants.cu has 1 ahead only for R=2 from 128 MiB up, by 3-6
// points.
constexpr int kSumUnroll = 4;

// Did the call fail (the watchdog released a stuck wait, or the workspace is closed)?
__device__ __forceinline__ bool call_failed(const char* own_header) {
  return own_header != nullptr &&
         reinterpret_cast<const volatile Control*>(own_header)->state != kStateOk;
}

// ---------------------------------------------------------------------------------------------
// Row maps: a copy moves `rows` rows of `row_bytes` each; a map gives each row's source and
// destination, and `checked_header()` the header whose state poisons the copy (none for
// the scatters: they run before the wait, so nothing can have failed yet).

struct OwnerChunksMap {  // grad_return scatter: rows = data peers x T x outer x 2 halves
  CallPlan plan;
  TensorPtrs t;
  PeerTable peers;
  __device__ const char* checked_header() const { return nullptr; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t h = row % 2;
    const int64_t b = (row / 2) % plan.outer;
    const int64_t k = (row / (2 * plan.outer)) % plan.tensors;
    const int64_t owner = data_peer(plan, row / (2 * plan.outer * plan.tensors));
    const int64_t rb = plan.run_bytes();
    *src = t.in[k] + (b * 2 * plan.n + chunk_of(owner, h, plan.n)) * rb;
    *dst = peers.slots[owner] + slot_offset(plan.n, plan.slot_bytes, plan.set, plan.self) +
           k * plan.tensor_bytes() + (b * 2 + h) * rb;
  }
};

struct LocalCopiesMap {  // all_gather scatter: rows = data peers x T, each a whole local tensor
  CallPlan plan;
  TensorPtrs t;
  PeerTable peers;
  __device__ const char* checked_header() const { return nullptr; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t k = row % plan.tensors;
    const int64_t owner = data_peer(plan, row / plan.tensors);
    *src = t.in[k];
    *dst = peers.slots[owner] + slot_offset(plan.n, plan.slot_bytes, plan.set, plan.self) +
           k * plan.tensor_bytes();
  }
};

struct GatherMap {  // all_gather finish: rows = T x outer x 2R global chunks (zeros out of reach)
  CallPlan plan;
  TensorPtrs t;
  const char* own_header;
  const char* own_slots;
  __device__ const char* checked_header() const { return own_header; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t j = row % (2 * plan.n);
    const int64_t b = (row / (2 * plan.n)) % plan.outer;
    const int64_t k = row / (2 * plan.n * plan.outer);
    const int64_t owner = owner_of(j, plan.n);
    const int64_t rb = plan.run_bytes();
    const int64_t local_row = (b * 2 + half_of(j, plan.n)) * rb;
    *src = !plan.in_reach(owner) ? nullptr
           : owner == plan.self
               ? t.in[k] + local_row
               : own_slots + slot_offset(plan.n, plan.slot_bytes, plan.set, owner) +
                     k * plan.tensor_bytes() + local_row;
    *dst = t.out[k] + row % (2 * plan.n * plan.outer) * rb;
  }
};

// The copies cut each row into tiles of kThreads * kCopyUnroll vectors and launch one block per
// tile of every row, leaving the scheduling to the hardware. In benchmarks/kernels.py on one
// H200, from 64 MiB per tensor up, that took the scatter from 85-91% to 94-97% of a device copy,
// while the gather (same kernel, another map) went from 87-90% to 86-88%. The accumulation keeps
// a one-wave grid-stride loop: one block per tile gave it 65-88% there (the per-block setup,
// unamortised over a 16 KiB tile, is the likely cost). experiments/kernel_variants.cu has
// the sweep. The tile loop only comes round again when the tiles outnumber the largest grid.
struct Tiling {
  int64_t rows, units_per_row, tiles_per_row;
};

Tiling tiling(int64_t rows, int64_t units_per_row, int64_t tile_units) {
  return {rows, units_per_row, (units_per_row + tile_units - 1) / tile_units};
}

unsigned blocks_for(const Tiling& g) {
  return static_cast<unsigned>(
      std::min<int64_t>(g.rows * g.tiles_per_row, INT32_MAX));  // callers skip empty copies
}

// Calls tile_fn(row, first unit of this thread) for every tile this block owns.
template <int64_t kTileUnits, typename TileFn>
__device__ __forceinline__ void for_each_tile(const Tiling& g, TileFn tile_fn) {
  for (int64_t tile = blockIdx.x; tile < g.rows * g.tiles_per_row; tile += gridDim.x) {
    tile_fn(tile / g.tiles_per_row, tile % g.tiles_per_row * kTileUnits + threadIdx.x);
  }
}

// The error word is read after the loads are issued, so its latency overlaps theirs.
template <typename Vec, typename Map>
__global__ void __launch_bounds__(kThreads) copy_rows(Map map, Tiling g) {
  for_each_tile<int64_t(kThreads) * kCopyUnroll>(g, [&](int64_t row, int64_t base) {
    const char* src_bytes;
    char* dst_bytes;
    map(row, &src_bytes, &dst_bytes);  // a null source: a row of zeros
    const Vec* src = reinterpret_cast<const Vec*>(src_bytes);
    Vec* dst = reinterpret_cast<Vec*>(dst_bytes);
    Vec v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < g.units_per_row) v[u] = src == nullptr ? Vec{} : src[i];
    }
    const bool failed = call_failed(map.checked_header());
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < g.units_per_row) {
        if (failed) memset(&v[u], 0xff, sizeof(Vec));  // all-ones: NaN in every float format
        dst[i] = v[u];
      }
    }
  });
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Launches copy_rows with the widest vector that the row size and every base pointer allow.
template <typename Map>
cudaError_t launch_copy(const Map& map, int64_t rows, int64_t row_bytes, bool all_aligned_16,
                        cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return cudaSuccess;
  constexpr int64_t kTile = int64_t(kThreads) * kCopyUnroll;
  if (all_aligned_16 && row_bytes % 16 == 0) {
    const Tiling g = tiling(rows, row_bytes / 16, kTile);
    copy_rows<uint4, Map><<<blocks_for(g), kThreads, 0, stream>>>(map, g);
  } else {
    const Tiling g = tiling(rows, row_bytes / 2, kTile);  // every dtype is a multiple of 2 bytes
    copy_rows<uint16_t, Map><<<blocks_for(g), kThreads, 0, stream>>>(map, g);
  }
  return cudaGetLastError();
}

TensorPtrs tensor_ptrs(const CallPlan& plan, const void* const* in, void* const* out, bool* ok16) {
  TensorPtrs t{};
  for (int64_t k = 0; k < plan.tensors; ++k) {
    t.in[k] = static_cast<const char*>(in[k]);
    t.out[k] = out ? static_cast<char*>(out[k]) : nullptr;
    *ok16 = *ok16 && aligned(in[k], 16) && (!out || aligned(out[k], 16));
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// The ordered accumulation: a one-wave grid, x over the words of a row, y over the rows.

template <typename T, typename Word>
__global__ void __launch_bounds__(kThreads)
    accumulate_rows(CallPlan plan, TensorPtrs t, const char* own_header, const char* own_slots,
                    int64_t words_per_row) {
  const int64_t rows = plan.tensors * plan.outer * 2;
  const int64_t rb = plan.run_bytes();
  const bool failed = call_failed(own_header);
  spin_for_ns(plan.test_finish_delay_ns);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t h = row % 2;
    const int64_t b = (row / 2) % plan.outer;
    const int64_t k = row / (2 * plan.outer);
    const Contributions<Word> in{
        reinterpret_cast<const Word*>(t.in[k] +
                                      (b * 2 * plan.n + chunk_of(plan.self, h, plan.n)) * rb),
        own_slots + slot_offset(plan.n, plan.slot_bytes, plan.set, 0) + row * rb,
        plan.slot_bytes,
        plan.first_in_reach(),
        plan.ranks_in_reach(),
        plan.self};
    Word* out = reinterpret_cast<Word*>(t.out[k] + (b * 2 + h) * rb);
    const int64_t stride = int64_t(gridDim.x) * kThreads * kSumUnroll;
    for (int64_t base = int64_t(blockIdx.x) * kThreads * kSumUnroll + threadIdx.x;
         base < words_per_row; base += stride) {
      if (failed) {
        for (int u = 0; u < kSumUnroll; ++u) {
          if (base + u * kThreads < words_per_row) out[base + u * kThreads] = poison_word<Word>();
        }
        continue;
      }
      sum_words<T, Word, kSumUnroll, kThreads>(in, out, base, words_per_row);
    }
  }
}

// Multiprocessors of the first GPU asked (the GPUs of one CP group are alike).
int64_t device_sm_count() {
  static const int64_t sms = [] {
    int device = 0, count = 132;
    if (cudaGetDevice(&device) == cudaSuccess)
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return static_cast<int64_t>(count);
  }();
  return sms;
}

// Blocks of `Kernel` that fit on one multiprocessor at once (looked up once per kernel).
template <auto Kernel>
int64_t resident_blocks_per_sm() {
  static const int64_t blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, 0) != cudaSuccess ||
        b < 1)
      b = 1;
    return static_cast<int64_t>(b);
  }();
  return blocks;
}

// One wave of `Kernel` over `rows` rows of `work_per_row` units, one block covering `per_block`
// units of a row: no tail wave, and grid-stride loops do the rest.
template <auto Kernel>
dim3 one_wave_grid(int64_t rows, int64_t work_per_row, int64_t per_block) {
  const int64_t target = device_sm_count() * resident_blocks_per_sm<Kernel>();
  const int64_t gx =
      std::max<int64_t>(1, std::min((work_per_row + per_block - 1) / per_block, target));
  const int64_t gy =
      std::max<int64_t>(1, std::min<int64_t>({rows, std::max<int64_t>(1, target / gx), 65535}));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

template <typename T>
cudaError_t launch_accumulate_typed(const CallPlan& plan, const TensorPtrs& t, bool ok16,
                                    const PeerTable& peers, cudaStream_t stream) {
  const int64_t rows = plan.tensors * plan.outer * 2;
  const int64_t rb = plan.run_bytes();
  const char* header = peers.header[plan.self];
  const char* slots = peers.slots[plan.self];
  if (ok16 && rb % 16 == 0 && plan.slot_bytes % 16 == 0) {
    constexpr auto kernel = accumulate_rows<T, uint4>;
    kernel<<<one_wave_grid<kernel>(rows, rb / 16, kThreads * kSumUnroll), kThreads, 0, stream>>>(
        plan, t, header, slots, rb / 16);
  } else {
    constexpr auto kernel = accumulate_rows<T, T>;
    kernel<<<one_wave_grid<kernel>(rows, plan.run, kThreads * kSumUnroll), kThreads, 0, stream>>>(
        plan, t, header, slots, plan.run);
  }
  return cudaGetLastError();
}

// Loads a kernel and primes its launch-configuration statics, outside the handler's hot path.
template <auto Kernel>
cudaError_t warm() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, Kernel);
  resident_blocks_per_sm<Kernel>();
  return err;
}

}  // namespace

cudaError_t launch_scatter_owner_chunks(const CallPlan& plan, const void* const* global_inputs,
                                        const PeerTable& peers, cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  OwnerChunksMap map{plan, tensor_ptrs(plan, global_inputs, nullptr, &ok16), peers};
  const int64_t rows = data_peer_count(plan) * plan.tensors * plan.outer * 2;
  return launch_copy(map, rows, plan.run_bytes(), ok16, stream);
}

cudaError_t launch_scatter_local_copies(const CallPlan& plan, const void* const* local_inputs,
                                        const PeerTable& peers, cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  LocalCopiesMap map{plan, tensor_ptrs(plan, local_inputs, nullptr, &ok16), peers};
  return launch_copy(map, data_peer_count(plan) * plan.tensors, plan.tensor_bytes(), ok16, stream);
}

cudaError_t launch_accumulate(const CallPlan& plan, const void* const* global_inputs,
                              void* const* local_outputs, const PeerTable& peers,
                              cudaStream_t stream) {
  bool ok16 = true;
  const TensorPtrs t = tensor_ptrs(plan, global_inputs, local_outputs, &ok16);
  switch (plan.dtype) {
    case ElementType::kF32:
      return launch_accumulate_typed<float>(plan, t, ok16, peers, stream);
    case ElementType::kBF16:
      return launch_accumulate_typed<__nv_bfloat16>(plan, t, ok16, peers, stream);
    case ElementType::kF16:
      return launch_accumulate_typed<__half>(plan, t, ok16, peers, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gather(const CallPlan& plan, const void* const* local_inputs,
                          void* const* global_outputs, const PeerTable& peers,
                          cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  GatherMap map{plan, tensor_ptrs(plan, local_inputs, global_outputs, &ok16),
                peers.header[plan.self], peers.slots[plan.self]};
  return launch_copy(map, plan.tensors * plan.outer * 2 * plan.n, plan.run_bytes(), ok16, stream);
}

cudaError_t warm_memop_kernels() {
  device_sm_count();
  for (cudaError_t err :
       {warm<copy_rows<uint4, OwnerChunksMap>>(), warm<copy_rows<uint16_t, OwnerChunksMap>>(),
        warm<copy_rows<uint4, LocalCopiesMap>>(), warm<copy_rows<uint16_t, LocalCopiesMap>>(),
        warm<copy_rows<uint4, GatherMap>>(), warm<copy_rows<uint16_t, GatherMap>>(),
        warm<accumulate_rows<float, uint4>>(), warm<accumulate_rows<float, float>>(),
        warm<accumulate_rows<__nv_bfloat16, uint4>>(),
        warm<accumulate_rows<__nv_bfloat16, __nv_bfloat16>>(),
        warm<accumulate_rows<__half, uint4>>(), warm<accumulate_rows<__half, __half>>()}) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_cpgrad
