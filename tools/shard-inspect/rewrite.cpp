// The subcommands that write checkpoints: consolidate, reshard, convert, extract. Each makes a
// plan (every output tensor: name, dtype, shape and layout) and one engine streams the input
// into a full checkpoint or a sharded state along it.
#include <algorithm>

#include "command.h"
#include "dtk/cli/checks.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::inspect {
namespace {

// Tensors of `in` as written by `w` (a ckpt::FileWriter or ckpt::SerialShardedWriter), each
// cast to its planned dtype, rows of dim 0 at a time.
template <typename Writer, typename Create>
void stream(const ckpt::Reader& in, const std::vector<ckpt::TensorInfo>& plan, Writer& w, Create&& create) {
  for (const ckpt::TensorInfo& t : plan) {
    const ckpt::TensorInfo& src = in.info(t.name);
    create(t);
    const size_t elem = std::max(dtype_size(src.dtype), dtype_size(t.dtype));
    for_each_chunk(in, src, rows_per_chunk(src, elem, kChunkBytes / 2), [&](int64_t row0, const Tensor& rows) {
      if (rows.dtype() == t.dtype) {
        w.write_rows(t.name, row0, rows);
        return;
      }
      Tensor cast = Tensor::empty(rows.shape(), t.dtype);
      ops::cast(rows, cast);
      w.write_rows(t.name, row0, cast);
    });
  }
  w.set_metadata(in.metadata());
  w.commit();
}

// Writes `plan` from `in` to `out`: a full checkpoint when world_size is 0, else a sharded
// state of world_size ranks (the plan's shard_offsets/shard_lengths or owner place each tensor).
void rewrite(const ckpt::Reader& in, const std::vector<ckpt::TensorInfo>& plan, int world_size, const fs::path& out,
             ckpt::WriteOptions opts) {
  if (world_size == 0) {
    ckpt::FileWriter w(out, opts);
    stream(in, plan, w, [&](const ckpt::TensorInfo& t) { w.create(t.name, t.shape, t.dtype); });
  } else {
    ckpt::SerialShardedWriter w(out, world_size, opts);
    stream(in, plan, w, [&](const ckpt::TensorInfo& t) { w.create(t); });
  }
  print_path(out);
}

ckpt::TensorInfo whole(const ckpt::TensorInfo& t) { return {t.name, t.shape, t.dtype, {}, {}, -1}; }

// ---------------------------------------------------------------------------- consolidate

class Consolidate : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override { add_io_options(sub, "the sharded state (or any checkpoint)"); }
  void validate() override { open(false); }
  int run() override {
    std::vector<ckpt::TensorInfo> plan;
    for (const auto& t : in_->tensors()) plan.push_back(whole(t));
    rewrite(*in_, plan, 0, output_, write_options());
    return 0;
  }
};

// ---------------------------------------------------------------------------- reshard

class Reshard : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_io_options(sub, "a full checkpoint or a sharded state");
    sub.add_option("-n,--world-size", world_size_, "ranks of the sharded state written")
        ->required()
        ->check(cli::between(1, 1 << 20));
  }
  void validate() override { open(true); }
  int run() override {
    // Rows of dim 0 split evenly; 0-d tensors, whole tensors of a sharded input and per-rank
    // state (ranks/<r>/...) stay whole, in rank 0's file.
    std::vector<ckpt::TensorInfo> plan;
    for (const auto& t : in_->tensors()) {
      ckpt::TensorInfo p = whole(t);
      const bool split = !t.shape.empty() && !t.name.starts_with("ranks/") && (!in_->sharded() || t.sharded());
      if (split) ckpt::even_split(t.shape[0], world_size_, p.shard_offsets, p.shard_lengths);
      else p.owner = 0;
      plan.push_back(std::move(p));
    }
    rewrite(*in_, plan, world_size_, output_, write_options());
    return 0;
  }

 private:
  int world_size_ = 0;
};

// ---------------------------------------------------------------------------- convert

class Convert : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_io_options(sub, "a full checkpoint or a sharded state");
    sub.add_option("--dtype", dtype_, "the float type of the output: bf16, f16 or f32")
        ->required()
        ->check(CLI::IsMember({"bf16", "f16", "f32"}));
  }
  void validate() override { open_like_input(); }
  int run() override {
    // The same layout, float tensors in the new type, the others untouched.
    const DType to = parse_dtype(dtype_);
    std::vector<ckpt::TensorInfo> plan = in_->tensors();
    for (auto& t : plan)
      if (dtype_is_float(t.dtype)) t.dtype = to;
    rewrite(*in_, plan, static_cast<int>(in_->shard_files().size()), output_, write_options());
    return 0;
  }

 private:
  std::string dtype_;
};

// ---------------------------------------------------------------------------- extract

class Extract : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_io_options(sub, "a full checkpoint or a sharded state");
    sub.add_option("NAME", names_, "the tensors to keep, or groups ending in / (model/)")->required();
  }
  void validate() override {
    open(false);
    check_names(names_, {in_.get()});
  }
  int run() override {
    std::vector<ckpt::TensorInfo> plan;
    for (const auto& t : in_->tensors())
      if (selected(t.name, names_)) plan.push_back(whole(t));
    rewrite(*in_, plan, 0, output_, write_options());
    return 0;
  }

 private:
  std::vector<std::string> names_;
};

}  // namespace

std::unique_ptr<Command> make_consolidate() { return std::make_unique<Consolidate>(); }
std::unique_ptr<Command> make_reshard() { return std::make_unique<Reshard>(); }
std::unique_ptr<Command> make_convert() { return std::make_unique<Convert>(); }
std::unique_ptr<Command> make_extract() { return std::make_unique<Extract>(); }

}  // namespace dtk::inspect
