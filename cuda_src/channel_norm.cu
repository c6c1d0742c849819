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
// The thin-tile forward (channel_fwd_thin, below the register tiles' forward) takes C up to 256
// with a few packs per thread and many small CTAs per SM: see its section.
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

// ---- thin tiles: a few channels per thread, many CTAs per SM ----------------------------------
// The forward above holds up to 16 packs per thread (96 registers for fp32 RMS: ~2 CTAs of 256
// threads per SM, each one load-reduce-store phase with nothing overlapping; KernelBench L1-36 at
// 67% of copy bandwidth). Here a thread holds CPT packs (4: 16 registers of fp32 data), so many
// small CTAs share an SM (~10 of 128 threads for fp32 RMS), one tile each (grid-stride CTAs
// loading the next tile before the current one's sums were slower: benchmarks/NOTES.md 2.7).
//
// Mapping: a CTA of (PX, CY) threads, PX a power of two <= 32, so a warp holds R = 32 / PX rows
// of ty (CY a multiple of R); thread (tx, ty) holds channels c = ty + k * CY (k < CPT) of pack
// p = tile * PX + tx. A warp's access covers R channel rows of PX * V contiguous elements (128
// bytes per row when vectorized). Column sums: xor shuffles over the R rows of a warp (every lane
// gets the same bits), then the warps' sums through shared memory, added in warp order by every
// thread; two buffers alternate, so one barrier per sum.
// LayerNorm: m = sum x / C (rounded), then one sum of d = x - m and d^2 together: d is exact for
// data near its mean, so var = <d^2> - <d>^2 loses nothing (<d> is a rounding of m, tiny against
// the spread), and mean = m + <d>; offset data (mean 1e4, std 1) keeps its digits.

// The packs a thread holds. A 16-byte pack is kept as four 32-bit words and its elements are
// taken out at each use (volatile: not hoisted to the load): half packs split into 16-bit values
// at the load would take a register per element, twice the words, and the prefetched tile again.
template <int V> using ThinPack = typename Select<V == 1, Pack<1>, uint4>::type;

__device__ __forceinline__ unsigned thin_word(const uint4& r, int i) {
    return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ __forceinline__ float thin_elem(const uint4& r, int j, const float*) {
    return __uint_as_float(thin_word(r, j));
}
__device__ __forceinline__ double thin_elem(const uint4& r, int j, const double*) {
    return __hiloint2double(static_cast<int>(thin_word(r, 2 * j + 1)),
                            static_cast<int>(thin_word(r, 2 * j)));
}
__device__ __forceinline__ float thin_elem(const uint4& r, int j, const half_t*) {
    float f;
    if (j & 1)
        asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi; }"
                     : "=f"(f) : "r"(thin_word(r, j >> 1)));
    else
        asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }"
                     : "=f"(f) : "r"(thin_word(r, j >> 1)));
    return f;
}
__device__ __forceinline__ float thin_elem(const uint4& r, int j, const bf16_t*) {
    unsigned u;
    if (j & 1)
        asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(u) : "r"(thin_word(r, j >> 1)));
    else
        asm volatile("shl.b32 %0, %1, 16;" : "=r"(u) : "r"(thin_word(r, j >> 1)));
    return __uint_as_float(u);
}
// element j of a held pack, as an accumulator
__device__ __forceinline__ acc_t thin_elem(const uint4& r, int j) {
    return thin_elem(r, j, static_cast<const scalar_t*>(nullptr));
}
__device__ __forceinline__ acc_t thin_elem(const Pack<1>& v, int) { return to_acc(v.v[0]); }

// Sum over the column of v[0..K) (see above), returned to every thread of the column. red: two
// buffers of (warps * PX * K) accumulators when the CTA has more than one warp; flip alternates.
template <int K>
__device__ __forceinline__ void thin_column_sum(acc_t (&v)[K], acc_t* red, int& flip) {
    const int PX = blockDim.x, t = threadIdx.y * PX + threadIdx.x;
    const int lane = t & 31, warp = t >> 5, warps = (blockDim.y * PX) >> 5;
    for (int off = PX; off < 32; off <<= 1) {
#pragma unroll
        for (int j = 0; j < K; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], off);
    }
    if (warps == 1) return;
    acc_t* buf = red + flip * warps * PX * K;
    flip ^= 1;
    if (lane < PX) {  // the warp's first row: lane == tx
#pragma unroll
        for (int j = 0; j < K; ++j) buf[(warp * PX + lane) * K + j] = v[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = 0;
    const acc_t* mine = buf + threadIdx.x * K;
#pragma unroll 1
    for (int w = 0; w < warps; ++w, mine += PX * K) {  // K consecutive values: vector loads
#pragma unroll
        for (int j = 0; j < K; ++j) v[j] += mine[j];
    }
}

// The packs of channels ty + k * CY (k < kc) of tile t, pixel pack tx: live when it exists.
template <int V, int CPT>
__device__ __forceinline__ void thin_load(ThinPack<V> (&v)[CPT], const scalar_t* __restrict__ x,
                                          int t, int tiles, int C, int64 S, int kc) {
    const int n = t / tiles;
    const int64 p = static_cast<int64>(t - n * tiles) * blockDim.x + threadIdx.x;
    if (p >= S / V) return;
    const scalar_t* xc = x + (static_cast<int64>(n) * C + threadIdx.y) * S;
    const int64 row = static_cast<int64>(blockDim.y) * S;
#pragma unroll
    for (int k = 0; k < CPT; ++k)
        if (k < kc) v[k] = reinterpret_cast<const ThinPack<V>*>(xc + k * row)[p];
}

// One tile from the packs v: the column sums, mean / rstd (N, S) when given, y. n: the sample,
// p: this thread's pack, kl: packs it holds (0 past the last pixel; it still joins the sums).
template <int V, int CPT, bool RMS>
__device__ __forceinline__ void thin_tile(const ThinPack<V> (&v)[CPT], const acc_t (&w)[CPT],
                                          const acc_t (&b)[CPT], scalar_t* __restrict__ y,
                                          acc_t* __restrict__ mean, acc_t* __restrict__ rstd,
                                          int n, int64 p, int kl, int C, int64 S, acc_t eps,
                                          int& flip) {
    extern __shared__ __align__(16) acc_t channel_thin_red[];
    const acc_t inv_c = acc_t(1) / acc_t(C);
    acc_t s[V];
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = 0;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
        if (k >= kl) continue;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t a = thin_elem(v[k], j);
            s[j] += RMS ? a * a : a;
        }
    }
    thin_column_sum<V>(s, channel_thin_red, flip);
    acc_t m[V], e[V], r[V];
    if (RMS) {
#pragma unroll
        for (int j = 0; j < V; ++j) m[j] = e[j] = 0, r[j] = rsqrt_acc(s[j] * inv_c + eps);
    } else {
        acc_t q[2 * V];  // sums of d and of d^2, d = x - m
#pragma unroll
        for (int j = 0; j < V; ++j) m[j] = s[j] * inv_c, q[j] = q[V + j] = 0;
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
            if (k >= kl) continue;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t d = thin_elem(v[k], j) - m[j];
                q[j] += d;
                q[V + j] += d * d;
            }
        }
        thin_column_sum<2 * V>(q, channel_thin_red, flip);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            e[j] = q[j] * inv_c;
            const acc_t var = q[V + j] * inv_c - e[j] * e[j];
            r[j] = rsqrt_acc((var > acc_t(0) ? var : acc_t(0)) + eps);
        }
    }
    if (kl == 0) return;
    if (threadIdx.y == 0) {
        const int64 i = n * S + p * V;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (mean != nullptr) mean[i + j] = m[j] + e[j];
            if (rstd != nullptr) rstd[i + j] = r[j];
        }
    }
    scalar_t* yc = y + (static_cast<int64>(n) * C + threadIdx.y) * S;
    const int64 row = static_cast<int64>(blockDim.y) * S;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
        if (k >= kl) continue;
        Pack<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j)
            out.v[j] =
                from_acc<scalar_t>(((thin_elem(v[k], j) - m[j]) - e[j]) * r[j] * w[k] + b[k]);
        store_pack<V>(yc + k * row, p, out);
    }
}

// One tile per CTA: grid = total = N * tiles (tiles per sample; the host keeps it below 2^31).
// Dynamic shared memory: thin_column_sum's buffers, K = V (RMS) or 2 * V (LayerNorm).
template <int V, int CPT, bool RMS>
__device__ __forceinline__ void channel_fwd_thin(const scalar_t* __restrict__ x,
                                                 scalar_t* __restrict__ y,
                                                 const param_t* __restrict__ weight,
                                                 const param_t* __restrict__ bias,
                                                 acc_t* __restrict__ mean, acc_t* __restrict__ rstd,
                                                 int C, int64 S, int tiles, int total, acc_t eps) {
    const int CY = blockDim.y, ty = threadIdx.y;
    const int kc = ty < C ? min(CPT, (C - ty + CY - 1) / CY) : 0;  // channels ty + k * CY, k < kc
    const int64 packs = S / V;                                    // V divides S when V > 1
    acc_t w[CPT], b[CPT];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
        w[k] = weight != nullptr && k < kc ? to_acc(weight[ty + k * CY]) : acc_t(1);
        b[k] = bias != nullptr && k < kc ? to_acc(bias[ty + k * CY]) : acc_t(0);
    }
    int flip = 0;
    ThinPack<V> v[CPT];
    const int t = blockIdx.x;
    if (t >= total) return;  // uniform over the CTA
    thin_load<V, CPT>(v, x, t, tiles, C, S, kc);
    const int n = t / tiles;
    const int64 p = static_cast<int64>(t - n * tiles) * blockDim.x + threadIdx.x;
    thin_tile<V, CPT, RMS>(v, w, b, y, mean, rstd, n, p, p < packs ? kc : 0, C, S, eps, flip);
}

// _thin4 / _thin8: packs of VEC elements (x, y 16-byte aligned, S a multiple of VEC), 4 or 8
// per thread; _thin_scalar: 16 single elements per thread. One pack width per kernel: a kernel
// holding both branches would take the wider one's registers for either.
// CTAs of at most 256 threads; CTAS(f32, half, f64): the CTAs of 256 per SM each kernel is built
// for, by element size, so its register budget (65536 / 256 / n: 5 -> 48, 4 -> 64, 3 -> 80,
// 2 -> 128): the tightest at which ptxas (sm_90) spills nothing or under 40 bytes. Left alone,
// ptxas takes 54 registers for the fp32 RMS tile (16 of data: the rest addresses computed ahead).
#define CTAS(f32, half, f64) \
    (sizeof(scalar_t) == 8 ? (f64) : sizeof(scalar_t) == 4 ? (f32) : (half))
#define CHANNEL_FWD_THIN(NAME, V, CPT, RMS, MIN_CTAS)                                             \
    extern "C" __global__ void __launch_bounds__(256, MIN_CTAS) NAME(                             \
        const scalar_t* __restrict__ x, scalar_t* __restrict__ y,                                 \
        const param_t* __restrict__ weight, const param_t* __restrict__ bias,                     \
        acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int C, int64 S, int tiles, int total, \
        acc_t eps) {                                                                              \
        channel_fwd_thin<V, CPT, RMS>(x, y, weight, bias, mean, rstd, C, S, tiles, total, eps);   \
    }
CHANNEL_FWD_THIN(channel_norm_fwd_rms_thin4, VEC, 4, true, CTAS(5, 5, 4))
CHANNEL_FWD_THIN(channel_norm_fwd_layer_thin4, VEC, 4, false, CTAS(4, 3, 4))
CHANNEL_FWD_THIN(channel_norm_fwd_rms_thin8, VEC, 8, true, CTAS(3, 3, 2))
CHANNEL_FWD_THIN(channel_norm_fwd_layer_thin8, VEC, 8, false, CTAS(2, 2, 2))
CHANNEL_FWD_THIN(channel_norm_fwd_rms_thin_scalar, 1, 16, true, CTAS(3, 3, 2))
CHANNEL_FWD_THIN(channel_norm_fwd_layer_thin_scalar, 1, 16, false, CTAS(3, 3, 2))
#undef CHANNEL_FWD_THIN
#undef CTAS

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
