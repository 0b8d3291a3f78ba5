// Fault injection: see ssd_fault_injection.h. The fast path (nothing armed) is one relaxed load.
#include "ssd_fault_injection.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace jaxascend {
namespace {

struct Armed {
  int64_t remaining = 0;  // operations left until the fault fires; 0: disarmed
  Fault fault;
};

struct InjectorState {
  std::mutex mu;
  std::atomic<int> armed_count{0};
  Armed armed[static_cast<int>(FaultOp::kCount)];
};

InjectorState& State() {
  static InjectorState state;
  return state;
}

int ParseErrno(const std::string& text, bool* short_transfer, bool* ok) {
  static const struct { const char* name; int value; } kNames[] = {
      {"ENOSPC", ENOSPC}, {"EIO", EIO},     {"EINVAL", EINVAL}, {"ENOMEM", ENOMEM},
      {"EPERM", EPERM},   {"EACCES", EACCES}, {"EAGAIN", EAGAIN}, {"EDQUOT", EDQUOT},
      {"EFBIG", EFBIG},   {"EROFS", EROFS}, {"EOPNOTSUPP", EOPNOTSUPP}, {"ENOSYS", ENOSYS}};
  *ok = true;
  *short_transfer = false;
  if (text == "SHORT") {
    *short_transfer = true;
    return 0;
  }
  for (const auto& n : kNames) {
    if (text == n.name) return n.value;
  }
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (!text.empty() && end && *end == '\0' && v > 0) return static_cast<int>(v);
  *ok = false;
  return 0;
}

}  // namespace

const char* FaultOpName(FaultOp op) {
  switch (op) {
    case FaultOp::kRead: return "read";
    case FaultOp::kWrite: return "write";
    case FaultOp::kMlock: return "mlock";
    case FaultOp::kOpenDirect: return "open_direct";
    case FaultOp::kFallocate: return "fallocate";
    case FaultOp::kIoUringSetup: return "io_uring_setup";
    default: return "?";
  }
}

FaultInjector::FaultInjector() {
  // The environment spec is armed once per process; a malformed one is kept as a status that
  // opening a store reports, since there is no caller to return it to here.
  if (const char* spec = std::getenv("JAXASCEND_FAULT")) {
    environment_status_ = ArmFromSpec(spec);
    if (!environment_status_.ok()) {
      environment_status_ = Status::InvalidArgument("JAXASCEND_FAULT: " + environment_status_.message());
    }
  }
}

FaultInjector& FaultInjector::Global() {
  static FaultInjector injector;
  return injector;
}

void FaultInjector::Arm(FaultOp op, int64_t nth, int err_no, bool short_transfer) {
  InjectorState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  Armed& a = s.armed[static_cast<int>(op)];
  if (a.remaining == 0 && nth > 0) s.armed_count.fetch_add(1);
  if (a.remaining > 0 && nth <= 0) s.armed_count.fetch_sub(1);
  a.remaining = nth > 0 ? nth : 0;
  a.fault = Fault{err_no, short_transfer};
}

Status FaultInjector::ArmFromSpec(const std::string& spec) {
  std::stringstream items(spec);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const size_t a = item.find(':');
    const size_t b = a == std::string::npos ? a : item.find(':', a + 1);
    if (b == std::string::npos) {
      return Status::InvalidArgument("fault spec '" + item + "': expected op:N:ERR, e.g. write:3:ENOSPC");
    }
    const std::string op_name = item.substr(0, a);
    const std::string nth_text = item.substr(a + 1, b - a - 1);
    const std::string err_text = item.substr(b + 1);
    int op = -1;
    for (int i = 0; i < static_cast<int>(FaultOp::kCount); ++i) {
      if (op_name == FaultOpName(static_cast<FaultOp>(i))) op = i;
    }
    if (op < 0) {
      return Status::InvalidArgument("fault spec '" + item + "': unknown operation '" + op_name +
                                     "' (allowed: read, write, mlock, open_direct, fallocate, io_uring_setup)");
    }
    char* end = nullptr;
    const long long nth = std::strtoll(nth_text.c_str(), &end, 10);
    if (nth_text.empty() || *end != '\0' || nth < 1) {
      return Status::InvalidArgument("fault spec '" + item + "': N must be an integer >= 1, got '" +
                                     nth_text + "'");
    }
    bool short_transfer = false, ok = false;
    const int err_no = ParseErrno(err_text, &short_transfer, &ok);
    if (!ok) {
      return Status::InvalidArgument("fault spec '" + item + "': unknown error '" + err_text +
                                     "' (an errno name like ENOSPC or EIO, a number, or SHORT)");
    }
    Arm(static_cast<FaultOp>(op), nth, err_no, short_transfer);
  }
  return Status::Ok();
}

void FaultInjector::Clear() {
  InjectorState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  for (Armed& a : s.armed) a = Armed{};
  s.armed_count.store(0);
}

Fault FaultInjector::Check(FaultOp op) {
  InjectorState& s = State();
  if (s.armed_count.load(std::memory_order_relaxed) == 0) return Fault{};
  std::lock_guard<std::mutex> lock(s.mu);
  Armed& a = s.armed[static_cast<int>(op)];
  if (a.remaining == 0) return Fault{};
  if (--a.remaining > 0) return Fault{};
  s.armed_count.fetch_sub(1);
  return a.fault;
}

}  // namespace jaxascend
