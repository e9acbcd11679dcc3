// The argument check both protocols share: a call's buffers against its workspace. Everything a
// call could get wrong is caught here, before anything is enqueued or any epoch advances, so a
// rejected call never writes into a peer's memory nor desynchronises the ranks.
#pragma once

#include <string>

#include "call_plan.h"
#include "workspace_state.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cpgrad {

// The attributes every call carries (Python passes them as numpy int64 scalars).
struct CallAttrs {
  int64_t workspace_id;       // which Workspace
  int64_t axis_size;          // R, from the mesh: must equal the workspace's
  int64_t seq_axis_from_end;  // sequence axis counted from the back (vmap adds leading axes)
  int64_t reach;              // 0: every rank's data moves; k > 0: only ranks within k (CallPlan)
};

// Fills `plan` (all but plan->set) and the buffer pointers; returns "" when the call is valid,
// otherwise a message naming the argument and what was expected.
std::string check_call(OpKind op, const WorkspaceState& ws, const Member& m,
                       const xla::ffi::RemainingArgs& args, const xla::ffi::RemainingRets& rets,
                       const CallAttrs& attrs, CallPlan* plan, TensorPtrs* buffers);

}  // namespace jax_cpgrad

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_cpgrad::CallAttrs,
                                      ::xla::ffi::StructMember<int64_t>("workspace_id"),
                                      ::xla::ffi::StructMember<int64_t>("axis_size"),
                                      ::xla::ffi::StructMember<int64_t>("seq_axis_from_end"),
                                      ::xla::ffi::StructMember<int64_t>("reach"));
