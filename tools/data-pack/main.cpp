// data-pack: write the HDF5 data files that the *-train programs read (see man data-pack):
// token files from text (bytes, or SentencePiece: tokens.cpp) and from token ids other tools
// wrote (tokens.cpp, streamed), image files from MNIST idx and CIFAR-10 binary batches, and the
// synthetic data materialised. Inputs are checked before anything is written; outputs are
// written under a temporary name and renamed, so bad input leaves no output.
#include <spdlog/spdlog.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "dtk/cli/cli.h"
#include "dtk/cli/checks.h"
#include "dtk/core/checks.h"
#include "dtk/core/enums.h"
#include "dtk/core/error.h"
#include "dtk/data/dataset.h"
#include "pack.h"

namespace dtk::pack {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------- input files
void check_input(const std::string& p) {
  std::error_code ec;
  const auto st = fs::status(p, ec);
  if (!fs::exists(st)) fail_usage(p + ": no such file");
  if (fs::is_directory(st)) fail_usage(p + ": is a directory");
  if (std::FILE* f = std::fopen(p.c_str(), "rb"))
    std::fclose(f);
  else
    fail_usage(p + ": cannot be read (" + std::strerror(errno) + ")");
}

// The whole content of a file; gzip-compressed files are decompressed (zlib reads other files
// as they are). A damaged or truncated gzip stream is bad input.
std::vector<uint8_t> read_all(const std::string& p) {
  gzFile f = gzopen(p.c_str(), "rb");
  if (!f) fail_usage(p + ": cannot be read (" + std::strerror(errno) + ")");
  gzbuffer(f, 1 << 20);
  std::vector<uint8_t> out;
  std::vector<uint8_t> chunk(1 << 20);
  for (;;) {
    const int n = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    int err = Z_OK;
    const char* msg = gzerror(f, &err);
    if (n < 0 || (err != Z_OK && err != Z_STREAM_END)) {
      const std::string m = msg ? msg : "read error";
      gzclose_r(f);
      fail_usage(p + ": " + (err == Z_BUF_ERROR ? "the gzip stream is truncated" : "cannot be read: " + m));
    }
    if (n == 0) break;
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
  }
  if (gzclose_r(f) != Z_OK) fail_usage(p + ": the gzip stream is truncated or damaged");
  return out;
}

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | b[at + 3];
}

std::string hex(uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

// ---------------------------------------------------------------------------- outputs
void check_output(const Args& a, const char* option, const std::string& out, const std::vector<std::string>& inputs) {
  if (out.empty()) fail_usage("no output given (-o OUT.h5)");
  const fs::path o(out);
  check_output_parent(option, out);
  std::error_code ec;
  for (const auto& in : inputs)
    if (fs::weakly_canonical(o, ec) == fs::weakly_canonical(in, ec))
      fail_usage("the output " + out + " would overwrite the input " + in);
  if (fs::is_directory(o)) fail_usage(out + " is a directory");
  if (fs::exists(fs::symlink_status(o)) && !a.force) fail_usage(out + " exists; use --force to overwrite it");
}

nlohmann::json base_attrs(const std::string& source) {
  return {{"source", source}, {"program", cli::version_string("data-pack")}};
}

void print_path(const std::string& p) { std::cout << p << '\n'; }

// ---------------------------------------------------------------------------- subcommands
void split_counts(const Args& a, int64_t n, int64_t& n_train, int64_t& n_val) {
  n_val = static_cast<int64_t>(std::llround(static_cast<double>(n) * a.val_fraction));
  n_train = n - n_val;
  if (n_train < 2) fail_usage("too few tokens: {} for training (at least 2 make one window)", n_train);
  if (a.val_fraction > 0 && n_val < 2)
    fail_usage("too few tokens for --val-fraction {}: {} for validation (at least 2 make one window)", a.val_fraction,
               n_val);
}

int run_text(const Args& a) {
  std::vector<uint32_t> tokens;
  int64_t vocab = 256;
  nlohmann::json attrs = base_attrs("text");
  if (!a.sentencepiece.empty()) {
    tokens = encode_sentencepiece(a, vocab, attrs);
  } else {
    for (const auto& f : a.inputs) {
      const auto bytes = read_all(f);
      tokens.insert(tokens.end(), bytes.begin(), bytes.end());
    }
    attrs["tokenizer"] = "bytes";
  }
  const auto n = static_cast<int64_t>(tokens.size());
  int64_t n_train = 0, n_val = 0;
  split_counts(a, n, n_train, n_val);
  attrs["inputs"] = nlohmann::json(a.inputs).dump();
  attrs["split"] = "train";
  data::write_token_file(a.output, std::span(tokens).first(static_cast<size_t>(n_train)), vocab, attrs);
  if (n_val > 0) {
    attrs["split"] = "validation";
    try {
      data::write_token_file(a.val_output, std::span(tokens).subspan(static_cast<size_t>(n_train)), vocab, attrs);
    } catch (...) {
      std::error_code ec;
      fs::remove(a.output, ec);  // both outputs or neither
      throw;
    }
  }
  spdlog::info("{} tokens from {} file(s): {} training, {} validation", n, a.inputs.size(), n_train, n_val);
  print_path(a.output);
  if (n_val > 0) print_path(a.val_output);
  return cli::kExitOk;
}

int run_mnist(const Args& a) {
  const auto img = read_all(a.images), lab = read_all(a.labels);
  if (img.size() < 16) fail_usage("{}: truncated idx header ({} bytes)", a.images, img.size());
  if (be32(img, 0) != 0x00000803)
    fail_usage(a.images + ": bad magic number " + hex(be32(img, 0)) + " (an idx3 image file starts with 0x00000803)");
  if (lab.size() < 8) fail_usage("{}: truncated idx header ({} bytes)", a.labels, lab.size());
  if (be32(lab, 0) != 0x00000801)
    fail_usage(a.labels + ": bad magic number " + hex(be32(lab, 0)) + " (an idx1 label file starts with 0x00000801)");
  const int64_t n = be32(img, 4), rows = be32(img, 8), cols = be32(img, 12), nl = be32(lab, 4);
  const int64_t want = 16 + n * rows * cols;
  if (static_cast<int64_t>(img.size()) != want)
    fail_usage("{}: {} images of {}x{} need {} bytes, the file has {} ({})", a.images, n, rows, cols, want, img.size(),
               static_cast<int64_t>(img.size()) < want ? "truncated" : "trailing bytes");
  if (static_cast<int64_t>(lab.size()) != 8 + nl)
    fail_usage("{}: {} labels need {} bytes, the file has {} ({})", a.labels, nl, 8 + nl, lab.size(),
               static_cast<int64_t>(lab.size()) < 8 + nl ? "truncated" : "trailing bytes");
  if (nl != n) fail_usage("{}: {} labels for {} images in {}", a.labels, nl, n, a.images);
  if (n == 0) fail_usage(a.images + ": holds no images");
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    labels[static_cast<size_t>(i)] = lab[static_cast<size_t>(8 + i)];
    if (labels[static_cast<size_t>(i)] >= a.classes)
      fail_usage("{}: label {} of image {} is not below --classes {}", a.labels, labels[static_cast<size_t>(i)], i,
                 a.classes);
  }
  auto attrs = base_attrs("mnist");
  attrs["inputs"] = nlohmann::json(std::vector<std::string>{a.images, a.labels}).dump();
  data::write_image_file(a.output, std::span(img).subspan(16), {n, rows, cols, 1}, labels, a.classes, attrs);
  spdlog::info("{} images of {}x{}", n, rows, cols);
  print_path(a.output);
  return cli::kExitOk;
}

int run_cifar10(const Args& a) {
  constexpr int64_t kRecord = 1 + 3 * 32 * 32;
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  for (const auto& f : a.inputs) {
    const auto b = read_all(f);
    if (b.empty() || b.size() % kRecord != 0)
      fail_usage("{}: {} bytes is not a whole number of {}-byte CIFAR-10 records (truncated record {})", f, b.size(),
                 kRecord, b.size() / kRecord);
    const size_t n = b.size() / kRecord, first = labels.size();
    images.resize(images.size() + n * 3072);
    for (size_t r = 0; r < n; ++r) {
      const uint8_t* rec = b.data() + r * kRecord;
      if (rec[0] >= a.classes)
        fail_usage("{}: label {} of record {} is not below --classes {} (is this a CIFAR-10 binary batch?)", f, rec[0], r,
                   a.classes);
      labels.push_back(rec[0]);
      uint8_t* out = images.data() + (first + r) * 3072;
      for (int c = 0; c < 3; ++c)  // CHW -> HWC
        for (int p = 0; p < 1024; ++p) out[p * 3 + c] = rec[1 + c * 1024 + p];
    }
  }
  const auto n = static_cast<int64_t>(labels.size());
  auto attrs = base_attrs("cifar10");
  attrs["inputs"] = nlohmann::json(a.inputs).dump();
  data::write_image_file(a.output, images, {n, 32, 32, 3}, labels, a.classes, attrs);
  spdlog::info("{} images of 32x32x3 from {} file(s)", n, a.inputs.size());
  print_path(a.output);
  return cli::kExitOk;
}

int run_synthetic(const Args& a) {
  auto attrs = base_attrs(a.kind == SynthKind::tokens ? "synthetic-markov" : "synthetic-gaussian-mixture");
  attrs["seed"] = a.seed;
  attrs["split"] = a.validation ? "validation" : "train";
  if (a.kind == SynthKind::tokens) {
    // One long sequence of the chain: its windows of any seq_len are stretches of a stationary
    // chain, so the optimum of a model's loss on them is the entropy rate.
    const data::MarkovChain chain(a.vocab, a.seed);
    const int64_t n = a.samples * a.seq_len + 1;
    std::vector<int32_t> seq(static_cast<size_t>(n));
    chain.sample(a.validation ? data::MarkovChain::kFileValidation : data::MarkovChain::kFileTrain, 0, seq);
    const std::vector<uint32_t> tokens(seq.begin(), seq.end());
    attrs["successors"] = chain.successors();
    attrs["seq_len"] = a.seq_len;
    attrs["entropy_rate"] = chain.entropy_rate();
    attrs["optimal_loss"] = chain.entropy_rate();
    data::write_token_file(a.output, tokens, a.vocab, attrs);
    spdlog::info("{} tokens of the synthetic language (vocab {}, entropy rate {:.6f} nats/token)", n, a.vocab,
                 chain.entropy_rate());
  } else {
    nn::ModelConfig m;
    m.arch = nn::Arch::mlp;
    m.input_dim = a.input_dim;
    m.classes = a.synth_classes;
    const auto ds = data::open_dataset("synthetic", m, a.validation, a.seed);
    std::vector<float> features;
    std::vector<int32_t> labels;
    features.reserve(static_cast<size_t>(a.samples * a.input_dim));
    for (int64_t i = 0; i < a.samples; i += 4096) {
      std::vector<int64_t> idx(static_cast<size_t>(std::min<int64_t>(4096, a.samples - i)));
      std::iota(idx.begin(), idx.end(), i);
      const nn::Batch b = ds->get(idx);
      features.insert(features.end(), b.inputs.ptr<float>(), b.inputs.ptr<float>() + b.inputs.numel());
      labels.insert(labels.end(), b.targets.ptr<int32_t>(), b.targets.ptr<int32_t>() + b.targets.numel());
    }
    attrs["optimal_loss"] = ds->optimal_loss();
    attrs["optimal_loss_method"] = "monte-carlo";
    data::write_feature_file(a.output, features, {a.samples, a.input_dim}, labels, a.synth_classes, attrs);
    spdlog::info("{} samples of the Gaussian mixture ({} classes in {} dimensions, Bayes loss ~{:.4f} nats)", a.samples,
                 a.synth_classes, a.input_dim, ds->optimal_loss());
  }
  print_path(a.output);
  return cli::kExitOk;
}

// ---------------------------------------------------------------------------- the program
// A subcommand that records itself in a.command, with the output options.
CLI::App* add_command(CLI::App& app, Args& a, Command c, const std::string& name, const std::string& help) {
  CLI::App* sub = app.add_subcommand(name, help);
  sub->parse_complete_callback([&a, c] { a.command = c; });
  sub->add_option("-o,--output", a.output, "the HDF5 file to write")->required();
  sub->add_flag("-f,--force", a.force, "overwrite an existing output");
  return sub;
}

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "data-pack";
  p.description =
      "Write the HDF5 data files that the dtk training programs read: token files from text (bytes, or a "
      "SentencePiece model) and from token ids others wrote (.npy, llm.c .bin, raw), image files from MNIST and "
      "CIFAR-10, and the synthetic data materialised.";
  p.footer =
      "Writes the path of each output on stdout. Inputs may be gzip-compressed, but for `tokens`, whose inputs are "
      "memory-mapped.\n"
      "Exit status: 0 success, 1 a failure while running, 2 bad usage or bad input (no output is left).\n"
      "Example: data-pack text corpus/*.txt -o train.h5 --val-fraction 0.01 --val-output val.h5";
  p.add_options = [&a](CLI::App& app) {
    app.require_subcommand(1, 1);
    app.fallthrough();
    CLI::App* text_cmd = add_command(app, a, Command::text, "text",
                                     "token file from text files, concatenated: bytes (vocab 256), or the pieces of a "
                                     "SentencePiece model");
    text_cmd->add_option("FILE", a.inputs, "text files")->required();
    text_cmd->add_option("--sentencepiece", a.sentencepiece,
                         "tokenize with this SentencePiece model (.model: Llama 2, Mistral, Gemma); the vocabulary is "
                         "its pieces")
        ->type_name("MODEL");
    text_cmd->add_flag("--split-lines", a.split_lines, "--sentencepiece: every non-empty line is a document (default: every file)");
    text_cmd->add_flag("--no-bos", a.no_bos, "--sentencepiece: no BOS before each document (default: the model's BOS, if it has one)");
    text_cmd->add_flag("--eos", a.eos, "--sentencepiece: the model's EOS after each document");
    CLI::App* tokens_cmd = add_command(app, a, Command::tokens, "tokens",
                                       "token file from token ids others wrote: .npy, llm.c / nanoGPT .bin shards, raw "
                                       "binaries (--dtype), concatenated, streamed");
    tokens_cmd->add_option("FILE", a.inputs, ".npy (u8, u16, u32, i32, i64), llm.c .bin (magic 20240520), or raw with --dtype")
        ->required();
    tokens_cmd->add_option_function<std::string>(
                  "--dtype", [&a](const std::string& s) { a.raw_dtype = parse_enum<data::TokenType>(s, "--dtype"); },
                  "read every FILE as raw little-endian token ids of this type (no header)")
        ->check(CLI::IsMember(std::vector<std::string>{"u8", "u16", "u32", "i32", "i64"}))
        ->type_name("TYPE");
    tokens_cmd->add_option("--vocab", a.token_vocab, "the vocabulary size (the tokenizer's); default the largest id + 1")
        ->check(cli::between(1, 4294967296.0));
    for (CLI::App* c : {text_cmd, tokens_cmd}) {
      c->add_option("--val-fraction", a.val_fraction, "put this fraction of the tokens (the end) in --val-output")
          ->check(cli::between(0, 0.999));
      c->add_option("--val-output", a.val_output, "the validation token file");
    }

    CLI::App* mnist_cmd = add_command(app, a, Command::mnist, "mnist", "image file from an MNIST idx3 image file and idx1 label file");
    mnist_cmd->add_option("IMAGES", a.images, "idx3-ubyte images (e.g. train-images-idx3-ubyte[.gz])")->required();
    mnist_cmd->add_option("LABELS", a.labels, "idx1-ubyte labels (e.g. train-labels-idx1-ubyte[.gz])")->required();
    mnist_cmd->add_option("--classes", a.classes, "number of classes")->check(cli::between(1, 256));

    CLI::App* cifar_cmd = add_command(app, a, Command::cifar10, "cifar10", "image file from CIFAR-10 binary batches (stored NHWC)");
    cifar_cmd->add_option("BATCH", a.inputs, "data_batch_*.bin / test_batch.bin")->required();
    cifar_cmd->add_option("--classes", a.classes, "number of classes")->check(cli::between(1, 256));

    CLI::App* synth_cmd = add_command(app, a, Command::synthetic, "synthetic", "materialise the synthetic data (the Markov language or the mixture)");
    cli::add_enum(*synth_cmd, "--kind", a.kind, "tokens (the Markov language) or classes (the Gaussian mixture)")->required();
    synth_cmd->add_option("--samples", a.samples, "samples (tokens: windows of --seq-len)")->check(cli::at_least(1));
    synth_cmd->add_option("--seed", a.seed, "the data seed (the --seed of the training programs gives the same data)");
    synth_cmd->add_flag("--validation", a.validation, "draw from the validation stream");
    synth_cmd->add_option("--vocab", a.vocab, "tokens: vocabulary size")->check(cli::between(2, 2147483648.0));
    synth_cmd->add_option("--seq-len", a.seq_len, "tokens: window length; the file holds samples * seq_len + 1 tokens")
        ->check(cli::at_least(1));
    synth_cmd->add_option("--input-dim", a.input_dim, "classes: feature dimension")->check(cli::at_least(1));
    synth_cmd->add_option("--classes", a.synth_classes, "classes: number of classes")->check(cli::between(2, 1 << 20));
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    if (rt.size() > 1)
      fail_usage("data-pack runs as one process, but this job has {} ranks", rt.size());
    std::vector<std::string> inputs = a.inputs;
    if (a.command == Command::mnist) inputs = {a.images, a.labels};
    for (const auto& f : inputs) check_input(f);
    check_output(a, "-o", a.output, inputs);
    if (a.command == Command::text && a.sentencepiece.empty() && (a.split_lines || a.no_bos || a.eos))
      fail_usage("--split-lines, --no-bos and --eos apply to --sentencepiece");
    if (!a.sentencepiece.empty()) check_input(a.sentencepiece);
    if (a.command == Command::text || a.command == Command::tokens) {
      if (a.val_fraction > 0 && a.val_output.empty()) fail_usage("--val-fraction needs --val-output VAL.h5");
      if (!a.val_output.empty() && a.val_fraction <= 0) fail_usage("--val-output needs --val-fraction F > 0");
      if (!a.val_output.empty()) {
        check_output(a, "--val-output", a.val_output, inputs);
        std::error_code ec;
        if (fs::weakly_canonical(a.val_output, ec) == fs::weakly_canonical(a.output, ec))
          fail_usage("--val-output and -o are the same file");
      }
    }
    if (a.command == Command::synthetic) {
      const double tokens = static_cast<double>(a.samples) * static_cast<double>(a.seq_len);
      if (a.kind == SynthKind::tokens && tokens > 4e9) fail_usage("--samples x --seq-len is too large (at most 4e9 tokens)");
      if (a.kind == SynthKind::classes && static_cast<double>(a.samples) * static_cast<double>(a.input_dim) > 4e9)
        fail_usage("--samples x --input-dim is too large (at most 4e9 values)");
    }
    return [&a](comm::Runtime&) {
      switch (a.command) {
        case Command::text: return run_text(a);
        case Command::tokens: return run_tokens(a);
        case Command::mnist: return run_mnist(a);
        case Command::cifar10: return run_cifar10(a);
        case Command::synthetic: return run_synthetic(a);
      }
      return cli::kExitUsage;
    };
  };
  return p;
}

}  // namespace dtk::pack

int main(int argc, char** argv) {
  dtk::pack::Args a;
  return dtk::cli::main(argc, argv, dtk::pack::program(a));
}
