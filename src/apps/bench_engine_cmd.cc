// `rolloutcore bench engine`: prefill and decode throughput of the embedded engine, and cold
// start (process start -> first token served over HTTP) of `rolloutcore engine serve`.
#include <httplib.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "apps/commands.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/base/subprocess.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/net/http.h"

namespace rc::apps {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

struct BenchResult {
  std::string preset;
  int64_t params = 0;
  double prefill_tok_s = 0;
  double decode_tok_s = 0;
  double cold_start_s = -1;
  int64_t weight_bytes = 0;
  std::string weight_dtype;
  int64_t prompt_len = 0, batch = 0, decode_tokens = 0;
};

Status Throughput(const std::string& preset, int64_t prompt_len, int64_t batch, int64_t gen, int threads,
                  const std::string& weight_dtype, BenchResult* out) {
  engine::EngineOptions o;
  o.max_model_len = prompt_len + gen + 8;
  o.num_threads = threads;
  o.max_num_seqs = batch;
  o.max_num_batched_tokens = prompt_len * batch;
  o.enable_prefix_caching = false;
  RC_ASSIGN_OR_RETURN(auto e, engine::CreateEngine({preset, "dummy", 0, weight_dtype}, o));
  out->params = e->spec().NumParameters();
  out->weight_bytes = e->WeightBytes();
  out->weight_dtype = std::string(engine::DTypeName(e->weight_dtype()));
  const int64_t vocab = e->spec().vocab_size;
  auto prompt = [&](int64_t k) {
    std::vector<int32_t> p;
    for (int64_t i = 0; i < prompt_len; ++i) p.push_back(static_cast<int32_t>((i * 131 + k * 7919 + 3) % vocab));
    return p;
  };
  // Prefill: one prompt, one token.
  {
    engine::GenerateRequest r;
    r.prompt = prompt(1000);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 1;
    RC_ASSIGN_OR_RETURN(auto s, e->AddRequest(r));
    auto t0 = Clock::now();
    while (e->Step()) {
    }
    auto t1 = Clock::now();
    s->Wait();
    out->prefill_tok_s = static_cast<double>(prompt_len) / Seconds(t0, t1);
  }
  // Decode: `batch` sequences; time only the steps after every prefill finished.
  std::vector<std::shared_ptr<engine::RequestStream>> streams;
  for (int64_t k = 0; k < batch; ++k) {
    engine::GenerateRequest r;
    r.prompt = prompt(k);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = gen + 1;
    r.sampling.ignore_eos = true;
    RC_ASSIGN_OR_RETURN(auto s, e->AddRequest(r));
    streams.push_back(s);
  }
  e->Step();  // the prefills (token budget covers all of them)
  auto t0 = Clock::now();
  int64_t steps = 0;
  while (e->Step()) ++steps;
  auto t1 = Clock::now();
  int64_t produced = 0;
  for (auto& s : streams) produced += static_cast<int64_t>(s->Wait().tokens.size()) - 1;
  out->decode_tok_s = static_cast<double>(produced) / Seconds(t0, t1);
  out->prompt_len = prompt_len;
  out->batch = batch;
  out->decode_tokens = produced;
  return OkStatus();
}

Result<double> ColdStart(const std::string& self, const std::string& preset, int threads) {
  const int port = FreePort();
  std::vector<std::string> args = {self, "engine", "serve", "--model", preset, "--load-format", "dummy",
                                   "--port", std::to_string(port), "--max-model-len", "256",
                                   "--threads", std::to_string(threads)};
  const auto t0 = Clock::now();
  auto proc = Subprocess::Spawn({.argv = args, .stdout_io = ChildIo::kNull});
  if (!proc.ok()) return Internal("cannot spawn " + self + ": " + proc.status().message());
  httplib::Client cli("127.0.0.1", port);
  net::ApplyClientPolicy(cli);
  cli.set_connection_timeout(0, 200000);
  cli.set_read_timeout(600, 0);
  const std::string body = R"({"prompt":[1,2,3,4],"max_tokens":1,"temperature":0})";
  double result = -1;
  for (int i = 0; i < 12000; ++i) {
    auto res = cli.Post("/v1/completions", body, "application/json");
    if (res && res->status == 200) {
      result = Seconds(t0, Clock::now());
      break;
    }
    if (!(*proc)->Alive()) return Internal("engine serve exited before serving");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  (*proc)->Signal(SIGTERM);
  (void)(*proc)->Wait(std::chrono::milliseconds(-1));
  if (result < 0) return DeadlineExceeded("engine serve did not answer");
  return result;
}

}  // namespace

void RegisterBenchEngineCommand(CLI::App& app, int* exit_code) {
  // `bench` may already exist (other benchmarks register under it too).
  CLI::App* bench = nullptr;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) bench = sub;
  if (bench == nullptr) {
    bench = app.add_subcommand("bench", "Benchmarks.");
    bench->require_subcommand(1);
  }
  struct Flags {
    std::vector<std::string> presets = {"tiny", "qwen3-0.6b-like"};
    int threads = 0;
    bool json = false;
    bool cold_start = true;
    std::string weight_dtype = "auto";
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = bench->add_subcommand("engine", "Prefill / decode tokens per second and cold start of the engine.");
  cmd->add_option("--preset", f->presets, "Presets to run")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Compute threads (0: all cores)");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->add_flag("--cold-start,!--no-cold-start", f->cold_start, "Measure cold start (spawns engine serve)");
  cmd->add_option("--weight-dtype", f->weight_dtype,
                  "auto (dummy weights stay BF16) or f32 (widened, as the engine kept them before)")
      ->check(CLI::IsMember({"auto", "f32"}))
      ->capture_default_str();
  cmd->callback([f, exit_code] {
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = '\0';
    Json out = Json::array();
    for (const auto& preset : f->presets) {
      BenchResult r;
      r.preset = preset;
      const bool big = preset.find("tiny") == std::string::npos;
      Status st = Throughput(preset, big ? 128 : 256, big ? 8 : 16, big ? 8 : 64, f->threads, f->weight_dtype, &r);
      if (!st.ok()) {
        std::cerr << "bench engine: " << preset << ": " << st.ToString() << "\n";
        *exit_code = 1;
        return;
      }
      if (f->cold_start) {
        auto cs = ColdStart(self, preset, f->threads);
        if (!cs.ok()) {
          std::cerr << "bench engine: cold start of " << preset << ": " << cs.status().ToString() << "\n";
        } else {
          r.cold_start_s = *cs;
        }
      }
      Json j = {{"preset", preset}, {"parameters", r.params}, {"prefill_tokens_per_s", r.prefill_tok_s},
                {"prefill_prompt_len", r.prompt_len}, {"decode_tokens_per_s", r.decode_tok_s},
                {"decode_batch", r.batch}, {"decode_tokens", r.decode_tokens},
                {"cold_start_s", r.cold_start_s}, {"weight_dtype", r.weight_dtype},
                {"weight_bytes", r.weight_bytes}};
      out.push_back(j);
      if (!f->json) {
        std::printf("%-16s %6.1fM params  %s weights %.1f MB  prefill %8.1f tok/s (prompt %ld)  decode %8.1f tok/s "
                    "(batch %ld)  cold start %.2f s\n",
                    preset.c_str(), static_cast<double>(r.params) / 1e6, r.weight_dtype.c_str(),
                    static_cast<double>(r.weight_bytes) / 1e6, r.prefill_tok_s, static_cast<long>(r.prompt_len),
                    r.decode_tok_s, static_cast<long>(r.batch), r.cold_start_s);
        std::fflush(stdout);
      }
    }
    if (f->json) std::cout << out.dump(2) << "\n";
    *exit_code = 0;
  });
}

}  // namespace rc::apps
