// What the checkpoint tests compare and forge, shared by test_checkpoint_random.cpp and
// test_aadl_load.cpp: parameters copied and compared bitwise, runs stepped on side by side,
// the whole state of two AADL runs (what a failed load could have touched), and archives
// copied key by key with one value left out or replaced (a valid archive damaged in
// exactly one place).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint_problems.h"

namespace tidepool::testing::checkpoint {

// Fresh leaf parameters with the same values: a second run that starts where `params` are.
inline Params copies(const Params& params) {
  Params out;
  for (const auto& p : params) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

inline void expect_bitwise(const Params& got, const Params& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(torch::equal(got[i].detach(), want[i].detach())) << "parameter " << i << what;
  }
}

// Steps `a` and `b` alike from step `from` to the problem's last, and expects the same
// parameters, bit for bit, after each step.
template <typename Run, typename Problem>
void expect_steps_alike(Run& a, Run& b, const Problem& problem, int from,
                        const std::string& what) {
  for (int s = from; s < problem.steps; ++s) {
    a.step(problem, s);
    b.step(problem, s);
    ASSERT_NO_FATAL_FAILURE(
        expect_bitwise(a.params, b.params, what + " after step " + std::to_string(s + 1)));
  }
}

// The state two AADL runs hold, compared: the safeguard's counts, every group's history
// and matrices, the inner SGD's options and momentum buffers. (The step counters have no
// accessor: stepping both on and comparing the parameters shows them.)
inline void expect_same_state(const AADLRun& a, const AADLRun& b) {
  EXPECT_EQ(a.aadl->accepted(), b.aadl->accepted());
  EXPECT_EQ(a.aadl->rejected(), b.aadl->rejected());
  auto& inner_a = a.aadl->inner();
  auto& inner_b = b.aadl->inner();
  ASSERT_EQ(inner_a.param_groups().size(), inner_b.param_groups().size());
  for (size_t g = 0; g < inner_a.param_groups().size(); ++g) {
    const auto& history_a = a.aadl->history(g);
    const auto& history_b = b.aadl->history(g);
    ASSERT_EQ(history_a.size(), history_b.size()) << "group " << g << "'s history";
    const auto vectors_a = history_a.read_host();
    const auto vectors_b = history_b.read_host();
    for (size_t i = 0; i < vectors_a.size(); ++i) {
      EXPECT_TRUE(torch::equal(vectors_a[i], vectors_b[i])) << "group " << g << " vector " << i;
    }
    EXPECT_TRUE(torch::equal(history_a.gram(), history_b.gram())) << "group " << g << "'s gram";
    EXPECT_TRUE(torch::equal(history_a.rhs(), history_b.rhs())) << "group " << g << "'s rhs";
    const auto& options_a =
        static_cast<const torch::optim::SGDOptions&>(inner_a.param_groups()[g].options());
    const auto& options_b =
        static_cast<const torch::optim::SGDOptions&>(inner_b.param_groups()[g].options());
    EXPECT_TRUE(options_a == options_b) << "group " << g << "'s SGD options";
    const auto& params_a = inner_a.param_groups()[g].params();
    const auto& params_b = inner_b.param_groups()[g].params();
    for (size_t i = 0; i < params_a.size(); ++i) {
      const auto it_a = inner_a.state().find(params_a[i].unsafeGetTensorImpl());
      const auto it_b = inner_b.state().find(params_b[i].unsafeGetTensorImpl());
      ASSERT_EQ(it_a == inner_a.state().end(), it_b == inner_b.state().end())
          << "group " << g << " parameter " << i << "'s SGD state";
      if (it_a == inner_a.state().end()) continue;
      const auto& buffer_a =
          static_cast<const torch::optim::SGDParamState&>(*it_a->second).momentum_buffer();
      const auto& buffer_b =
          static_cast<const torch::optim::SGDParamState&>(*it_b->second).momentum_buffer();
      EXPECT_TRUE(buffer_a.defined() == buffer_b.defined() &&
                  (!buffer_a.defined() || torch::equal(buffer_a, buffer_b)))
          << "group " << g << " parameter " << i << "'s momentum";
    }
  }
}

// ---- forged archives ---------------------------------------------------------------------

inline void write_value(torch::serialize::OutputArchive& to, const std::string& key,
                        const c10::IValue& value) {
  if (value.isTensor()) {
    to.write(key, value.toTensor(), /*is_buffer=*/true);
  } else {
    to.write(key, value);
  }
}

// Copies `from` into `to` but for `skip`: values, tensors and nested archives.
inline void copy_archive(torch::serialize::InputArchive& from,
                         torch::serialize::OutputArchive& to, const std::string& skip) {
  for (const std::string& key : from.keys()) {
    if (key == skip || key == "training") continue;  // every archive has its own "training"
    torch::serialize::InputArchive nested_in;
    if (from.try_read(key, nested_in)) {
      torch::serialize::OutputArchive nested_out;
      copy_archive(nested_in, nested_out, "");
      to.write(key, nested_out);
      continue;
    }
    c10::IValue value;
    from.read(key, value);
    write_value(to, key, value);
  }
}

// Copies `from` into `to` with the value at `path` ("key", or "nested/key" inside nested
// archives) replaced by `value`. The path must exist: a misspelt one fails the test
// instead of forging an archive that is still valid.
inline void copy_replacing(torch::serialize::InputArchive& from,
                           torch::serialize::OutputArchive& to, const std::string& path,
                           const c10::IValue& value) {
  const size_t slash = path.find('/');
  const std::string key = path.substr(0, slash);
  const std::vector<std::string> keys = from.keys();
  ASSERT_NE(std::find(keys.begin(), keys.end(), key), keys.end()) << "no '" << key << "'";
  copy_archive(from, to, key);
  if (slash == std::string::npos) {
    write_value(to, key, value);
    return;
  }
  torch::serialize::InputArchive nested_in;
  ASSERT_TRUE(from.try_read(key, nested_in)) << "'" << key << "' is no nested archive";
  torch::serialize::OutputArchive nested_out;
  copy_replacing(nested_in, nested_out, path.substr(slash + 1), value);
  to.write(key, nested_out);
}

// `bytes` (a saved archive) with the value at `path` replaced, as copy_replacing.
inline std::string with_value(const std::string& bytes, const std::string& path,
                              const c10::IValue& value) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  torch::serialize::OutputArchive forged;
  copy_replacing(archive, forged, path, value);
  std::ostringstream out;
  forged.save_to(out);
  return out.str();
}

}  // namespace tidepool::testing::checkpoint
