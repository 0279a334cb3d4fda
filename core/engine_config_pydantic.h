// DeepSpeed reads some sections of its configuration with pydantic models (DeepSpeedConfigModel,
// lax mode): zero_optimization and its offload_optimizer and offload_param (runtime/zero/
// config.py, offload_config.py), hybrid_engine and tensor_parallel, and from 0.17 on fp16 and
// bf16 (runtime/precision_config.py). pydantic converts a value to its field's type
// where it can: "false" to false, "2" to 2, "1e9" to 1e9 where a float is wanted, and refuses
// what it cannot. The other keys DeepSpeed reads with get_scalar_param, which converts nothing:
// there a quoted "false" is a non-empty string, true for Python. This file reads the first kind
// as pydantic does, before the section readers see them, for the engine and (through
// zoe_config_normalize) for zoe.torch.initialize alike.
#pragma once

#include <nlohmann/json.hpp>

#include "core/result.h"

namespace zoe::config {

// The document read, in place, as DeepSpeed's pydantic models read it (a document that is not an
// object is left alone):
//  - the values of the keys they type bool, int or float, in the sections above (bfloat16 too;
//    only the keys zoe accepts there), converted as pydantic's lax mode converts them: for a bool,
//    "true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0" in any letter case,
//    and the numbers 0 and 1; for an int, a quoted integer (" 2 ", "+2", "1_000", "2.0"; not
//    "1e9" or "2.5"); for a float, a quoted number ("0.5", "1e9", "inf"). Numbers given where an
//    int or a float is wanted, null and "auto" (which DeepSpeed's models drop) are left for the
//    section readers. Anything else pydantic refuses is InvalidArgument naming the key, the value
//    and what is allowed;
//  - then zero_optimization's deprecated offload switches as DeepSpeedZeroConfig reads them:
//    cpu_offload becomes offload_optimizer and cpu_offload_param becomes offload_param,
//    {"device": "cpu"} when true and {"device": "none"} when false or null ("auto" is removed).
//    Given with the section it stands for, it is InvalidArgument, as DeepSpeed refuses the pair.
//    cpu_offload_params, the spelling of DeepSpeed before 0.7 (later releases refuse it as an
//    unknown key), is InvalidArgument naming what to write.
// zoe_config_normalize hands the result to zoe.torch.initialize, which reads the keys of the
// framework from it; the engine reads it before DropDefaultedValues.
Status ReadPydanticSections(nlohmann::json* document);

// The values DeepSpeed's pydantic models read as their field's default, removed from the
// sections above, so that the section readers see the key absent: "auto" (the models drop it;
// fp16.enabled and bf16.enabled keep theirs, which the framework decides) and null (an Optional
// field's None, as accelerate writes "nvme_path": null). zero_optimization's offload_optimizer
// or offload_param given as null becomes {"device": "none"}, DeepSpeed's None (no offload),
// where zoe's default without the section is the CPU. Runs after ReadPydanticSections.
void DropDefaultedValues(nlohmann::json* document);

}  // namespace zoe::config
