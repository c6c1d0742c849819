// strided_norm.cu: normalization whose statistic sets are too large for chip memory or are strided
// (BatchNorm, every norm on channel-innermost data). Three passes: partial statistics, a
// deterministic merge, and the elementwise apply (two reads + one write of x).
//
//   partials:  (count, mean, M2) of pieces of each statistic set k, each piece reduced exactly
//              (two-pass over values held in registers, Chan-merged; never E[x^2] - E[x]^2)
//   finalize:  mean[k], rstd[k] = 1 / sqrt(M2 / count + eps) (biased variance), optional var[k]
//   apply:     y = (x - mean[k]) * (rstd[k] * weight[c]) + bias[c]
//
// Statistic sets k:
//   per-sample (groups > 0, GroupNorm/InstanceNorm): k = n * groups + c / chans_per_group
//   per-channel (groups == 0, BatchNorm):            k = c
//
// Two layouts of x (N, C, S) (S = flattened spatial size), both with 64-bit offsets:
//   rows:    each (n, c) plane is S contiguous elements at n*sample_stride + c*chan_stride (NCHW);
//   columns: channels innermost, element (n, r, c) at n*sample_stride + r*row_stride + c (NHWC).
// V is the vector width: VEC (16-byte accesses) when the host has checked alignment, else 1.
#include "common.cuh"

#define UNROLL 4

// ------------------------------------------------------------------------------------------------
// partial statistics, rows layout. Set k = n_runs runs of run_len contiguous elements; run r starts
// at k * set_stride + r * run_stride:
//   GroupNorm NCHW: n_runs = 1, run_len = Cg * S, set_stride = Cg * S
//   BatchNorm NCHW: n_runs = N, run_len = S,      set_stride = S, run_stride = C * S
// Grid (1-D): K * ctas_per_set CTAs; CTA j of set k reduces the set's flattened elements
// [j * chunk, (j + 1) * chunk) (chunk a multiple of V) into partials[k * ctas_per_set + j].
template <int V>
__device__ __forceinline__ void stats_rows(const scalar_t* __restrict__ x, acc_t* __restrict__ partials,
                                           int64 n_runs, int64 run_len, int64 run_stride,
                                           int64 set_stride, int64 chunk, int64 ctas_per_set) {
    __shared__ Stats scratch[32];
    const int64 k = blockIdx.x / ctas_per_set, j = blockIdx.x % ctas_per_set;
    const int64 f0 = j * chunk, f1 = min(f0 + chunk, n_runs * run_len);
    const int64 step = blockDim.x;
    Stats st = stats_empty();
    for (int64 r = f0 / run_len; r < n_runs && r * run_len < f1; ++r) {
        const int64 lo = max(f0 - r * run_len, int64(0)), hi = min(f1 - r * run_len, run_len);
        const scalar_t* __restrict__ run = x + k * set_stride + r * run_stride;
        int64 q = lo / V + threadIdx.x;
        const int64 q_end = hi / V;
        for (; q + (UNROLL - 1) * step < q_end; q += UNROLL * step) {
            Pack<V> p[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) p[u] = load_pack<V>(run, q + u * step);
            acc_t v[UNROLL * V];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int e = 0; e < V; ++e) v[u * V + e] = to_acc(p[u].v[e]);
            st = stats_merge(st, stats_of<UNROLL * V>(v));
        }
        for (; q < q_end; q += step) st = stats_merge(st, stats_of_pack<V>(load_pack<V>(run, q)));
    }
    st = block_stats(st, scratch);
    if (threadIdx.x == 0) {
        partials[3 * blockIdx.x + 0] = st.n;
        partials[3 * blockIdx.x + 1] = st.mean;
        partials[3 * blockIdx.x + 2] = st.m2;
    }
}

extern "C" __global__ void strided_norm_stats_rows(const scalar_t* __restrict__ x,
                                                   acc_t* __restrict__ partials, int64 n_runs,
                                                   int64 run_len, int64 run_stride, int64 set_stride,
                                                   int64 chunk, int64 ctas_per_set, int vectorized) {
    if (vectorized)
        stats_rows<VEC>(x, partials, n_runs, run_len, run_stride, set_stride, chunk, ctas_per_set);
    else
        stats_rows<1>(x, partials, n_runs, run_len, run_stride, set_stride, chunk, ctas_per_set);
}

// ------------------------------------------------------------------------------------------------
// partial statistics, columns layout. Block (TX, TY): thread x owns channels [cp*V, cp*V + V) of a
// channel tile, thread y strides over the CTA's rows; the TY triples of a channel are then merged in
// order through shared memory. Grid (1-D): N * ctas_per_n CTAs, CTA (n, chunk) covers rows
// [chunk * rows_per_cta, ...) of sample n. It writes one triple per (n, chunk, c):
//   per-sample:  k = n*G + c/Cg, slot = chunk*Cg + c%Cg,   sets of P = ctas_per_n * Cg triples
//   per-channel: k = c,          slot = n*ctas_per_n + chunk, sets of P = N * ctas_per_n triples
// Dynamic shared memory: TX * TY * V * sizeof(Stats).
template <int V>
__device__ __forceinline__ void stats_cols(const scalar_t* __restrict__ x, acc_t* __restrict__ partials,
                                           int64 N, int64 R, int64 C, int64 row_stride,
                                           int64 sample_stride, int64 rows_per_cta, int64 ctas_per_n,
                                           int groups, int64 chans_per_group) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Stats* partial_rows = reinterpret_cast<Stats*>(smem_raw);
    const int64 n = blockIdx.x / ctas_per_n, chunk = blockIdx.x % ctas_per_n;
    const int64 r0 = chunk * rows_per_cta, r1 = min(r0 + rows_per_cta, R);
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const scalar_t* __restrict__ xn = x + n * sample_stride;
    const int64 n_packs = C / V;
    for (int64 tile = 0; tile < n_packs; tile += TX) {
        const int64 cp = tile + tx;
        Stats st[V];
#pragma unroll
        for (int e = 0; e < V; ++e) st[e] = stats_empty();
        if (cp < n_packs) {
            int64 r = r0 + ty;
            for (; r + (UNROLL - 1) * TY < r1; r += UNROLL * TY) {
                Pack<V> p[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) p[u] = load_pack<V>(xn + (r + u * TY) * row_stride, cp);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    acc_t v[UNROLL];
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) v[u] = to_acc(p[u].v[e]);
                    st[e] = stats_merge(st[e], stats_of<UNROLL>(v));
                }
            }
            for (; r < r1; r += TY) {
                const Pack<V> p = load_pack<V>(xn + r * row_stride, cp);
#pragma unroll
                for (int e = 0; e < V; ++e) st[e] = stats_merge(st[e], Stats{acc_t(1), to_acc(p.v[e]), acc_t(0)});
            }
        }
        __syncthreads();  // the previous tile's readers are done with partial_rows
#pragma unroll
        for (int e = 0; e < V; ++e) partial_rows[(ty * TX + tx) * V + e] = st[e];
        __syncthreads();
        if (ty == 0 && cp < n_packs) {
            for (int e = 0; e < V; ++e) {
                Stats acc = partial_rows[tx * V + e];
                for (int t = 1; t < TY; ++t) acc = stats_merge(acc, partial_rows[(t * TX + tx) * V + e]);
                const int64 c = cp * V + e;
                int64 slot;
                if (groups > 0) {
                    const int64 k = n * groups + c / chans_per_group;
                    slot = k * (ctas_per_n * chans_per_group) + chunk * chans_per_group + c % chans_per_group;
                } else {
                    slot = c * (N * ctas_per_n) + n * ctas_per_n + chunk;
                }
                partials[3 * slot + 0] = acc.n;
                partials[3 * slot + 1] = acc.mean;
                partials[3 * slot + 2] = acc.m2;
            }
        }
    }
}

extern "C" __global__ void strided_norm_stats_cols(const scalar_t* __restrict__ x,
                                                   acc_t* __restrict__ partials, int64 N, int64 R,
                                                   int64 C, int64 row_stride, int64 sample_stride,
                                                   int64 rows_per_cta, int64 ctas_per_n, int groups,
                                                   int64 chans_per_group, int vectorized) {
    if (vectorized)
        stats_cols<VEC>(x, partials, N, R, C, row_stride, sample_stride, rows_per_cta, ctas_per_n,
                        groups, chans_per_group);
    else
        stats_cols<1>(x, partials, N, R, C, row_stride, sample_stride, rows_per_cta, ctas_per_n,
                      groups, chans_per_group);
}

// ------------------------------------------------------------------------------------------------
// finalize: one warp per statistic set k merges its P triples (lane l takes l, l+32, ... in order,
// then a fixed shuffle tree). count is the exact element count of a set.
extern "C" __global__ void strided_norm_finalize(const acc_t* __restrict__ partials, int64 K, int64 P,
                                                 double count, acc_t eps, acc_t* __restrict__ mean,
                                                 acc_t* __restrict__ rstd, acc_t* __restrict__ var) {
    const int64 k = (static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (k >= K) return;  // whole warps leave together
    Stats st = stats_empty();
    for (int64 p = lane; p < P; p += 32) {
        const acc_t* t = partials + 3 * (k * P + p);
        st = stats_merge(st, Stats{t[0], t[1], t[2]});
    }
    st = warp_stats(st);
    if (lane == 0) {
        const acc_t v = st.m2 / static_cast<acc_t>(count);
        mean[k] = st.mean;
        rstd[k] = rsqrt_acc(v + eps);
        if (var != nullptr) var[k] = v;
    }
}

// ------------------------------------------------------------------------------------------------
// apply: y = (x - mean[k]) * a + b, a = rstd[k] * weight[c], b = bias[c].
struct Affine {
    acc_t mean, a, b;
};

__device__ __forceinline__ Affine affine_of(int64 n, int64 c, const param_t* __restrict__ weight,
                                            const param_t* __restrict__ bias,
                                            const acc_t* __restrict__ mean,
                                            const acc_t* __restrict__ rstd, int groups,
                                            int64 chans_per_group) {
    const int64 k = groups > 0 ? n * groups + c / chans_per_group : c;
    Affine f;
    f.mean = mean[k];
    f.a = weight != nullptr ? rstd[k] * to_acc(weight[c]) : rstd[k];
    f.b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
    return f;
}

// rows layout. Grid (1-D): N * C * tiles_per_plane CTAs, each normalizing tile_len (a multiple of
// V) elements of one plane.
template <int V>
__device__ __forceinline__ void apply_rows(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias,
                                           const acc_t* __restrict__ mean,
                                           const acc_t* __restrict__ rstd, int64 C, int64 S,
                                           int64 sample_stride, int64 chan_stride, int groups,
                                           int64 chans_per_group, int64 tiles_per_plane,
                                           int64 tile_len) {
    const int64 plane = blockIdx.x / tiles_per_plane, tile = blockIdx.x % tiles_per_plane;
    const int64 n = plane / C, c = plane % C;
    const Affine f = affine_of(n, c, weight, bias, mean, rstd, groups, chans_per_group);
    const int64 offset = n * sample_stride + c * chan_stride;
    const scalar_t* __restrict__ xp = x + offset;
    scalar_t* __restrict__ yp = y + offset;
    const int64 q_end = min(tile_len * (tile + 1), S) / V;
    const int64 step = blockDim.x;
    int64 q = tile * tile_len / V + threadIdx.x;
    for (; q + (UNROLL - 1) * step < q_end; q += UNROLL * step) {
        Pack<V> p[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) p[u] = load_pack<V>(xp, q + u * step);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int e = 0; e < V; ++e) p[u].v[e] = from_acc<scalar_t>((to_acc(p[u].v[e]) - f.mean) * f.a + f.b);
            store_pack<V>(yp, q + u * step, p[u]);
        }
    }
    for (; q < q_end; q += step) {
        Pack<V> p = load_pack<V>(xp, q);
#pragma unroll
        for (int e = 0; e < V; ++e) p.v[e] = from_acc<scalar_t>((to_acc(p.v[e]) - f.mean) * f.a + f.b);
        store_pack<V>(yp, q, p);
    }
}

extern "C" __global__ void strided_norm_apply_rows(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
    int64 C, int64 S, int64 sample_stride, int64 chan_stride, int groups, int64 chans_per_group,
    int64 tiles_per_plane, int64 tile_len, int vectorized) {
    if (vectorized)
        apply_rows<VEC>(x, y, weight, bias, mean, rstd, C, S, sample_stride, chan_stride, groups,
                        chans_per_group, tiles_per_plane, tile_len);
    else
        apply_rows<1>(x, y, weight, bias, mean, rstd, C, S, sample_stride, chan_stride, groups,
                      chans_per_group, tiles_per_plane, tile_len);
}

// columns layout. Block (TX, TY) as in stats_cols; grid (1-D): N * ctas_per_n CTAs.
template <int V>
__device__ __forceinline__ void apply_cols(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias,
                                           const acc_t* __restrict__ mean,
                                           const acc_t* __restrict__ rstd, int64 R, int64 C,
                                           int64 row_stride, int64 sample_stride, int groups,
                                           int64 chans_per_group, int64 rows_per_cta,
                                           int64 ctas_per_n) {
    const int64 n = blockIdx.x / ctas_per_n, chunk = blockIdx.x % ctas_per_n;
    const int64 r0 = chunk * rows_per_cta, r1 = min(r0 + rows_per_cta, R);
    const int TX = blockDim.x, TY = blockDim.y;
    const int64 n_packs = C / V;
    for (int64 cp = threadIdx.x; cp < n_packs; cp += TX) {
        Affine f[V];
#pragma unroll
        for (int e = 0; e < V; ++e)
            f[e] = affine_of(n, cp * V + e, weight, bias, mean, rstd, groups, chans_per_group);
        int64 r = r0 + threadIdx.y;
        for (; r + (UNROLL - 1) * TY < r1; r += UNROLL * TY) {
            Pack<V> p[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                p[u] = load_pack<V>(x + n * sample_stride + (r + u * TY) * row_stride, cp);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
                for (int e = 0; e < V; ++e)
                    p[u].v[e] = from_acc<scalar_t>((to_acc(p[u].v[e]) - f[e].mean) * f[e].a + f[e].b);
                store_pack<V>(y + n * sample_stride + (r + u * TY) * row_stride, cp, p[u]);
            }
        }
        for (; r < r1; r += TY) {
            Pack<V> p = load_pack<V>(x + n * sample_stride + r * row_stride, cp);
#pragma unroll
            for (int e = 0; e < V; ++e)
                p.v[e] = from_acc<scalar_t>((to_acc(p.v[e]) - f[e].mean) * f[e].a + f[e].b);
            store_pack<V>(y + n * sample_stride + r * row_stride, cp, p);
        }
    }
}

extern "C" __global__ void strided_norm_apply_cols(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
    int64 R, int64 C, int64 row_stride, int64 sample_stride, int groups, int64 chans_per_group,
    int64 rows_per_cta, int64 ctas_per_n, int vectorized) {
    if (vectorized)
        apply_cols<VEC>(x, y, weight, bias, mean, rstd, R, C, row_stride, sample_stride, groups,
                        chans_per_group, rows_per_cta, ctas_per_n);
    else
        apply_cols<1>(x, y, weight, bias, mean, rstd, R, C, row_stride, sample_stride, groups,
                      chans_per_group, rows_per_cta, ctas_per_n);
}
