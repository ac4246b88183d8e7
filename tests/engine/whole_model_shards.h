// Test helper shared by the engine's receiver tests: one trainer rank that owns every source
// tensor of a refit preset whole, in bf16, with the synthetic weights W_step of
// trainer::SyntheticWeights{7, 1e-3f}.
//
// Thread safety: call from the test's thread.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/trainer/synthetic_trainer.h"
#include "rolloutcore/transport/shm.h"

namespace rc::engine::test_util {

// Adds every tensor of `model` to `publisher`'s `version` as a whole bf16 shard in shared memory;
// `edit` (when set) may change a tensor's bits before they are published. Each buffer is kept in
// `published` under "<version>/<tensor>". Fails the test (ASSERT) on any error.
inline void AddWholeModelShards(
    trainer::Publisher* publisher, const std::string& model, const std::string& version, int64_t step,
    std::map<std::string, std::shared_ptr<transport::ShmBuffer>>* published,
    const std::function<void(const std::string& tensor, std::vector<uint16_t>* bits)>& edit = {}) {
  auto config = refit::ModelPreset(model);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto specs = refit::ListSourceTensors(*config);
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  trainer::SyntheticWeights w{7, 1e-3f};
  for (auto spec : *specs) {
    spec.dtype = refit::DType::kBF16;
    refit::Box box;
    box.start = refit::Shape(spec.shape.size(), 0);
    box.extent = spec.shape;
    std::vector<uint16_t> bits = trainer::ComputeBf16(w, spec, box, step);
    if (edit) edit(spec.name, &bits);
    auto created = transport::ShmBuffer::Create(bits.size() * 2);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    auto buf = std::make_shared<transport::ShmBuffer>(std::move(created).value());
    std::memcpy(buf->data(), bits.data(), bits.size() * 2);
    trainer::ShardSource s;
    s.name = spec.name;
    s.dtype = refit::DType::kBF16;
    s.global_shape = spec.shape;
    s.offset = box.start;
    s.local_shape = spec.shape;
    s.data = buf->data();
    s.keep_alive = buf;
    std::string key = version;
    key += "/";
    key += spec.name;
    (*published)[key] = buf;
    ASSERT_TRUE(publisher->AddShard(version, std::move(s)).ok());
  }
}

}  // namespace rc::engine::test_util
