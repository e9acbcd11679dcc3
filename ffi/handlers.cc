// The peer transport on XLA's stream: validate, advance the epoch, scatter, publish and wait
// (one batch of stream memory ops), accumulate or gather. Nothing here blocks the host,
// allocates, or changes peer access: all of that happened when the workspace was created.
#include "handlers.h"

#include <cuda_runtime.h>

#include <string>

#include "cp_layout.h"
#include "kernels.h"
#include "peer_registry.h"
#include "stream_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cpgrad {

// The attributes every call carries (Python passes them as numpy int64 scalars).
struct CallAttrs {
  int64_t workspace_id;       // which Workspace
  int64_t axis_size;          // N, from the mesh: must equal the workspace's
  int64_t seq_axis_from_end;  // sequence axis counted from the back (vmap adds leading axes)
};

}  // namespace jax_cpgrad

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_cpgrad::CallAttrs,
                                      ::xla::ffi::StructMember<int64_t>("workspace_id"),
                                      ::xla::ffi::StructMember<int64_t>("axis_size"),
                                      ::xla::ffi::StructMember<int64_t>("seq_axis_from_end"));

namespace jax_cpgrad {
namespace {

std::string shape_text(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

bool element_type_of(ffi::DataType dt, ElementType* out) {
  switch (dt) {
    case ffi::DataType::F32: *out = ElementType::kF32; return true;
    case ffi::DataType::BF16: *out = ElementType::kBF16; return true;
    case ffi::DataType::F16: *out = ElementType::kF16; return true;
    default: return false;
  }
}

// Checks the call against the workspace and fills the plan and the buffer pointers. Returns an
// empty string when the call is valid; nothing has been enqueued or advanced either way.
std::string plan_call(OpKind op, const WorkspaceState& ws, const Member& m,
                      const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                      const CallAttrs& attrs, CallPlan* plan, const void** in, void** out) {
  // The message prefix is built only when a check fails: nothing is allocated on the valid path.
  const auto who = [op] { return std::string("jax_cpgrad_") + op_name(op) + ": "; };
  if (attrs.axis_size != ws.n) {
    return who() + "the mesh axis has " + std::to_string(attrs.axis_size) + " devices but workspace '" +
           ws.name + "' was created for " + std::to_string(ws.n);
  }
  const size_t count = args.size();
  if (count == 0 || count > static_cast<size_t>(kMaxTensors) || rets.size() != count) {
    return who() + "expected 1 to " + std::to_string(kMaxTensors) +
           " inputs and as many outputs, got " + std::to_string(count) + " inputs and " +
           std::to_string(rets.size()) + " outputs";
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first) return who() + "input 0 is not a buffer";
  if (!element_type_of(first->element_type(), &plan->dtype)) {
    return who() + "dtype must be float32, bfloat16 or float16";
  }
  const auto dims = first->dimensions();
  const int64_t rank = static_cast<int64_t>(dims.size());
  const int64_t seq_axis = rank - attrs.seq_axis_from_end;
  Geometry g;
  std::string err = compute_geometry(dims.begin(), rank, seq_axis, ws.n,
                                     op == OpKind::kGradReturn ? SeqExtent::kGlobal : SeqExtent::kLocal, &g);
  if (!err.empty()) return who() + "input 0 " + shape_text(dims) + ": " + err;

  for (size_t k = 0; k < count; ++k) {
    auto a = args.get<ffi::AnyBuffer>(k);
    auto r = rets.get<ffi::AnyBuffer>(k);
    if (!a || !r) return who() + "argument " + std::to_string(k) + " is not a buffer";
    if (a->element_type() != first->element_type() || (*r)->element_type() != first->element_type()) {
      return who() + "input and output " + std::to_string(k) + " must have input 0's dtype";
    }
    const auto adims = a->dimensions();
    const auto rdims = (*r)->dimensions();
    bool same = adims.size() == dims.size() && rdims.size() == dims.size();
    for (size_t i = 0; same && i < dims.size(); ++i) {
      const int64_t want = static_cast<int64_t>(i) != seq_axis ? dims[i]
                           : op == OpKind::kGradReturn           ? g.local_len
                                                                 : g.global_len;
      same = adims[i] == dims[i] && rdims[i] == want;
    }
    if (!same) {
      return who() + "input " + std::to_string(k) + " " + shape_text(adims) + " / output " +
             shape_text(rdims) + " do not match input 0 " + shape_text(dims) +
             " and the expected output shape";
    }
    in[k] = a->untyped_data();
    out[k] = (*r)->untyped_data();
  }
  plan->n = ws.n;
  plan->self = m.rank;
  plan->tensors = static_cast<int64_t>(count);
  plan->outer = g.outer;
  plan->run = g.run;
  plan->slot_bytes = ws.slot_bytes;
  const int64_t needed = plan->tensors * plan->tensor_bytes();
  if (needed > ws.slot_bytes) {
    return who() + "this call needs " + std::to_string(needed) + " bytes per slot (" +
           std::to_string(count) + " tensors of " + std::to_string(plan->tensor_bytes()) +
           " local bytes) but workspace '" + ws.name + "' holds " + std::to_string(ws.slot_bytes) +
           ": create it with a larger nbytes";
  }
  return {};
}

ffi::Error launch_error(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_cpgrad: launching ") + what + " failed: " +
                              cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

template <OpKind kOp>
ffi::Error CollectiveImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, CallAttrs attrs) {
  auto lock = Registry::get().read_lock();
  const WorkspaceState* ws = Registry::get().find(attrs.workspace_id);
  if (ws == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_cpgrad: workspace #" + std::to_string(attrs.workspace_id) +
                          " is closed (or was never created in this process)");
  }
  if (ws->failed.load()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, ws->failure_text());
  Member* m = ws->member_for_device(device);
  if (m == nullptr) {
    return ffi::Error::InvalidArgument("jax_cpgrad: GPU " + std::to_string(device) +
                                       " is not part of workspace '" + ws->name + "'");
  }
  CallPlan plan;
  const void* in[kMaxTensors];
  void* out[kMaxTensors];
  std::string invalid = plan_call(kOp, *ws, *m, args, rets, attrs, &plan, in, out);
  if (!invalid.empty()) return ffi::Error::InvalidArgument(invalid);

  // Valid: from here on every rank takes the same steps, so the epochs stay in agreement.
  const uint32_t e = m->epoch.load(std::memory_order_relaxed) + 1;
  m->epoch.store(e, std::memory_order_relaxed);
  m->op_of_epoch[e % m->op_of_epoch.size()].store(static_cast<uint8_t>(kOp), std::memory_order_relaxed);
  plan.set = ws->unsafe_single_buffer ? 0 : e & 1;

  cudaError_t err = kOp == OpKind::kGradReturn
                        ? launch_scatter_owner_chunks(plan, in, m->regions, stream)
                        : launch_scatter_local_copies(plan, in, m->regions, stream);
  if (err != cudaSuccess) return launch_error(err, "the scatter");
  if (ws->n > 1) {
    const ProtocolSite site{ws->n, m->rank, &m->regions, m->own_region,
                            &static_cast<ProgressWords*>(m->progress_device)->reached,
                            &static_cast<ProgressWords*>(m->progress_device)->passed};
    if (CUresult res = enqueue_publish_and_wait(site, e, stream); res != CUDA_SUCCESS) {
      return ffi::Error::Internal("jax_cpgrad: cuStreamBatchMemOp failed with CUresult " +
                                  std::to_string(static_cast<int>(res)));
    }
  }
  err = kOp == OpKind::kGradReturn ? launch_accumulate(plan, in, out, m->own_region, stream)
                                   : launch_gather(plan, in, out, m->own_region, stream);
  if (err != cudaSuccess) return launch_error(err, kOp == OpKind::kGradReturn ? "the accumulation" : "the gather");
  return ffi::Error::Success();
}

}  // namespace

#define CPG_BIND_COLLECTIVE                                                               \
  ::xla::ffi::Ffi::Bind()                                                                        \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>() /* XLA's stream for this device */ \
      .Ctx<::xla::ffi::DeviceOrdinal>()                /* which local GPU is calling */          \
      .RemainingArgs()                          /* inputs: dK, dV, ... same shape/dtype */ \
      .RemainingRets()                          /* one output per input */                \
      .Attrs<::jax_cpgrad::CallAttrs>()                    /* workspace_id, axis_size, seq_axis */

// No command-buffer-compatible trait: the epoch is chosen on the host at each call, and a captured
// command buffer would replay a stale epoch whose waits already pass.
}  // namespace jax_cpgrad

// (The macro also static_asserts that each symbol really is an XLA FFI handler.)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradGradReturn, jax_cpgrad::CollectiveImpl<jax_cpgrad::OpKind::kGradReturn>,
                              CPG_BIND_COLLECTIVE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradAllGather, jax_cpgrad::CollectiveImpl<jax_cpgrad::OpKind::kAllGather>,
                              CPG_BIND_COLLECTIVE);
