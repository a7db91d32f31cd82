// What the mock node's runtime (mock_node.cc) shares with its kernels
// (mock_kernels.cc): the configuration, streams and the stream operations
// the kernels are made of.
#ifndef JAX_SMDDP_TESTS_MOCK_NODE_MOCK_NODE_H_
#define JAX_SMDDP_TESTS_MOCK_NODE_MOCK_NODE_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_runtime_api.h"

// A stream: its operations run in order on a worker thread.
struct CUstream_st {
  int device;
  bool capturing = false;                       // set and read by the capturing thread
  std::vector<std::function<void()>> captured;  // what a capture recorded
  std::mutex m;
  std::condition_variable cv, idle;
  std::deque<std::function<void()>> q;
  bool busy = false, stop = false;
  std::thread worker;
};

namespace mock_node {

using Clock = std::chrono::steady_clock;

struct Config {
  std::vector<int> devices;  // node device id of each local ordinal
  bool p2p = true;
  double bytes_per_us = 2000;
  double latency_us = 20;
  double wait_s = 30;
};

const Config& Cfg();
void Poison(int dev, const std::string& why);
// Checks every range for `dev`; poisons its context on the first refused.
bool Touch(int dev, const char* what, std::initializer_list<std::pair<const void*, size_t>> ranges,
           bool plain_host);
CUstream_st* Of(cudaStream_t s);
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> op);
// Moves rows x width bytes in four pieces spread over the copy's time.
void TimedCopy(int dev, uint8_t* dst, size_t dpitch, const uint8_t* src, size_t spitch,
               size_t width, size_t rows);
cudaError_t Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                   size_t rows, cudaStream_t stream, const char* what);
cudaError_t WaitValue(cudaStream_t stream, const uint32_t* flag, uint32_t value, const char* what);
cudaError_t WriteValue(cudaStream_t stream, uint32_t* flag, uint32_t value, const char* what);

}  // namespace mock_node

#endif  // JAX_SMDDP_TESTS_MOCK_NODE_MOCK_NODE_H_
