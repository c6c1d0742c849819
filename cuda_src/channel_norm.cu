// channel_norm.cu: LayerNorm / RMSNorm over the channels of NCHW data, per (sample, pixel).
// (timm's LayerNorm2d of ConvNeXt; KernelBench level 1 problem 36's RMS over dim 1.)
//
// x is (N, C, S) contiguous (S = prod(spatial)); every pixel (n, s) is normalized over its C
// values x[n, c, s], which lie S elements apart:
//   LayerNorm: mean = sum_c x / C, var = sum_c (x - mean)^2 / C, rstd = 1 / sqrt(var + eps)
//   RMSNorm:   mean = 0,           rstd = 1 / sqrt(sum_c x^2 / C + eps)
//   xhat = (x - mean) * rstd,  y = xhat * weight[c] + bias[c]
// backward, with g = dy * weight[c] and <.> the mean over the C channels of the pixel:
//   dx = rstd * (g - <g> - xhat * <g xhat>)   (RMSNorm: without <g>)
//   dweight[c] = sum over (n, s) of dy * xhat,  dbias[c] = sum over (n, s) of dy
//
// (channels_last data is the row norm of segment_norm.cu on the (N * S, C) view: not here.)
//
// Mapping: a CTA of (PX, CY) threads owns a tile of PX packs of V adjacent pixels of one sample
// (V = VEC when vectorized: 16-byte accesses, else 1). Thread (tx, ty) holds in registers the
// packs of channels c = ty, ty + CY, ... (at most CPT of them: the host picks CY = ceil(C / CPT)).
// A warp's lanes run along tx, so each load of a warp is PX * 16 contiguous bytes of one channel
// row. The per-pixel sums over the CY threads of a column go through shared memory in a fixed
// order (bitwise reproducible); LayerNorm's statistics are passes over the registers (mean, its
// correction, then the squared deviations): one read and one write of x, nothing re-read.
//
// The backward's dx kernel walks tiles grid-stride with a grid of resident CTAs; each thread keeps
// its channels' dweight / dbias sums in registers, the CTA folds them over tx into one fp32
// partial row per CTA, and row_norm_bwd_params (row_norm.cu) adds the rows in order:
// no atomics. Offsets are 64-bit (problem 36's tensor has 1.9e9 elements).
#include "common.cuh"

// Channels per thread held in registers (the host's CHANNEL_FWD_CPT / CHANNEL_BWD_CPT): 16 packs
// of 16 bytes are 64 registers; the backward holds x and dy, so half as many channels.
#define CHANNEL_FWD_CPT 16
#define CHANNEL_BWD_CPT 8

// Sum over the CY threads of this thread's column of v[0..V), returned to every thread of the
// column. red: CY * PX * V values of shared memory; the call begins and ends with a barrier.
template <int V>
__device__ __forceinline__ void column_sum(acc_t (&v)[V], acc_t* red) {
    const int PX = blockDim.x, CY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < V; ++j) red[(ty * PX + tx) * V + j] = v[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < V; ++j) {
        acc_t s = 0;
        for (int t = 0; t < CY; ++t) s += red[(t * PX + tx) * V + j];
        v[j] = s;
    }
    __syncthreads();
}

// Grid: N * tiles CTAs, tile = PX packs. mean / rstd: (N, S) or null (inference).
template <int V, bool RMS>
__device__ __forceinline__ void channel_fwd(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                            const param_t* __restrict__ weight,
                                            const param_t* __restrict__ bias,
                                            acc_t* __restrict__ mean, acc_t* __restrict__ rstd,
                                            int C, int64 S, int64 tiles, acc_t eps) {
    extern __shared__ unsigned char channel_smem[];
    acc_t* red = reinterpret_cast<acc_t*>(channel_smem);
    const int PX = blockDim.x, CY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const int64 n = blockIdx.x / tiles, tile = blockIdx.x - n * tiles;
    const int64 p = tile * PX + tx;  // this thread's pack of pixels
    const bool live = p < S / V;     // V divides S when V > 1
    const scalar_t* xn = x + n * C * S;
    scalar_t* yn = y + n * C * S;

    Pack<V> v[CHANNEL_FWD_CPT];
    acc_t s[V];
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = 0;
#pragma unroll
    for (int k = 0; k < CHANNEL_FWD_CPT; ++k) {
        const int c = ty + k * CY;
        if (live && c < C) v[k] = load_pack<V>(xn + c * S, p);
    }
#pragma unroll
    for (int k = 0; k < CHANNEL_FWD_CPT; ++k) {
        if (!(live && ty + k * CY < C)) continue;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t a = to_acc(v[k].v[j]);
            s[j] += RMS ? a * a : a;
        }
    }
    column_sum<V>(s, red);
    const acc_t inv_c = acc_t(1) / acc_t(C);
    // LayerNorm: x - mean as (x - m) - e, with m the rounded mean of the first sum and e the mean
    // of x - m (a second pass over the registers): data whose mean dwarfs its spread keeps the
    // digits a rounded fp32 mean would lose
    acc_t m[V], e[V], r[V];
#pragma unroll
    for (int j = 0; j < V; ++j) m[j] = RMS ? acc_t(0) : s[j] * inv_c, e[j] = 0;
    if (RMS) {
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = rsqrt_acc(s[j] * inv_c + eps);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] = 0;
#pragma unroll
        for (int k = 0; k < CHANNEL_FWD_CPT; ++k) {
            if (!(live && ty + k * CY < C)) continue;
#pragma unroll
            for (int j = 0; j < V; ++j) s[j] += to_acc(v[k].v[j]) - m[j];
        }
        column_sum<V>(s, red);
#pragma unroll
        for (int j = 0; j < V; ++j) e[j] = s[j] * inv_c, s[j] = 0;
#pragma unroll
        for (int k = 0; k < CHANNEL_FWD_CPT; ++k) {
            if (!(live && ty + k * CY < C)) continue;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t d = (to_acc(v[k].v[j]) - m[j]) - e[j];
                s[j] += d * d;
            }
        }
        column_sum<V>(s, red);
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = rsqrt_acc(s[j] * inv_c + eps);
    }
    if (!live) return;
    if (ty == 0) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (mean != nullptr) mean[n * S + p * V + j] = m[j] + e[j];
            if (rstd != nullptr) rstd[n * S + p * V + j] = r[j];
        }
    }
#pragma unroll
    for (int k = 0; k < CHANNEL_FWD_CPT; ++k) {
        const int c = ty + k * CY;
        if (c >= C) continue;
        const acc_t w = weight != nullptr ? to_acc(weight[c]) : acc_t(1);
        const acc_t b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
        Pack<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j)
            out.v[j] = from_acc<scalar_t>(((to_acc(v[k].v[j]) - m[j]) - e[j]) * r[j] * w + b);
        store_pack<V>(yn + c * S, p, out);
    }
}

// vectorized: x, y 16-byte aligned and S a multiple of VEC. Dynamic shared memory:
// blockDim.x * blockDim.y * (vectorized ? VEC : 1) accumulators.
extern "C" __global__ void channel_norm_fwd_layer(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int C,
    int64 S, int64 tiles, acc_t eps, int vectorized) {
    if (vectorized)
        channel_fwd<VEC, false>(x, y, weight, bias, mean, rstd, C, S, tiles, eps);
    else
        channel_fwd<1, false>(x, y, weight, bias, mean, rstd, C, S, tiles, eps);
}

extern "C" __global__ void channel_norm_fwd_rms(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int C,
    int64 S, int64 tiles, acc_t eps, int vectorized) {
    if (vectorized)
        channel_fwd<VEC, true>(x, y, weight, bias, mean, rstd, C, S, tiles, eps);
    else
        channel_fwd<1, true>(x, y, weight, bias, mean, rstd, C, S, tiles, eps);
}

// Grid: any number of CTAs (the host launches the resident ones); CTA b walks tiles b, b + grid,
// ... of the N * tiles tiles. mean null: RMSNorm. dx null: weight gradients only. dweight_part /
// dbias_part: (gridDim.x, C) fp32 partial rows, or null. Dynamic shared memory:
// blockDim.x * blockDim.y * max(V, 2) accumulators.
template <int V>
__device__ __forceinline__ void channel_bwd(const scalar_t* __restrict__ x,
                                            const scalar_t* __restrict__ dy,
                                            const param_t* __restrict__ weight,
                                            const acc_t* __restrict__ mean,
                                            const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx,
                                            acc_t* __restrict__ dweight_part,
                                            acc_t* __restrict__ dbias_part, int C, int64 S,
                                            int64 tiles, int64 N) {
    extern __shared__ unsigned char channel_smem[];
    acc_t* red = reinterpret_cast<acc_t*>(channel_smem);
    const int PX = blockDim.x, CY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    acc_t w[CHANNEL_BWD_CPT], dw[CHANNEL_BWD_CPT], db[CHANNEL_BWD_CPT];
#pragma unroll
    for (int k = 0; k < CHANNEL_BWD_CPT; ++k) {
        const int c = ty + k * CY;
        w[k] = weight != nullptr && c < C ? to_acc(weight[c]) : acc_t(1);
        dw[k] = db[k] = acc_t(0);
    }
    const acc_t inv_c = acc_t(1) / acc_t(C);
    for (int64 b = blockIdx.x; b < N * tiles; b += gridDim.x) {
        const int64 n = b / tiles, tile = b - n * tiles;
        const int64 p = tile * PX + tx;
        const bool live = p < S / V;
        const int64 base = n * C * S;
        Pack<V> xv[CHANNEL_BWD_CPT], dv[CHANNEL_BWD_CPT];
#pragma unroll
        for (int k = 0; k < CHANNEL_BWD_CPT; ++k) {
            const int c = ty + k * CY;
            if (live && c < C) {
                xv[k] = load_pack<V>(x + base + c * S, p);
                dv[k] = load_pack<V>(dy + base + c * S, p);
            }
        }
        acc_t m[V], r[V], sg[V], sgx[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int64 i = n * S + (live ? p : 0) * V + j;
            m[j] = live && mean != nullptr ? mean[i] : acc_t(0);
            r[j] = live ? rstd[i] : acc_t(0);
            sg[j] = sgx[j] = 0;
        }
#pragma unroll
        for (int k = 0; k < CHANNEL_BWD_CPT; ++k) {
            if (!(live && ty + k * CY < C)) continue;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = (to_acc(xv[k].v[j]) - m[j]) * r[j], d = to_acc(dv[k].v[j]);
                dw[k] += d * xhat;
                db[k] += d;
                sg[j] += w[k] * d;
                sgx[j] += w[k] * d * xhat;
            }
        }
        if (dx == nullptr) continue;  // uniform over the grid: no barrier is skipped by a part
        column_sum<V>(sg, red);
        column_sum<V>(sgx, red);
        if (!live) continue;
#pragma unroll
        for (int k = 0; k < CHANNEL_BWD_CPT; ++k) {
            const int c = ty + k * CY;
            if (c >= C) continue;
            Pack<V> out;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = (to_acc(xv[k].v[j]) - m[j]) * r[j], g = w[k] * to_acc(dv[k].v[j]);
                const acc_t mean_g = mean != nullptr ? sg[j] * inv_c : acc_t(0);
                out.v[j] = from_acc<scalar_t>(r[j] * (g - mean_g - xhat * sgx[j] * inv_c));
            }
            store_pack<V>(dx + base + c * S, p, out);
        }
    }
    if (dweight_part == nullptr && dbias_part == nullptr) return;
    // fold dw / db over the PX threads of each row, in order: the row's sums go through shared
    // memory one channel slot k at a time (PX * CY pairs)
#pragma unroll
    for (int k = 0; k < CHANNEL_BWD_CPT; ++k) {
        __syncthreads();
        red[2 * (ty * PX + tx)] = dw[k];
        red[2 * (ty * PX + tx) + 1] = db[k];
        __syncthreads();
        const int c = ty + k * CY;
        if (tx == 0 && c < C) {
            acc_t a = 0, e = 0;
            for (int t = 0; t < PX; ++t) {
                a += red[2 * (ty * PX + t)];
                e += red[2 * (ty * PX + t) + 1];
            }
            const int64 i = static_cast<int64>(blockIdx.x) * C + c;
            if (dweight_part != nullptr) dweight_part[i] = a;
            if (dbias_part != nullptr) dbias_part[i] = e;
        }
    }
}

// vectorized: x, dy, dx 16-byte aligned and S a multiple of VEC.
extern "C" __global__ void channel_norm_bwd_dx(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const param_t* __restrict__ weight, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx, acc_t* __restrict__ dweight_part,
    acc_t* __restrict__ dbias_part, int C, int64 S, int64 tiles, int64 N, int vectorized) {
    if (vectorized)
        channel_bwd<VEC>(x, dy, weight, mean, rstd, dx, dweight_part, dbias_part, C, S, tiles, N);
    else
        channel_bwd<1>(x, dy, weight, mean, rstd, dx, dweight_part, dbias_part, C, S, tiles, N);
}
