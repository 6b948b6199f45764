// FP8 cast kernels launched from C++: x * scale, saturated to the format's range (NaN stays NaN), rounded to
// nearest even; optionally the transpose of the result, the amax of |x| (NaN counted as +inf) maxed into a
// slot, and 1 / scale into scale_inv. The same bytes as the Triton kernel of `triton_kernels.py` and the
// torch formula of `tensor.cast_to_fp8`.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdexcept>

#include "cuda_ops.h"
#include "messages.h"

namespace fp8p {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;      // elements per vector access
constexpr int kTileM = 64;   // rows of x per transposing program
constexpr int kTileN = 128;  // columns of x per transposing program
constexpr int kUnroll = 4;   // runs of 8 elements per thread per loop of the row-major cast
constexpr int kPad = 4;      // bytes of padding per shared-memory row (bank spread)

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// eight consecutive elements from a 16-byte aligned address (32 bytes for float)
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = to_float<T>(v[j]);
  }
}

template <__nv_fp8_interpretation_t FMT>
__device__ __forceinline__ unsigned char to_fp8(float v, float scale, float limit) {
  float y = v * scale;
  y = isnan(y) ? y : fminf(fmaxf(y, -limit), limit);
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, FMT));
}

__device__ __forceinline__ float abs_amax(float v) {
  const float a = fabsf(v);
  return isnan(a) ? INFINITY : a;
}

__device__ __forceinline__ bool skipped(const void* noop, int noop_bytes) {
  if (noop == nullptr) return false;
  switch (noop_bytes) {
    case 1: return *static_cast<const unsigned char*>(noop) != 0;
    case 2: return *static_cast<const unsigned short*>(noop) != 0;
    case 4: return *static_cast<const unsigned int*>(noop) != 0;
    default: return *static_cast<const unsigned long long*>(noop) != 0;
  }
}

// one atomic per block: the block's max of `v` (all values >= 0, so their int bits order as the floats do)
__device__ __forceinline__ void block_amax(float v, float* amax) {
  __shared__ float warp_max[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(v));
  }
}

struct CastArgs {
  const void* x;
  unsigned char* data;    // [M, N] row-major, or null
  unsigned char* t;       // [N, M] row-major, or null
  const float* scale;
  float* scale_inv;
  float* amax;            // or null
  const void* noop;       // or null
  int noop_bytes;
  int64_t M, N, stride_x;  // stride_x: elements between rows of x
  float limit;
  bool vec;               // N % 8 == 0 and x / data 16- / 8-byte aligned: vector loads and stores
  bool vec_t;             // M % 16 == 0 and t 16-byte aligned: 16-byte transposed stores
};

// rows of x, no transpose: each thread casts runs of 8 elements of one row, kUnroll runs at a time (their loads
// issued together)
template <typename T, __nv_fp8_interpretation_t FMT>
__global__ void __launch_bounds__(kThreads) cast_rows_kernel(CastArgs a) {
  if (skipped(a.noop, a.noop_bytes)) return;
  const float scale = *a.scale;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  unsigned char* __restrict__ data = a.data;
  const int64_t runs_per_row = (a.N + kVec - 1) / kVec;
  const int64_t runs = a.M * runs_per_row;
  const bool flat = a.stride_x == a.N;  // contiguous rows: run r starts at element 8 r
  float mx = 0.0f;
  const int64_t step = (int64_t)gridDim.x * kThreads * kUnroll;
  for (int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x; base < runs; base += step) {
    if (a.vec) {
      float v[kUnroll][kVec];
      int64_t src[kUnroll], dst[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = base + (int64_t)u * kThreads;
        const int64_t row = flat ? 0 : r / runs_per_row;
        const int64_t col = flat ? r * kVec : (r - row * runs_per_row) * kVec;
        src[u] = r < runs ? row * a.stride_x + col : -1;
        dst[u] = row * a.N + col;
        if (src[u] >= 0) load8<T>(x + src[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (src[u] < 0) continue;
        unsigned char q[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          q[j] = to_fp8<FMT>(v[u][j], scale, a.limit);
          mx = fmaxf(mx, abs_amax(v[u][j]));
        }
        *reinterpret_cast<uint2*>(data + dst[u]) = *reinterpret_cast<const uint2*>(q);
      }
    } else {
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = base + (int64_t)u * kThreads;
        if (r >= runs) break;
        const int64_t row = r / runs_per_row;
        const int64_t col = (r - row * runs_per_row) * kVec;
        const int64_t n = a.N - col < kVec ? a.N - col : kVec;
        for (int j = 0; j < n; ++j) {
          const float v = to_float<T>(x[row * a.stride_x + col + j]);
          data[row * a.N + col + j] = to_fp8<FMT>(v, scale, a.limit);
          mx = fmaxf(mx, abs_amax(v));
        }
      }
    }
  }
  if (a.amax != nullptr) block_amax(mx, a.amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale_inv = __fdiv_rn(1.0f, scale);
}

// one kTileM x kTileN tile of x per block: the row-major cast (when `data`) and its transpose through shared
// memory, so both sets of stores coalesce
template <typename T, __nv_fp8_interpretation_t FMT>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(CastArgs a) {
  if (skipped(a.noop, a.noop_bytes)) return;
  __shared__ __align__(16) unsigned char tile[kTileN][kTileM + kPad];
  const float scale = *a.scale;
  const T* x = static_cast<const T*>(a.x);
  const int64_t m0 = (int64_t)blockIdx.x * kTileM, n0 = (int64_t)blockIdx.y * kTileN;
  const bool full = m0 + kTileM <= a.M && n0 + kTileN <= a.N;
  float mx = 0.0f;
  constexpr int kRunsPerRow = kTileN / kVec;                  // 16
  constexpr int kRowsPerPass = kThreads / kRunsPerRow;        // 16
#pragma unroll
  for (int pass = 0; pass < kTileM / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + threadIdx.x / kRunsPerRow;
    const int c = (threadIdx.x % kRunsPerRow) * kVec;
    const int64_t row = m0 + r, col = n0 + c;
    unsigned char q[kVec];
    if (full && a.vec) {
      float v[kVec];
      load8<T>(x + row * a.stride_x + col, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        q[j] = to_fp8<FMT>(v[j], scale, a.limit);
        mx = fmaxf(mx, abs_amax(v[j]));
      }
      if (a.data != nullptr) *reinterpret_cast<uint2*>(a.data + row * a.N + col) = *reinterpret_cast<const uint2*>(q);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        q[j] = 0;
        if (row < a.M && col + j < a.N) {
          const float v = to_float<T>(x[row * a.stride_x + col + j]);
          q[j] = to_fp8<FMT>(v, scale, a.limit);
          mx = fmaxf(mx, abs_amax(v));
          if (a.data != nullptr) a.data[row * a.N + col + j] = q[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) tile[c + j][r] = q[j];
  }
  __syncthreads();
  // the transposed tile: kTileN rows of kTileM bytes, 16 bytes per thread and pass
  constexpr int kChunks = kTileM / 16;  // 4 per row
#pragma unroll
  for (int pass = 0; pass < kTileN * kChunks / kThreads; ++pass) {
    const int chunk = pass * kThreads + threadIdx.x;
    const int tn = chunk / kChunks, tm = (chunk % kChunks) * 16;
    const int64_t trow = n0 + tn, tcol = m0 + tm;
    if (full && a.vec_t) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&tile[tn][tm + 4 * k]);
      *reinterpret_cast<uint4*>(a.t + trow * a.M + tcol) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if (trow < a.N) {
      for (int k = 0; k < 16 && tcol + k < a.M; ++k) a.t[trow * a.M + tcol + k] = tile[tn][tm + k];
    }
  }
  if (a.amax != nullptr) block_amax(mx, a.amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *a.scale_inv = __fdiv_rn(1.0f, scale);
}

int multiprocessors() {
  static int count[64] = {0};  // per device, read once
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64) return 132;
  if (count[device] == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&count[device], cudaDevAttrMultiProcessorCount, device));
  return count[device];
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T, __nv_fp8_interpretation_t FMT>
void launch(const CastArgs& a, cudaStream_t stream) {
  if (a.t != nullptr) {
    const dim3 grid((unsigned)((a.M + kTileM - 1) / kTileM), (unsigned)((a.N + kTileN - 1) / kTileN));
    cast_transpose_kernel<T, FMT><<<grid, kThreads, 0, stream>>>(a);
  } else {
    const int64_t runs = a.M * ((a.N + kVec - 1) / kVec);
    const int64_t sms = multiprocessors();
    const int64_t blocks = std::min<int64_t>((runs + kThreads * kUnroll - 1) / (kThreads * kUnroll), sms * 16);
    cast_rows_kernel<T, FMT><<<(unsigned)std::max<int64_t>(blocks, 1), kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cast_cuda(const at::Tensor& x, const float* scale, unsigned char* data, unsigned char* t, float* scale_inv,
               float* amax, const at::Tensor* noop, bool e5m2) {
  const c10::cuda::CUDAGuard guard(x.device());
  CastArgs a;
  a.x = x.data_ptr();
  a.data = data;
  a.t = t;
  a.scale = scale;
  a.scale_inv = scale_inv;
  a.amax = amax;
  a.noop = noop != nullptr ? noop->data_ptr() : nullptr;
  a.noop_bytes = noop != nullptr ? (int)noop->element_size() : 0;
  a.M = x.size(0);
  a.N = x.size(1);
  a.stride_x = x.stride(0);
  a.limit = e5m2 ? 57344.0f : 448.0f;
  a.vec = a.N % kVec == 0 && a.stride_x % kVec == 0 && aligned(a.x, 16) && (data == nullptr || aligned(data, 8));
  a.vec_t = t != nullptr && a.M % 16 == 0 && aligned(t, 16);
  if (a.M == 0 || a.N == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (x.scalar_type()) {
    case at::kBFloat16:
      e5m2 ? launch<__nv_bfloat16, __NV_E5M2>(a, stream) : launch<__nv_bfloat16, __NV_E4M3>(a, stream);
      break;
    case at::kHalf:
      e5m2 ? launch<__half, __NV_E5M2>(a, stream) : launch<__half, __NV_E4M3>(a, stream);
      break;
    case at::kFloat:
      e5m2 ? launch<float, __NV_E5M2>(a, stream) : launch<float, __NV_E4M3>(a, stream);
      break;
    default:
      throw std::runtime_error(
          message("fp8_parallel cast: input dtype ", x.scalar_type(), " is not float32, float16 or bfloat16"));
  }
}

}  // namespace fp8p
