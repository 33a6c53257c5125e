// CPU tests of the GPU TSQR's row-chunk plan (optimizers/linalg/tsqr_plan.h): the chunks
// tile the rows exactly, none exceeds 2²⁷ elements, every full chunk has at least as many
// rows as columns, and the plans the GPU tests rely on come out as those tests say — so a
// mistake here is found without the 20 GB problems that exercise it on a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "optimizers/linalg/tsqr_plan.h"

namespace tidepool::linalg::detail {
namespace {

void expect_valid(int64_t rows, int64_t cols) {
  const TsqrPlan plan = tsqr_plan(rows, cols);
  const std::string what = std::to_string(rows) + "x" + std::to_string(cols);
  ASSERT_GE(plan.chunks, 1) << what;
  ASSERT_GE(plan.chunk_rows, 1) << what;
  EXPECT_GE(plan.last_rows, 1) << what;
  EXPECT_LE(plan.last_rows, plan.chunk_rows) << what;
  EXPECT_EQ(plan.begin(plan.chunks - 1) + plan.count(plan.chunks - 1), rows) << what;
  // Consecutive chunks abut: chunk c + 1 begins where chunk c ends.
  EXPECT_EQ(plan.begin(0), 0) << what;
  if (plan.chunks > 1) {
    EXPECT_EQ(plan.begin(1), plan.count(0)) << what;
    EXPECT_EQ(plan.count(0), plan.chunk_rows) << what;
    EXPECT_GE(plan.chunk_rows, cols) << what;  // every full chunk yields a cols×cols triangle
  }
  if (cols * cols <= kTsqrMaxChunkElements) {
    EXPECT_LE(plan.chunk_rows * cols, kTsqrMaxChunkElements) << what;
  }
}

TEST(TsqrPlan, ChunksTileTheRowsWithinTheElementLimit) {
  const std::vector<int64_t> row_counts{1,
                                        2,
                                        8,
                                        9,
                                        14'913'080,
                                        14'913'081,
                                        (int64_t{1} << 27) - 1,
                                        int64_t{1} << 27,
                                        (int64_t{1} << 28) + 3,
                                        (int64_t{1} << 28) + 4096,
                                        (int64_t{1} << 31) + 1,
                                        (int64_t{1} << 36) + 7};
  for (const int64_t cols : {int64_t{1}, int64_t{2}, int64_t{9}, int64_t{10}, int64_t{17},
                             int64_t{33}, int64_t{11'585}, int64_t{11'586}, int64_t{20'000}}) {
    for (const int64_t rows : row_counts) expect_valid(rows, cols);
  }
}

TEST(TsqrPlan, TheSvdPathBeyond2To31GetsEighteenFullChunksAndAShortOne) {
  // gpu_test_lstsq_large.cpp's SvdPathBeyond2To31Elements: [A·D | b] is (2²⁸ + 4096)×9 fp64.
  const TsqrPlan plan = tsqr_plan((int64_t{1} << 28) + 4096, 9);
  EXPECT_EQ(plan.chunk_rows, 14'913'080);  // ⌊2²⁷ / 9⌋
  EXPECT_EQ(plan.chunks, 19);
  EXPECT_EQ(plan.last_rows, 4'112);
}

TEST(TsqrPlan, ShortLastChunkAndSingleChunk) {
  // One row past a whole number of chunks: the last chunk is a single row.
  const int64_t per_chunk = kTsqrMaxChunkElements / 8;
  const TsqrPlan one_extra = tsqr_plan(3 * per_chunk + 1, 8);
  EXPECT_EQ(one_extra.chunks, 4);
  EXPECT_EQ(one_extra.last_rows, 1);
  // Fewer rows than one chunk (or than columns, the wide case): one chunk of all rows.
  for (const int64_t rows : {int64_t{1}, int64_t{5}, int64_t{100'000}}) {
    const TsqrPlan plan = tsqr_plan(rows, 8);
    EXPECT_EQ(plan.chunks, 1) << rows;
    EXPECT_EQ(plan.chunk_rows, rows) << rows;
    EXPECT_EQ(plan.last_rows, rows) << rows;
  }
  EXPECT_THROW(tsqr_plan(0, 3), std::invalid_argument);
  EXPECT_THROW(tsqr_plan(10, 0), std::invalid_argument);
}

}  // namespace
}  // namespace tidepool::linalg::detail
