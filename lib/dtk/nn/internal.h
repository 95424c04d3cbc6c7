// Internal to dtk::nn: what model.cpp takes from the architectures' files, and the error of a
// bad model config (a UsageError "model config: ...").
#pragma once
#include <fmt/format.h>

#include <memory>
#include <string>
#include <utility>

#include "dtk/core/error.h"
#include "dtk/nn/model.h"

namespace dtk::nn::detail {

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, Device d, DType t, Storage s);   // llama.cpp
std::unique_ptr<Model> make_mlp(const ModelConfig& cfg, Device d, DType t, Storage s);     // mlp.cpp
std::unique_ptr<Model> make_resnet(const ModelConfig& cfg, Device d, DType t, Storage s);  // resnet.cpp
void resnet_validate(const ModelConfig& cfg);                                            // resnet.cpp
int64_t resnet_num_params(const ModelConfig& cfg);                                       // resnet.cpp
double resnet_train_flops(const ModelConfig& cfg);                                       // resnet.cpp

[[noreturn]] inline void bad(const std::string& what) { fail_usage("model config: " + what); }
template <class... A>
  requires(sizeof...(A) > 0)
[[noreturn]] void bad(fmt::format_string<A...> format, A&&... args) {
  bad(fmt::format(format, std::forward<A>(args)...));
}

}  // namespace dtk::nn::detail
