// Benchmark-only Triton backend standing in for `llm` (scripts/bench_plane.py compiles it with g++ and puts
// it in its own copies of a repository as the model's backend, libtriton_bench_paced_llm.so; no repository
// users build holds it). It decodes at a GPU's pace without computing: every `bench_step_ms` (a parameter of
// the model's config) one decode step gives each request it holds its next token, as an inflight-batching
// engine does; a request joins at the next step. It answers in the llm's decoupled protocol as the
// tensorrtllm backend does (streaming: one response per step, the last one final; else one final response
// with every token; output_ids [1, 1, tokens] and sequence_length [1, 1], as its executor's results are
// written), and like that backend it is C++ inside tritonserver's process: what the plane around it costs
// per token is what a GPU host's plane costs, not a python model's sends.
//
// Declared against Triton's C API (include/triton/core/tritonbackend.h and tritonserver.h, r24.10: the
// server nvidia-pytriton bundles); the functions resolve from that server's libtritonserver at load.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

extern "C" {
struct TRITONSERVER_Error;
struct TRITONSERVER_Message;
struct TRITONBACKEND_Model;
struct TRITONBACKEND_ModelInstance;
struct TRITONBACKEND_Request;
struct TRITONBACKEND_Input;
struct TRITONBACKEND_Output;
struct TRITONBACKEND_Response;
struct TRITONBACKEND_ResponseFactory;

// Values of tritonserver.h's enums and flags.
const int TYPE_INT32 = 8;                 // TRITONSERVER_TYPE_INT32
const int MEMORY_CPU = 0;                 // TRITONSERVER_MEMORY_CPU
const uint32_t RESPONSE_FINAL = 1;        // TRITONSERVER_RESPONSE_COMPLETE_FINAL
const uint32_t REQUEST_RELEASE_ALL = 1;   // TRITONSERVER_REQUEST_RELEASE_ALL
const int ERROR_INVALID_ARG = 3;          // TRITONSERVER_ERROR_INVALID_ARG

TRITONSERVER_Error* TRITONSERVER_ErrorNew(int code, const char* msg);
TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message*, const char** base, size_t* size);
TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message*);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance*, TRITONBACKEND_Model**);
TRITONSERVER_Error* TRITONBACKEND_ModelConfig(TRITONBACKEND_Model*, uint32_t version, TRITONSERVER_Message**);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance*, void* state);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance*, void** state);
TRITONSERVER_Error* TRITONBACKEND_RequestInput(TRITONBACKEND_Request*, const char* name, TRITONBACKEND_Input**);
TRITONSERVER_Error* TRITONBACKEND_InputBuffer(
    TRITONBACKEND_Input*, uint32_t index, const void** buffer, uint64_t* byte_size, int* memory_type,
    int64_t* memory_type_id);
TRITONSERVER_Error* TRITONBACKEND_RequestRelease(TRITONBACKEND_Request*, uint32_t flags);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryNew(TRITONBACKEND_ResponseFactory**, TRITONBACKEND_Request*);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryDelete(TRITONBACKEND_ResponseFactory*);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactorySendFlags(TRITONBACKEND_ResponseFactory*, uint32_t flags);
TRITONSERVER_Error* TRITONBACKEND_ResponseNewFromFactory(TRITONBACKEND_Response**, TRITONBACKEND_ResponseFactory*);
TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(
    TRITONBACKEND_Response*, TRITONBACKEND_Output**, const char* name, int datatype, const int64_t* shape,
    uint32_t dims_count);
TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(
    TRITONBACKEND_Output*, void** buffer, uint64_t byte_size, int* memory_type, int64_t* memory_type_id);
TRITONSERVER_Error* TRITONBACKEND_ResponseSend(TRITONBACKEND_Response*, uint32_t flags, TRITONSERVER_Error*);
}

namespace {

const int32_t FIRST_TOKEN = 1000;  // ordinary text ids, so the text decodes to real words

struct Held {
  TRITONBACKEND_ResponseFactory* factory;
  int32_t count;
  bool streaming;
  std::vector<int32_t> ids;
};

// A scalar input's value, or `absent` when the request does not carry it (optional inputs).
template <typename T>
T Scalar(TRITONBACKEND_Request* request, const char* name, T absent)
{
  TRITONBACKEND_Input* input = nullptr;
  if (TRITONBACKEND_RequestInput(request, name, &input) != nullptr || input == nullptr) return absent;
  const void* buffer = nullptr;
  uint64_t size = 0;
  int memory_type = MEMORY_CPU;
  int64_t memory_id = 0;
  if (TRITONBACKEND_InputBuffer(input, 0, &buffer, &size, &memory_type, &memory_id) != nullptr ||
      size < sizeof(T))
    return absent;
  T value;
  std::memcpy(&value, buffer, sizeof(T));
  return value;
}

// The step from the model config's JSON: parameters { key: "bench_step_ms" value { string_value: "10" } }.
double StepMs(const std::string& json)
{
  const size_t key = json.find("\"bench_step_ms\"");
  const size_t value = json.find("\"string_value\"", key == std::string::npos ? 0 : key);
  if (key == std::string::npos || value == std::string::npos) return -1;
  const size_t quote = json.find('"', json.find(':', value) + 1);
  return std::atof(json.c_str() + quote + 1);
}

void SendTokens(TRITONBACKEND_ResponseFactory* factory, const std::vector<int32_t>& ids, uint32_t flags)
{
  TRITONBACKEND_Response* response = nullptr;
  if (TRITONBACKEND_ResponseNewFromFactory(&response, factory) != nullptr) return;
  const int64_t ids_shape[3] = {1, 1, static_cast<int64_t>(ids.size())};
  const int64_t length_shape[2] = {1, 1};
  const int32_t length = static_cast<int32_t>(ids.size());
  struct {
    const char* name;
    const int64_t* shape;
    uint32_t dims;
    const void* data;
    uint64_t bytes;
  } outputs[2] = {
      {"output_ids", ids_shape, 3, ids.data(), ids.size() * sizeof(int32_t)},
      {"sequence_length", length_shape, 2, &length, sizeof(int32_t)},
  };
  for (const auto& out : outputs) {
    TRITONBACKEND_Output* output = nullptr;
    void* buffer = nullptr;
    int memory_type = MEMORY_CPU;
    int64_t memory_id = 0;
    if (TRITONBACKEND_ResponseOutput(response, &output, out.name, TYPE_INT32, out.shape, out.dims) == nullptr &&
        TRITONBACKEND_OutputBuffer(output, &buffer, out.bytes, &memory_type, &memory_id) == nullptr)
      std::memcpy(buffer, out.data, out.bytes);
  }
  TRITONBACKEND_ResponseSend(response, flags, nullptr);
}

class Instance {
 public:
  explicit Instance(double step_ms) : step_(std::chrono::microseconds(static_cast<int64_t>(step_ms * 1000)))
  {
    loop_ = std::thread([this] { Decode(); });
  }

  ~Instance()
  {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
    }
    cond_.notify_one();
    loop_.join();
  }

  void Add(TRITONBACKEND_Request* request)
  {
    TRITONBACKEND_ResponseFactory* factory = nullptr;
    if (TRITONBACKEND_ResponseFactoryNew(&factory, request) != nullptr) {
      TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL);
      return;
    }
    const bool stop = Scalar<bool>(request, "stop", false);
    Held held{factory, Scalar<int32_t>(request, "request_output_len", 1), Scalar<bool>(request, "streaming", false),
              {}};
    TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL);  // the factory outlives the request
    if (stop || held.count < 1) {  // a client's stop: nothing of ours is that long
      TRITONBACKEND_ResponseFactorySendFlags(factory, RESPONSE_FINAL);
      TRITONBACKEND_ResponseFactoryDelete(factory);
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    held_.push_back(std::move(held));
    cond_.notify_one();
  }

 private:
  void Decode()
  {
    auto next_step = std::chrono::steady_clock::now();
    std::vector<Held> batch;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        while (held_.empty() && batch.empty() && !closing_) {
          cond_.wait(lock);
          next_step = std::chrono::steady_clock::now() + step_;  // a request that arrives idle waits one step
        }
        if (closing_) break;
        std::move(held_.begin(), held_.end(), std::back_inserter(batch));  // joins at this step
        held_.clear();
      }
      std::this_thread::sleep_until(next_step);
      next_step += step_;
      for (Held& held : batch) {
        held.ids.push_back(FIRST_TOKEN + static_cast<int32_t>(held.ids.size()));
        const bool done = static_cast<int32_t>(held.ids.size()) >= held.count;
        if (held.streaming)
          SendTokens(held.factory, {held.ids.back()}, done ? RESPONSE_FINAL : 0);
        else if (done)
          SendTokens(held.factory, held.ids, RESPONSE_FINAL);
        if (done) TRITONBACKEND_ResponseFactoryDelete(held.factory);
      }
      batch.erase(
          std::remove_if(
              batch.begin(), batch.end(), [](const Held& h) { return static_cast<int32_t>(h.ids.size()) >= h.count; }),
          batch.end());
    }
    for (Held& held : batch) {
      TRITONBACKEND_ResponseFactorySendFlags(held.factory, RESPONSE_FINAL);
      TRITONBACKEND_ResponseFactoryDelete(held.factory);
    }
  }

  const std::chrono::microseconds step_;
  std::mutex mutex_;
  std::condition_variable cond_;
  std::vector<Held> held_;
  bool closing_ = false;
  std::thread loop_;
};

}  // namespace

extern "C" {

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance* instance)
{
  TRITONBACKEND_Model* model = nullptr;
  TRITONSERVER_Message* config = nullptr;
  TRITONSERVER_Error* error = TRITONBACKEND_ModelInstanceModel(instance, &model);
  if (error == nullptr) error = TRITONBACKEND_ModelConfig(model, 1, &config);
  if (error != nullptr) return error;
  const char* json = nullptr;
  size_t size = 0;
  TRITONSERVER_MessageSerializeToJson(config, &json, &size);
  const double step_ms = StepMs(std::string(json, size));
  TRITONSERVER_MessageDelete(config);
  if (step_ms <= 0) return TRITONSERVER_ErrorNew(ERROR_INVALID_ARG, "parameter bench_step_ms: a positive number");
  return TRITONBACKEND_ModelInstanceSetState(instance, new Instance(step_ms));
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance* instance)
{
  void* state = nullptr;
  TRITONBACKEND_ModelInstanceState(instance, &state);
  delete static_cast<Instance*>(state);
  return nullptr;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count)
{
  void* state = nullptr;
  TRITONBACKEND_ModelInstanceState(instance, &state);
  for (uint32_t i = 0; i < count; ++i) static_cast<Instance*>(state)->Add(requests[i]);
  return nullptr;
}

}  // extern "C"
