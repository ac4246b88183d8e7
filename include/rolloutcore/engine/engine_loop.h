// EngineLoop: the background thread that drives an Engine: Step() while there is runnable
// work, otherwise sleep until AddRequest / Resume wakes it.
//
// Thread safety: Start/Stop from one owner thread; the loop thread is the only caller of
// Engine::Step while it runs. Invariant: after Stop returns no Step is in progress.
#pragma once

#include <atomic>
#include <thread>

#include "rolloutcore/engine/engine.h"

namespace rc::engine {

class EngineLoop {
 public:
  explicit EngineLoop(Engine* engine) : engine_(engine) {}
  ~EngineLoop() { Stop(); }
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  void Start();
  void Stop();

 private:
  Engine* engine_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rc::engine
