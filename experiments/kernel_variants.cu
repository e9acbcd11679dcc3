// Sweep of kernel variants behind the stream-memop protocol's copy and accumulation kernels in
// ffi/memop_kernels.cu, on one GPU (not part of the package; the variants are written out here
// so that the package keeps only the winners). Index: experiments/README.md.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --extended-lambda -o /tmp/kv experiments/kernel_variants.cu
//   /tmp/kv 2> all_variants.csv    # stdout: the best per config; stderr: every variant
//
// Two families, each timed against cudaMemcpy of the same memory traffic (median of 7 x 20):
//   copy: the grad_return scatter ((R-1) owners x 2 tensors x 2 chunks of runs), tile size
//         (threads x vectors per thread), grid shape and cache hints;
//   sum:  the ordered float32 accumulation of R writers, vectors per thread per writer, writer
//         batch, threads, grid shape and cache hints, bf16 and f32.
// Grid shapes: m0 one wave, rows on y, grid-stride in x; m1 one wave over flat tiles; m2 one block
// per tile. Hints: h0 plain; h1 __ldcs/__stcs (evict-first); h2 __ldg.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                     \
  do {                                                            \
    cudaError_t e = (x);                                          \
    if (e != cudaSuccess) {                                       \
      printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                    \
    }                                                             \
  } while (0)

template <int Hint>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if (Hint == 1) return __ldcs(p);
  if (Hint == 2) return __ldg(p);
  return *p;
}
template <int Hint>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if (Hint == 1)
    __stcs(p, v);
  else
    *p = v;
}

// Runs do_tile(row, first vector of this thread) over every tile of every row in grid shape Mode.
template <int Mode, typename F>
__device__ __forceinline__ void for_each_tile(int rows, int64_t vecs, int64_t tile,
                                              int64_t tiles_per_row, F do_tile) {
  if (Mode == 0) {
    for (int row = blockIdx.y; row < rows; row += gridDim.y)
      for (int64_t b = blockIdx.x * tile + threadIdx.x; b < vecs; b += gridDim.x * tile)
        do_tile(row, b);
  } else {
    for (int64_t t = blockIdx.x; t < tiles_per_row * rows; t += gridDim.x)
      do_tile(int(t / tiles_per_row), (t % tiles_per_row) * tile + threadIdx.x);
  }
}

struct Layout {  // one rank's view: 2 tensors, global inputs, R regions of slots
  int n, rows;
  int64_t rb, vecs, tiles_per_row, slot_bytes;
  const char* in;  // [2 tensors][2R chunks][rb]
  char* regions;   // R regions, each [1 KiB flags][R slots of slot_bytes]
  char* out;       // [2 tensors][2 chunks][rb]
  __device__ int64_t region_bytes() const { return 1024 + n * slot_bytes; }
};

template <int Threads, int U, int Mode, int Hint>
__global__ void __launch_bounds__(Threads) scatter(Layout p) {
  for_each_tile<Mode>(
      p.rows, p.vecs, int64_t(Threads) * U, p.tiles_per_row, [&](int row, int64_t base) {
        const int h = row % 2, k = (row / 2) % 2, owner = row / 4 + 1;
        const int chunk = h == 0 ? owner : 2 * p.n - 1 - owner;
        const uint4* s =
            reinterpret_cast<const uint4*>(p.in + (int64_t(k) * 2 * p.n + chunk) * p.rb);
        uint4* d = reinterpret_cast<uint4*>(p.regions + owner * p.region_bytes() + 1024 +
                                            (k * 2 + h) * p.rb);
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * Threads;
          if (i < p.vecs) v[u] = load16<Hint>(s + i);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * Threads;
          if (i < p.vecs) store16<Hint>(d + i, v[u]);
        }
      });
}

template <typename T>
__device__ float to_f32(T x);
template <>
__device__ float to_f32<float>(float x) {
  return x;
}
template <>
__device__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ T from_f32(float x);
template <>
__device__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T, int Threads, int U, int B, int Mode, int Hint>
__global__ void __launch_bounds__(Threads) accumulate(Layout p) {
  constexpr int E = 16 / sizeof(T);
  for_each_tile<Mode>(
      p.rows, p.vecs, int64_t(Threads) * U, p.tiles_per_row, [&](int row, int64_t base) {
        const int k = row / 2, h = row % 2, n = p.n;
        const char* own =
            p.in + (int64_t(k) * 2 * n + (h == 0 ? 0 : 2 * n - 1)) * p.rb;  // rank 0's chunks
        const char* slot0 = p.regions + 1024 + (k * 2 + h) * p.rb;
        uint4* out = reinterpret_cast<uint4*>(p.out + (k * 2 + h) * p.rb);
        float a[U][E];
        for (int w0 = 0; w0 < n; w0 += B) {
          uint4 v[B][U];
#pragma unroll
          for (int j = 0; j < B; ++j) {
            const int w = w0 + j;
            const uint4* src =
                reinterpret_cast<const uint4*>(w == 0 ? own : slot0 + w * p.slot_bytes);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t i = base + u * Threads;
              if (w < n && i < p.vecs) v[j][u] = load16<Hint>(src + i);
            }
          }
#pragma unroll
          for (int j = 0; j < B; ++j)
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const T* t = reinterpret_cast<const T*>(&v[j][u]);
#pragma unroll
              for (int e = 0; e < E; ++e) {
                if (w0 + j >= n) continue;
                a[u][e] = w0 + j == 0 ? to_f32<T>(t[e]) : a[u][e] + to_f32<T>(t[e]);
              }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * Threads;
          if (i >= p.vecs) continue;
          uint4 r;
          T* t = reinterpret_cast<T*>(&r);
#pragma unroll
          for (int e = 0; e < E; ++e) t[e] = from_f32<T>(a[u][e]);
          store16<Hint>(out + i, r);
        }
      });
}

template <typename F>
float median_ms(F launch) {
  for (int i = 0; i < 3; ++i) launch();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> v;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(a);
    for (int i = 0; i < 20; ++i) launch();
    cudaEventRecord(b);
    CK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    v.push_back(ms / 20);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <auto Kernel, int Threads, int U, int Mode>
float time_variant(Layout p) {
  p.tiles_per_row = (p.vecs + Threads * U - 1) / (Threads * U);
  int per_sm = 0, sms = 0, dev = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, Threads, 0);
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t wave = int64_t(sms) * std::max(per_sm, 1);
  dim3 grid;
  if (Mode == 0) {
    const int64_t gx = std::min(p.tiles_per_row, wave);
    grid = dim3(gx, std::max<int64_t>(1, std::min<int64_t>(p.rows, wave / gx)));
  } else {
    grid = dim3(Mode == 1 ? std::min(p.tiles_per_row * p.rows, wave) : p.tiles_per_row * p.rows);
  }
  return median_ms([&] { Kernel<<<grid, Threads>>>(p); });
}

struct Variant {
  std::string name;
  float ms;
};

template <int Threads, int U>
void scatter_variants(const Layout& p, std::vector<Variant>& out) {
  const std::string tag = "t" + std::to_string(Threads) + " u" + std::to_string(U);
  out.push_back({tag + " m0 h0", time_variant<scatter<Threads, U, 0, 0>, Threads, U, 0>(p)});
  out.push_back({tag + " m1 h0", time_variant<scatter<Threads, U, 1, 0>, Threads, U, 1>(p)});
  out.push_back({tag + " m2 h0", time_variant<scatter<Threads, U, 2, 0>, Threads, U, 2>(p)});
  out.push_back({tag + " m0 h1", time_variant<scatter<Threads, U, 0, 1>, Threads, U, 0>(p)});
  out.push_back({tag + " m2 h1", time_variant<scatter<Threads, U, 2, 1>, Threads, U, 2>(p)});
}

template <typename T, int Threads, int U, int B>
void accumulate_variants(const Layout& p, std::vector<Variant>& out) {
  const std::string tag =
      "t" + std::to_string(Threads) + " u" + std::to_string(U) + " b" + std::to_string(B);
  out.push_back(
      {tag + " m0 h0", time_variant<accumulate<T, Threads, U, B, 0, 0>, Threads, U, 0>(p)});
  out.push_back(
      {tag + " m1 h0", time_variant<accumulate<T, Threads, U, B, 1, 0>, Threads, U, 1>(p)});
  out.push_back(
      {tag + " m2 h0", time_variant<accumulate<T, Threads, U, B, 2, 0>, Threads, U, 2>(p)});
  out.push_back(
      {tag + " m0 h1", time_variant<accumulate<T, Threads, U, B, 0, 1>, Threads, U, 0>(p)});
  out.push_back(
      {tag + " m2 h1", time_variant<accumulate<T, Threads, U, B, 2, 1>, Threads, U, 2>(p)});
  out.push_back(
      {tag + " m2 h2", time_variant<accumulate<T, Threads, U, B, 2, 2>, Threads, U, 2>(p)});
}

// Prints one config: every variant to stderr as CSV, the best five to stdout, as % of cudaMemcpy.
void report(const char* family, int n, int64_t mib, const char* dtype, float copy_ms,
            std::vector<Variant> v) {
  for (const Variant& x : v)
    fprintf(stderr, "%s,%d,%lld,%s,%s,%.2f\n", family, n, (long long)mib, dtype, x.name.c_str(),
            100 * copy_ms / x.ms);
  std::sort(v.begin(), v.end(), [](const Variant& a, const Variant& b) { return a.ms < b.ms; });
  printf("%-10s R=%d %5lld MiB %-4s | best:", family, n, (long long)mib, dtype);
  for (size_t i = 0; i < std::min<size_t>(5, v.size()); ++i)
    printf(" [%s %.1f%%]", v[i].name.c_str(), 100 * copy_ms / v[i].ms);
  printf("\n");
  fflush(stdout);
}

template <typename T>
void run_config(int n, int64_t mib, const char* dtype) {
  const int64_t global = mib << 20, local = global / n;
  Layout p{};
  p.n = n;
  p.rb = local / 2;
  p.vecs = p.rb / 16;
  p.slot_bytes = 2 * local;
  char *in, *regions, *out, *copy_src, *copy_dst;
  const int64_t regions_bytes = n * (1024 + n * p.slot_bytes);
  const int64_t scatter_bytes = (n - 1) * 2 * local, sum_traffic = (n + 1) * 2 * local;
  CK(cudaMalloc(&in, 2 * global));
  CK(cudaMemset(in, 0, 2 * global));
  CK(cudaMalloc(&regions, regions_bytes));
  CK(cudaMemset(regions, 0, regions_bytes));
  CK(cudaMalloc(&out, 2 * local));
  CK(cudaMalloc(&copy_src, std::max(scatter_bytes, sum_traffic / 2)));
  CK(cudaMalloc(&copy_dst, std::max(scatter_bytes, sum_traffic / 2)));
  p.in = in;
  p.regions = regions;
  p.out = out;
  auto copy_ms = [&](int64_t bytes) {
    return median_ms(
        [&] { cudaMemcpyAsync(copy_dst, copy_src, bytes, cudaMemcpyDeviceToDevice, 0); });
  };
  if (sizeof(T) == 2) {  // the scatter moves bytes: one dtype is enough
    std::vector<Variant> v;
    p.rows = (n - 1) * 4;
    scatter_variants<256, 4>(p, v);
    scatter_variants<256, 2>(p, v);
    scatter_variants<256, 8>(p, v);
    scatter_variants<512, 4>(p, v);
    scatter_variants<128, 8>(p, v);
    scatter_variants<1024, 2>(p, v);
    report("scatter", n, mib, "any", copy_ms(scatter_bytes), v);
  }
  std::vector<Variant> v;
  p.rows = 4;
  accumulate_variants<T, 256, 1, 4>(p, v);
  accumulate_variants<T, 256, 2, 4>(p, v);
  accumulate_variants<T, 256, 4, 4>(p, v);
  accumulate_variants<T, 256, 1, 8>(p, v);
  accumulate_variants<T, 256, 2, 2>(p, v);
  accumulate_variants<T, 512, 1, 4>(p, v);
  accumulate_variants<T, 128, 2, 4>(p, v);
  report("accumulate", n, mib, dtype, copy_ms(sum_traffic / 2), v);
  for (char* ptr : {in, regions, out, copy_src, copy_dst}) cudaFree(ptr);
}

int main() {
  for (int64_t mib : {16, 64, 128, 256, 1024}) {
    for (int n : {2, 4, 8}) {
      run_config<__nv_bfloat16>(n, mib, "bf16");
      run_config<float>(n, mib, "f32");
    }
  }
}
