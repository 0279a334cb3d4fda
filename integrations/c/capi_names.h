// The names the capi_*.cc files use, declared once. zoe.h's functions are defined at global
// scope (extern "C"); their bodies use zoe's status types, the engine, and the helpers of
// zoe::capi. Included only by those files, after the helpers' own headers.
#pragma once

#include "integrations/c/capi_guard.h"
#include "integrations/c/capi_handles.h"
#include "integrations/c/capi_sized.h"
#include "integrations/c/capi_views.h"

namespace offload = zoe::offload;
using zoe::Result;
using zoe::Status;
using zoe::capi::CheckCreatorProcess;
using zoe::capi::CheckNotNull;
using zoe::capi::CopyForCaller;
using zoe::capi::EngineOf;
using zoe::capi::Guard;
using zoe::capi::ResetSized;
using zoe::capi::StructSize;
using zoe::capi::ToGroupId;
using zoe::capi::ToHostViews;
using zoe::capi::ToHyper;
using zoe::capi::ToStepResult;
using zoe::capi::ToTensorId;
using zoe::capi::WriteSized;
using zoe::offload::Engine;
