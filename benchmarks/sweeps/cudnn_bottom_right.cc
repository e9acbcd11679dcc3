// A probe, not part of the package: cuDNN flash attention with its causal mask aligned
// bottom-right (query i of Tq sees keys 0..Tk-Tq+i), through the cuDNN frontend, as XLA FFI
// handlers. jax's cuDNN binds align the mask top-left only, so a CP rank's query chunk cannot
// take its whole key prefix, diagonal block included, in one call; this measures what such calls
// would cost. Built and run on the GPU machine by benchmarks/sweeps/cudnn_bottom_right.py.
//
// Layout BTNH (jax's): q/o/do [B, Tq, H, D], k/v/dk/dv [B, Tk, Hk, D] (Hk divides H), bfloat16;
// lse [B, H, Tq] float32, the natural log-sum-exp of the scaled scores (cuDNN's "stats").
// cuDNN is loaded at run time: init_cudnn(path) takes the libcudnn_graph.so.9 that jax loaded.
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace fe = cudnn_frontend;
namespace ffi = xla::ffi;

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's symbols come from here (dynamic loading)
}

extern "C" int init_cudnn(const char* path) {
  fe::cudnn_dlhandle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  return fe::cudnn_dlhandle != nullptr ? 0 : 1;
}

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct Shape {
  int64_t b, tq, tk, h, hk, d;
  float scale;
  int64_t mask;  // 0 none, 1 causal top-left, 2 causal bottom-right, 3 = 2 as a shifted band
  bool backward;
  int device;
  auto key() const { return std::make_tuple(b, tq, tk, h, hk, d, scale, mask, backward, device); }
  bool operator<(const Shape& o) const { return key() < o.key(); }
};

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

std::mutex mu;
std::map<int, cudnnHandle_t> handles;  // one per device
std::map<Shape, Built> graphs;

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, Uid uid, int64_t b,
                                                     int64_t t, int64_t n, int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_uid(uid)
                      .set_name(std::to_string(uid))
                      .set_dim({b, n, t, d})
                      .set_stride({t * n * d, d, n * d, 1}));
}

void as_output(const std::shared_ptr<fe::graph::Tensor_attributes>& x, Uid uid, int64_t b,
               int64_t t, int64_t n, int64_t d) {
  x->set_output(true).set_uid(uid).set_dim({b, n, t, d}).set_stride({t * n * d, d, n * d, 1});
}

std::string build(const Shape& s, cudnnHandle_t handle, Built& out) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = tensor(*g, kQ, s.b, s.tq, s.h, s.d);
  auto k = tensor(*g, kK, s.b, s.tk, s.hk, s.d);
  auto v = tensor(*g, kV, s.b, s.tk, s.hk, s.d);
  if (!s.backward) {
    auto opts =
        fe::graph::SDPA_attributes().set_name("fwd").set_generate_stats(true).set_attn_scale(
            s.scale);
    if (s.mask == 1) opts.set_causal_mask(true);
    if (s.mask == 2) opts.set_causal_mask_bottom_right(true);
    if (s.mask == 3)  // the same mask, said as a top-left band shifted right by Tk - Tq
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(static_cast<int>(s.tk - s.tq));
    auto [o, stats] = g->sdpa(q, k, v, opts);
    as_output(o, kO, s.b, s.tq, s.h, s.d);
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
    stats->set_dim({s.b, s.h, s.tq, 1}).set_stride({s.h * s.tq, s.tq, 1, 1});
  } else {
    auto o = tensor(*g, kO, s.b, s.tq, s.h, s.d);
    auto d_o = tensor(*g, kDO, s.b, s.tq, s.h, s.d);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_uid(kStats)
                               .set_name("stats")
                               .set_dim({s.b, s.h, s.tq, 1})
                               .set_stride({s.h * s.tq, s.tq, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("bwd").set_attn_scale(s.scale);
    if (s.mask == 1) opts.set_causal_mask(true);
    if (s.mask == 2) opts.set_causal_mask_bottom_right(true);
    if (s.mask == 3)  // the same mask, said as a top-left band shifted right by Tk - Tq
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(static_cast<int>(s.tk - s.tq));
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, opts);
    as_output(dq, kDQ, s.b, s.tq, s.h, s.d);
    as_output(dk, kDK, s.b, s.tk, s.hk, s.d);
    as_output(dv, kDV, s.b, s.tk, s.hk, s.d);
  }
  auto status = g->build(handle, {fe::HeurMode_t::A});
  if (!status.is_good()) return status.get_message();
  status = g->get_workspace_size(out.workspace);
  if (!status.is_good()) return status.get_message();
  out.graph = g;
  return "";
}

ffi::Error run(const Shape& shape, cudaStream_t stream, ffi::ScratchAllocator& scratch,
               std::unordered_map<int64_t, void*> pack) {
  cudnnHandle_t handle;
  const Built* built;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (fe::cudnn_dlhandle == nullptr) return ffi::Error::Internal("init_cudnn was not called");
    auto h = handles.find(shape.device);
    if (h == handles.end()) {
      cudnnHandle_t made;
      if (fe::detail::create_handle(&made) != CUDNN_STATUS_SUCCESS)
        return ffi::Error::Internal("cudnnCreate failed");
      h = handles.emplace(shape.device, made).first;
    }
    handle = h->second;
    auto it = graphs.find(shape);
    if (it == graphs.end()) {
      Built b;
      std::string why = build(shape, handle, b);
      if (!why.empty()) return ffi::Error::Internal("cuDNN graph: " + why);
      it = graphs.emplace(shape, b).first;
    }
    built = &it->second;
  }
  if (fe::detail::set_stream(handle, stream) != CUDNN_STATUS_SUCCESS)
    return ffi::Error::Internal("cudnnSetStream failed");
  void* workspace = nullptr;
  if (built->workspace > 0) {
    auto got = scratch.Allocate(built->workspace);
    if (!got.has_value()) return ffi::Error::Internal("no scratch for the cuDNN workspace");
    workspace = *got;
  }
  auto status = built->graph->execute(handle, pack, workspace);
  if (!status.is_good()) return ffi::Error::Internal("cuDNN execute: " + status.get_message());
  return ffi::Error::Success();
}

Shape shape_of(int device, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, float scale,
               int64_t mask, bool backward) {
  auto qd = q.dimensions(), kd = k.dimensions();
  return Shape{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], scale, mask, backward, device};
}

ffi::Error Forward(cudaStream_t stream, int device, ffi::ScratchAllocator scratch, float scale,
                   int64_t mask, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  return run(shape_of(device, q, k, scale, mask, false), stream, scratch,
             {{kQ, q.untyped_data()},
              {kK, k.untyped_data()},
              {kV, v.untyped_data()},
              {kO, o->untyped_data()},
              {kStats, lse->untyped_data()}});
}

ffi::Error Backward(cudaStream_t stream, int device, ffi::ScratchAllocator scratch, float scale,
                    int64_t mask, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_o,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv) {
  return run(shape_of(device, q, k, scale, mask, true), stream, scratch,
             {{kQ, q.untyped_data()},
              {kK, k.untyped_data()},
              {kV, v.untyped_data()},
              {kO, o.untyped_data()},
              {kStats, lse.untyped_data()},
              {kDO, d_o.untyped_data()},
              {kDQ, dq->untyped_data()},
              {kDK, dk->untyped_data()},
              {kDV, dv->untyped_data()}});
}

// What both handlers take first: the stream, the device, scratch, the attributes, q, k and v.
auto bind_q_k_v() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::ScratchAllocator>()
      .Attr<float>("scale")
      .Attr<int64_t>("mask")
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BottomRightForward, Forward,
                              bind_q_k_v().Ret<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BottomRightBackward, Backward,
                              bind_q_k_v()
                                  .Arg<ffi::AnyBuffer>()         // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::AnyBuffer>()         // do
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
