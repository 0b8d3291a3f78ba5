// Status values returned by the arena and the SSD engine (no exceptions in native code).
//
// A Status carries a code that says which Python exception it becomes (see
// store_bindings.cc), the errno of the failed system call when there is one, and a
// message that names the file, offset, region or size involved.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

namespace jaxascend {

enum class StatusCode {
  kOk,
  kInvalidArgument,   // a caller mistake: unaligned offset, unknown region, bad size
  kIoError,           // a failed system call (ENOSPC, EIO, short transfer, ...)
  kChecksumMismatch,  // crc32c of a block read back differs from what was written
  kLocked,            // the offload directory is held by another opener
  kArenaExhausted,    // the arena cannot satisfy a plan or a slot request
  kClosed,            // the object was closed
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, int err_no, std::string message)
      : code_(code), err_no_(err_no), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, EINVAL, std::move(m)}; }
  static Status Io(int err_no, std::string m) { return {StatusCode::kIoError, err_no, std::move(m)}; }
  static Status Checksum(std::string m) { return {StatusCode::kChecksumMismatch, EBADMSG, std::move(m)}; }
  static Status Locked(std::string m) { return {StatusCode::kLocked, EBUSY, std::move(m)}; }
  static Status ArenaExhausted(std::string m) { return {StatusCode::kArenaExhausted, ENOMEM, std::move(m)}; }
  static Status Closed(std::string m) { return {StatusCode::kClosed, EBADF, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  int err_no() const { return err_no_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  int err_no_ = 0;
  std::string message_;
};

// "ENOSPC (No space left on device)": the symbolic name makes logs greppable.
inline std::string DescribeErrno(int err_no) {
  const char* name = nullptr;
  switch (err_no) {
    case ENOSPC: name = "ENOSPC"; break;
    case EIO: name = "EIO"; break;
    case EINVAL: name = "EINVAL"; break;
    case ENOMEM: name = "ENOMEM"; break;
    case EPERM: name = "EPERM"; break;
    case EACCES: name = "EACCES"; break;
    case EAGAIN: name = "EAGAIN"; break;
    case EBADF: name = "EBADF"; break;
    case EBUSY: name = "EBUSY"; break;
    case EDQUOT: name = "EDQUOT"; break;
    case EFBIG: name = "EFBIG"; break;
    case EROFS: name = "EROFS"; break;
    case ENOENT: name = "ENOENT"; break;
    case EOPNOTSUPP: name = "EOPNOTSUPP"; break;
    case EINTR: name = "EINTR"; break;
    case ENOSYS: name = "ENOSYS"; break;
    default: break;
  }
  std::string out = name ? name : ("errno " + std::to_string(err_no));
  return out + " (" + std::strerror(err_no) + ")";
}

// Human-readable byte count, exact: "1048576 bytes (1.00 MiB)".
inline std::string DescribeBytes(int64_t n) {
  char buf[96];
  const double mib = static_cast<double>(n) / (1024.0 * 1024.0);
  if (mib >= 1024.0) {
    std::snprintf(buf, sizeof buf, "%lld bytes (%.2f GiB)", static_cast<long long>(n), mib / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%lld bytes (%.2f MiB)", static_cast<long long>(n), mib);
  }
  return buf;
}

constexpr int64_t kIoAlignment = 4096;  // O_DIRECT alignment of offsets, lengths and addresses

inline int64_t RoundUpToAlignment(int64_t n) { return (n + kIoAlignment - 1) / kIoAlignment * kIoAlignment; }

}  // namespace jaxascend

#define JAXASCEND_RETURN_IF_ERROR(expr)      \
  do {                                       \
    ::jaxascend::Status _status = (expr);    \
    if (!_status.ok()) return _status;       \
  } while (0)
