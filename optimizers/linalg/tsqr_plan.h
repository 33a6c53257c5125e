// The row-chunk plan of the GPU TSQR in cusolver_qr.cpp, apart from cuSOLVER: how many rows
// each Xgeqrf call gets, how many calls there are and how many rows the last one holds.
// Pure arithmetic, so tests/linalg/test_tsqr_plan.cpp checks it on the CPU for N·m far
// beyond 2³¹, where the cuSOLVER path itself can only run on a GPU with tens of GB.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tidepool::linalg::detail {

// No Xgeqrf call sees more than this many elements (2²⁷ fp64 = 1 GB, so every byte offset
// inside a chunk is below 2³¹; see Note [Why chunks] in cusolver_qr.cpp) unless one chunk
// must hold m rows of m > 11,585 columns (never, for lstsq's k ≲ 32).
constexpr int64_t kTsqrMaxChunkElements = int64_t{1} << 27;

struct TsqrPlan {
  int64_t chunk_rows;  // rows of every chunk but the last
  int64_t chunks;      // ⌈rows / chunk_rows⌉ ≥ 1
  int64_t last_rows;   // rows of the last chunk: 1 ≤ last_rows ≤ chunk_rows
  // Rows [begin, begin + count) of chunk c.
  constexpr int64_t begin(int64_t c) const { return c * chunk_rows; }
  constexpr int64_t count(int64_t c) const { return c + 1 == chunks ? last_rows : chunk_rows; }
};

// The plan for a rows×cols matrix: chunks of at most kTsqrMaxChunkElements elements and at
// least cols rows each (so every full chunk yields a cols×cols triangle); the last chunk
// may be short, even a single row (its R is then a 1×cols trapezoid, which the stacked
// root QR handles).
inline TsqrPlan tsqr_plan(int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1) {
    throw std::invalid_argument("tidepool::linalg: TSQR of a " + std::to_string(rows) + "x" +
                                std::to_string(cols) +
                                " matrix (needs at least one row and one column)");
  }
  const int64_t chunk_rows = std::min(rows, std::max(cols, kTsqrMaxChunkElements / cols));
  const int64_t chunks = rows / chunk_rows + (rows % chunk_rows != 0 ? 1 : 0);
  return {chunk_rows, chunks, rows - (chunks - 1) * chunk_rows};
}

}  // namespace tidepool::linalg::detail
