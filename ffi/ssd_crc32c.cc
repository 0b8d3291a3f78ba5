// CRC-32C: slicing-by-8 in software, and SSE4.2 in three interleaved streams.
//
// One _mm_crc32_u64 stream is bound by the instruction's 3-cycle latency (~8 GB/s);
// the hardware path therefore runs three independent streams over adjacent stripes and
// joins them with "append N zero bytes" operators (linear maps over GF(2), tabulated once),
// which is what lets checksumming keep up with the disk on a couple of cores.
#include "ssd_crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace jaxascend {
namespace {

constexpr uint32_t kPolyReflected = 0x82F63B78u;
constexpr size_t kLongStripe = 8192;  // bytes per stream in the long interleaved loop
constexpr size_t kShortStripe = 256;  // bytes per stream in the short interleaved loop

// Tables: slicing-by-8 lookups, and the zero-append operators for both stripe lengths,
// stored byte-wise so applying one costs four lookups.
struct Crc32cTables {
  uint32_t slice[8][256];
  uint32_t shift_long[4][256];
  uint32_t shift_short[4][256];

  Crc32cTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolyReflected : c >> 1;
      slice[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int t = 1; t < 8; ++t) slice[t][b] = (slice[t - 1][b] >> 8) ^ slice[0][slice[t - 1][b] & 0xff];
    }
    BuildShift(kLongStripe, shift_long);
    BuildShift(kShortStripe, shift_short);
  }

  // The register after feeding `n` zero bytes to register `reg` (byte-wise, for table building).
  uint32_t FeedZeros(uint32_t reg, size_t n) const {
    for (size_t i = 0; i < n; ++i) reg = slice[0][reg & 0xff] ^ (reg >> 8);
    return reg;
  }

  // The operator is linear: tabulate its image of each basis bit, then of each byte value.
  void BuildShift(size_t n, uint32_t out[4][256]) const {
    uint32_t basis[32];
    for (int bit = 0; bit < 32; ++bit) basis[bit] = FeedZeros(1u << bit, n);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int i = 0; i < 8; ++i) {
          if (b & (1u << i)) v ^= basis[8 * k + i];
        }
        out[k][b] = v;
      }
    }
  }
};

const Crc32cTables& Tables() {
  static const Crc32cTables tables;
  return tables;
}

inline uint32_t Shift(const uint32_t table[4][256], uint32_t reg) {
  return table[0][reg & 0xff] ^ table[1][(reg >> 8) & 0xff] ^ table[2][(reg >> 16) & 0xff] ^
         table[3][reg >> 24];
}

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Raw register update (no pre/post inversion), slicing-by-8.
uint32_t RawSoftware(uint32_t reg, const uint8_t* p, size_t n) {
  const Crc32cTables& t = Tables();
  while (n >= 8) {
    const uint64_t v = Load64(p) ^ reg;  // little-endian: low 4 bytes meet the register
    reg = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
          t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^ t.slice[2][(v >> 40) & 0xff] ^
          t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) reg = t.slice[0][(reg ^ *p++) & 0xff] ^ (reg >> 8);
  return reg;
}

#if defined(__x86_64__)
// Consumes whole groups of three `stripe`-byte stripes from (*p, *n), three streams at a time.
__attribute__((target("sse4.2"))) uint32_t Interleaved3(uint32_t reg, const uint8_t** p, size_t* n,
                                                         size_t stripe, const uint32_t shift[4][256]) {
  const uint8_t* q = *p;
  while (*n >= 3 * stripe) {
    uint64_t c0 = reg, c1 = 0, c2 = 0;
    const uint8_t* end = q + stripe;
    do {
      c0 = _mm_crc32_u64(c0, Load64(q));
      c1 = _mm_crc32_u64(c1, Load64(q + stripe));
      c2 = _mm_crc32_u64(c2, Load64(q + 2 * stripe));
      q += 8;
    } while (q < end);
    // register(s0 s1 s2) = shift(shift(c0) ^ c1) ^ c2, since the update is linear.
    reg = Shift(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    reg = Shift(shift, reg) ^ static_cast<uint32_t>(c2);
    q += 2 * stripe;
    *n -= 3 * stripe;
  }
  *p = q;
  return reg;
}

__attribute__((target("sse4.2"))) uint32_t RawHardware(uint32_t reg, const uint8_t* p, size_t n) {
  const Crc32cTables& t = Tables();
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    reg = _mm_crc32_u8(reg, *p++);
    --n;
  }
  reg = Interleaved3(reg, &p, &n, kLongStripe, t.shift_long);
  reg = Interleaved3(reg, &p, &n, kShortStripe, t.shift_short);
  uint64_t c = reg;
  while (n >= 8) {
    c = _mm_crc32_u64(c, Load64(p));
    p += 8;
    n -= 8;
  }
  reg = static_cast<uint32_t>(c);
  while (n--) reg = _mm_crc32_u8(reg, *p++);
  return reg;
}
#endif

}  // namespace

bool Crc32cHardwareAvailable() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t crc) {
  return ~RawSoftware(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (Crc32cHardwareAvailable()) return ~RawHardware(~crc, static_cast<const uint8_t*>(data), n);
#endif
  return Crc32cSoftware(data, n, crc);
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  return Crc32cHardwareAvailable() ? Crc32cHardware(data, n, crc) : Crc32cSoftware(data, n, crc);
}

uint32_t Crc32cOfZeros(size_t n) {
  static const uint8_t zeros[4096] = {};
  uint32_t crc = 0;
  while (n > 0) {
    const size_t step = n < sizeof zeros ? n : sizeof zeros;
    crc = Crc32c(zeros, step, crc);
    n -= step;
  }
  return crc;
}

}  // namespace jaxascend
