// An optimizer's checkpoint as the bytes a trainer writes to a file, and back: the
// save/load round trip of the optimizer tests, through torch::serialize archives.
#pragma once

#include <torch/torch.h>

#include <sstream>
#include <string>

namespace tidepool::testing {

inline std::string archive_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// Reading the archive and loading it are one operation to a caller: either may throw.
inline void load_archive_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  optimizer.load(archive);
}

}  // namespace tidepool::testing
