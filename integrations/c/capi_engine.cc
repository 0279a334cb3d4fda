// The engine's lifetime, flush, the async-error query, statistics and configuration.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/config.h"
#include "core/engine_config.h"
#include "core/engine_config_pydantic.h"
#include "integrations/c/capi_names.h"

extern "C" {

zoe_status zoe_engine_create(const char* config_json, zoe_engine** out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = nullptr;
    const std::string_view text = config_json != nullptr ? config_json : "";
    ZOE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::CreateFromJson(text));
    auto handle = std::make_unique<zoe_engine>();
    handle->engine = std::move(engine);
    *out = handle.release();
    return Status::Ok();
  });
}

zoe_status zoe_config_check(const char* config_json, char** out_warnings_json) {
  return Guard([&]() -> Status {
    if (out_warnings_json != nullptr) *out_warnings_json = nullptr;
    const std::string_view text = config_json != nullptr ? config_json : "";
    ZOE_ASSIGN_OR_RETURN(const zoe::config::EngineConfig config,
                         zoe::config::ParseEngineConfig(text.empty() ? "{}" : text));
    if (out_warnings_json != nullptr) {
      ZOE_ASSIGN_OR_RETURN(*out_warnings_json,
                           CopyForCaller(nlohmann::json(config.warnings).dump()));
    }
    return Status::Ok();
  });
}

zoe_status zoe_config_normalize(const char* config_json, char** out_json) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out_json, "out_json"));
    *out_json = nullptr;
    const std::string_view text = config_json != nullptr ? config_json : "";
    ZOE_ASSIGN_OR_RETURN(nlohmann::json document,
                         zoe::config::ParseConfigJson(text.empty() ? "{}" : text));
    ZOE_RETURN_IF_ERROR(zoe::config::ReadPydanticSections(&document));
    ZOE_ASSIGN_OR_RETURN(*out_json, CopyForCaller(zoe::config::WriteConfigJson(document)));
    return Status::Ok();
  });
}

void zoe_engine_destroy(zoe_engine* engine) {
  (void)Guard([&]() -> Status {
    // In a forked child the engine's threads do not exist and its swap files, rings and locked
    // memory are the parent's: the child's copy is left to the child's exit, only the handle goes.
    if (engine != nullptr && !CheckCreatorProcess(*engine).ok()) (void)engine->engine.release();
    delete engine;
    return Status::Ok();
  });
}

zoe_status zoe_engine_async_error(zoe_engine* engine) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->TakeAsyncError();
  });
}

zoe_status zoe_engine_flush(zoe_engine* engine) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->Flush();
  });
}

zoe_status zoe_engine_stats_json(zoe_engine* engine, char** out_json) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out_json, "out_json"));
    *out_json = nullptr;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(*out_json, CopyForCaller(e->StatsJson().dump()));
    return Status::Ok();
  });
}

zoe_status zoe_engine_config_json(zoe_engine* engine, char** out_json) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out_json, "out_json"));
    *out_json = nullptr;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(*out_json, CopyForCaller(e->ConfigJson().dump()));
    return Status::Ok();
  });
}

}  // extern "C"
