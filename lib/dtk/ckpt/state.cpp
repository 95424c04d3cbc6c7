#include "dtk/ckpt/state.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dtk/core/error.h"

namespace dtk::ckpt {

namespace {

std::string stored_name(const StateEntry& e, int rank) {
  return e.owner == kPerRank ? fmt::format("ranks/{}/{}", rank, e.name) : e.name;
}

// Does this rank send (rank != 0) or write (rank 0) the entry?
bool mine(const StateEntry& e, int rank) {
  return e.owner == kPerRank || e.owner == rank || (e.owner == kReplicated && rank == 0);
}

void send_bytes(comm::Communicator& c, const std::string& s) {
  int64_t n = static_cast<int64_t>(s.size());
  c.send({&n, 1, DType::i64, {}}, 0, 0, comm::Mode::sync).wait();
  if (n > 0) c.send({const_cast<char*>(s.data()), s.size(), DType::u8, {}}, 0, 0, comm::Mode::sync).wait();
}

std::string recv_bytes(comm::Communicator& c, int src) {
  int64_t n = 0;
  c.recv({&n, 1, DType::i64, {}}, src, 0, comm::Mode::sync).wait();
  std::string s(static_cast<size_t>(n), '\0');
  if (n > 0) c.recv({s.data(), s.size(), DType::u8, {}}, src, 0, comm::Mode::sync).wait();
  return s;
}

int64_t packed_size(int64_t d) { return d * (d + 1) / 2; }

Shape stored_shape(const StateEntry& e) { return e.symmetric ? Shape{packed_size(e.tensor.dim(0))} : e.tensor.shape(); }

// The entry's tensor as stored, on the host: a symmetric matrix packed (StateEntry::symmetric).
Tensor stored_form(const StateEntry& e) {
  Tensor h = e.tensor.to(Device::cpu());
  if (!e.symmetric) return h;
  const int64_t d = h.dim(0);
  if (h.ndim() != 2 || h.dim(1) != d) fail("ckpt: " + e.name + " is marked symmetric but is " + shape_str(h.shape()));
  const size_t es = dtype_size(h.dtype());
  Tensor p = Tensor::empty({packed_size(d)}, h.dtype());
  const char* src = static_cast<const char*>(h.data());
  char* dst = static_cast<char*>(p.data());
  for (int64_t i = 0; i < d; ++i) {
    const size_t n = static_cast<size_t>(d - i) * es;
    std::memcpy(dst, src + static_cast<size_t>(i * d + i) * es, n);
    dst += n;
  }
  return p;
}

// Fills the symmetric [d, d] host tensor `full` from its packed upper triangle.
void unpack_symmetric(const Tensor& packed, Tensor& full) {
  const int64_t d = full.dim(0);
  const size_t es = dtype_size(full.dtype());
  const char* src = static_cast<const char*>(packed.data());
  char* dst = static_cast<char*>(full.data());
  for (int64_t i = 0; i < d; ++i) {
    const size_t n = static_cast<size_t>(d - i) * es;
    std::memcpy(dst + static_cast<size_t>(i * d + i) * es, src, n);  // row i from the diagonal on
    for (int64_t j = i + 1; j < d; ++j)                               // and its mirror, column i
      std::memcpy(dst + static_cast<size_t>(j * d + i) * es, src + static_cast<size_t>(j - i) * es, es);
    src += n;
  }
}

}  // namespace

StateEntry entry(const PlacedTensor& t) {
  StateEntry e{t.name, t.value};
  e.symmetric = t.symmetric;
  e.resize = t.resize;
  switch (t.placement) {
    case Placement::replicated: e.owner = kReplicated; break;
    case Placement::per_rank: e.owner = kPerRank; break;
    case Placement::owned:
      if (t.owner < 0) fail("ckpt: " + t.name + " is owned by no rank");
      e.owner = t.owner;
      break;
    case Placement::sharded:
      if (t.symmetric) fail("ckpt: " + t.name + " is sharded and symmetric");
      e.owner = kSharded;
      e.shape = t.rows.shape;
      e.offsets = t.rows.offsets;
      e.lengths = t.rows.lengths;
      e.replicas = t.rows.replicas;
      if (e.replicas < 1) fail("ckpt: " + t.name + " is held by no replica");
      break;
  }
  return e;
}

std::vector<StateEntry> entries(const std::vector<PlacedTensor>& state) {
  std::vector<StateEntry> out;
  out.reserve(state.size());
  for (const PlacedTensor& t : state) out.push_back(entry(t));
  return out;
}

// ------------------------------------------------------------------------------ Snapshot

Snapshot::~Snapshot() { release(); }

void Snapshot::release() {
  if (pinned_) cuda::host_unregister(block_.data());
  pinned_ = false;
  block_ = Tensor();
}

namespace {
constexpr size_t kAlign = 64;  // each copy where a host tensor of its own would start
size_t rounded(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void Snapshot::ensure(size_t bytes, bool pinned) {
  if (block_.defined() && bytes <= block_.bytes() && (pinned_ || !pinned)) return;
  release();
  block_ = Tensor::empty({static_cast<int64_t>(std::max(bytes, kAlign))}, DType::u8);
  std::memset(block_.data(), 0, block_.bytes());  // its pages, now
  if (pinned) {
    cuda::host_register(block_.data(), block_.bytes());
    pinned_ = true;
  }
}

void Snapshot::reserve(const std::vector<Tensor>& tensors) {
  size_t total = 0;
  bool device = false;
  for (const Tensor& t : tensors) {
    total += rounded(t.bytes());
    device = device || t.is_cuda();
  }
  ensure(total, device);
}

std::vector<Tensor> Snapshot::copy(const std::vector<Tensor>& tensors) {
  reserve(tensors);
  bool device = false;
  for (const Tensor& t : tensors) device = device || t.is_cuda();
  std::vector<Tensor> out;
  out.reserve(tensors.size());
  size_t off = 0;
  for (const Tensor& t : tensors) {
    Tensor dst = t.bytes() == 0 ? Tensor::empty(t.shape(), t.dtype())
                                : block_.slice(static_cast<int64_t>(off), static_cast<int64_t>(off + t.bytes()))
                                      .view(t.dtype())
                                      .reshape(t.shape());
    if (t.is_cuda()) dst.copy_from_async(t, cuda::current_stream());
    else dst.copy_from(t);
    off += rounded(t.bytes());
    out.push_back(std::move(dst));
  }
  if (device) cuda::stream_synchronize(cuda::current_stream(), "the checkpoint's copy of the state");
  return out;
}

// ------------------------------------------------------------------------------ StateWrite

StateWrite::StateWrite(std::filesystem::path path, const std::vector<StateEntry>& entries, const Metadata& meta,
                       comm::Communicator& comm, bool sharded, Snapshot* snapshot, WriteOptions opts)
    : path_(std::move(path)), meta_(meta), comm_(comm), sharded_(sharded), opts_(opts) {
  const int rank = comm.rank();
  std::vector<size_t> live;  // items that are this rank's state itself, not a copy (the snapshot's)
  auto take = [&](Item item, bool is_live) {
    if (is_live) live.push_back(writes_.size());
    writes_.push_back(std::move(item));
  };
  if (!sharded) {
    if (rank != 0) {
      // Announce the entries this rank contributes, then send them one by one.
      nlohmann::json list = nlohmann::json::array();
      std::vector<Tensor> sent;
      for (const auto& e : entries)
        if (e.owner != kReplicated && mine(e, rank)) {
          sent.push_back(stored_form(e));
          list.push_back({{"name", stored_name(e, rank)}, {"shape", sent.back().shape()}, {"dtype", dtype_name(e.tensor.dtype())}});
        }
      send_bytes(comm, list.dump());
      for (const Tensor& h : sent)
        if (h.numel() > 0) comm.send(comm::buffer_of(h), 0, 0, comm::Mode::sync).wait();
      return;
    }
    for (const auto& e : entries)
      if (mine(e, 0)) take({stored_name(e, 0), e.symmetric ? stored_form(e) : e.tensor}, !e.symmetric);
    for (int r = 1; r < comm.size(); ++r) {
      const auto list = nlohmann::json::parse(recv_bytes(comm, r));
      for (const auto& item : list) {
        Tensor h = Tensor::empty(item["shape"].get<Shape>(), parse_dtype(item["dtype"].get<std::string>()));
        if (h.numel() > 0) comm.recv(comm::buffer_of(h), r, 0, comm::Mode::sync).wait();
        take({item["name"].get<std::string>(), h}, false);
      }
    }
  } else {
    sw_ = std::make_unique<ShardedWriter>(path_, comm, opts);
    // Per-rank entries differ in names and shapes between ranks: rank 0, which writes the
    // index, learns the others'.
    if (rank != 0) {
      nlohmann::json list = nlohmann::json::array();
      for (const auto& e : entries)
        if (e.owner == kPerRank || e.owner == rank)
          list.push_back({{"name", stored_name(e, rank)}, {"shape", stored_shape(e)}, {"dtype", dtype_name(e.tensor.dtype())}});
      send_bytes(comm, list.dump());
    } else {
      for (int r = 1; r < comm.size(); ++r)
        for (const auto& item : nlohmann::json::parse(recv_bytes(comm, r)))
          sw_->write_whole(item["name"].get<std::string>(), item["shape"].get<Shape>(),
                           parse_dtype(item["dtype"].get<std::string>()), r, Tensor());
    }
    for (const auto& e : entries) {
      if (e.owner == kSharded && e.replicas > 1) {
        // Rows held alike by `replicas` groups of S ranks: the first group's are written, the
        // others' ranks write none (in the index, rows of length 0 at the end).
        const size_t S = e.offsets.size();
        if (S * static_cast<size_t>(e.replicas) != static_cast<size_t>(comm.size())) {
          if (error_.empty())
            error_ = fmt::format("save_sharded_state: {} is held by {} groups of {} ranks, not by the {} writing it",
                                 e.name, e.replicas, S, comm.size());
          continue;
        }
        std::vector<int64_t> offsets(static_cast<size_t>(comm.size()), e.shape[0]), lengths(offsets.size(), 0);
        for (size_t r = 0; r < S; ++r) offsets[r] = e.offsets[r], lengths[r] = e.lengths[r];
        const bool writes = static_cast<size_t>(rank) < S;
        take({e.name, writes ? e.tensor : e.tensor.slice(0, 0), kSharded, e.shape, offsets, lengths}, writes);
      } else if (e.owner == kSharded) {
        take({e.name, e.tensor, kSharded, e.shape, e.offsets, e.lengths}, true);
      } else if (e.owner == kReplicated && rank != 0) {
        sw_->write_whole(e.name, stored_shape(e), e.tensor.dtype(), 0, Tensor());  // in rank 0's file
      } else if (e.owner == kReplicated || e.owner == kPerRank || e.owner == rank) {
        take({stored_name(e, rank), e.symmetric ? stored_form(e) : e.tensor, e.owner, stored_shape(e)}, !e.symmetric);
      } else if (error_.empty()) {
        error_ = fmt::format("save_sharded_state: {} is owned by rank {}, not by rank {} that lists it", e.name, e.owner, rank);
      }
    }
    sw_->set_metadata(meta_);
  }
  if (snapshot && !live.empty()) {
    std::vector<Tensor> from;
    for (size_t i : live) from.push_back(writes_[i].tensor);
    std::vector<Tensor> copies = snapshot->copy(from);
    for (size_t k = 0; k < live.size(); ++k) writes_[live[k]].tensor = std::move(copies[k]);
  }
}

StateWrite::~StateWrite() = default;

std::string StateWrite::write() noexcept {
  if (!error_.empty()) return error_;
  try {
    if (!sharded_) {
      if (comm_.rank() != 0) return {};
      FileWriter w(path_, opts_);
      for (const Item& item : writes_) w.write(item.name, item.tensor);
      w.set_metadata(meta_);
      w.commit();
      return {};
    }
    for (const Item& item : writes_) {
      if (item.kind == kSharded) sw_->write_shard(item.name, item.shape, item.tensor, item.offsets, item.lengths);
      else sw_->write_whole(item.name, item.shape, item.tensor.dtype(), item.kind == kReplicated ? 0 : comm_.rank(), item.tensor);
    }
    sw_->commit_mine();
    return {};
  } catch (const std::exception& e) {
    return *e.what() ? e.what() : "cannot write " + path_.string();
  } catch (...) {
    return "cannot write " + path_.string();
  }
}

void StateWrite::commit(const std::string& error) {
  if (!sharded_) {
    const std::string e = agree(comm_, error);
    if (!e.empty()) throw AgreedError(e, 1);
    return;
  }
  sw_->settle(error);  // every rank's file is written, or every rank throws
  sw_->commit();
}

void save_state(const std::filesystem::path& path, const std::vector<StateEntry>& entries, const Metadata& meta,
                comm::Communicator& comm, WriteOptions opts) {
  StateWrite w(path, entries, meta, comm, false, nullptr, opts);
  w.commit(w.write());
}

void save_sharded_state(const std::filesystem::path& path, const std::vector<StateEntry>& entries,
                        const Metadata& meta, comm::Communicator& comm, WriteOptions opts) {
  StateWrite w(path, entries, meta, comm, true, nullptr, opts);
  w.commit(w.write());
}

namespace {

void check_stored(const Reader& reader, const std::string& name, const TensorInfo& ti, DType dtype, const Shape& shape) {
  if (ti.shape != shape || ti.dtype != dtype)
    fail_usage(reader.path().string() + ": " + name + " is " + std::string(dtype_name(ti.dtype)) + shape_str(ti.shape) +
               ", this run needs " + std::string(dtype_name(dtype)) + shape_str(shape));
}

// Per-rank state of `ranks` other ranks as its mean (Resize::mean): every rank sums the same
// tensors in the same order in f64, so every rank gets the same bits.
void load_mean(const Reader& reader, StateEntry& e, int64_t ranks) {
  if (e.symmetric) fail("ckpt: " + e.name + " is per rank and symmetric: its mean over ranks is not defined");
  std::vector<double> sum(static_cast<size_t>(e.tensor.numel()), 0.0);
  for (int64_t r = 0; r < ranks; ++r) {
    const std::string name = stored_name(e, static_cast<int>(r));
    check_stored(reader, name, reader.info(name), e.tensor.dtype(), e.tensor.shape());
    const std::vector<double> v = reader.read(name).to_doubles();
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
  }
  for (double& x : sum) x /= static_cast<double>(ranks);
  e.tensor.copy_from(Tensor::from_doubles(sum, e.tensor.shape(), e.tensor.dtype()));
}

}  // namespace

Restored load_state(const Reader& reader, std::vector<StateEntry>& entries, int rank, int world_size) {
  const Metadata& meta = reader.metadata();
  const int64_t ranks = meta.extra.value("state_ranks", meta.world_size);
  const bool same_world = ranks == world_size;
  Restored out = Restored::exact;
  for (auto& e : entries) {
    if (e.owner == kPerRank && !same_world) {
      if (e.resize == Resize::fresh) {
        out = Restored::fresh;
        continue;
      }
      load_mean(reader, e, ranks);
      if (e.resize == Resize::mean_approximate && out == Restored::exact) out = Restored::approximate;
      continue;
    }
    if (e.owner >= 0 && e.owner != rank) continue;
    const std::string name = stored_name(e, rank);
    if (e.owner >= 0 && e.resize == Resize::if_present && !reader.contains(name)) {
      out = Restored::fresh;
      continue;
    }
    if (e.owner == kSharded) {
      check_stored(reader, name, reader.info(name), e.tensor.dtype(), e.shape);
      // Per-replica state saved as its mean over the replicas (fsdp-train's compressors): exact
      // only where it enters the computation through that mean.
      if (e.resize == Resize::mean_approximate && out == Restored::exact) out = Restored::approximate;
      if (e.tensor.numel() == 0) continue;
      if (e.tensor.is_cuda()) {
        Tensor h = Tensor::empty(e.tensor.shape(), e.tensor.dtype());
        reader.read_rows(name, e.offsets[static_cast<size_t>(rank) % e.offsets.size()], h);
        e.tensor.copy_from(h);
      } else {
        reader.read_rows(name, e.offsets[static_cast<size_t>(rank) % e.offsets.size()], e.tensor);
      }
      continue;
    }
    const TensorInfo& ti = reader.info(name);  // UsageError naming it when missing
    if (e.symmetric && ti.dtype == e.tensor.dtype() && ti.shape == stored_shape(e)) {
      Tensor full = Tensor::empty(e.tensor.shape(), e.tensor.dtype());
      unpack_symmetric(reader.read(name), full);
      e.tensor.copy_from(full);
      continue;
    }
    check_stored(reader, name, ti, e.tensor.dtype(), e.tensor.shape());
    if (e.tensor.is_cuda()) {
      e.tensor.copy_from(reader.read(name));
    } else {
      reader.read_into(name, e.tensor);
    }
  }
  return out;
}

}  // namespace dtk::ckpt
