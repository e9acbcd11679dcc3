// The watchdog: one host thread per process that notices a call no peer completes.
// - Memop protocol: when a GPU has sat at the same call's wait for longer than the
//   workspace's timeout, it names the call and the missing peers, marks the workspace failed
//   (later calls return that error), sets the header's state (the stuck call's outputs become
//   NaN) and releases the wait, so the GPU never hangs.
// - Device protocol: the kernel keeps its own deadline and stops by itself; the watchdog reads
//   the report it left, names the missing peers and marks the workspace failed.
// A slow peer that arrives within the timeout is never reported. On a timeout, a workspace
// created with on_timeout="abort" aborts the process after printing the message.
#pragma once

namespace jax_cpgrad {

struct WorkspaceState;

// Device protocol: if a kernel of `ws` reported a timeout that nobody has turned into the
// workspace's failure yet, do it now (name the missing peers, mark it failed, print, abort if
// asked). The watchdog calls it every poll; status() and the handlers too, so that a failure is
// visible as soon as the failed call has returned. Returns whether the workspace has failed.
bool sync_device_failure(WorkspaceState& ws);

void watchdog_start();  // idempotent
void watchdog_stop();   // joins the thread; call before interpreter exit

}  // namespace jax_cpgrad
