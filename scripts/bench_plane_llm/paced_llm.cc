// Benchmark-only Triton backend standing in for `llm` (scripts/bench_plane.py compiles it with g++ and puts
// it in its own copies of a repository as the model's backend, libtriton_bench_paced_llm.so; no repository
// users build holds it). It decodes at a GPU's pace without computing: every `bench_step_ms` (a parameter of
// the model's config) one decode step gives each request it holds its next token, as an inflight-batching
// engine does; a request joins at the next step. Like the tensorrtllm backend it is C++ inside tritonserver's
// process, so what the plane around it costs per token is what a GPU host's plane costs, and it answers as that
// backend does (NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src: fillTritonResponse,
// WaitForResponse, handleStopRequest, WaitForCancel):
// - streaming: one response per step, output_ids [1, 1, 1] and sequence_length [1, 1], the last one final;
// - not streaming: one final response, the prompt first unless exclude_input_in_output;
// - a `stop` request ends the held request with its id and is answered empty; a cancelled request is ended at
//   the next poll (every 100 ms).
// Unlike it, it reports no statistics to Triton (the llm's statistics read zero).
//
// Declared against Triton's C API (include/triton/core/tritonbackend.h and tritonserver.h, r24.10: the
// server nvidia-pytriton bundles); the functions resolve from that server's libtritonserver at load.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
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
void TRITONSERVER_ErrorDelete(TRITONSERVER_Error*);
TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message*, const char** base, size_t* size);
TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message*);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance*, TRITONBACKEND_Model**);
TRITONSERVER_Error* TRITONBACKEND_ModelConfig(TRITONBACKEND_Model*, uint32_t version, TRITONSERVER_Message**);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance*, void* state);
TRITONSERVER_Error* TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance*, void** state);
TRITONSERVER_Error* TRITONBACKEND_RequestId(TRITONBACKEND_Request*, const char** id);
TRITONSERVER_Error* TRITONBACKEND_RequestInput(TRITONBACKEND_Request*, const char* name, TRITONBACKEND_Input**);
TRITONSERVER_Error* TRITONBACKEND_InputProperties(
    TRITONBACKEND_Input*, const char** name, int* datatype, const int64_t** shape, uint32_t* dims_count,
    uint64_t* byte_size, uint32_t* buffer_count);
TRITONSERVER_Error* TRITONBACKEND_InputBuffer(
    TRITONBACKEND_Input*, uint32_t index, const void** buffer, uint64_t* byte_size, int* memory_type,
    int64_t* memory_type_id);
TRITONSERVER_Error* TRITONBACKEND_RequestRelease(TRITONBACKEND_Request*, uint32_t flags);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryNew(TRITONBACKEND_ResponseFactory**, TRITONBACKEND_Request*);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryDelete(TRITONBACKEND_ResponseFactory*);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactorySendFlags(TRITONBACKEND_ResponseFactory*, uint32_t flags);
TRITONSERVER_Error* TRITONBACKEND_ResponseFactoryIsCancelled(TRITONBACKEND_ResponseFactory*, bool* cancelled);
TRITONSERVER_Error* TRITONBACKEND_ResponseNewFromFactory(TRITONBACKEND_Response**, TRITONBACKEND_ResponseFactory*);
TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(
    TRITONBACKEND_Response*, TRITONBACKEND_Output**, const char* name, int datatype, const int64_t* shape,
    uint32_t dims_count);
TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(
    TRITONBACKEND_Output*, void** buffer, uint64_t byte_size, int* memory_type, int64_t* memory_type_id);
TRITONSERVER_Error* TRITONBACKEND_ResponseSend(TRITONBACKEND_Response*, uint32_t flags, TRITONSERVER_Error*);
}

// The llm's tensor names and the step's parameter: bench_plane.py passes them (-D) from qwen3vl_trt.serving.interface
// and its own STEP_MS_PARAMETER, where they are declared.
#if !defined(INPUT_IDS) || !defined(REQUEST_OUTPUT_LEN) || !defined(STREAMING) || !defined(EXCLUDE_INPUT) || \
    !defined(STOP) || !defined(OUTPUT_IDS) || !defined(SEQUENCE_LENGTH) || !defined(STEP_MS)
#error "compile with the llm's tensor names defined: scripts/bench_plane.py compile_paced_llm"
#endif

namespace {

const int32_t FIRST_TOKEN = 1000;  // ordinary text ids, so the text decodes to real words
// How often a held request's cancellation is asked (the tensorrtllm backend's WaitForCancel polls every 100 ms).
const std::chrono::milliseconds CANCEL_POLL(100);

void Drop(TRITONSERVER_Error* error)
{
  if (error != nullptr) TRITONSERVER_ErrorDelete(error);
}

struct Held {
  TRITONBACKEND_ResponseFactory* factory;
  std::string id;
  int32_t count;  // tokens to generate
  bool streaming;
  std::vector<int32_t> ids;  // what the final response of a request not streamed holds: its prompt unless excluded
  int32_t generated = 0;
};

// An input's values (BOOL read as uint8_t); empty when the request does not carry it (optional inputs).
template <typename T>
std::vector<T> Values(TRITONBACKEND_Request* request, const char* name)
{
  std::vector<T> values;
  TRITONBACKEND_Input* input = nullptr;
  uint32_t buffers = 0;
  if (TRITONSERVER_Error* error = TRITONBACKEND_RequestInput(request, name, &input)) {
    TRITONSERVER_ErrorDelete(error);
    return values;
  }
  Drop(TRITONBACKEND_InputProperties(input, nullptr, nullptr, nullptr, nullptr, nullptr, &buffers));
  for (uint32_t i = 0; i < buffers; ++i) {
    const void* buffer = nullptr;
    uint64_t size = 0;
    int memory_type = MEMORY_CPU;
    int64_t memory_id = 0;
    if (TRITONSERVER_Error* error = TRITONBACKEND_InputBuffer(input, i, &buffer, &size, &memory_type, &memory_id)) {
      TRITONSERVER_ErrorDelete(error);
      break;
    }
    const size_t first = values.size();
    values.resize(first + size / sizeof(T));
    std::memcpy(values.data() + first, buffer, (values.size() - first) * sizeof(T));
  }
  return values;
}

template <typename T>
T Scalar(TRITONBACKEND_Request* request, const char* name, T absent)
{
  const std::vector<T> values = Values<T>(request, name);
  return values.empty() ? absent : values[0];
}

// The step from the model config's JSON: parameters { key: "bench_step_ms" value { string_value: "10" } }.
double StepMs(const std::string& json)
{
  const size_t key = json.find("\"" STEP_MS "\"");
  const size_t value = json.find("\"string_value\"", key == std::string::npos ? 0 : key);
  if (key == std::string::npos || value == std::string::npos) return -1;
  const size_t quote = json.find('"', json.find(':', value) + 1);
  return std::atof(json.c_str() + quote + 1);
}

void SendTokens(TRITONBACKEND_ResponseFactory* factory, const std::vector<int32_t>& ids, uint32_t flags)
{
  TRITONBACKEND_Response* response = nullptr;
  if (TRITONSERVER_Error* error = TRITONBACKEND_ResponseNewFromFactory(&response, factory)) {
    TRITONSERVER_ErrorDelete(error);
    return;
  }
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
      {OUTPUT_IDS, ids_shape, 3, ids.data(), ids.size() * sizeof(int32_t)},
      {SEQUENCE_LENGTH, length_shape, 2, &length, sizeof(int32_t)},
  };
  for (const auto& out : outputs) {
    TRITONBACKEND_Output* output = nullptr;
    void* buffer = nullptr;
    int memory_type = MEMORY_CPU;
    int64_t memory_id = 0;
    TRITONSERVER_Error* error = TRITONBACKEND_ResponseOutput(response, &output, out.name, TYPE_INT32, out.shape, out.dims);
    if (error == nullptr) error = TRITONBACKEND_OutputBuffer(output, &buffer, out.bytes, &memory_type, &memory_id);
    if (error == nullptr) std::memcpy(buffer, out.data, out.bytes);
    Drop(error);
  }
  Drop(TRITONBACKEND_ResponseSend(response, flags, nullptr));
}

// A final response: empty (a stop's answer), or the request's error.
void SendFinal(TRITONBACKEND_ResponseFactory* factory, TRITONSERVER_Error* error = nullptr)
{
  TRITONBACKEND_Response* response = nullptr;
  if (TRITONSERVER_Error* failed = TRITONBACKEND_ResponseNewFromFactory(&response, factory)) {
    TRITONSERVER_ErrorDelete(failed);
    Drop(TRITONBACKEND_ResponseFactorySendFlags(factory, RESPONSE_FINAL));
  } else {
    Drop(TRITONBACKEND_ResponseSend(response, RESPONSE_FINAL, error));
  }
  Drop(error);  // ResponseSend does not take it (the backend utilities' RESPOND_AND_SET_NULL_IF_ERROR deletes it)
}

// Ends a held request early (stopped or cancelled): the tensorrtllm backend ends its stream with a final flag.
void End(Held& held)
{
  Drop(TRITONBACKEND_ResponseFactorySendFlags(held.factory, RESPONSE_FINAL));
  Drop(TRITONBACKEND_ResponseFactoryDelete(held.factory));
  held.factory = nullptr;
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
    if (TRITONSERVER_Error* error = TRITONBACKEND_ResponseFactoryNew(&factory, request)) {
      TRITONSERVER_ErrorDelete(error);
      Drop(TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL));
      return;
    }
    const char* id = nullptr;
    Drop(TRITONBACKEND_RequestId(request, &id));
    const bool stop = Scalar<uint8_t>(request, STOP, 0) != 0;
    const int32_t count = Scalar<int32_t>(request, REQUEST_OUTPUT_LEN, -1);
    Held held{factory, id == nullptr ? "" : id, count, Scalar<uint8_t>(request, STREAMING, 0) != 0, {}};
    // Not streamed, the answer holds the prompt first unless excluded (the tensorrtllm backend's default: false).
    if (!held.streaming && Scalar<uint8_t>(request, EXCLUDE_INPUT, 0) == 0)
      held.ids = Values<int32_t>(request, INPUT_IDS);
    Drop(TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL));  // the factory outlives the request
    if (stop) {  // the tensorrtllm backend's stop: ends the request with this id, answers empty
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stops_.push_back(held.id);
      }
      SendFinal(factory);
    } else if (count < 1) {
      SendFinal(factory, TRITONSERVER_ErrorNew(ERROR_INVALID_ARG, "request_output_len: a positive number is needed"));
    } else {
      std::lock_guard<std::mutex> lock(mutex_);
      held_.push_back(std::move(held));
      cond_.notify_one();
      return;
    }
    Drop(TRITONBACKEND_ResponseFactoryDelete(factory));
  }

 private:
  void Decode()
  {
    auto next_step = std::chrono::steady_clock::now();
    auto next_poll = next_step + CANCEL_POLL;
    std::vector<Held> batch;
    std::vector<std::string> stops;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        while (held_.empty() && batch.empty() && !closing_) {
          stops_.clear();  // nothing held to stop
          cond_.wait(lock);
          next_step = std::chrono::steady_clock::now() + step_;  // a request that arrives idle waits one step
        }
        if (closing_) break;
        std::move(held_.begin(), held_.end(), std::back_inserter(batch));  // joins at this step
        held_.clear();
        stops.swap(stops_);
      }
      const bool poll = std::chrono::steady_clock::now() >= next_poll;
      if (poll) next_poll = std::chrono::steady_clock::now() + CANCEL_POLL;
      for (Held& held : batch) {
        bool cancelled = false;
        if (poll) Drop(TRITONBACKEND_ResponseFactoryIsCancelled(held.factory, &cancelled));
        if (cancelled || std::find(stops.begin(), stops.end(), held.id) != stops.end()) End(held);
      }
      stops.clear();
      std::this_thread::sleep_until(next_step);
      next_step += step_;
      for (Held& held : batch) {
        if (held.factory == nullptr) continue;
        const int32_t token = FIRST_TOKEN + held.generated++;
        held.ids.push_back(token);
        const bool done = held.generated >= held.count;
        if (held.streaming)
          SendTokens(held.factory, {token}, done ? RESPONSE_FINAL : 0);
        else if (done)
          SendTokens(held.factory, held.ids, RESPONSE_FINAL);
        if (done) {
          Drop(TRITONBACKEND_ResponseFactoryDelete(held.factory));
          held.factory = nullptr;
        }
      }
      batch.erase(
          std::remove_if(batch.begin(), batch.end(), [](const Held& h) { return h.factory == nullptr; }), batch.end());
    }
    for (Held& held : batch) End(held);
  }

  const std::chrono::microseconds step_;
  std::mutex mutex_;
  std::condition_variable cond_;
  std::vector<Held> held_;
  std::vector<std::string> stops_;  // ids whose stop came since the last step
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
  if (step_ms <= 0) return TRITONSERVER_ErrorNew(ERROR_INVALID_ARG, "parameter " STEP_MS ": a positive number");
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
