// A process-wide table of live objects that native entry points reach by an integer handle.
//
// An FFI attribute cannot carry a pointer, so Python registers an object (a gradient sink, a
// parameter source, a shard store) and passes the int64 handle it got back; the FFI handler and
// the host entries look the object up by it. Handles start at 1 and are never reused, so a
// stale handle finds nothing rather than another object. Every call is thread-safe.
//
//   HandleTable<GradientSink> sinks("gradient sink");
//   const int64_t handle = sinks.Register(sink);
//   std::shared_ptr<GradientSink> s = sinks.Find(handle);  // nullptr: "grad_sink: " + sinks.Missing(handle)
//
// Ref is how the table holds an object: std::shared_ptr<T> keeps it alive until it is taken
// out; std::weak_ptr<T> does not (a store unregisters itself when it closes), and Find returns
// nullptr once it is gone.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace jaxascend {

template <typename T, typename Ref = std::shared_ptr<T>>
class HandleTable {
 public:
  // `noun` names the objects in Missing()'s message, e.g. "gradient sink".
  explicit HandleTable(std::string noun) : noun_(std::move(noun)) {}
  HandleTable(const HandleTable&) = delete;
  HandleTable& operator=(const HandleTable&) = delete;

  // Adds `object`; returns its new handle.
  int64_t Register(Ref object) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t handle = next_++;
    objects_[handle] = std::move(object);
    return handle;
  }

  // The object registered under `handle`, or nullptr when there is none (any more).
  std::shared_ptr<T> Find(int64_t handle) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(handle);
    return it == objects_.end() ? nullptr : Strong(it->second);
  }

  // Removes `handle`; returns the object it held (nullptr when none), so that the caller can
  // finish with it, and its last reference can go, outside the table's lock.
  std::shared_ptr<T> Take(int64_t handle) {
    Ref taken;
    return Extract(handle, &taken) ? Strong(taken) : nullptr;
  }

  // Removes `handle`; returns whether it was registered.
  bool Remove(int64_t handle) {
    Ref taken;  // released after the table's lock
    return Extract(handle, &taken);
  }

  // "no open <noun> with handle <handle>": the end of the message of a failed lookup; each
  // caller puts its own prefix ("grad_sink: ", "param_source: ") in front.
  std::string Missing(int64_t handle) const {
    return "no open " + noun_ + " with handle " + std::to_string(handle);
  }

 private:
  bool Extract(int64_t handle, Ref* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(handle);
    if (it == objects_.end()) return false;
    *out = std::move(it->second);
    objects_.erase(it);
    return true;
  }

  static std::shared_ptr<T> Strong(const std::shared_ptr<T>& p) { return p; }
  static std::shared_ptr<T> Strong(const std::weak_ptr<T>& p) { return p.lock(); }

  const std::string noun_;
  mutable std::mutex mu_;
  int64_t next_ = 1;
  std::map<int64_t, Ref> objects_;
};

}  // namespace jaxascend
