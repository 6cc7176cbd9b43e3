// How many thread-block clusters of 1..16 CTAs the GPU runs at once, for CTAs of 256 threads
// that take one SM each through their shared memory (the sizes of cuda_wgmma's six tiles,
// ternop/cuda/csrc/ternary_wgmma.cu). cuda_wgmma adds its splits of K inside clusters only where
// every cluster of a call fits at once (ternary_wgmma_cluster_sums); this shows where that bound
// sits on a given GPU.
//
//     nvcc -arch=sm_90a -o probe_clusters benchmarks/probe_clusters.cu && ./probe_clusters
#include <cstdio>

#include <cuda_runtime.h>

__global__ void __launch_bounds__(256, 1) probe_kernel(float* p) {
  extern __shared__ float s[];
  if (p != nullptr) p[threadIdx.x] = s[threadIdx.x];
}

int main() {
  const int smem_bytes[] = {115712, 136192, 173056, 181248, 195584, 216064};  // tiles 5, 0, 3, 4, 1, 2
  for (int smem : smem_bytes) {
    cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    for (int size = 1; size <= 16; size *= 2) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(1, 1, size);
      config.blockDim = dim3(256);
      config.dynamicSmemBytes = smem;
      cudaLaunchAttribute cluster = {};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 1;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = size;
      config.attrs = &cluster;
      config.numAttrs = 1;
      int clusters = -1;
      const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, probe_kernel, &config);
      std::printf("smem %d cluster %2d: max active clusters %d (%d CTAs) %s\n", smem, size, clusters,
                  clusters * size, cudaGetErrorString(err));
    }
  }
  return 0;
}
