#include "workspace_state.h"

#include <algorithm>

namespace jax_cpgrad {

const char* protocol_name(Protocol p) { return p == Protocol::kDevice ? "device" : "memop"; }

void WorkspaceState::fail(const std::string& why) {
  std::lock_guard lock(failure_mu_);
  if (!failed.load()) failure_ = why;
  failed.store(true);
}

std::string WorkspaceState::failure_text() const {
  std::lock_guard lock(failure_mu_);
  return failure_;
}

Member* WorkspaceState::member_for_device(int device) const {
  for (const auto& m : members) {
    if (m->region.device() == device) return m.get();
  }
  return nullptr;
}

std::vector<std::string> WorkspaceState::begin_close() {
  {
    std::unique_lock lock(mu);
    closed = true;
  }
  std::vector<std::string> problems;
  for (const auto& m : members) {
    for (auto& p : m->region.drain()) problems.push_back(std::move(p));
  }
  return problems;
}

std::vector<std::string> WorkspaceState::finish_close() {
  std::unique_lock lock(mu);
  std::vector<std::string> problems;
  if (released) return problems;
  closed = released = true;
  for (const auto& m : members) {
    for (auto& p : m->region.close()) problems.push_back(std::move(p));
  }
  return problems;
}

Registry& Registry::get() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

void Registry::add(std::shared_ptr<WorkspaceState> ws) {
  std::lock_guard lock(mu_);
  workspaces_.push_back(std::move(ws));
}

void Registry::remove(int64_t id) {
  std::lock_guard lock(mu_);
  workspaces_.erase(std::remove_if(workspaces_.begin(), workspaces_.end(),
                                   [id](const auto& ws) { return ws->id == id; }),
                    workspaces_.end());
}

std::shared_ptr<WorkspaceState> Registry::find(int64_t id) const {
  std::lock_guard lock(mu_);
  for (const auto& ws : workspaces_) {
    if (ws->id == id) return ws;
  }
  return nullptr;
}

std::vector<std::shared_ptr<WorkspaceState>> Registry::all() const {
  std::lock_guard lock(mu_);
  return workspaces_;
}

}  // namespace jax_cpgrad
