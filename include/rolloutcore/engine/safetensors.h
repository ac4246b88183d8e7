// The engine's names for the safetensors types and functions of the `formats` module
// (rolloutcore/formats/safetensors.h, where the reader, writer and header parser live and are
// documented). The engine spells them rc::engine::DType etc. throughout; these using-declarations
// keep that spelling. Code outside the engine includes rolloutcore/formats/safetensors.h.
#pragma once

#include "rolloutcore/formats/safetensors.h"

namespace rc::engine {

using formats::BF16ToF32;
using formats::ConvertToF32;
using formats::DType;
using formats::DTypeFromName;
using formats::DTypeName;
using formats::DTypeSize;
using formats::F16ToF32;
using formats::F32ToBF16;
using formats::F32ToF16;
using formats::kMaxSafetensorsHeaderBytes;
using formats::ParseSafetensorsHeader;
using formats::SafetensorsFile;
using formats::SafetensorsFolder;
using formats::SafetensorsHeader;
using formats::TensorEntry;
using formats::TensorToWrite;
using formats::WriteSafetensors;

}  // namespace rc::engine
