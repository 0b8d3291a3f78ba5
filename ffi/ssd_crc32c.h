// CRC-32C (Castagnoli), the checksum the SSD engine stores per block.
//
// Crc32c() picks the SSE4.2 instruction when the CPU has it (checked once at run time)
// and a slicing-by-8 table implementation otherwise; both give identical results.
// Chaining works like zlib's crc32: Crc32c(b, nb, Crc32c(a, na)) == Crc32c(a+b).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxascend {

uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t crc = 0);
// Only valid when Crc32cHardwareAvailable(); otherwise falls back to software.
uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc = 0);
bool Crc32cHardwareAvailable();

// The CRC of `n` zero bytes (a fresh, never-written block reads back as zeros).
uint32_t Crc32cOfZeros(size_t n);

}  // namespace jaxascend
