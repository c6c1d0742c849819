// row_norm.cu: LayerNorm / RMSNorm over rows held in registers, and the column sums of the weight
// gradients' partial rows shared by every row and channel norm backward:
//   short rows (whole packs of 16 bytes, at most 128 of them: 1024 bf16 values), forward and
//     backward, a group of 4 to 32 lanes of a warp per row;
//   longer rows (129 to 1024 packs), forward and backward (in one pass), a CTA per row. Rows
//     that are not whole packs and rows longer than a CTA's registers stay on segment_norm.cu.
// The module variant with OUT_T = float beside SCALAR_T = half_t / bf16_t is LayerNorm under
// autocast (torch's policy: the norm in float32, y float32): short rows read x in its own type,
// write y (and read dy) in float and write dx in x's type, where a float32 copy of x each way
// moved 2.3x the bytes (NOTES.md); other rows take the copies at the end of this file.
//
// A row of L = row_len elements shares one (mean, rstd); weight and bias are indexed by the
// position i in the row (formulas in segment_norm.cu's row-norm section):
//   forward:  xhat_i = (x_i - mean) * rstd,  y_i = xhat_i * weight[i] + bias[i]
//             (RMS: mean = 0, rstd = 1 / sqrt(<x^2> + eps); CAST: y = round(w * round(xhat)))
//   backward: g_i = weight[i] * dy_i,  dx_i = rstd * (g_i - <g> - xhat_i * <g xhat>) (RMS: no <g>)
//             dweight[i] = sum over rows of dy_i * xhat_i (CAST: of round(xhat_i)),
//             dbias[i] = sum over rows of dy_i
//
// Forward of long rows, tried here before and measured slower than segment_norm.cu's CTA per row
// (LayerNorm / RMSNorm bf16 8192x4096 on an H200: 52 / 42 us, floor 32): a persistent CTA of 256
// threads per row with the next row's loads in flight (63.5 / 48.5 us: 77 registers, three CTAs
// per SM) and a warp per row with 16 packs per lane (75 / 54 us: 255 registers). What won: no
// persistence, no prefetch, small CTAs (row_fwd_cta below).
//
// Backward of long rows: a CTA of T <= 256 threads per row, thread t holding packs t, t + T, ... of
// x and dy (its weight-gradient sums must stay few per thread), the two row sums one block
// reduction. No prefetch of the next row: its registers held the SM to 2 CTAs, without them 3
// fit up to 2 packs a thread (80 registers, no spill): LayerNorm bf16 8192x4096 112 -> 104 us,
// RMSNorm bf16 16384x2048 116 -> 98 us on an H200 (NOTES.md). Each thread keeps its dweight /
// dbias sums over the CTA's rows in registers; every CTA writes one fp32 partial row, and
// row_norm_bwd_params adds the partial rows in CTA order. (The separate sums and dx passes of
// segment_norm.cu took 118-150 us for 5 passes of bf16 8192x4096, floor 80.) Deterministic: no
// atomics, fixed orders for a given grid.
#include "common.cuh"

// a and b summed over the block, returned to every thread (fixed order). scratch: 66 values;
// begins and ends with a barrier.
__device__ __forceinline__ void block_sum2(acc_t& a, acc_t& b, acc_t* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = a;
        scratch[33 + warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        acc_t ta = lane < nwarps ? scratch[lane] : acc_t(0);
        acc_t tb = lane < nwarps ? scratch[33 + lane] : acc_t(0);
        ta = warp_sum(ta);
        tb = warp_sum(tb);
        if (lane == 0) {
            scratch[32] = ta;
            scratch[65] = tb;
        }
    }
    __syncthreads();
    a = scratch[32];
    b = scratch[65];
}

// Packs first, first + step, ... (at most PACKS, those < packs) of row `row`: of x (P a Pack of
// scalar_t) or of dy (an OutPack of out_t).
template <int PACKS, typename P, typename T>
__device__ __forceinline__ void load_row(P (&v)[PACKS], const T* __restrict__ src, int64 row,
                                         int row_len, int packs, int first, int step) {
    const P* base = reinterpret_cast<const P*>(src + row * row_len);
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = first + k * step;
        if (p < packs) v[k] = base[p];
    }
}

// One pack p of a row's backward, both families: the pack's dweight / dbias terms added to dw,
// db, and dx (plus the incoming gradient of the sum when dsum is set) stored when dx is set.
// g: weight * dy of the pack; mean_g, mean_gx: <g>, <g xhat> over the row.
template <int V, bool CAST>
__device__ __forceinline__ void row_bwd_pack(const Pack<V>& xv, const OutPack<V>& dv,
                                             const acc_t (&g)[V], acc_t m, acc_t rs,
                                             acc_t mean_g, acc_t mean_gx,
                                             const scalar_t* __restrict__ dsum,
                                             scalar_t* __restrict__ dx, int64 base, int p,
                                             acc_t (&dw)[V], acc_t (&db)[V]) {
    Pack<V> sv, out;
    if (dsum != nullptr) sv = load_pack<V>(dsum + base, p);
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const acc_t xhat = (to_acc(xv.v[j]) - m) * rs, d = to_acc(dv.v[j]);
        dw[j] += d * (CAST ? to_acc(from_acc<scalar_t>(xhat)) : xhat);
        db[j] += d;
        acc_t v = rs * (g[j] - mean_g - xhat * mean_gx);
        if (dsum != nullptr) v += to_acc(sv.v[j]);
        out.v[j] = from_acc<scalar_t>(v);
    }
    if (dx != nullptr) store_pack<V>(dx + base, p, out);
}

// ---- backward ----------------------------------------------------------------------------------
// x: the normalized rows (the sum s with a residual); mean null: RMSNorm; dsum: the incoming
// gradient of s, added to dx, or null. dx null: weight gradients only. dweight_part /
// dbias_part: gridDim.x partial rows of row_len, or null.
template <int PACKS, bool CAST>
__device__ __forceinline__ void row_bwd(
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int row_len) {
    constexpr int V = VEC;
    __shared__ acc_t scratch[66];
    const int packs = row_len / V;
    const acc_t L = acc_t(row_len);
    Pack<V> xc[PACKS];
    OutPack<V> dc[PACKS];
    acc_t dw[PACKS][V], db[PACKS][V];
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) dw[k][j] = db[k][j] = acc_t(0);
    for (int64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64 base = row * row_len;
        load_row<PACKS>(xc, x, row, row_len, packs, threadIdx.x, blockDim.x);
        load_row<PACKS>(dc, dy, row, row_len, packs, threadIdx.x, blockDim.x);
        const acc_t m = mean != nullptr ? mean[row] : acc_t(0), rs = rstd[row];
        acc_t g[PACKS][V];
        acc_t sg = 0, sgx = 0;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            const int p = threadIdx.x + k * blockDim.x;
            if (p >= packs) continue;
            acc_t w[V];
            load_row_params<V>(weight, p * V, acc_t(1), w);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                g[k][j] = w[j] * to_acc(dc[k].v[j]);
                sg += g[k][j];
                sgx += g[k][j] * ((to_acc(xc[k].v[j]) - m) * rs);
            }
        }
        if (dx != nullptr) block_sum2(sg, sgx, scratch);
        const acc_t mean_g = mean != nullptr ? sg / L : acc_t(0), mean_gx = sgx / L;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            const int p = threadIdx.x + k * blockDim.x;
            if (p >= packs) continue;
            row_bwd_pack<V, CAST>(xc[k], dc[k], g[k], m, rs, mean_g, mean_gx, dsum, dx, base, p,
                                  dw[k], db[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p >= packs) continue;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int64 i = blockIdx.x * static_cast<int64>(row_len) + p * V + j;
            if (dweight_part != nullptr) dweight_part[i] = dw[k][j];
            if (dbias_part != nullptr) dbias_part[i] = db[k][j];
        }
    }
}

// The backward kernels' parameters (short rows and CTA per row alike), and their names passed on
#define ROW_BWD_PARAMS                                                                         \
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy,                             \
        const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,                \
        const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,                       \
        scalar_t* __restrict__ dx, acc_t* __restrict__ dweight_part,                          \
        acc_t* __restrict__ dbias_part, int64 rows, int row_len
#define ROW_BWD_ARGS x, dy, dsum, weight, mean, rstd, dx, dweight_part, dbias_part, rows, row_len
// 3 CTAs per SM up to 2 packs a thread (80 registers, no spill); at 4, 3 would spill
#define ROW_BWD_ENTRY(NAME, PACKS, CAST)                                                       \
    extern "C" __global__ void __launch_bounds__(256, PACKS <= 2 ? 3 : 1) NAME(ROW_BWD_PARAMS) { \
        row_bwd<PACKS, CAST>(ROW_BWD_ARGS);                                                    \
    }

ROW_BWD_ENTRY(row_norm_bwd_1, 1, false)
ROW_BWD_ENTRY(row_norm_bwd_2, 2, false)
ROW_BWD_ENTRY(row_norm_bwd_4, 4, false)
ROW_BWD_ENTRY(row_norm_bwd_cast_1, 1, true)
ROW_BWD_ENTRY(row_norm_bwd_cast_2, 2, true)
ROW_BWD_ENTRY(row_norm_bwd_cast_4, 4, true)

// ---- forwards of rows held in registers: what the CTA per row and the short rows share ---------
// A thread holds packs first, first + step, ... (below `packs`) of its row, at most PACKS of them;
// the statistics are two passes over the registers relative to the row's first value (the
// formulas of segment_norm.cu's row section), the sums over the row by the caller's reduction.
template <int PACKS>
__device__ __forceinline__ void held_add_residual(Pack<VEC> (&v)[PACKS],
                                                  const Pack<VEC> (&r)[PACKS],
                                                  scalar_t* __restrict__ sum_row, int first,
                                                  int step, int packs) {
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = first + k * step;
        if (p >= packs) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            v[k].v[j] = from_acc<scalar_t>(to_acc(v[k].v[j]) + to_acc(r[k].v[j]));
        store_pack<VEC>(sum_row, p, v[k]);
    }
}

// This thread's part of sum (x - shift) (SQUARES false) or of sum ((x - shift) - rel_mean)^2.
template <int PACKS, bool SQUARES>
__device__ __forceinline__ acc_t held_sum(const Pack<VEC> (&v)[PACKS], int first, int step,
                                          int packs, acc_t shift, acc_t rel_mean = 0) {
    acc_t s = 0;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        if (first + k * step >= packs) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const acc_t d = SQUARES ? (to_acc(v[k].v[j]) - shift) - rel_mean
                                    : to_acc(v[k].v[j]) - shift;
            s += SQUARES ? d * d : d;
        }
    }
    return s;
}

// y of the held packs: xhat * weight + bias, or (CAST) round(weight * round(xhat)).
template <int PACKS, bool CAST>
__device__ __forceinline__ void held_write(const Pack<VEC> (&v)[PACKS], out_t* __restrict__ y_row,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias, acc_t mean,
                                           acc_t rstd, int first, int step, int packs) {
    constexpr int V = VEC;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = first + k * step;
        if (p >= packs) continue;
        acc_t w[V], b[V];
        load_row_params<V>(weight, p * V, acc_t(1), w);
        OutPack<V> out;
        if (CAST) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = to_acc(from_acc<scalar_t>((to_acc(v[k].v[j]) - mean) * rstd));
                out.v[j] = from_acc<out_t>(w[j] * xhat);
            }
        } else {
            load_row_params<V>(bias, p * V, acc_t(0), b);
#pragma unroll
            for (int j = 0; j < V; ++j)
                out.v[j] = from_acc<out_t>((to_acc(v[k].v[j]) - mean) * rstd * w[j] + b[j]);
        }
        store_pack<V>(y_row, p, out);
    }
}

// x's packs (and the residual's) loaded, every load issued before any is used.
template <int PACKS>
__device__ __forceinline__ void held_load(Pack<VEC> (&v)[PACKS], Pack<VEC> (&r)[PACKS],
                                          const scalar_t* __restrict__ x_row,
                                          const scalar_t* __restrict__ residual_row, int first,
                                          int step, int packs) {
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = first + k * step;
        if (p < packs) {
            v[k] = load_pack<VEC>(x_row, p);
            if (residual_row != nullptr) r[k] = load_pack<VEC>(residual_row, p);
        }
    }
}

// ---- longer rows: a CTA per row, held in registers ------------------------------------------
// Rows of 129 to 1024 packs: a CTA of T threads per row (the fewest that hold it at 4 packs each:
// 64 for 256 packs), thread t holding packs t, t + T, ... (at most PACKS) of x in registers, the
// sums over the CTA by block_sum. One row per CTA, no persistence: small CTAs, many of them on an
// SM, keep their loads in flight. Measured against one CTA per row staged through shared memory
// (segment_norm.cu, the forward of these rows before; a persistent ring there was slower still):
// LayerNorm / RMSNorm bf16 8192x4096 43.5 / 38.1 us against 53.8 / 43.8 (NOTES.md).
template <int PACKS, bool RMS, bool CAST>
__device__ __forceinline__ void row_fwd_cta(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
    scalar_t* __restrict__ sum_out, out_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out,
    int64 rows, int row_len, acc_t eps) {
    __shared__ acc_t scratch[33];
    const int64 row = blockIdx.x, base = row * row_len;
    const int packs = row_len / VEC, first = threadIdx.x, step = blockDim.x;
    Pack<VEC> v[PACKS], r[PACKS];
    held_load<PACKS>(v, r, x + base, residual != nullptr ? residual + base : nullptr, first, step,
                     packs);
    if (residual != nullptr) held_add_residual<PACKS>(v, r, sum_out + base, first, step, packs);
    const acc_t L = acc_t(row_len);
    acc_t shift = 0, rel_mean = 0;
    if (!RMS) {
        if (threadIdx.x == 0) scratch[32] = to_acc(v[0].v[0]);  // the row's first value
        __syncthreads();
        shift = scratch[32];
        rel_mean = block_sum(held_sum<PACKS, false>(v, first, step, packs, shift), scratch) / L;
    }
    const acc_t q =
        block_sum(held_sum<PACKS, true>(v, first, step, packs, shift, rel_mean), scratch);
    const acc_t mean = shift + rel_mean, rstd = rsqrt_acc(q / L + eps);
    if (threadIdx.x == 0) {
        if (mean_out != nullptr) mean_out[row] = mean;
        if (rstd_out != nullptr) rstd_out[row] = rstd;
    }
    held_write<PACKS, CAST>(v, y + base, weight, bias, mean, rstd, first, step, packs);
}

// The forward kernels' parameters (CTA per row and short rows alike), and their names passed on
#define ROW_FWD_PARAMS                                                                          \
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,                     \
        scalar_t* __restrict__ sum_out, out_t* __restrict__ y,                                 \
        const param_t* __restrict__ weight, const param_t* __restrict__ bias,                  \
        acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int64 rows, int row_len, acc_t eps
#define ROW_FWD_ARGS x, residual, sum_out, y, weight, bias, mean, rstd, rows, row_len, eps
#define ROW_FWD_CTA_ENTRY(NAME, PACKS, RMS, CAST)                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(ROW_FWD_PARAMS) {                    \
        row_fwd_cta<PACKS, RMS, CAST>(ROW_FWD_ARGS);                                            \
    }
#define ROW_FWD_CTA_ALL(PACKS)                                                                  \
    ROW_FWD_CTA_ENTRY(row_norm_fwd_cta_layer_##PACKS, PACKS, false, false)                      \
    ROW_FWD_CTA_ENTRY(row_norm_fwd_cta_rms_##PACKS, PACKS, true, false)                        \
    ROW_FWD_CTA_ENTRY(row_norm_fwd_cta_rms_cast_##PACKS, PACKS, true, true)
ROW_FWD_CTA_ALL(1)
ROW_FWD_CTA_ALL(2)
ROW_FWD_CTA_ALL(4)

// ---- short rows: a group of LANES lanes of a warp per row -------------------------------------
// Rows of at most SHORT_PACKS * LANES packs (LANES = 4, 8, 16, 32): a LayerNorm2d over 96 channels
// on channels_last data is 12 packs of bf16 per (sample, pixel). One CTA per row (segment_norm.cu)
// gives such rows a warp each and a CTA slot each (32 per SM): a few kilobytes in flight per SM,
// far below what hides HBM latency. Here a warp holds 32 / LANES rows in registers, lane l of a
// group holding packs l, l + LANES, ... of its row, and the row sums are xor-butterfly shuffles
// within the group (every lane gets the same bits: a + b == b + a).
#define SHORT_PACKS 4
#define SHORT_THREADS 256

// v summed over the LANES lanes of this lane's group, returned to all of them.
template <int LANES>
__device__ __forceinline__ acc_t group_sum(acc_t v) {
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Forward. One row per group, grid = ceil(rows / (SHORT_THREADS / LANES)), the row sums by
// group_sum. A group past the last row still takes part in the shuffles (holding no packs).
template <int LANES, bool RMS, bool CAST>
__device__ __forceinline__ void row_fwd_short(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
    scalar_t* __restrict__ sum_out, out_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out,
    int64 rows, int row_len, acc_t eps) {
    const int lane = threadIdx.x % LANES;
    const int64 row = blockIdx.x * static_cast<int64>(SHORT_THREADS / LANES) + threadIdx.x / LANES;
    const bool live = row < rows;
    const int packs = live ? row_len / VEC : 0;  // a dead group holds none
    const int64 base = live ? row * row_len : 0;
    Pack<VEC> v[SHORT_PACKS], r[SHORT_PACKS];
    held_load<SHORT_PACKS>(v, r, x + base, residual != nullptr ? residual + base : nullptr, lane,
                           LANES, packs);
    if (residual != nullptr)
        held_add_residual<SHORT_PACKS>(v, r, sum_out + base, lane, LANES, packs);
    const acc_t L = acc_t(row_len);
    acc_t shift = 0, rel_mean = 0;
    if (!RMS) {
        shift = __shfl_sync(0xffffffffu, live ? to_acc(v[0].v[0]) : acc_t(0), 0, LANES);
        rel_mean = group_sum<LANES>(held_sum<SHORT_PACKS, false>(v, lane, LANES, packs, shift)) / L;
    }
    const acc_t q =
        group_sum<LANES>(held_sum<SHORT_PACKS, true>(v, lane, LANES, packs, shift, rel_mean));
    if (!live) return;  // no shuffles below
    const acc_t mean = shift + rel_mean, rstd = rsqrt_acc(q / L + eps);
    if (lane == 0) {
        if (mean_out != nullptr) mean_out[row] = mean;
        if (rstd_out != nullptr) rstd_out[row] = rstd;
    }
    held_write<SHORT_PACKS, CAST>(v, y + base, weight, bias, mean, rstd, lane, LANES, packs);
}

// The arguments of segment_norm.cu's row forwards, less the team's. Four CTAs per SM (64
// registers): three, as the compiler chose, moved bf16 rows at 3.1-3.4 TB/s, four at 3.4-3.7.
#define ROW_FWD_SHORT_ENTRY(NAME, LANES, RMS, CAST)                                              \
    extern "C" __global__ void __launch_bounds__(SHORT_THREADS, 4) NAME(ROW_FWD_PARAMS) {       \
        row_fwd_short<LANES, RMS, CAST>(ROW_FWD_ARGS);                                          \
    }
#define ROW_FWD_SHORT_ALL(LANES)                                                                \
    ROW_FWD_SHORT_ENTRY(row_norm_fwd_short_layer_##LANES, LANES, false, false)                  \
    ROW_FWD_SHORT_ENTRY(row_norm_fwd_short_rms_##LANES, LANES, true, false)                    \
    ROW_FWD_SHORT_ENTRY(row_norm_fwd_short_rms_cast_##LANES, LANES, true, true)
ROW_FWD_SHORT_ALL(4)
ROW_FWD_SHORT_ALL(8)
ROW_FWD_SHORT_ALL(16)
ROW_FWD_SHORT_ALL(32)

// Backward, one pass (x and dy read once, dx written once; the segment passes read them twice):
// the groups of a CTA walk rows grid-stride, block by block (every thread of the CTA takes the
// same number of steps, so the shuffles see whole warps), each lane keeping its packs' dweight /
// dbias sums in registers. At the end the groups of a warp add theirs by xor shuffles, the warps
// theirs in warp order through shared memory, and the CTA writes one partial row for
// row_norm_bwd_params: fixed orders for a given grid, bitwise reproducible.
template <int LANES, bool CAST>
__device__ __forceinline__ void row_bwd_short(
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int row_len) {
    constexpr int V = VEC, GROUPS = SHORT_THREADS / LANES, MAX_LEN = SHORT_PACKS * LANES * V;
    // dy held in registers between the two passes over the row; a float dy beside half x is
    // read again instead (from L1: this thread just read it): held, it spilled 88 bytes a thread
    constexpr bool HOLD_DY = sizeof(out_t) == sizeof(scalar_t);
    __shared__ acc_t red[2][MAX_LEN];
    const int lane = threadIdx.x % LANES;
    const int packs = row_len / V;
    const acc_t L = acc_t(row_len);
    acc_t dw[SHORT_PACKS][V], db[SHORT_PACKS][V];
#pragma unroll
    for (int k = 0; k < SHORT_PACKS; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) dw[k][j] = db[k][j] = acc_t(0);
    const int64 step = static_cast<int64>(gridDim.x) * GROUPS;
    for (int64 first = blockIdx.x * static_cast<int64>(GROUPS); first < rows; first += step) {
        const int64 row = first + threadIdx.x / LANES;
        const bool live = row < rows;
        const int64 base = live ? row * row_len : 0;
        Pack<V> xc[SHORT_PACKS];
        OutPack<V> dc[SHORT_PACKS];
#pragma unroll
        for (int k = 0; k < SHORT_PACKS; ++k) {
            const int p = lane + k * LANES;
            if (live && p < packs) {
                xc[k] = load_pack<V>(x + base, p);
                if (HOLD_DY) dc[k] = load_pack<V>(dy + base, p);
            }
        }
        const acc_t m = live && mean != nullptr ? mean[row] : acc_t(0);
        const acc_t rs = live ? rstd[row] : acc_t(0);
        acc_t sg = 0, sgx = 0;
#pragma unroll
        for (int k = 0; k < SHORT_PACKS; ++k) {
            const int p = lane + k * LANES;
            if (!live || p >= packs) continue;
            acc_t w[V];
            load_row_params<V>(weight, p * V, acc_t(1), w);
            if (!HOLD_DY) dc[k] = load_pack<V>(dy + base, p);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t g = w[j] * to_acc(dc[k].v[j]);
                sg += g;
                sgx += g * ((to_acc(xc[k].v[j]) - m) * rs);
            }
        }
        sg = group_sum<LANES>(sg);
        sgx = group_sum<LANES>(sgx);
        if (!live) continue;
        const acc_t mean_g = mean != nullptr ? sg / L : acc_t(0), mean_gx = sgx / L;
#pragma unroll
        for (int k = 0; k < SHORT_PACKS; ++k) {
            const int p = lane + k * LANES;
            if (p >= packs) continue;
            acc_t g[V];  // recomputed: keeping it beside the dweight / dbias sums costs registers
            load_row_params<V>(weight, p * V, acc_t(1), g);
            if (!HOLD_DY) dc[k] = load_pack<V>(dy + base, p);
#pragma unroll
            for (int j = 0; j < V; ++j) g[j] *= to_acc(dc[k].v[j]);
            row_bwd_pack<V, CAST>(xc[k], dc[k], g, m, rs, mean_g, mean_gx, dsum, dx, base, p,
                                  dw[k], db[k]);
        }
    }
    if (dweight_part == nullptr && dbias_part == nullptr) return;
    // the groups of each warp: lanes l, l + LANES, ... hold the same columns
#pragma unroll
    for (int off = LANES; off < 32; off <<= 1)
#pragma unroll
        for (int k = 0; k < SHORT_PACKS; ++k)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                dw[k][j] += __shfl_xor_sync(0xffffffffu, dw[k][j], off);
                db[k][j] += __shfl_xor_sync(0xffffffffu, db[k][j], off);
            }
    // the warps, in order: group 0 of warp w adds its sums to the shared row
    const int warp = threadIdx.x >> 5;
    for (int w = 0; w < SHORT_THREADS / 32; ++w) {
        if (warp == w && (threadIdx.x & 31) < LANES) {
#pragma unroll
            for (int k = 0; k < SHORT_PACKS; ++k) {
                const int p = lane + k * LANES;
                if (p >= packs) continue;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const int i = p * V + j;
                    red[0][i] = (w == 0 ? acc_t(0) : red[0][i]) + dw[k][j];
                    red[1][i] = (w == 0 ? acc_t(0) : red[1][i]) + db[k][j];
                }
            }
        }
        __syncthreads();
    }
    const int64 out = blockIdx.x * static_cast<int64>(row_len);
    for (int i = threadIdx.x; i < row_len; i += SHORT_THREADS) {
        if (dweight_part != nullptr) dweight_part[out + i] = red[0][i];
        if (dbias_part != nullptr) dbias_part[out + i] = red[1][i];
    }
}

// Two CTAs per SM (128 registers, a 16-24 byte spill for bf16): one, as the compiler chose (151
// registers), left too few loads in flight (rows of 96 bf16, forward + backward 0.510 -> 0.419 ms).
#define ROW_BWD_SHORT_ENTRY(NAME, LANES, CAST)                                                 \
    extern "C" __global__ void __launch_bounds__(SHORT_THREADS, 2) NAME(ROW_BWD_PARAMS) {      \
        row_bwd_short<LANES, CAST>(ROW_BWD_ARGS);                                              \
    }
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_4, 4, false)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_8, 8, false)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_16, 16, false)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_32, 32, false)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_cast_4, 4, true)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_cast_8, 8, true)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_cast_16, 16, true)
ROW_BWD_SHORT_ENTRY(row_norm_bwd_short_cast_32, 32, true)

// ---- the weight gradients from partial rows ---------------------------------------------------
__device__ __forceinline__ void store_grad(void* out, int64 i, acc_t v, int as_param) {
    if (as_param)
        static_cast<param_t*>(out)[i] = from_acc<param_t>(v);
    else
        static_cast<acc_t*>(out)[i] = v;
}

// dweight[i] / dbias[i] = sum over groups g of the partial rows' [g, i], written as param_t
// (as_param) or acc_t (no weight: the accumulator's type); null parts are skipped. Block (32, 8):
// 32 columns per CTA, thread (tx, ty) sums groups ty, ty + 8, ... in order, then the 8 sums are
// added in ty order (so every column has many threads: a thread per column walking all groups
// left the GPU nearly idle for 4096 columns, 33 us).
#define PARAMS_ROWS 8
extern "C" __global__ void row_norm_bwd_params(const acc_t* __restrict__ dweight_part,
                                               const acc_t* __restrict__ dbias_part,
                                               void* dweight, void* dbias, int64 groups,
                                               int64 row_len, int as_param) {
    __shared__ acc_t red[2][PARAMS_ROWS][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64 i = blockIdx.x * 32 + static_cast<int64>(tx);
    acc_t sw = 0, sb = 0;
    if (i < row_len) {
        for (int64 g = ty; g < groups; g += PARAMS_ROWS) {
            if (dweight_part != nullptr) sw += dweight_part[g * row_len + i];
            if (dbias_part != nullptr) sb += dbias_part[g * row_len + i];
        }
    }
    red[0][ty][tx] = sw;
    red[1][ty][tx] = sb;
    __syncthreads();
    if (ty != 0 || i >= row_len) return;
    sw = sb = 0;
#pragma unroll
    for (int r = 0; r < PARAMS_ROWS; ++r) {
        sw += red[0][r][tx];
        sb += red[1][r][tx];
    }
    if (dweight_part != nullptr) store_grad(dweight, i, sw, as_param);
    if (dbias_part != nullptr) store_grad(dbias, i, sb, as_param);
}

// ---- autocast's copies, for rows the short-row kernels do not take ---------------------------
// A call whose y (and dy) are out_t beside x in scalar_t (autocast: float beside half) runs the
// short-row kernels above in one pass; other rows run the float path on a float copy of x
// (row_norm_to_out), the backward's dx coming back through row_norm_from_out. Grid-stride.
extern "C" __global__ void row_norm_to_out(const scalar_t* __restrict__ src,
                                           out_t* __restrict__ dst, int64 n) {
    const int64 step = static_cast<int64>(gridDim.x) * blockDim.x;
    for (int64 i = blockIdx.x * static_cast<int64>(blockDim.x) + threadIdx.x; i < n; i += step)
        dst[i] = from_acc<out_t>(to_acc(src[i]));
}

extern "C" __global__ void row_norm_from_out(const out_t* __restrict__ src,
                                             scalar_t* __restrict__ dst, int64 n) {
    const int64 step = static_cast<int64>(gridDim.x) * blockDim.x;
    for (int64 i = blockIdx.x * static_cast<int64>(blockDim.x) + threadIdx.x; i < n; i += step)
        dst[i] = from_acc<scalar_t>(to_acc(src[i]));
}
