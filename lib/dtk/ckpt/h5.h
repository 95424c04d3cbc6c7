// Thin RAII over the HDF5 C API (internal to ckpt): owned ids, errors as dtk::Error with the
// message of HDF5's error stack, and dtk's dtypes as HDF5 types (bf16 and f16 as IEEE-style
// float types that h5dump, h5diff and h5py understand).
#pragma once
#include <hdf5.h>

#include <string>
#include <utility>

#include "dtk/core/dtype.h"
#include "dtk/core/h5.h"
#include "dtk/core/tensor.h"

namespace dtk::ckpt::h5 {

// core/h5.h: the RAII ids, error handling and attribute helpers.
using namespace dtk::h5;

hid_t file_type(DType t);    // the on-disk type (little-endian); do not close predefined ones: use Id(H5Tcopy(...))
hid_t memory_type(DType t);  // the in-memory type of our buffers
// The dtype of an on-disk type; UsageError naming `what` for types dtk does not use.
DType dtype_of(hid_t type, const std::string& what);

// Creates every missing group on the path to `name` ("a/b/c" creates "a" and "a/b").
void make_parents(hid_t file, const std::string& name);

}  // namespace dtk::ckpt::h5
