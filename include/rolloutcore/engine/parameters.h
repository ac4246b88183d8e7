// The engine's names for the weight storage of the `receiver` module
// (rolloutcore/receiver/weights.h, where WeightBuffer, Parameter, ParameterStore and WeightImage
// are defined and documented). The engine keeps its live parameters in them and spells them
// rc::engine::ParameterStore etc. throughout; these using-declarations keep that spelling.
#pragma once

#include "rolloutcore/engine/safetensors.h"
#include "rolloutcore/receiver/weights.h"

namespace rc::engine {

using receiver::IsParameterDType;
using receiver::Parameter;
using receiver::ParameterStore;
using receiver::ShapeString;
using receiver::WeightBuffer;
using receiver::WeightImage;

}  // namespace rc::engine
