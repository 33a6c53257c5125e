// The arithmetic of the Gram kernel (gram_kernels.cu), apart from the kernel: launch shape,
// tile and pair-group sizes, the panel split of X's columns, the 16-byte vector split of a
// tile's flat element range, and the maps from a tile element to its address in X and its
// place in shared memory. No CUDA headers: the kernel calls these functions on the device,
// and tests/linalg/test_gram_plan.cpp runs them on the CPU (where the kernel cannot run),
// so the index arithmetic of every load path is tested on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optimizers/host_device.h"

namespace tidepool::linalg::cuda {

// The kernel holds the packed upper triangle of the Gram matrix in fp64 registers spread
// over up to four warps' worth of pair groups, so it handles at most this many columns of
// [A | B]; wider problems use the chunked cuBLAS path in gram.cpp.
constexpr int kMaxKernelColumns = 16;

// Column j of [A | B] is element i at data[j] + i·stride[j] (in elements). Columns of a
// row-major N×k matrix have stride k and adjacent data pointers (the kernel reads them as
// one row-major panel); separately allocated column vectors have stride 1. Every data
// pointer must be aligned to the element size (any torch tensor's is).
struct ColumnSet {
  const void* data[kMaxKernelColumns];
  int64_t stride[kMaxKernelColumns];
};

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 2048;  // ≥ 15 blocks per SM on an H200 (132 SMs): small tail
constexpr int kVectorBytes = 16;  // float4 / double2

// Tile height: 512 rows up to 10 columns (≤ 41 KB of fp64 tile), else 256 (≤ 33 KB), so
// two blocks fit per SM with static shared memory (< 48 KB per block).
TIDEPOOL_HOST_DEVICE constexpr int tile_rows(int m) { return m <= 10 ? 512 : 256; }
// Shared-memory pitch of one tile column: odd, so a warp's 32 consecutive rows of one column
// and a thread's walk over the columns of one row both spread over the banks.
TIDEPOOL_HOST_DEVICE constexpr int tile_pitch(int m) { return tile_rows(m) + 1; }
TIDEPOOL_HOST_DEVICE constexpr int pair_count(int m) { return m * (m + 1) / 2; }
// Pair groups: ≤ 45 pairs (m ≤ 9) in one thread; m ≤ 12 in two groups (≤ 39 each); m ≤ 16
// in four (≤ 34 each). Register budget: __launch_bounds__(256, 2) allows 128 per thread.
TIDEPOOL_HOST_DEVICE constexpr int pair_groups(int m) { return m <= 9 ? 1 : (m <= 12 ? 2 : 4); }
TIDEPOOL_HOST_DEVICE constexpr int pairs_per_group(int m) {
  return (pair_count(m) + pair_groups(m) - 1) / pair_groups(m);
}
// Loads each thread issues before it stores any: 4, or 2 when more than 40 accumulators
// (m = 9) leave too few registers for four 16-byte vectors without spilling.
TIDEPOOL_HOST_DEVICE constexpr int load_batch(int m) { return pairs_per_group(m) > 40 ? 2 : 4; }
// Static shared memory of the partials kernel: the fp64 tile and the per-warp pair sums.
TIDEPOOL_HOST_DEVICE constexpr size_t partials_shared_bytes(int m) {
  return sizeof(double) * (static_cast<size_t>(m) * static_cast<size_t>(tile_pitch(m)) +
                           static_cast<size_t>(kWarps) * static_cast<size_t>(pairs_per_group(m)));
}

static_assert(tile_rows(1) * kMaxKernelColumns < (1 << 22),
              "row_of() divides by a float reciprocal, exact only below 2^22");
static_assert(kThreads % (32 * pair_groups(kMaxKernelColumns)) == 0,
              "warps split evenly over pair groups");
static_assert(pairs_per_group(kMaxKernelColumns) * pair_groups(kMaxKernelColumns) >=
                  pair_count(kMaxKernelColumns),
              "groups cover all pairs");
static_assert(partials_shared_bytes(9) < 48 * 1024 && partials_shared_bytes(10) < 48 * 1024 &&
                  partials_shared_bytes(kMaxKernelColumns) < 48 * 1024,
              "static shared memory is limited to 48 KB per block");

// The launch shape for (rows, m), rows ≥ 1: tiles of tile_rows(m) rows, ⌈tiles / kMaxBlocks⌉
// tiles per block, as many blocks as that takes (1 ≤ blocks ≤ kMaxBlocks, each with ≥ 1 row).
// It depends only on (rows, m), so the summation order of a given problem never changes.
struct LaunchShape {
  int64_t rows_per_block;
  int blocks;
};

constexpr LaunchShape launch_shape(int64_t rows, int m) {
  const int64_t tile = tile_rows(m);
  const int64_t tiles = rows / tile + (rows % tile != 0 ? 1 : 0);  // no rows + tile − 1 overflow
  const int64_t tiles_per_block = (tiles + kMaxBlocks - 1) / kMaxBlocks;
  const int64_t rows_per_block = tiles_per_block * tile;
  return {rows_per_block,
          static_cast<int>(rows / rows_per_block + (rows % rows_per_block != 0 ? 1 : 0))};
}

// Doubles of device workspace launch_gram needs for `rows` rows and m columns: one partial
// sum per (pair, block).
constexpr int64_t gram_workspace_doubles(int64_t rows, int m) {
  if (rows < 1 || m < 1) return 0;
  return static_cast<int64_t>(launch_shape(rows, m).blocks) * pair_count(m);
}

// Adjacent columns read as one block of memory: element (r, c) is at base + r·row_stride + c.
struct Panel {
  const void* base;
  int64_t row_stride;   // in elements
  int first_column;     // column of X that c = 0 is
  int width;            // columns in the panel
  float inverse_width;  // 1/width, for row_of()
  int vectorised;       // row_stride == width and width·size ≥ 16 B: read as 16-byte vectors
};

struct PanelSet {
  Panel panel[kMaxKernelColumns];
  int count;
};

// Merges adjacent columns into panels. Column j + 1 joins the panel of column j when its data
// pointer is one element after column j's and its stride is the panel's: then element (r, c)
// of the panel is base + r·stride + c for every column in it, whatever the stride (a
// stride-0 or overlapping panel included). A panel with stride == width is one contiguous
// array of N·width elements; it is read as 16-byte vectors when a row holds at least one.
inline PanelSet make_panels(const ColumnSet& columns, int m, size_t element_size) {
  PanelSet set{};
  for (int j = 0; j < m;) {
    Panel panel{columns.data[j], columns.stride[j], j, 1, 1.0f, 0};
    const auto* base = static_cast<const unsigned char*>(columns.data[j]);
    while (j + panel.width < m && columns.stride[j + panel.width] == panel.row_stride &&
           static_cast<const unsigned char*>(columns.data[j + panel.width]) ==
               base + static_cast<size_t>(panel.width) * element_size) {
      ++panel.width;
    }
    panel.inverse_width = 1.0f / static_cast<float>(panel.width);
    panel.vectorised =
        panel.row_stride == panel.width &&
        static_cast<size_t>(panel.width) * element_size >= kVectorBytes ? 1 : 0;
    set.panel[set.count++] = panel;
    j += panel.width;
  }
  return set;
}

// f / width for 0 ≤ f < 2²²: (f + ½)/w = r + (c + ½)/w lies at least ½/w away from an
// integer, and the float product's relative error (≤ 2⁻²³, counting the rounding of 1/w)
// moves it by less than (f + ½)·2⁻²³/w < ½/w, so truncation gives r exactly. Four
// instructions instead of an integer division by a run-time width. (The cast truncates
// toward zero: cvt.rzi on the device, the same IEEE single-precision arithmetic on the host.)
TIDEPOOL_HOST_DEVICE inline int row_of(int f, float inverse_width) {
  return static_cast<int>((static_cast<float>(f) + 0.5f) * inverse_width);
}

// Where element f of a panel's tile (row r = f / width, column c = f mod width of the panel)
// goes in the column-major fp64 tile: tile[(first_column + c)·pitch + r].
TIDEPOOL_HOST_DEVICE inline int tile_index(const Panel& panel, int f, int pitch) {
  const int r = row_of(f, panel.inverse_width);
  const int c = f - r * panel.width;
  return (panel.first_column + c) * pitch + r;
}

// Element e of the tile of rows [row0, row0 + n) of any panel, in elements from its base:
// (row0 + r)·row_stride + c, in int64 (N·stride beyond 2³¹ is the normal case).
TIDEPOOL_HOST_DEVICE inline int64_t element_offset(const Panel& panel, int64_t row0, int e) {
  const int r = row_of(e, panel.inverse_width);
  const int c = e - r * panel.width;
  return (row0 + r) * panel.row_stride + c;
}

// The split of `count` contiguous elements starting at byte address `address` (aligned to
// element_size, which divides 16) into `head` scalars up to the first 16-byte boundary,
// `vectors` whole 16-byte vectors, and the scalar tail [body_end, count). Nothing assumes
// the pointer, the row length or the row count is a multiple of anything.
struct VectorSplit {
  int head;
  int vectors;
  int body_end;
};

TIDEPOOL_HOST_DEVICE inline VectorSplit vector_split(uintptr_t address, int count,
                                                     int element_size) {
  const int lanes = kVectorBytes / element_size;
  const int misalign = static_cast<int>(address % kVectorBytes) / element_size;
  const int to_boundary = (lanes - misalign) % lanes;
  const int head = to_boundary < count ? to_boundary : count;
  const int vectors = (count - head) / lanes;
  return {head, vectors, head + vectors * lanes};
}

}  // namespace tidepool::linalg::cuda
