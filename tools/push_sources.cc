#include "tools/push_sources.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <set>

namespace weightfs::cli {
namespace {

// Formats that checkpoints are saved in by PyTorch, safetensors, llama.cpp, NumPy, Keras/TF,
// Flax, ONNX, PaddlePaddle and torch.distributed.checkpoint.
constexpr std::array<std::string_view, 17> kWeightExtensions = {
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".npy", ".npz",
    ".h5", ".hdf5", ".keras", ".msgpack", ".onnx", ".tflite", ".pdparams", ".distcp"};

std::string WithoutDigits(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (!std::isdigit(static_cast<unsigned char>(c))) out.push_back(c);
  }
  return out;
}

}  // namespace

bool IsWeightFile(std::string_view path) {
  std::string lower(path);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return std::any_of(kWeightExtensions.begin(), kWeightExtensions.end(),
                     [&](std::string_view ext) { return lower.ends_with(ext); });
}

Status CheckNotVersionParent(const std::string& dir, const std::vector<PushFile>& files) {
  // Subdirectories of `dir` (first path components) that hold weight files, grouped by their
  // name without digits: a run of checkpoints is one group of several.
  std::map<std::string, std::set<std::string>> groups;
  for (const PushFile& f : files) {
    const size_t slash = f.path.find('/');
    if (slash == std::string::npos || !IsWeightFile(f.path)) continue;
    const std::string sub = f.path.substr(0, slash);
    if (sub.find('@') != std::string::npos) {
      return Status::InvalidArgument(dir + " holds the version directory " + sub +
                                     "/: pushing it would publish a version of version directories. Push "
                                     "the version's own directory (" + dir + "/" + sub +
                                     "), or pass --allow-nested if this layout is meant");
    }
    groups[WithoutDigits(sub)].insert(sub);
  }
  for (const auto& [key, subs] : groups) {
    if (subs.size() < 2) continue;
    const std::string& first = *subs.begin();
    const std::string& second = *std::next(subs.begin());
    return Status::InvalidArgument(dir + " holds " + std::to_string(subs.size()) + " checkpoint directories (" + first +
                                   "/, " + second + "/" + (subs.size() > 2 ? ", ..." : "") +
                                   ", each with weight files): pushing it would publish all of them as one "
                                   "version. Push one per version (" + dir + "/" + first +
                                   "), or pass --allow-nested if this layout is meant");
  }
  return Status::Ok();
}

Status CheckHasWeights(const std::vector<std::string>& sources, const std::vector<PushFile>& files) {
  if (std::any_of(files.begin(), files.end(), [](const PushFile& f) { return IsWeightFile(f.path); })) {
    return Status::Ok();
  }
  std::string what;
  for (size_t i = 0; i < files.size() && i < 3; ++i) what += (i ? ", " : "") + files[i].path;
  if (files.size() > 3) what += ", ...";
  std::string from;
  for (const std::string& s : sources) from += (from.empty() ? "" : " ") + s;
  if (files.empty()) {
    return Status::InvalidArgument(from + " holds no files: is it the checkpoint directory? (--allow-no-weights "
                                   "publishes an empty version anyway)");
  }
  return Status::InvalidArgument(from + " holds " + std::to_string(files.size()) + " file(s) (" + what +
                                 ") but no weight file (.safetensors, .bin, .pt, .pth, .gguf, .npz, ...): is it the "
                                 "checkpoint directory? Pass --allow-no-weights to publish them as a version anyway");
}

}  // namespace weightfs::cli
