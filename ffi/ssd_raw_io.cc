// The raw-disk baseline of scripts/bench_io.py: `threads` workers moving a file's bytes with
// pread/pwrite on an O_DIRECT descriptor, `request` bytes at a time, no checksums, no store.
// Native so that the baseline is not slowed by the interpreter (a Python thread pool issuing
// os.pwrite/os.preadv measured up to 40% slower than this on the same disk).
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "registry.h"
#include "ssd_io_status.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

using BufferArg = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Moves [0, nbytes) of `fd` in `request`-byte pieces from `threads` workers, worker k using
// buffer[k * request, (k + 1) * request). Returns the wall seconds, or an error Status.
Status RawPass(int fd, int64_t nbytes, int64_t request, int threads, bool write, uint8_t* buffer, double* seconds) {
  std::atomic<int64_t> next{0};
  std::atomic<int> first_errno{0};
  std::atomic<int64_t> short_at{-1};
  auto worker = [&](int k) {
    uint8_t* mine = buffer + k * request;
    for (;;) {
      const int64_t off = next.fetch_add(request);
      if (off >= nbytes || first_errno.load() != 0 || short_at.load() >= 0) return;
      const size_t n = static_cast<size_t>(std::min(request, nbytes - off));
      ssize_t r;
      do {
        r = write ? pwrite(fd, mine, n, off) : pread(fd, mine, n, off);
      } while (r < 0 && errno == EINTR);
      if (r < 0) {
        first_errno.store(errno);
        return;
      }
      if (static_cast<size_t>(r) != n) {
        short_at.store(off);
        return;
      }
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) pool.emplace_back(worker, k);
  for (std::thread& t : pool) t.join();
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const char* op = write ? "raw pwrite" : "raw pread";
  if (first_errno.load() != 0) return Status::Io(first_errno.load(), std::string(op) + ": " + DescribeErrno(first_errno.load()));
  if (short_at.load() >= 0) {
    return Status::Io(EIO, std::string(op) + ": short transfer at byte offset " + std::to_string(short_at.load()));
  }
  return Status::Ok();
}

void BindRawIo(nb::module_& m) {
  m.def(
      "raw_direct_pass",
      [](const std::string& path, int64_t nbytes, int64_t request, int threads, bool write, BufferArg buffer) {
        if (request < kIoAlignment || request % kIoAlignment != 0 || nbytes < 1 || threads < 1 ||
            static_cast<int64_t>(buffer.shape(0)) < request * threads ||
            reinterpret_cast<uintptr_t>(buffer.data()) % kIoAlignment != 0) {
          throw nb::value_error(("raw_direct_pass: need a 4096-aligned buffer of threads * request = " +
                                 std::to_string(request * threads) + " bytes and a request that is a multiple of 4096")
                                    .c_str());
        }
        double seconds = 0;
        Status s;
        {
          nb::gil_scoped_release release;
          const int fd = open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
          if (fd < 0) {
            s = Status::Io(errno, "raw_direct_pass: cannot open " + path + " with O_DIRECT: " + DescribeErrno(errno));
          } else {
            s = RawPass(fd, nbytes, request, threads, write, buffer.data(), &seconds);
            close(fd);
          }
        }
        if (!s.ok()) {
          PyObject* args = Py_BuildValue("(is)", s.err_no(), s.message().c_str());
          PyErr_SetObject(PyExc_OSError, args);  // OSError(errno, message), like the store's errors
          Py_XDECREF(args);
          throw nb::python_error();
        }
        return seconds;
      },
      nb::arg("path"), nb::arg("nbytes"), nb::arg("request"), nb::arg("threads"), nb::arg("write"), nb::arg("buffer"),
      "Seconds for `threads` workers to pwrite (or pread) bytes [0, nbytes) of an existing file with O_DIRECT, "
      "`request` bytes at a time from `buffer` (worker k uses its k-th `request` bytes); no checksums.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindRawIo);

}  // namespace jaxascend
