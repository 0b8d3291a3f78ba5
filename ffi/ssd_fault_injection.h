// Fault injection for the arena and the SSD engine: make the N-th operation of a kind fail.
//
// Armed from the environment at first use (JAXASCEND_FAULT="write:3:ENOSPC,read:2:EIO") or by
// tests through Arm()/Clear() (Python: jaxascend.ssd.store.inject_fault). Each armed fault fires
// once, on the N-th operation of its kind counted from when it was armed, then disarms.
// Operations are counted per I/O request (one checksum block), not per API call.
#pragma once

#include <cstdint>
#include <string>

#include "ssd_io_status.h"

namespace jaxascend {

enum class FaultOp { kRead = 0, kWrite, kMlock, kOpenDirect, kFallocate, kIoUringSetup, kCount };

struct Fault {
  int err_no = 0;               // errno the operation reports; 0: no fault
  bool short_transfer = false;  // the read/write moves only half its bytes and stops
  bool fires() const { return err_no != 0 || short_transfer; }
};

class FaultInjector {
 public:
  static FaultInjector& Global();

  // Makes the `nth` (1-based) next `op` fail with `err_no`, or transfer short when err_no == 0.
  void Arm(FaultOp op, int64_t nth, int err_no, bool short_transfer);
  // Parses "op:N:ERR[,op:N:ERR...]" (op: read|write|mlock|open_direct|fallocate|io_uring_setup;
  // ERR: an errno name such as ENOSPC or EIO, a number, or SHORT) and arms each fault.
  Status ArmFromSpec(const std::string& spec);
  void Clear();
  // Counts one `op` and returns the fault to apply to it (usually none).
  Fault Check(FaultOp op);
  // The result of parsing JAXASCEND_FAULT at start-up (the store reports a malformed spec).
  const Status& environment_status() const { return environment_status_; }

 private:
  FaultInjector();
  Status environment_status_;
};

const char* FaultOpName(FaultOp op);

}  // namespace jaxascend
