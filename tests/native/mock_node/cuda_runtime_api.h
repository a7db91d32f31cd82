// The tests' mock CUDA runtime, one that behaves like a GPU node: cuda/'s
// host code and its stream operations (cuda/cuda_stream_ops.cc) compiled
// against it run on CPU processes as they would on a node of GPUs (the
// layouts of gpu_node_test.cc, nccl_windows_test.cc). Tests of the protocol
// alone (gpu_communicator_test.cc, gpu_hosts_test.cc, the NCCL front end's)
// take their set-up's CUDA calls from it and run the stream operations on
// host threads themselves (tests/native/host_stream_ops.h), which none of
// the rules below check. Implemented in mock_node.cc; never part of the
// library. What it enforces:
//  - Devices: the process sees the node's devices listed in
//    JAX_SMDDP_MOCK_DEVICES (node device ids, comma separated; default
//    0..7) as ordinals 0, 1, ...; the current device is per host thread.
//  - Memory: each cudaMalloc'd allocation belongs to its device (POSIX shared
//    memory, so that CUDA IPC handles and cuMem descriptors open it in other
//    processes). A stream operation of device d (copy, memset, kernel, stream
//    memory operation) may touch: its own memory; another local device's
//    memory once peer access was enabled from d to it; a CUDA IPC mapping
//    opened on d (or whose owner is a local device d has peer access to); a
//    cuMem mapping that cuMemSetAccess granted to d; host memory allocated or
//    registered with CUDA (copies also plain host memory). Anything else is
//    an illegal address: the operation does nothing, the device's context is
//    poisoned (every later operation of it is skipped, synchronizing returns
//    cudaErrorIllegalAddress) and the fault is printed once. The mock is
//    stricter than CUDA in one place: CUDA copies between cudaMalloc'd
//    memory of devices without peer access by staging through the host.
//  - Topology (JAX_SMDDP_MOCK_TOPOLOGY): nvlink (default, all to all), pcie
//    (peer to peer allowed, slower), pcie_nop2p (cudaDeviceCanAccessPeer
//    says 0, enabling peer access and opening another device's IPC handle
//    fail with cudaErrorPeerAccessUnsupported).
//  - Memory shared between processes: JAX_SMDDP_MOCK_CUMEM=1 makes
//    cudaMalloc's allocations cuMemCreate's (exported as POSIX file
//    descriptors, no legacy CUDA IPC), as XLA's allocator hands out;
//    JAX_SMDDP_MOCK_IPC_OPEN_FAILS=1 (read at each call) makes opening a
//    peer's (cudaIpcOpenMemHandle, cuMemImportFromShareableHandle) fail.
//  - Streams: each runs its operations in order on a worker thread of its
//    own, asynchronously to the host and concurrently with other streams.
//    Copies take JAX_SMDDP_MOCK_COPY_US (default 20) plus their bytes at
//    JAX_SMDDP_MOCK_COPY_GBPS (default 2; a third of it over pcie), and move
//    their data in four pieces spread over that time (reading early or
//    releasing a buffer before its copy is done shows as a wrong answer).
//    Stream memory operations (cuStreamWaitValue32, cuStreamWriteValue32)
//    block their stream until the value is reached (a deadline of
//    JAX_SMDDP_MOCK_WAIT_S, default 30, poisons the context instead of
//    hanging); events order streams. The mock records when each copy ran
//    (mock_node::Schedule). Streams can be captured into graphs and the
//    graphs launched (recorded operations run again as recorded).
#ifndef JAX_SMDDP_TESTS_MOCK_NODE_CUDA_RUNTIME_API_H_
#define JAX_SMDDP_TESTS_MOCK_NODE_CUDA_RUNTIME_API_H_

// Tells the code under test that "device memory" is host memory here.
#define SMDDP_MOCK_CUDA_RUNTIME 1

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

typedef int cudaError_t;
enum : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorIllegalAddress = 700,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorNotReady = 600,
};
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
struct cudaIpcMemHandle_t {
  char reserved[64];
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum : unsigned {
  cudaHostAllocPortable = 1,
  cudaHostAllocMapped = 2,
  cudaHostRegisterPortable = 1,
  cudaHostRegisterMapped = 2,
  cudaStreamNonBlocking = 1,
  cudaIpcMemLazyEnablePeerAccess = 1,
  cudaEventDisableTiming = 2,
};
enum cudaDeviceAttr {
  cudaDevAttrGPUDirectRDMAFlushWritesOptions = 117,
  cudaDevAttrGPUDirectRDMAWritesOrdering = 118
};
enum cudaGPUDirectRDMAWritesOrdering {
  cudaGPUDirectRDMAWritesOrderingNone = 0,
  cudaGPUDirectRDMAWritesOrderingOwner = 100
};
enum cudaFlushGPUDirectRDMAWritesOptions { cudaFlushGPUDirectRDMAWritesOptionHost = 1 };
enum cudaFlushGPUDirectRDMAWritesTarget { cudaFlushGPUDirectRDMAWritesTargetCurrentDevice };
enum cudaFlushGPUDirectRDMAWritesScope { cudaFlushGPUDirectRDMAWritesToOwner = 100 };
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1
};
enum : unsigned long long { cudaEnableDefault = 0 };

const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int device);
cudaError_t cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget,
                                               cudaFlushGPUDirectRDMAWritesScope);

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMemset(void* p, int v, size_t n);
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t rows, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void* p);
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned flags);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamGetDevice(cudaStream_t s, int* device);
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
// Record and replay: while a stream is captured its operations are recorded,
// not run (cudaStreamIsCapturing says so); a launch of the graph enqueues
// them again, in order, with the values they were recorded with.
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraph_st* cudaGraphExec_t;
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1
};
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p);
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void* p);
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* found);

// What the tests ask the mock node.
namespace mock_node {
struct CopyRecord {
  int device;       // the stream's (node device id)
  bool peer;        // it read another device's memory
  double start_us;  // since the process started
  double end_us;
  size_t bytes;
};
// Every copy so far (copy engines and copy kernels), in the order they ended.
std::vector<CopyRecord> Schedule();
void ClearSchedule();
// Most copies reading other devices' memory that ran at once on one device.
int MaxPeerCopiesInFlight(int node_device);
// Why device `ordinal`'s context is poisoned ("" if it is not).
std::string Fault(int ordinal);
// The node device id of local ordinal `ordinal`.
int NodeDevice(int ordinal);
// What this process asked of the runtime so far (the steady-state test reads
// how many of each one call costs once its buffers are known).
struct Counters {
  uint64_t ipc_exports;        // cudaIpcGetMemHandle
  uint64_t ipc_opens;          // cudaIpcOpenMemHandle
  uint64_t cumem_exports;      // cuMemExportToShareableHandle
  uint64_t imports;            // cuMemImportFromShareableHandle
  uint64_t maps;               // cuMemMap
  uint64_t grants;             // cuMemSetAccess
  uint64_t attribute_queries;  // cuPointerGetAttributes
};
Counters Count();
// Whether allocations are cuMemCreate's (JAX_SMDDP_MOCK_CUMEM=1).
bool CuMemMode();
// Removes the device memory process `pid` left (killed, or left by _exit).
void RemoveMemoryOf(int pid);
}  // namespace mock_node

#endif  // JAX_SMDDP_TESTS_MOCK_NODE_CUDA_RUNTIME_API_H_
