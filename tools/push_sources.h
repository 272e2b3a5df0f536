// Sanity checks on what `weightfs push` is asked to publish, before anything is uploaded: a
// mistake here publishes a version that becomes the model's @latest (and the parent of every
// draft after it), so the two common ones are refused unless a flag says they are meant:
//   - no weight file among the files (a directory of configs, an empty directory, the wrong one);
//   - a directory that holds version directories (the parent of step-1/, step-2/, ... or of
//     name@version directories), which would publish them all as one version.
// Pure functions of the file list; not thread-specific.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "hub/engine/version_writer.h"

namespace weightfs::cli {

// Whether a file name looks like model weights by its extension (.safetensors, .bin, .pt, .gguf...).
bool IsWeightFile(std::string_view path);

// `files` were collected from directory `dir` (paths relative to it). InvalidArgument naming
// two of the version directories and the fix when `dir` holds version directories: two or more
// subdirectories whose names differ only in digits (v000/ v001/, step-100/ step-200/) that each
// hold weight files, or one named MODEL@VERSION that does.
Status CheckNotVersionParent(const std::string& dir, const std::vector<PushFile>& files);

// InvalidArgument naming what was found and the fix when no file of `files` is a weight file.
// `sources`: the PATH arguments, for the message.
Status CheckHasWeights(const std::vector<std::string>& sources, const std::vector<PushFile>& files);

}  // namespace weightfs::cli
