// single_launch_norm.cu: BatchNorm training on channel-innermost data (channels_last, or (N, C))
// in one cooperative launch per direction, for tensors small enough that launches and the gaps
// between three kernels are a large part of the time (a resnet50 layer at batch 64).
//
// The kernels are the three passes of strided_norm.cu run by one grid, with a grid barrier between
// them; the grid is one wave of resident CTAs and the launch is cooperative, so the driver refuses
// it (and the host falls back to the three launches) rather than let it wait for CTAs that cannot
// run. The barrier counts arrivals in `arrived`, which the host zeroes just before the launch
// (cuMemsetD32Async on the same stream); barrier b of a launch waits for b * gridDim.x arrivals,
// so it never needs resetting within a launch. No CUDA headers: the barrier is atomics and fences.
//
//   forward:   stats_cols -> barrier -> finalize (one warp per channel, running statistics updated)
//              -> barrier -> apply_cols
//   backward:  bwd_sums_cols -> barrier -> bwd_finalize (dweight, dbias, the dx coefficients)
//              -> barrier -> bwd_dx (apply_cols, backward form)
// The partials are merged in the same fixed order as the split passes: bitwise reproducible.
#define STRIDED_NORM_DEVICE_ONLY
#define STRIDED_NORM_COHERENT_LOADS  // what a pass reads after a barrier: ordinary loads
#include "strided_norm.cu"

// Every thread's earlier global writes are visible to the whole grid once the barrier returns.
__device__ __forceinline__ void grid_barrier(unsigned int* arrived, unsigned int target) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        atomicAdd(arrived, 1u);
        while (*reinterpret_cast<volatile unsigned int*>(arrived) < target) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}

// One statistic set per full warp of the grid (a block of TX * TY threads may end with a partial
// warp, which sits this phase out: the merges shuffle across all 32 lanes).
struct GridWarps {
    int64 first, count;
    int lane;
    bool active;
};

__device__ __forceinline__ GridWarps grid_warps() {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int full = (blockDim.x * blockDim.y) / 32;
    GridWarps w;
    w.first = static_cast<int64>(blockIdx.x) * full + tid / 32;
    w.count = static_cast<int64>(gridDim.x) * full;
    w.lane = tid & 31;
    w.active = tid < full * 32;
    return w;
}

// Forward: x (R rows of C channels, row stride C) -> y; mean, rstd (C,) for the backward; running
// statistics (into new_running_*) and batch counter (each may be null) updated as
// strided_norm_finalize does. Grid: ctas CTAs of (TX, TY).
template <int V>
__device__ __forceinline__ void batch_norm_fwd_cols(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ partials, unsigned int* arrived,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, const param_t* running_mean,
    const param_t* running_var, int64* __restrict__ batches_tracked, int64 R, int64 C,
    double count, acc_t eps, acc_t momentum, acc_t unbias, param_t* new_running_mean,
    param_t* new_running_var) {
    const int64 ctas = gridDim.x;
    stats_cols<V>(x, partials, 1, R, C, C, 0, ctas, 0, 1, nullptr);
    grid_barrier(arrived, gridDim.x);
    const GridWarps w = grid_warps();
    if (w.active) {
        for (int64 k = w.first; k < C; k += w.count)  // set c starts at x[c]
            finalize_set(k, w.lane, partials, ctas, count, eps, mean, rstd, nullptr, x, 1, 1, 0,
                         running_mean, running_var, momentum, unbias, batches_tracked,
                         new_running_mean, new_running_var);
    }
    grid_barrier(arrived, 2 * gridDim.x);
    apply_cols<V, false>(x, nullptr, y, weight, bias, mean, rstd, nullptr, nullptr, R, C, C, 0, 0, 1,
                         ctas, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(COLS_THREADS_MAX, 1) single_launch_batch_norm_fwd_cols(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ partials, unsigned int* arrived,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, const param_t* running_mean,
    const param_t* running_var, int64* __restrict__ batches_tracked, int64 R, int64 C,
    double count, acc_t eps, acc_t momentum, acc_t unbias, int vectorized,
    param_t* new_running_mean, param_t* new_running_var) {
    if (vectorized)
        batch_norm_fwd_cols<VEC>(x, y, weight, bias, partials, arrived, mean, rstd, running_mean,
                                 running_var, batches_tracked, R, C, count, eps, momentum, unbias,
                                 new_running_mean, new_running_var);
    else
        batch_norm_fwd_cols<1>(x, y, weight, bias, partials, arrived, mean, rstd, running_mean,
                               running_var, batches_tracked, R, C, count, eps, momentum, unbias,
                               new_running_mean, new_running_var);
}

// Backward (training: the statistics are the batch's; eval: constants, u = v = 0): dx (may be
// null), dweight and dbias (either may be null; in the weight's type, acc_t without weight).
// u, v: (C,) scratch for the dx coefficients (null when dx is). Dynamic shared memory as
// bwd_sums_cols.
template <int V>
__device__ __forceinline__ void batch_norm_bwd_cols(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy, scalar_t* __restrict__ dx,
    const param_t* __restrict__ weight, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, acc_t* __restrict__ partials, unsigned int* arrived,
    acc_t* __restrict__ u, acc_t* __restrict__ v, void* __restrict__ dweight,
    void* __restrict__ dbias, int64 R, int64 C, double count, int training) {
    const int64 ctas = gridDim.x;
    bwd_sums_cols<V>(x, dy, mean, partials, R, C, C, 0, 0, 1, ctas, Epilogue{}, nullptr,
                            nullptr, nullptr, nullptr);
    grid_barrier(arrived, gridDim.x);
    const GridWarps w = grid_warps();
    if (w.active) {  // warps 0 .. C-1: dweight, dbias; C .. 2C-1: u, v
        for (int64 k = w.first; k < 2 * C; k += w.count)
            bwd_finalize_warp(k, w.lane, partials, 1, C, ctas, rstd, weight, 0, 1, C, count,
                              training, dweight, dbias, u, v);
    }
    if (dx == nullptr) return;  // the same for every CTA
    grid_barrier(arrived, 2 * gridDim.x);
    apply_cols<V, true>(x, dy, dx, weight, nullptr, mean, rstd, u, v, R, C, C, 0, 0, 1, ctas, nullptr,
                        nullptr);
}

extern "C" __global__ void __launch_bounds__(COLS_THREADS_MAX, 1) single_launch_batch_norm_bwd_cols(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy, scalar_t* __restrict__ dx,
    const param_t* __restrict__ weight, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, acc_t* __restrict__ partials, unsigned int* arrived,
    acc_t* __restrict__ u, acc_t* __restrict__ v, void* __restrict__ dweight,
    void* __restrict__ dbias, int64 R, int64 C, double count, int training, int vectorized) {
    if (vectorized)
        batch_norm_bwd_cols<VEC>(x, dy, dx, weight, mean, rstd, partials, arrived, u, v, dweight,
                                 dbias, R, C, count, training);
    else
        batch_norm_bwd_cols<1>(x, dy, dx, weight, mean, rstd, partials, arrived, u, v, dweight,
                               dbias, R, C, count, training);
}
