#include "rolloutcore/engine/engine_loop.h"

namespace rc::engine {

void EngineLoop::Start() {
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] {
    while (!stop_.load()) {
      if (!engine_->Step()) engine_->WaitForWork(std::chrono::milliseconds(50));
    }
  });
}

void EngineLoop::Stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  engine_->Notify();
  thread_.join();
}

}  // namespace rc::engine
