// Small helpers shared by the core test suites.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"

namespace weightfs::testing_util {

// A tensor description with offsets left for BuildSafetensorsHeader to assign.
inline TensorInfo Tensor(std::string name, DType dtype, std::vector<uint64_t> shape) {
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

}  // namespace weightfs::testing_util
