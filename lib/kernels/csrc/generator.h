// A random generator owned through the C API (Megatron's model-parallel stream), shared by the
// shim's translation units.
#pragma once

#include <ATen/core/Generator.h>

struct mrs_generator {
  at::Generator generator;
};
