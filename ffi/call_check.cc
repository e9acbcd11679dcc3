#include "call_check.h"

namespace ffi = xla::ffi;

namespace jax_cpgrad {
namespace {

std::string shape_text(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

bool element_type_of(ffi::DataType dt, ElementType* out) {
  switch (dt) {
    case ffi::DataType::F32:
      *out = ElementType::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = ElementType::kBF16;
      return true;
    case ffi::DataType::F16:
      *out = ElementType::kF16;
      return true;
    default:
      return false;
  }
}

}  // namespace

std::string check_call(OpKind op, const WorkspaceState& ws, const Member& m,
                       const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                       const CallAttrs& attrs, CallPlan* plan, TensorPtrs* buffers) {
  // The message prefix is built only when a check fails: nothing is allocated on the valid path.
  const auto who = [op] { return std::string("jax_cpgrad_") + op_name(op) + ": "; };
  const WorkspaceConfig& cfg = ws.config;
  if (attrs.axis_size != cfg.n) {
    return who() + "the mesh axis has " + std::to_string(attrs.axis_size) +
           " devices but workspace '" + cfg.name + "' was created for " + std::to_string(cfg.n);
  }
  if (attrs.reach < 0 || attrs.reach >= cfg.n) {
    return who() + "reach must be 0 (every rank's data) or k in 1 .. R-1 (the ranks within k of " +
           "this one; R = " + std::to_string(cfg.n) + "), got " + std::to_string(attrs.reach);
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
  const SeqExtent extent = op == OpKind::kGradReturn ? SeqExtent::kGlobal : SeqExtent::kLocal;
  std::string err = compute_geometry(dims.begin(), rank, seq_axis, cfg.n, extent, &g);
  if (!err.empty()) return who() + "input 0 " + shape_text(dims) + ": " + err;

  for (size_t k = 0; k < count; ++k) {
    auto a = args.get<ffi::AnyBuffer>(k);
    auto r = rets.get<ffi::AnyBuffer>(k);
    if (!a || !r) return who() + "argument " + std::to_string(k) + " is not a buffer";
    if (a->element_type() != first->element_type() ||
        (*r)->element_type() != first->element_type()) {
      return who() + "input and output " + std::to_string(k) + " must have input 0's dtype";
    }
    const auto adims = a->dimensions();
    const auto rdims = (*r)->dimensions();
    bool same = adims.size() == dims.size() && rdims.size() == dims.size();
    for (size_t i = 0; same && i < dims.size(); ++i) {
      const int64_t want = static_cast<int64_t>(i) != seq_axis ? dims[i]
                           : op == OpKind::kGradReturn         ? g.local_len
                                                               : g.global_len;
      same = adims[i] == dims[i] && rdims[i] == want;
    }
    if (!same) {
      return who() + "input " + std::to_string(k) + " " + shape_text(adims) + " / output " +
             shape_text(rdims) + " do not match input 0 " + shape_text(dims) +
             " and the expected output shape";
    }
    buffers->in[k] = static_cast<const char*>(a->untyped_data());
    buffers->out[k] = static_cast<char*>((*r)->untyped_data());
  }
  plan->n = cfg.n;
  plan->self = m.region.rank();
  plan->tensors = static_cast<int64_t>(count);
  plan->outer = g.outer;
  plan->run = g.run;
  plan->slot_bytes = cfg.slot_bytes;
  plan->reach = attrs.reach;
  plan->test_finish_delay_ns = m.test_finish_delay_ns.load(std::memory_order_relaxed);
  if (plan->payload_bytes() > cfg.slot_bytes) {
    return who() + "this call needs " + std::to_string(plan->payload_bytes()) +
           " bytes per slot (" + std::to_string(count) + " tensors of " +
           std::to_string(plan->tensor_bytes()) + " local bytes) but workspace '" + cfg.name +
           "' holds " + std::to_string(cfg.slot_bytes) + ": create it with a larger nbytes";
  }
  return {};
}

}  // namespace jax_cpgrad
