// The transport's kernels: run copies (scatter, gather) and the ordered float32 accumulation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "region_layout.h"

namespace jax_cpgrad {
namespace {

constexpr int kThreads = 256;
constexpr int kCopyUnroll = 2;  // vectors in flight per thread in a copy (see copy_rows)
// Vectors per thread per writer in the accumulation. With 4 (and packed loads, see
// accumulate_rows) benchmarks/kernels.py on one H200 went from 77-84% to 88-93% of a device copy
// at 64 MiB per tensor; benchmarks/sweeps/kernel_variants.cu has 1 ahead only for N=2 from
// 128 MiB up, by 3-6 points.
constexpr int kSumUnroll = 4;

struct TensorPtrs {
  const char* in[kMaxTensors];
  char* out[kMaxTensors];
};

// Is the word at `own_region + kErrorWordOffset` set (the watchdog released a stuck wait)?
__device__ __forceinline__ bool call_failed(const char* own_region) {
  return own_region != nullptr &&
         *reinterpret_cast<const volatile int*>(own_region + kErrorWordOffset) != 0;
}

// The p-th peer (p = 0..N-2) a writer sends to. Rotated by writer, so that at any moment every
// writer pushes into a different owner: with the same order on every writer all of them pushed
// into one owner at a time (incast), and 4 H200s reached 145-162 GB/s instead of 228-279.
__device__ __forceinline__ int64_t rotated_owner(const CallPlan& plan, int64_t p) {
  return (plan.self + 1 + p) % plan.n;
}

// ---------------------------------------------------------------------------------------------
// Row maps: a copy moves `rows` rows of `row_bytes` each; a map gives each row's source and
// destination, and `checked_region()` the region whose error word poisons the copy (none for
// the scatters: they run before the wait, so nothing can have failed yet).

struct OwnerChunksMap {  // grad_return scatter: rows = (N-1) peers x T x outer x 2 halves
  CallPlan plan;
  TensorPtrs t;
  RegionTable regions;
  __device__ const char* checked_region() const { return nullptr; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t h = row % 2;
    const int64_t b = (row / 2) % plan.outer;
    const int64_t k = (row / (2 * plan.outer)) % plan.tensors;
    const int64_t owner = rotated_owner(plan, row / (2 * plan.outer * plan.tensors));
    const int64_t rb = plan.run_bytes();
    *src = t.in[k] + (b * 2 * plan.n + chunk_of(owner, h, plan.n)) * rb;
    *dst = regions.region[owner] + slot_offset(plan.n, plan.slot_bytes, plan.set, plan.self) +
           k * plan.tensor_bytes() + (b * 2 + h) * rb;
  }
};

struct LocalCopiesMap {  // all_gather scatter: rows = (N-1) peers x T, each a whole local tensor
  CallPlan plan;
  TensorPtrs t;
  RegionTable regions;
  __device__ const char* checked_region() const { return nullptr; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t k = row % plan.tensors;
    const int64_t owner = rotated_owner(plan, row / plan.tensors);
    *src = t.in[k];
    *dst = regions.region[owner] + slot_offset(plan.n, plan.slot_bytes, plan.set, plan.self) +
           k * plan.tensor_bytes();
  }
};

struct GatherMap {  // all_gather finish: rows = T x outer x 2N global chunks
  CallPlan plan;
  TensorPtrs t;
  const char* own_region;
  __device__ const char* checked_region() const { return own_region; }
  __device__ void operator()(int64_t row, const char** src, char** dst) const {
    const int64_t j = row % (2 * plan.n);
    const int64_t b = (row / (2 * plan.n)) % plan.outer;
    const int64_t k = row / (2 * plan.n * plan.outer);
    const int64_t owner = owner_of(j, plan.n);
    const int64_t rb = plan.run_bytes();
    const int64_t local_row = (b * 2 + half_of(j, plan.n)) * rb;
    *src = owner == plan.self ? t.in[k] + local_row
                              : own_region + slot_offset(plan.n, plan.slot_bytes, plan.set, owner) +
                                    k * plan.tensor_bytes() + local_row;
    *dst = t.out[k] + row % (2 * plan.n * plan.outer) * rb;
  }
};

// The copies cut each row into tiles of kThreads * kCopyUnroll vectors and launch one block per
// tile of every row, leaving the scheduling to the hardware. In benchmarks/kernels.py on one
// H200, from 64 MiB per tensor up, that took the scatter from 85-91% to 94-97% of a device copy,
// while the gather (same kernel, another map) went from 87-90% to 86-88%. The accumulation keeps
// a one-wave grid-stride loop: one block per tile gave it 65-88% there (the per-block setup,
// unamortised over a 16 KiB tile, is the likely cost). benchmarks/sweeps/kernel_variants.cu has
// the sweep. The tile loop only comes round again when the tiles outnumber the largest grid.
struct Tiling {
  int64_t rows, units_per_row, tiles_per_row;
};

Tiling tiling(int64_t rows, int64_t units_per_row, int64_t tile_units) {
  return {rows, units_per_row, (units_per_row + tile_units - 1) / tile_units};
}

unsigned blocks_for(const Tiling& g) {
  return static_cast<unsigned>(std::min<int64_t>(g.rows * g.tiles_per_row, INT32_MAX));  // callers skip empty copies
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
    map(row, &src_bytes, &dst_bytes);
    const Vec* src = reinterpret_cast<const Vec*>(src_bytes);
    Vec* dst = reinterpret_cast<Vec*>(dst_bytes);
    Vec v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < g.units_per_row) v[u] = src[i];
    }
    const bool failed = call_failed(map.checked_region());
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
// The ordered accumulation.

template <typename T> struct Convert;
template <> struct Convert<float> {
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
template <> struct Convert<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Convert<__half> {
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

// out row (k, b, h) = sum over writers w = 0..N-1, in that order, of writer w's run: our own
// from the global input, the others from their slots. `Word` is what one load moves (uint4 for
// 16-byte vectors, T itself otherwise); loaded words stay packed and are unpacked one element at
// a time as they are added (a struct of T elements made nvcc keep every bf16 in its own
// register: 213 registers, one block per multiprocessor, 35% of a copy). Loads of kWriterBatch
// writers are issued before their adds, so each thread keeps kWriterBatch * kSumUnroll loads in
// flight.
template <typename T, typename Word>
__global__ void __launch_bounds__(kThreads)
accumulate_rows(CallPlan plan, TensorPtrs t, const char* own_region, int64_t words_per_row) {
  constexpr int kElems = sizeof(Word) / sizeof(T);
  constexpr int kWriterBatch = 4;
  const int64_t rows = plan.tensors * plan.outer * 2;
  const int64_t rb = plan.run_bytes();
  const bool failed = call_failed(own_region);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t h = row % 2;
    const int64_t b = (row / 2) % plan.outer;
    const int64_t k = row / (2 * plan.outer);
    const char* own = t.in[k] + (b * 2 * plan.n + chunk_of(plan.self, h, plan.n)) * rb;
    const char* slot0 = own_region + slot_offset(plan.n, plan.slot_bytes, plan.set, 0) +
                        k * plan.tensor_bytes() + (b * 2 + h) * rb;
    Word* out = reinterpret_cast<Word*>(t.out[k] + (b * 2 + h) * rb);
    const int64_t stride = int64_t(gridDim.x) * kThreads * kSumUnroll;
    for (int64_t base = int64_t(blockIdx.x) * kThreads * kSumUnroll + threadIdx.x;
         base < words_per_row; base += stride) {
      float acc[kSumUnroll][kElems];
      for (int64_t w0 = 0; w0 < plan.n; w0 += kWriterBatch) {
        Word loaded[kWriterBatch][kSumUnroll];
#pragma unroll
        for (int j = 0; j < kWriterBatch; ++j) {
          const int64_t w = w0 + j;
          const Word* src = reinterpret_cast<const Word*>(w == plan.self ? own : slot0 + w * plan.slot_bytes);
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u) {
            const int64_t i = base + u * kThreads;
            if (w < plan.n && i < words_per_row) loaded[j][u] = src[i];
          }
        }
#pragma unroll
        for (int j = 0; j < kWriterBatch; ++j) {
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u) {
            const T* elems = reinterpret_cast<const T*>(&loaded[j][u]);
#pragma unroll
            for (int e = 0; e < kElems; ++e) {
              if (w0 + j >= plan.n) continue;
              const float x = Convert<T>::load(elems[e]);
              acc[u][e] = w0 + j == 0 ? x : acc[u][e] + x;
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i >= words_per_row) continue;
        Word result;
        T* elems = reinterpret_cast<T*>(&result);
#pragma unroll
        for (int e = 0; e < kElems; ++e) elems[e] = Convert<T>::store(acc[u][e]);
        if (failed) memset(&result, 0xff, sizeof(Word));
        out[i] = result;
      }
    }
  }
}

// Multiprocessors of the first GPU asked (the GPUs of one CP group are alike).
int64_t device_sm_count() {
  static const int64_t sms = [] {
    int device = 0, count = 132;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return static_cast<int64_t>(count);
  }();
  return sms;
}

// Blocks of `Kernel` that fit on one multiprocessor at once (looked up once per kernel).
template <auto Kernel>
int64_t resident_blocks_per_sm() {
  static const int64_t blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, 0) != cudaSuccess || b < 1) b = 1;
    return static_cast<int64_t>(b);
  }();
  return blocks;
}

// One wave of `Kernel` over `rows` rows of `work_per_row` units, one block covering `per_block`
// units of a row: no tail wave, and grid-stride loops do the rest.
template <auto Kernel>
dim3 one_wave_grid(int64_t rows, int64_t work_per_row, int64_t per_block) {
  const int64_t target = device_sm_count() * resident_blocks_per_sm<Kernel>();
  const int64_t gx = std::max<int64_t>(1, std::min((work_per_row + per_block - 1) / per_block, target));
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({rows, std::max<int64_t>(1, target / gx), 65535}));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

template <typename T>
cudaError_t launch_accumulate_typed(const CallPlan& plan, const TensorPtrs& t, bool ok16,
                                    const char* own_region, cudaStream_t stream) {
  const int64_t rows = plan.tensors * plan.outer * 2;
  const int64_t rb = plan.run_bytes();
  if (ok16 && rb % 16 == 0 && plan.slot_bytes % 16 == 0) {
    constexpr auto kernel = accumulate_rows<T, uint4>;
    kernel<<<one_wave_grid<kernel>(rows, rb / 16, kThreads * kSumUnroll), kThreads, 0, stream>>>(plan, t, own_region, rb / 16);
  } else {
    constexpr auto kernel = accumulate_rows<T, T>;
    kernel<<<one_wave_grid<kernel>(rows, plan.run, kThreads * kSumUnroll), kThreads, 0, stream>>>(plan, t, own_region, plan.run);
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
                                        const RegionTable& regions, cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  OwnerChunksMap map{plan, tensor_ptrs(plan, global_inputs, nullptr, &ok16), regions};
  const int64_t rows = (plan.n - 1) * plan.tensors * plan.outer * 2;
  return launch_copy(map, rows, plan.run_bytes(), ok16, stream);
}

cudaError_t launch_scatter_local_copies(const CallPlan& plan, const void* const* local_inputs,
                                        const RegionTable& regions, cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  LocalCopiesMap map{plan, tensor_ptrs(plan, local_inputs, nullptr, &ok16), regions};
  return launch_copy(map, (plan.n - 1) * plan.tensors, plan.tensor_bytes(), ok16, stream);
}

cudaError_t launch_accumulate(const CallPlan& plan, const void* const* global_inputs,
                              void* const* local_outputs, const char* own_region,
                              cudaStream_t stream) {
  bool ok16 = true;
  const TensorPtrs t = tensor_ptrs(plan, global_inputs, local_outputs, &ok16);
  switch (plan.dtype) {
    case ElementType::kF32: return launch_accumulate_typed<float>(plan, t, ok16, own_region, stream);
    case ElementType::kBF16: return launch_accumulate_typed<__nv_bfloat16>(plan, t, ok16, own_region, stream);
    case ElementType::kF16: return launch_accumulate_typed<__half>(plan, t, ok16, own_region, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gather(const CallPlan& plan, const void* const* local_inputs,
                          void* const* global_outputs, const char* own_region,
                          cudaStream_t stream) {
  bool ok16 = plan.slot_bytes % 16 == 0;
  GatherMap map{plan, tensor_ptrs(plan, local_inputs, global_outputs, &ok16), own_region};
  return launch_copy(map, plan.tensors * plan.outer * 2 * plan.n, plan.run_bytes(), ok16, stream);
}

cudaError_t warm_kernels() {
  device_sm_count();
  for (cudaError_t err : {
           warm<copy_rows<uint4, OwnerChunksMap>>(), warm<copy_rows<uint16_t, OwnerChunksMap>>(),
           warm<copy_rows<uint4, LocalCopiesMap>>(), warm<copy_rows<uint16_t, LocalCopiesMap>>(),
           warm<copy_rows<uint4, GatherMap>>(), warm<copy_rows<uint16_t, GatherMap>>(),
           warm<accumulate_rows<float, uint4>>(), warm<accumulate_rows<float, float>>(),
           warm<accumulate_rows<__nv_bfloat16, uint4>>(), warm<accumulate_rows<__nv_bfloat16, __nv_bfloat16>>(),
           warm<accumulate_rows<__half, uint4>>(), warm<accumulate_rows<__half, __half>>()}) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_cpgrad
