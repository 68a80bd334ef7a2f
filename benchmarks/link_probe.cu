// Host-link probe: cudaMemcpyAsync of pinned host memory, one way each direction and both at once
// (two streams), for copy sizes from 4 KiB to 128 MiB.  Prints: bytes_per_copy direction copies
// seconds GB/s (best of 3).  Build: nvcc -O2 -o link_probe link_probe.cu
#include <chrono>
#include <cstdio>
#include <cuda_runtime.h>
int main() {
  size_t T = 1 << 29;
  char *h, *g, *h2, *g2;
  cudaMallocHost(&h, T); cudaMalloc(&g, T); cudaMallocHost(&h2, T); cudaMalloc(&g2, T);
  cudaStream_t a, b;
  cudaStreamCreate(&a); cudaStreamCreate(&b);
  size_t S[] = {4096, 32768, 262144, 2097152, 16777216, 134217728};
  for (size_t s : S) {
    size_t n = T / s;
    for (int dir = 0; dir < 3; dir++) {
      double best = 1e9;
      for (int r = 0; r < 3; r++) {
        cudaDeviceSynchronize();
        auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < n; i++) {
          if (dir != 1) cudaMemcpyAsync(g + i * s, h + i * s, s, cudaMemcpyHostToDevice, a);
          if (dir != 0) cudaMemcpyAsync(h2 + i * s, g2 + i * s, s, cudaMemcpyDeviceToHost, b);
        }
        cudaDeviceSynchronize();
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (dt < best) best = dt;
      }
      double bytes = (double)n * s * (dir == 2 ? 2 : 1);
      printf("%zu %s %zu %.6f %.2f\n", s, dir == 0 ? "H2D" : dir == 1 ? "D2H" : "BOTH", n, best, bytes / best / 1e9);
    }
  }
  return 0;
}
