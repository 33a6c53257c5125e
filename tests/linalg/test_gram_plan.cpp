// CPU tests of the Gram kernel's index arithmetic (optimizers/linalg/gram_plan.h), which
// gram_kernels.cu runs on the device and which cannot run there on a machine without a GPU:
// the float-reciprocal row division, the launch shape for row counts up to 2⁶³, the panel
// merge of column layouts, the 16-byte vector split of misaligned ranges, and — putting
// them together — a host replay of both load paths that must place every element of X
// exactly once, at the right place of the tile, reading only inside the panel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "optimizers/linalg/gram_plan.h"

namespace tidepool::linalg::cuda {
namespace {

TEST(GramPlan, RowOfIsExactIntegerDivisionBelow2To22) {
  // The kernel's widths are 1..16 and its offsets < 8192; the static_assert promises 2²².
  for (int width = 1; width <= kMaxKernelColumns; ++width) {
    const float inverse = 1.0f / static_cast<float>(width);
    int mismatches = 0;
    for (int f = 0; f < (1 << 22); ++f) mismatches += row_of(f, inverse) != f / width ? 1 : 0;
    EXPECT_EQ(mismatches, 0) << "width " << width;
  }
}

TEST(GramPlan, LaunchShapeCoversEveryRowOnceWithABoundedGrid) {
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::vector<int64_t> row_counts{1,
                                        2,
                                        255,
                                        256,
                                        257,
                                        511,
                                        512,
                                        513,
                                        int64_t{kMaxBlocks} * 512 - 1,
                                        int64_t{kMaxBlocks} * 512,
                                        int64_t{kMaxBlocks} * 512 + 1,
                                        1'500'007,
                                        (int64_t{1} << 28) + 3,
                                        (int64_t{1} << 31) - 1,
                                        int64_t{1} << 31,
                                        (int64_t{1} << 31) + 1,
                                        (int64_t{1} << 33) + 5,
                                        (int64_t{1} << 40) + 1,
                                        kMax / 2,
                                        kMax};
  for (int m = 1; m <= kMaxKernelColumns; ++m) {
    for (const int64_t rows : row_counts) {
      const LaunchShape shape = launch_shape(rows, m);
      const std::string what = "m " + std::to_string(m) + " rows " + std::to_string(rows);
      ASSERT_GE(shape.blocks, 1) << what;
      ASSERT_LE(shape.blocks, kMaxBlocks) << what;
      ASSERT_GT(shape.rows_per_block, 0) << what;
      EXPECT_EQ(shape.rows_per_block % tile_rows(m), 0) << what;
      // The last block starts inside the rows and ends at or past the end: every block has
      // ≥ 1 row and every row has a block (written without forming blocks·rows_per_block,
      // which can exceed 2⁶³ for rows near the maximum).
      const int64_t last_begin = static_cast<int64_t>(shape.blocks - 1) * shape.rows_per_block;
      EXPECT_LT(last_begin, rows) << what;
      EXPECT_LE(rows - last_begin, shape.rows_per_block) << what;
      EXPECT_EQ(gram_workspace_doubles(rows, m),
                static_cast<int64_t>(shape.blocks) * pair_count(m))
          << what;
    }
  }
  EXPECT_EQ(gram_workspace_doubles(0, 3), 0);
  EXPECT_EQ(gram_workspace_doubles(10, 0), 0);
}

TEST(GramPlan, PairGroupsFitRegistersAndSharedMemory) {
  for (int m = 1; m <= kMaxKernelColumns; ++m) {
    EXPECT_GE(pairs_per_group(m) * pair_groups(m), pair_count(m)) << m;
    EXPECT_LE(pairs_per_group(m), 46) << m;  // fp64 accumulators per thread
    EXPECT_EQ(kThreads % (32 * pair_groups(m)), 0) << m;
    EXPECT_LT(2 * partials_shared_bytes(m), 228u * 1024u) << m;  // two blocks per H100/H200 SM
    EXPECT_EQ(tile_pitch(m) % 2, 1) << m;
  }
}

TEST(GramPlan, VectorSplitCoversTheRangeWithAlignedVectors) {
  for (const int size : {4, 8}) {
    const int lanes = kVectorBytes / size;
    for (uintptr_t address = 4096; address < 4096 + 2 * kVectorBytes;
         address += static_cast<uintptr_t>(size)) {
      for (int count = 0; count <= 40; ++count) {
        const VectorSplit split = vector_split(address, count, size);
        const std::string what = "size " + std::to_string(size) + " address " +
                                 std::to_string(address % 16) + " count " + std::to_string(count);
        ASSERT_GE(split.head, 0) << what;
        ASSERT_LT(split.head, lanes) << what;
        ASSERT_GE(split.vectors, 0) << what;
        EXPECT_EQ(split.body_end, split.head + split.vectors * lanes) << what;
        ASSERT_LE(split.body_end, count) << what;
        EXPECT_LT(count - split.body_end, lanes) << what;  // the tail is less than one vector
        if (split.head < count) {
          EXPECT_EQ((address + static_cast<uintptr_t>(split.head * size)) % kVectorBytes, 0u)
              << what;
        }
      }
    }
  }
}

TEST(GramPlan, ElementOffsetsAreInt64BeyondTwoTo31) {
  Panel panel{nullptr, 9, 0, 9, 1.0f / 9.0f, 1};
  const int64_t row0 = (int64_t{1} << 31) + 5;
  for (const int e : {0, 8, 9, 4607}) {
    EXPECT_EQ(element_offset(panel, row0, e), (row0 + e / 9) * 9 + e % 9) << e;
  }
  panel = Panel{nullptr, int64_t{1} << 33, 0, 1, 1.0f, 0};  // a column of a very wide matrix
  EXPECT_EQ(element_offset(panel, 3, 2), int64_t{5} << 33);
}

// ---- Panels and a host replay of the kernel's loads ----------------------------------

template <typename T>
ColumnSet column_set(const std::vector<const T*>& data, const std::vector<int64_t>& stride) {
  ColumnSet set{};
  for (size_t j = 0; j < data.size(); ++j) {
    set.data[j] = data[j];
    set.stride[j] = stride[j];
  }
  return set;
}

// Replays load_vectorised / load_elements for rows [row0, row0 + n): fills `tile` (pitch
// tile_pitch(m)) and counts writes per slot; fails the test on a read outside a panel's
// elements or an unaligned vector.
template <typename T>
void replay_loads(const PanelSet& panels, int m, int64_t row0, int n, std::vector<double>& tile,
                  std::vector<int>& writes) {
  const int pitch = tile_pitch(m);
  const auto store = [&](const Panel& panel, int f, T value) {
    const int index = tile_index(panel, f, pitch);
    ASSERT_GE(index, 0);
    ASSERT_LT(index, m * pitch);
    tile[static_cast<size_t>(index)] = static_cast<double>(value);
    ++writes[static_cast<size_t>(index)];
  };
  for (int i = 0; i < panels.count; ++i) {
    const Panel& panel = panels.panel[i];
    const T* base = static_cast<const T*>(panel.base);
    const int count = n * panel.width;
    if (panel.vectorised) {
      ASSERT_EQ(panel.row_stride, panel.width);
      const T* segment = base + row0 * panel.width;
      const int size = static_cast<int>(sizeof(T));
      const VectorSplit split = vector_split(reinterpret_cast<uintptr_t>(segment), count, size);
      const int lanes = kVectorBytes / size;
      for (int v = 0; v < split.vectors; ++v) {
        const T* vector = segment + split.head + v * lanes;
        ASSERT_EQ(reinterpret_cast<uintptr_t>(vector) % kVectorBytes, 0u);
        for (int q = 0; q < lanes; ++q) store(panel, split.head + v * lanes + q, vector[q]);
      }
      for (int f = 0; f < split.head; ++f) store(panel, f, segment[f]);
      for (int f = split.body_end; f < count; ++f) store(panel, f, segment[f]);
    } else {
      for (int e = 0; e < count; ++e) store(panel, e, base[element_offset(panel, row0, e)]);
    }
  }
}

// The columns of one layout over a buffer whose element at index i holds the value i + 1
// (exact in fp32 below 2²⁴), so a misplaced or wrong read is recognisable.
template <typename T>
struct Layout {
  std::string name;
  std::vector<const T*> data;
  std::vector<int64_t> stride;
  int64_t rows;
};

template <typename T>
std::vector<Layout<T>> layouts(const std::vector<T>& buffer) {
  const T* b = buffer.data();
  std::vector<Layout<T>> all;
  // Row-major N×k at element offsets 0..3 (16-byte aligned or not), then a separate vector.
  for (int k = 1; k <= kMaxKernelColumns - 1; ++k) {
    for (int offset = 0; offset < 4; ++offset) {
      Layout<T> layout{"row_major_" + std::to_string(k) + "_at_" + std::to_string(offset), {}, {},
                       600};
      for (int j = 0; j < k; ++j) {
        layout.data.push_back(b + offset + j);
        layout.stride.push_back(k);
      }
      layout.data.push_back(b + 20000 + offset);
      layout.stride.push_back(1);
      all.push_back(layout);
    }
  }
  // Columns 0..4 and 7 of an N×8 matrix: a strided width-5 panel and a strided width-1 one.
  Layout<T> slices{
      "column_slices", {b + 1, b + 2, b + 3, b + 4, b + 5, b + 8}, {8, 8, 8, 8, 8, 8}, 700};
  all.push_back(slices);
  // Column-major N×4 (four width-1 panels), and N = 1 column-major (adjacent, stride 1: one
  // overlapping panel of width 4 whose element (0, c) is base + c).
  all.push_back({"column_major", {b + 3, b + 603, b + 1203, b + 1803}, {1, 1, 1, 1}, 600});
  all.push_back({"column_major_one_row", {b + 3, b + 4, b + 5, b + 6}, {1, 1, 1, 1}, 1});
  // A stride-0 constant column between two ordinary ones; the same column twice.
  all.push_back({"stride_zero", {b + 1, b + 7, b + 2001}, {1, 0, 1}, 800});
  all.push_back({"repeated_column", {b + 5, b + 5, b + 6}, {2, 2, 2}, 800});
  // Shifted overlapping views x[0:], x[1:], x[2:] of one vector (a stride-1 width-3 panel).
  all.push_back({"shifted_views", {b + 9, b + 10, b + 11}, {1, 1, 1}, 700});
  return all;
}

template <typename T>
void check_every_layout() {
  std::vector<T> buffer(40000);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<T>(i + 1);
  for (const auto& layout : layouts(buffer)) {
    const int m = static_cast<int>(layout.data.size());
    const PanelSet panels = make_panels(column_set(layout.data, layout.stride), m, sizeof(T));
    int covered = 0;
    for (int i = 0; i < panels.count; ++i) covered += panels.panel[i].width;
    ASSERT_EQ(covered, m) << layout.name;
    const int rows_per_tile = tile_rows(m);
    // Tiles at several starting rows, full and partial (the kernel's last tile of a slab).
    for (const int64_t row0 :
         {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{rows_per_tile / 2 + 1}}) {
      if (row0 >= layout.rows) continue;
      for (const int64_t wanted :
           {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{rows_per_tile}}) {
        const int n = static_cast<int>(std::min(wanted, layout.rows - row0));
        const std::string what =
            layout.name + " row0 " + std::to_string(row0) + " n " + std::to_string(n);
        std::vector<double> tile(static_cast<size_t>(m * tile_pitch(m)), -1.0);
        std::vector<int> writes(tile.size(), 0);
        replay_loads<T>(panels, m, row0, n, tile, writes);
        ASSERT_FALSE(::testing::Test::HasFatalFailure()) << what;
        for (int j = 0; j < m; ++j) {
          for (int r = 0; r < n; ++r) {
            const size_t slot = static_cast<size_t>(j * tile_pitch(m) + r);
            const auto expected = static_cast<double>(
                layout.data[static_cast<size_t>(j)]
                           [(row0 + r) * layout.stride[static_cast<size_t>(j)]]);
            ASSERT_EQ(writes[slot], 1) << what << ": column " << j << " row " << r;
            ASSERT_EQ(tile[slot], expected) << what << ": column " << j << " row " << r;
          }
          for (int r = n; r < tile_pitch(m); ++r) {
            ASSERT_EQ(writes[static_cast<size_t>(j * tile_pitch(m) + r)], 0)
                << what << ": wrote past row n";
          }
        }
      }
    }
  }
}

TEST(GramPlan, ReplayedLoadsPlaceEveryElementOnceFp32) { check_every_layout<float>(); }
TEST(GramPlan, ReplayedLoadsPlaceEveryElementOnceFp64) { check_every_layout<double>(); }

TEST(GramPlan, PanelsMergeOnlyAdjacentEqualStrideColumns) {
  std::vector<float> f(1000);
  std::vector<double> d(1000);
  // Row-major N×8 fp32 + a vector: one vectorised width-8 panel, one scalar width-1 panel.
  auto set = make_panels(
      column_set<float>({&f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7], &f[500]},
                        {8, 8, 8, 8, 8, 8, 8, 8, 1}),
      9, sizeof(float));
  ASSERT_EQ(set.count, 2);
  EXPECT_EQ(set.panel[0].width, 8);
  EXPECT_EQ(set.panel[0].vectorised, 1);
  EXPECT_EQ(set.panel[1].first_column, 8);
  EXPECT_EQ(set.panel[1].vectorised, 0);  // 4 bytes a row: no whole vector in a row
  // Row-major N×3: 12-byte fp32 rows are read element-wise, 24-byte fp64 rows as vectors.
  set = make_panels(column_set<float>({&f[0], &f[1], &f[2]}, {3, 3, 3}), 3, sizeof(float));
  ASSERT_EQ(set.count, 1);
  EXPECT_EQ(set.panel[0].vectorised, 0);
  set = make_panels(column_set<double>({&d[0], &d[1], &d[2]}, {3, 3, 3}), 3, sizeof(double));
  ASSERT_EQ(set.count, 1);
  EXPECT_EQ(set.panel[0].vectorised, 1);
  // Adjacent pointers with different strides, or equal strides not adjacent: no merge.
  set = make_panels(column_set<float>({&f[0], &f[1]}, {2, 3}), 2, sizeof(float));
  EXPECT_EQ(set.count, 2);
  set = make_panels(column_set<float>({&f[0], &f[2]}, {4, 4}), 2, sizeof(float));
  EXPECT_EQ(set.count, 2);
  // Strided panel (columns 0..4 of N×8): merged but not vectorised (stride ≠ width).
  set = make_panels(column_set<double>({&d[0], &d[1], &d[2], &d[3], &d[4]}, {8, 8, 8, 8, 8}), 5,
                    sizeof(double));
  ASSERT_EQ(set.count, 1);
  EXPECT_EQ(set.panel[0].width, 5);
  EXPECT_EQ(set.panel[0].vectorised, 0);
}

}  // namespace
}  // namespace tidepool::linalg::cuda
