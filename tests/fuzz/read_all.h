// What the checkpoint fuzz targets do with a Reader that opened: everything a program reads
// (metadata, the tensor list, each tensor whole and by rows, as shard-inspect streams them).
#pragma once
#include "dtk/ckpt/checkpoint.h"
#include "fuzz.h"

namespace dtk::fuzz {

inline void read_all(const ckpt::Reader& r) {
  (void)r.metadata().model_config.dump();
  for (const ckpt::TensorInfo& t : r.tensors()) {
    if (t.bytes() > kMaxReadBytes) continue;
    const Tensor whole = r.read(t.name);
    if (t.shape.empty() || t.shape[0] < 2) continue;
    Shape rows = t.shape;
    rows[0] = 1;
    Tensor last = Tensor::empty(rows, t.dtype);
    r.read_rows(t.name, t.shape[0] - 1, last);
  }
}

}  // namespace dtk::fuzz
