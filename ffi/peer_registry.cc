#include "peer_registry.h"

#include <algorithm>

namespace jax_cpgrad {

const char* op_name(OpKind op) {
  return op == OpKind::kGradReturn ? "grad_return" : "all_gather";
}

Member* WorkspaceState::member_for_device(int device) const {
  for (const auto& m : members) {
    if (m->device == device) return m.get();
  }
  return nullptr;
}

void WorkspaceState::fail(const std::string& why) {
  std::lock_guard lock(failure_mu);
  if (!failed.load()) failure = why;
  failed.store(true);
}

std::string WorkspaceState::failure_text() const {
  std::lock_guard lock(failure_mu);
  return failure;
}

Registry& Registry::get() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

void Registry::add(std::shared_ptr<WorkspaceState> ws) {
  std::unique_lock lock(mu_);
  workspaces_.push_back(std::move(ws));
}

std::shared_ptr<WorkspaceState> Registry::remove(int64_t id) {
  std::unique_lock lock(mu_);
  auto it = std::find_if(workspaces_.begin(), workspaces_.end(),
                         [id](const auto& ws) { return ws->id == id; });
  if (it == workspaces_.end()) return nullptr;
  std::shared_ptr<WorkspaceState> ws = *it;
  workspaces_.erase(it);
  return ws;
}

WorkspaceState* Registry::find(int64_t id) const {
  for (const auto& ws : workspaces_) {
    if (ws->id == id) return ws.get();
  }
  return nullptr;
}

}  // namespace jax_cpgrad
