// `rolloutcore model init`: writes a seeded random model as a real Hugging Face folder
// (config.json + model.safetensors): the project's own fixtures.
#include <filesystem>
#include <iostream>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "rolloutcore/engine/loader.h"

namespace rc::apps {

void RegisterModelFp8Command(CLI::App* model, int* exit_code);  // model_fp8_cmd.cc

void RegisterModelCommand(CLI::App& app, int* exit_code) {
  auto* model = app.add_subcommand("model", "Model folders.");
  model->require_subcommand(1);
  struct Flags {
    std::string preset = "tiny";
    uint64_t seed = 0;
    std::string out;
    std::string dtype = "BF16";
  };
  auto f = std::make_shared<Flags>();
  auto* init = model->add_subcommand("init", "Write a seeded random model of a preset as a HF folder.");
  init->add_option("--preset", f->preset, "Preset (tiny, tiny-llama, tiny-qwen2, tiny-tied, qwen3-0.6b-like)")
      ->capture_default_str();
  init->add_option("--seed", f->seed, "Seed (same as --load-format dummy --seed)")->check(Unsigned())->capture_default_str();
  init->add_option("--out", f->out, "Output folder")->required();
  init->add_option("--dtype", f->dtype, "BF16, F16 or F32 (any case)")
      ->transform(CLI::IsMember({"BF16", "F16", "F32"}, CLI::ignore_case))
      ->capture_default_str();
  init->callback([f, exit_code] {
    auto spec = engine::ResolveModel(f->preset);
    if (!spec.ok()) {
      std::cerr << "model init: " << spec.status().ToString() << "\n";
      *exit_code = 2;
      return;
    }
    auto dtype = engine::DTypeFromName(f->dtype);
    if (!dtype.ok()) {
      std::cerr << "model init: --dtype: " << dtype.status().message() << "\n";
      *exit_code = 2;
      return;
    }
    {
      // Other *.safetensors in the folder would be loaded beside the new one (or clash with it).
      std::error_code ec;
      for (const auto& de : std::filesystem::directory_iterator(f->out, ec)) {
        const std::string name = de.path().filename().string();
        if ((de.path().extension() == ".safetensors" && name != "model.safetensors") ||
            name == "model.safetensors.index.json") {
          std::cerr << "model init: --out " << f->out << " already holds " << name
                    << ", which would be read with (or instead of) the new model.safetensors; use an empty folder\n";
          *exit_code = 2;
          return;
        }
      }
    }
    auto source = engine::MakeDummySource(*spec, f->seed);
    Status st = engine::WriteModelFolder(f->out, *spec, source.get(), *dtype);
    if (!st.ok()) {
      std::cerr << "model init: " << st.ToString() << "\n";
      *exit_code = 1;
      return;
    }
    std::cout << "wrote " << f->preset << " (" << spec->NumParameters() << " parameters, seed " << f->seed << ") to "
              << f->out << "\n";
    *exit_code = 0;
  });
  RegisterModelFp8Command(model, exit_code);
}

}  // namespace rc::apps
