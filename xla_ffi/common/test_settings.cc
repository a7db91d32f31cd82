// The test-only JAX_SMDDP_* settings: switches that tests and test probes set
// (fault injection in the engine's links, the mock CUDA runtime and node, the
// GPU test harness) and a user never does. They are a registry of their own so
// that docs/settings.md and jax_smddp.settings() list only what a user may
// set; FindSetting, the typed reads and CheckSettings take them as they take
// the user's (settings.cc), so a test-only value is still validated and its
// default still declared once, here. Their table is generated into the tests
// section of docs/architecture.md (python -m jax_smddp.doctor --test-settings).
#include "xla_ffi/common/settings.h"

namespace smddp {

namespace {

constexpr SettingKind kInt = SettingKind::kInt;
constexpr SettingKind kSeconds = SettingKind::kSeconds;
constexpr SettingKind kChoice = SettingKind::kChoice;
constexpr SettingKind kText = SettingKind::kText;

}  // namespace

// A function's static: the registry is complete whenever it is first read, static
// initialisers of other files included.
const std::vector<SettingSpec>& TestSettings() {
  static const std::vector<SettingSpec> settings = {
      // name, kind, default, min, max, choices, scope, agree, meaning
      {"JAX_SMDDP_FABRIC_TEST_REORDER", kChoice, "unset", 0, 0, "0|1", "engine", false,
       "1: libfabric chunks are sent out of order"},
      {"JAX_SMDDP_FABRIC_TEST_REGISTER", kChoice, "unset", 0, 0, "0|1", "engine", false,
       "1: libfabric direct transfers register the callers' buffers even where the provider does "
       "not ask for it (the FI_MR_LOCAL path, as on efa)"},
      {"JAX_SMDDP_FABRIC_TEST_CORRUPT", kChoice, "unset", 0, 0, "magic|version|sender|length|short",
       "engine", false,
       "every libfabric chunk this process sends is malformed so: a wrong magic, another protocol "
       "version, an unknown sender, a length past the chunk's end, or cut short of its header "
       "(its receivers must drop it with an error naming this process)"},
      {"JAX_SMDDP_TEST_PROTOCOL_VERSION", kInt, "unset (the build's)", 1, 4294967295.0, "",
       "engine", false,
       "this process poses as a build of another wire protocol version: it announces this one at "
       "jax_smddp.initialize() and writes it into its links' headers"},
      {"JAX_SMDDP_MOCK_IPC_OPEN_FAILS", kChoice, "unset", 0, 0, "0|1", "mock CUDA", false,
       "the mock CUDA runtime fails to open IPC handles"},
      {"JAX_SMDDP_MOCK_CUMEM", kChoice, "unset", 0, 0, "0|1", "mock CUDA", false,
       "the mock CUDA runtime allocates as cuMemCreate"},
      {"JAX_SMDDP_MOCK_GDR_OPEN_FAILS", kChoice, "unset", 0, 0, "0|1", "mock GDRCopy", false,
       "the mock GDRCopy fails gdr_open"},
      {"JAX_SMDDP_MOCK_DEVICES", kText, "0,1,2,3,4,5,6,7", 0, 0, "", "mock CUDA", false,
       "the mock CUDA node's devices this process sees (node device ids, comma separated)"},
      {"JAX_SMDDP_MOCK_TOPOLOGY", kChoice, "nvlink", 0, 0, "nvlink|pcie|pcie_nop2p", "mock CUDA",
       false,
       "the mock CUDA node's links: NVLink all to all, PCIe with peer access, PCIe without it"},
      {"JAX_SMDDP_MOCK_COPY_US", kInt, "20", 0, 1e9, "", "mock CUDA", false,
       "microseconds every mock copy takes before its bytes (the mock node's copy latency)"},
      {"JAX_SMDDP_MOCK_COPY_GBPS", kText, "2", 0, 0, "", "mock CUDA", false,
       "GB/s of the mock node's copies over NVLink (a third of it over PCIe)"},
      {"JAX_SMDDP_MOCK_WAIT_S", kSeconds, "30", 0.001, 1e9, "", "mock CUDA", false,
       "seconds a mock stream wait may block before it poisons its context"},
      {"JAX_SMDDP_TEST_EXPECT_GDRCOPY", kChoice, "unset", 0, 0, "0|1", "native tests", false,
       "the GPU communicator test expects GDRCopy to be used"},
      {"JAX_SMDDP_GPU_TEST_TIMEOUT", kInt, "600", 1, 1e6, "", "GPU tests", false,
       "seconds a GPU test (tests/gpu/test_gpu.py) may take before it counts as hung; "
       "tests/gpu/test_kernels.py reads it with a default of its own, 120"},
      {"JAX_SMDDP_WORKER_STACKS_AFTER_S", kSeconds, "unset", 0.001, 1e9, "", "GPU tests", false,
       "GPU test workers dump every thread's stack after this many seconds"},
  };
  return settings;
}

}  // namespace smddp
