// CRC-32C (Castagnoli), the checksum of every SSD-PS file and manifest record.
// Debian 12 packages no C/C++ CRC-32C library, so it lives here: the SSE4.2
// instruction when the CPU has it, a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hps::detail {

// The CRC-32C of data[0, n), continuing from a previous result `crc` (0 to
// start): Crc32c(ab) == Crc32c(b, Crc32c(a)).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// Whether Crc32c uses the CPU's crc32 instruction.
bool Crc32cHardware();

// The table-driven path Crc32c takes without SSE4.2; the same values.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace hps::detail
