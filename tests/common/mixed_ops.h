// One table of the mixed-precision ops (ops.h: "mixes"), run by the CPU test (bf16 = the f32 op
// on the widened values, each bf16 output rounded once) and the GPU test (CUDA against the CPU).
// Each case builds its inputs from fixed seeds, bf16-representable values, with its mixable
// tensors in dtype `act` (bf16 or f32), on device d, and returns its outputs.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "test_util.h"

namespace dtk::test_util {

struct MixedCase {
  std::string name;
  std::function<std::vector<Tensor>(DType act, Device d)> run;
};

inline std::vector<MixedCase> mixed_cases() {
  // bf16-representable normals, as a tensor of dtype t on d.
  const auto in = [](const Shape& s, uint64_t seed, DType t, Device d, double scale = 1.0) {
    return Tensor::from_doubles(rounded(randn(shape_numel(s), seed, scale), DType::bf16), s, t, d);
  };
  const Shape rows{6, 96}, w{96}, bthd{2, 5, 3, 64};
  const DType f32 = DType::f32;
  return {
      {"add (f32 + act -> act)",
       [=](DType act, Device d) {
         Tensor a = in(rows, 1, f32, d), b = in(rows, 2, act, d), out = Tensor::empty(rows, act, d);
         ops::add(a, b, out);
         return std::vector<Tensor>{out};
       }},
      {"add (act + act -> f32)",
       [=](DType act, Device d) {
         Tensor a = in(rows, 3, act, d), b = in(rows, 4, act, d), out = Tensor::empty(rows, f32, d);
         ops::add(a, b, out);
         return std::vector<Tensor>{out};
       }},
      {"rmsnorm_forward (w, y act)",
       [=](DType act, Device d) {
         Tensor x = in(rows, 5, f32, d, 2.0), wt = in(w, 6, act, d), y = Tensor::empty(rows, act, d);
         Tensor rstd = Tensor::empty({6}, f32, d);
         ops::rmsnorm_forward(x, wt, 1e-5, y, rstd);
         return std::vector<Tensor>{y, rstd};
       }},
      {"add_rmsnorm_forward (b, w, y act)",
       [=](DType act, Device d) {
         Tensor a = in(rows, 7, f32, d), b = in(rows, 8, act, d), wt = in(w, 9, act, d);
         Tensor x = Tensor::empty(rows, f32, d), y = Tensor::empty(rows, act, d), rstd = Tensor::empty({6}, f32, d);
         ops::add_rmsnorm_forward(a, b, wt, 1e-5, x, y, rstd);
         return std::vector<Tensor>{x, y, rstd};
       }},
      {"rmsnorm_backward (w, dy act; dx accumulates)",
       [=](DType act, Device d) {
         Tensor x = in(rows, 10, f32, d), wt = in(w, 11, act, d), dy = in(rows, 12, act, d);
         Tensor y = Tensor::empty(rows, f32, d), rstd = Tensor::empty({6}, f32, d);
         ops::rmsnorm_forward(x, in(w, 11, f32, d), 1e-5, y, rstd);
         Tensor dx = in(rows, 13, f32, d), dw = in(w, 14, f32, d);
         ops::rmsnorm_backward(x, wt, rstd, dy, dx, dw, true);
         return std::vector<Tensor>{dx, dw};
       }},
      {"swiglu_forward",
       [=](DType act, Device d) {
         Tensor a = in(rows, 15, act, d, 2.0), b = in(rows, 16, act, d), y = Tensor::empty(rows, act, d);
         ops::swiglu_forward(a, b, y);
         return std::vector<Tensor>{y};
       }},
      {"swiglu_backward",
       [=](DType act, Device d) {
         Tensor a = in(rows, 17, act, d, 2.0), b = in(rows, 18, act, d), dy = in(rows, 19, act, d);
         Tensor da = Tensor::empty(rows, act, d), db = Tensor::empty(rows, act, d);
         ops::swiglu_backward(a, b, dy, da, db);
         return std::vector<Tensor>{da, db};
       }},
      {"rope (in place, positions from 100)",
       [=](DType act, Device d) {
         Tensor x = in(bthd, 20, act, d), z = in(bthd, 26, act, d), y = Tensor::empty(bthd, act, d);
         ops::rope(x, 10000.0, 100, false, x);
         ops::rope(z, 10000.0, 100, true, y);
         return std::vector<Tensor>{x, y};
       }},
      {"rope_qk (k with fewer heads, inverse)",
       [=](DType act, Device d) {
         Tensor q = in(bthd, 27, act, d), k = in({bthd[0], bthd[1], 1, bthd[3]}, 28, act, d);
         ops::rope_qk(q, k, 500000.0, 7, true);
         return std::vector<Tensor>{q, k};
       }},
      {"embedding_forward (table act, out f32)",
       [=](DType act, Device d) {
         Tensor table = in({11, 96}, 21, act, d);
         Tensor ids = Tensor::from_doubles({3, 0, 10, 3, 7}, {5}, DType::i32, d), out = Tensor::empty({5, 96}, f32, d);
         ops::embedding_forward(table, ids, out);
         return std::vector<Tensor>{out};
       }},
      {"cross_entropy (logits act, losses f32)",
       [=](DType act, Device d) {
         Tensor logits = in({5, 300}, 22, act, d, 3.0);
         Tensor targets = Tensor::from_doubles({299, -1, 0, 17, 150}, {5}, DType::i32, d);
         Tensor losses = Tensor::empty({5}, f32, d), dlogits = Tensor::empty({5, 300}, act, d);
         Tensor lse = Tensor::empty({5}, f32, d);
         ops::cross_entropy_forward(logits, targets, losses, lse);
         ops::cross_entropy_backward(logits, targets, lse, 0.25, dlogits);
         return std::vector<Tensor>{losses, lse, dlogits};
       }},
      {"gemm (act operands, act c)",
       [=](DType act, Device d) {
         Tensor a = in({7, 40}, 23, act, d), b = in({40, 9}, 24, act, d), c = in({7, 9}, 25, act, d);
         ops::gemm(false, false, 1.0, a, b, 0.5, c);
         return std::vector<Tensor>{c};
       }},
  };
}

}  // namespace dtk::test_util
