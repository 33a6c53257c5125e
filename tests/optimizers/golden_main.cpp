// tidepool_golden [--float32] [--verbose] FILE.json...: runs tidepool's optimizer on each
// golden trajectory file and prints one line per file (name, steps, largest scaled
// deviation |x − ref|/(1e-3 + |ref|), largest absolute deviation, PASS/FAIL). Pass/fail is
// judge()'s rule (golden_runner.h), the same as the test batteries': fp64 (default) at the
// README's tolerance; --float32 runs in fp32, within 1e-4 absolute. --verbose adds one line
// per step. Exits 1 when any file fails or cannot be
// read, 2 on usage errors.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "golden_runner.h"

int main(int argc, char** argv) {
  bool float32 = false;
  bool verbose = false;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--float32") == 0) {
      float32 = true;
    } else if (std::strcmp(argv[i], "--verbose") == 0) {
      verbose = true;
    } else {
      files.emplace_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: %s [--float32] [--verbose] GOLDEN.json...\n", argv[0]);
    return 2;
  }
  int failures = 0;
  for (const auto& file : files) {
    try {
      const auto golden = tidepool::testing::load_golden(file);
      tidepool::testing::RunOptions options;
      if (float32) options.dtype = torch::kFloat32;
      const auto run = tidepool::testing::run_golden(golden, options);
      if (verbose) {
        for (size_t k = 1; k <= run.params.size(); ++k) {
          tidepool::testing::Trajectory prefix;
          prefix.losses.assign(run.losses.begin(), run.losses.begin() + static_cast<long>(k));
          prefix.params.assign(run.params.begin(), run.params.begin() + static_cast<long>(k));
          const auto d = tidepool::testing::compare(golden, prefix);
          std::printf("  step %3zu  loss %.12f (ref %.12f)  max scaled so far %.3e  abs %.3e\n", k,
                      run.losses[k - 1], golden.steps[k - 1].loss, d.max_scaled, d.max_abs);
        }
      }
      const auto d = tidepool::testing::compare(golden, run);
      const auto v = tidepool::testing::judge(golden, d, options.dtype);
      std::printf("%-28s %s steps %3lld  max deviation %.3e (step %lld)  abs %.3e  loss %.3e  "
                  "%s %.3e <= %.1e: %s\n",
                  golden.name.c_str(), float32 ? "fp32" : "fp64", static_cast<long long>(d.steps),
                  d.max_scaled, static_cast<long long>(d.worst_step), d.max_abs,
                  d.max_loss_scaled, v.measure, v.measured, v.bound, v.pass ? "PASS" : "FAIL");
      if (!v.pass) ++failures;
    } catch (const std::exception& e) {
      std::printf("%-28s ERROR %s\n", file.c_str(), e.what());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
