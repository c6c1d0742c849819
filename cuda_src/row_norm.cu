// row_norm.cu: the backward of LayerNorm / RMSNorm over rows held in registers (rows of 32 to 1024
// packs of 16 bytes: 256 to 8192 bf16 values) in one pass, and the column sums of the weight
// gradients' partial rows shared by every row and channel norm backward. (The forward stays on
// segment_norm.cu: two register-held forwards measured slower than its shared-memory one, below.)
//
// A row of L = row_len elements shares one (mean, rstd); weight and bias are indexed by the
// position i in the row (formulas in segment_norm.cu's row-norm section, which keeps the rows
// this file does not take: short, unaligned, or longer than a CTA's registers):
//   forward:  xhat_i = (x_i - mean) * rstd,  y_i = xhat_i * weight[i] + bias[i]
//             (RMS: mean = 0, rstd = 1 / sqrt(<x^2> + eps); CAST: y = round(w * round(xhat)))
//   backward: g_i = weight[i] * dy_i,  dx_i = rstd * (g_i - <g> - xhat_i * <g xhat>) (RMS: no <g>)
//             dweight[i] = sum over rows of dy_i * xhat_i (CAST: of round(xhat_i)),
//             dbias[i] = sum over rows of dy_i
//
// Forward, tried here and measured slower than segment_norm.cu's CTA per row staged through
// shared memory (LayerNorm / RMSNorm bf16 8192x4096 on an H200: 52 / 42 us, floor 32): a CTA of
// 256 threads per row with the next row's loads in flight (63.5 / 48.5 us: three block barriers
// per row, three CTAs per SM) and a warp per row with 16 packs per lane (75 / 54 us: 255
// registers, eight warps per SM). Registers hold less data in flight than shared memory's cp.async
// staging (NOTES.md).
//
// Backward: a CTA of T <= 256 threads per row, thread t holding packs t, t + T, ... of x and dy
// (its weight-gradient sums must stay few per thread), the two row sums one block reduction, the
// next row's loads in flight during it. Each thread keeps its dweight / dbias sums over the CTA's
// rows in registers; every CTA writes one fp32 partial row, and row_norm_bwd_params adds the
// partial rows in CTA order. (The separate sums and dx passes of segment_norm.cu took 118-150 us
// for 5 passes of bf16 8192x4096, floor 80.) Deterministic: no atomics, fixed orders for a given
// grid.
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

// Packs first, first + step, ... (at most PACKS, those < packs) of row `row`.
template <int PACKS>
__device__ __forceinline__ void load_row(Pack<VEC> (&v)[PACKS], const scalar_t* __restrict__ src,
                                         int64 row, int row_len, int packs, int first, int step) {
    const scalar_t* base = src + row * row_len;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        const int p = first + k * step;
        if (p < packs) v[k] = load_pack<VEC>(base, p);
    }
}

// ---- backward ----------------------------------------------------------------------------------
// x: the normalized rows (the sum s with a residual); mean null: RMSNorm; dsum: the incoming
// gradient of s, added to dx, or null. dx null: weight gradients only. dweight_part /
// dbias_part: gridDim.x partial rows of row_len, or null.
template <int PACKS, bool CAST>
__device__ __forceinline__ void row_bwd(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int row_len) {
    constexpr int V = VEC;
    __shared__ acc_t scratch[66];
    const int packs = row_len / V;
    const acc_t L = acc_t(row_len);
    Pack<V> xc[PACKS], dc[PACKS];
    acc_t dw[PACKS][V], db[PACKS][V];
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) dw[k][j] = db[k][j] = acc_t(0);
    int64 row = blockIdx.x;
    load_row<PACKS>(xc, x, row, row_len, packs, threadIdx.x, blockDim.x);
    load_row<PACKS>(dc, dy, row, row_len, packs, threadIdx.x, blockDim.x);
    for (; row < rows; row += gridDim.x) {
        const int64 next = row + gridDim.x, base = row * row_len;
        Pack<V> xn[PACKS], dn[PACKS];
        if (next < rows) {  // in flight during this row's reduction
            load_row<PACKS>(xn, x, next, row_len, packs, threadIdx.x, blockDim.x);
            load_row<PACKS>(dn, dy, next, row_len, packs, threadIdx.x, blockDim.x);
        }
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
            Pack<V> sv, out;
            if (dsum != nullptr) sv = load_pack<V>(dsum + base, p);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = (to_acc(xc[k].v[j]) - m) * rs, d = to_acc(dc[k].v[j]);
                dw[k][j] += d * (CAST ? to_acc(from_acc<scalar_t>(xhat)) : xhat);
                db[k][j] += d;
                acc_t v = rs * (g[k][j] - mean_g - xhat * mean_gx);
                if (dsum != nullptr) v += to_acc(sv.v[j]);
                out.v[j] = from_acc<scalar_t>(v);
            }
            if (dx != nullptr) store_pack<V>(dx + base, p, out);
        }
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            xc[k] = xn[k];
            dc[k] = dn[k];
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

#define ROW_BWD_ENTRY(NAME, PACKS, CAST)                                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                   \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,                      \
        const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,                \
        const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,                       \
        scalar_t* __restrict__ dx, acc_t* __restrict__ dweight_part,                          \
        acc_t* __restrict__ dbias_part, int64 rows, int row_len) {                            \
        row_bwd<PACKS, CAST>(x, dy, dsum, weight, mean, rstd, dx, dweight_part, dbias_part,   \
                             rows, row_len);                                                  \
    }

ROW_BWD_ENTRY(row_norm_bwd_1, 1, false)
ROW_BWD_ENTRY(row_norm_bwd_2, 2, false)
ROW_BWD_ENTRY(row_norm_bwd_4, 4, false)
ROW_BWD_ENTRY(row_norm_bwd_cast_1, 1, true)
ROW_BWD_ENTRY(row_norm_bwd_cast_2, 2, true)
ROW_BWD_ENTRY(row_norm_bwd_cast_4, 4, true)

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
