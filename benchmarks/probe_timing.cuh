// What the standalone CUDA probes (probe_weight_reads.cu, probe_small_m_math.cu) share: an error
// check for main(), the choice of what to run, and the timing of one launch pattern as a CUDA graph.

#pragma once

#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

// In main(): prints the failed call and returns 1.
#define CHECK(call)                                                                          \
  do {                                                                                       \
    const cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));      \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

// Whether `name` is one of the comma-separated names in `list` (a null list names everything).
// Whole names only: "x_smem_fma" does not also pick "fma".
inline bool named_in(const char* list, const char* name) {
  if (list == nullptr) return true;
  const size_t n = std::strlen(name);
  for (const char* p = list; *p != '\0';) {
    const char* end = std::strchr(p, ',');
    const size_t len = end != nullptr ? static_cast<size_t>(end - p) : std::strlen(p);
    if (len == n && std::strncmp(p, name, n) == 0) return true;
    if (end == nullptr) break;
    p = end + 1;
  }
  return false;
}

#define PROBE_TRY(call)                          \
  do {                                           \
    const cudaError_t err_ = (call);             \
    if (err_ != cudaSuccess) return err_;        \
  } while (0)

// Captures launch(0) .. launch(reps - 1) on `stream` into one CUDA graph, so that launch gaps do
// not count (as in a captured model), replays it once untimed, then sets *us to the best of five
// timed replays, in microseconds a launch.
template <typename Launch>
cudaError_t time_graph_us(cudaStream_t stream, int reps, Launch&& launch, double* us) {
  cudaEvent_t t0, t1;
  PROBE_TRY(cudaEventCreate(&t0));
  PROBE_TRY(cudaEventCreate(&t1));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  PROBE_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < reps; ++i) launch(i);
  PROBE_TRY(cudaStreamEndCapture(stream, &graph));
  PROBE_TRY(cudaGraphInstantiate(&exec, graph, 0));
  PROBE_TRY(cudaGraphLaunch(exec, stream));
  PROBE_TRY(cudaStreamSynchronize(stream));
  float best = 1e30f;
  for (int round = 0; round < 5; ++round) {
    PROBE_TRY(cudaEventRecord(t0, stream));
    PROBE_TRY(cudaGraphLaunch(exec, stream));
    PROBE_TRY(cudaEventRecord(t1, stream));
    PROBE_TRY(cudaEventSynchronize(t1));
    float ms = 0.f;
    PROBE_TRY(cudaEventElapsedTime(&ms, t0, t1));
    best = ms < best ? ms : best;
  }
  PROBE_TRY(cudaGetLastError());
  PROBE_TRY(cudaGraphExecDestroy(exec));
  PROBE_TRY(cudaGraphDestroy(graph));
  PROBE_TRY(cudaEventDestroy(t0));
  PROBE_TRY(cudaEventDestroy(t1));
  *us = 1e3 * best / reps;
  return cudaSuccess;
}
