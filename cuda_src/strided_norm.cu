// strided_norm.cu: normalization whose statistic sets are too large for chip memory or are strided
// (Long: one family's five passes in two layouts, with the fused epilogue's template hooks.)
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
//
// Per-sample statistics may normalize s = x + addend[n, c] instead of x (GroupNorm after a
// diffusion block's time embedding): addend is (N, C) contiguous or null, and the sum is formed in
// acc_t, never stored. The passes fold it into what they subtract from x -- the statistics'
// shift K (x - (K - a) == (x + a) - K, so the partial means stay relative to K) and the apply's
// mean (x - (mean - a)) -- so it costs nothing per element.
//
// With STRIDED_NORM_DEVICE_ONLY defined, only the device functions are compiled (the single-launch
// family, single_launch_norm.cu, includes this file for them).
#include "common.cuh"

// Loads of the statistics, the dx coefficients and the partials: the single-launch family
// (single_launch_norm.cu, which defines STRIDED_NORM_COHERENT_LOADS) reads them in the kernel that
// wrote them, after a grid barrier, where the read-only path (ld.global.nc, which the compiler may
// pick for a `const __restrict__` parameter) is not allowed; there they are explicit ordinary
// loads (__ldca: ld.global.ca, which the barrier's fences order). Elsewhere they are plain
// dereferences. (Through L2 instead, __ldcg, every thread's coefficient loads made resnet50's
// norm layers 1.6x slower in the split passes and the single launch slower than them:
// benchmarks/NOTES.md.)
#ifdef STRIDED_NORM_COHERENT_LOADS
#define LOAD_WRITTEN(p) __ldca(p)
#else
#define LOAD_WRITTEN(p) (*(p))
#endif

#define UNROLL 4
// Rows per channel a columns-statistics thread reduces exactly before one merge; its block is at
// most COLS_THREADS_MAX threads (_plan.COLS_THREADS).
#define COLS_STATS_ROWS 8
#define COLS_THREADS_MAX 256
// Partial triples a finalize lane loads before merging them.
#define FINALIZE_BATCH 4
// Rows per thread in flight in the columns apply/dx passes (BatchNorm fp16 channels_last
// 256x64x112x112 apply on an H200, 128 threads: 2 / 4 / 8 / 16 rows 228 / 218 / 206 / 207 us; a copy
// of the tensor 198 us)
#define COLS_APPLY_UNROLL 8

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
                                           int64 set_stride, int64 chunk, int64 ctas_per_set,
                                           const scalar_t* __restrict__ addend) {
    __shared__ Stats scratch[32];
    const int64 k = blockIdx.x / ctas_per_set, j = blockIdx.x % ctas_per_set;
    // statistics relative to the set's first value K (the finalize adds it back): small means
    // with all their digits on offset data; every CTA of the set uses the same K
    const acc_t first = to_acc(x[k * set_stride]);
    const int64 f0 = j * chunk, f1 = min(f0 + chunk, n_runs * run_len);
    const int64 step = blockDim.x;
    Stats st = stats_empty();
    for (int64 r = f0 / run_len; r < n_runs && r * run_len < f1; ++r) {
        const int64 lo = max(f0 - r * run_len, int64(0)), hi = min(f1 - r * run_len, run_len);
        const scalar_t* __restrict__ run = x + k * set_stride + r * run_stride;
        // with an addend, run r of set k is one channel (the host passes runs of one plane each)
        const acc_t shift = addend != nullptr ? first - to_acc(addend[k * n_runs + r]) : first;
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
                for (int e = 0; e < V; ++e) v[u * V + e] = to_acc(p[u].v[e]) - shift;
            stats_push<UNROLL * V>(st, v);
        }
        for (; q < q_end; q += step) {
            const Pack<V> p = load_pack<V>(run, q);
            acc_t v[V];
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = to_acc(p.v[e]) - shift;
            stats_push<V>(st, v);
        }
    }
    st = block_stats(st, scratch);
    if (threadIdx.x == 0) {
        partials[3 * blockIdx.x + 0] = st.n;
        partials[3 * blockIdx.x + 1] = st.mean;
        partials[3 * blockIdx.x + 2] = st.m2;
    }
}

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_stats_rows(const scalar_t* __restrict__ x,
                                                   acc_t* __restrict__ partials, int64 n_runs,
                                                   int64 run_len, int64 run_stride, int64 set_stride,
                                                   int64 chunk, int64 ctas_per_set, int vectorized,
                                                   const scalar_t* __restrict__ addend) {
    if (vectorized)
        stats_rows<VEC>(x, partials, n_runs, run_len, run_stride, set_stride, chunk, ctas_per_set,
                        addend);
    else
        stats_rows<1>(x, partials, n_runs, run_len, run_stride, set_stride, chunk, ctas_per_set,
                      addend);
}
#endif

// ------------------------------------------------------------------------------------------------
// Columns passes deal each sample's rows to its CTAs in blocks, interleaved: CTA j of ctas_per_n
// takes blocks j, j + ctas_per_n, ... (any grid size; only the sample's last block may be partial).
// The grid's y dimension deals the channel tiles the same way: CTA (j, t) takes the tiles t,
// t + gridDim.y, ... of blockDim.x packs each, so few rows of many channels still fill the GPU
// (gridDim.y == 1: every CTA walks all the channels). The partials do not depend on gridDim.y.

// partial statistics, columns layout. Block (TX, TY): thread x owns channels [cp*V, cp*V + V) of a
// channel tile, thread y the rows ty, ty + TY, ... of each block of COLS_STATS_ROWS * TY rows; the
// TY triples of a channel are then merged as a tree through shared memory. Grid:
// (N * ctas_per_n, channel tiles). It writes one triple per (n, chunk, c):
//   per-sample:  k = n*G + c/Cg, slot = chunk*Cg + c%Cg,   sets of P = ctas_per_n * Cg triples
//   per-channel: k = c,          slot = n*ctas_per_n + chunk, sets of P = N * ctas_per_n triples
// 16-byte packs are double-buffered through shared memory (cp.async): the next block's loads are in
// flight while this one is reduced (a deeper ring measured the same: benchmarks/NOTES.md).
// Dynamic shared memory: the larger of TX * TY * V * sizeof(Stats) (the block's triples) and
// (V == VEC only) 2 * COLS_STATS_ROWS * TX * TY packs (the ring), which share it.
template <int V>
__device__ __forceinline__ void stats_cols_push(Stats (&st)[V], const acc_t (&shift)[V],
                                                const Pack<V> (&p)[COLS_STATS_ROWS]) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
        acc_t v[COLS_STATS_ROWS];
#pragma unroll
        for (int u = 0; u < COLS_STATS_ROWS; ++u) v[u] = to_acc(p[u].v[e]) - shift[e];
        stats_push<COLS_STATS_ROWS>(st[e], v);
    }
}

template <int V>
__device__ __forceinline__ void stats_cols(const scalar_t* __restrict__ x, acc_t* __restrict__ partials,
                                           int64 N, int64 R, int64 C, int64 row_stride,
                                           int64 sample_stride, int64 ctas_per_n, int groups,
                                           int64 chans_per_group,
                                           const scalar_t* __restrict__ addend) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const int tid = ty * TX + tx, threads = TX * TY;
    Stats* partial_rows = reinterpret_cast<Stats*>(smem_raw);
    // stage s, row u of thread tid: staged[(s * COLS_STATS_ROWS + u) * threads + tid]
    Pack<V>* staged = reinterpret_cast<Pack<V>*>(smem_raw);
    constexpr bool pipelined = sizeof(Pack<V>) == 16;
    const int64 n = blockIdx.x / ctas_per_n, chunk = blockIdx.x % ctas_per_n;
    const int64 block_rows = COLS_STATS_ROWS * TY, full_blocks = R / block_rows;
    const scalar_t* __restrict__ xn = x + n * sample_stride;
    const int64 n_packs = C / V;
    // channel tiles of TX packs: this CTA takes tiles blockIdx.y, blockIdx.y + gridDim.y, ...
    const int64 first_tile = static_cast<int64>(blockIdx.y) * TX;
    for (int64 tile = first_tile; tile < n_packs; tile += static_cast<int64>(TX) * gridDim.y) {
        const int64 cp = tile + tx;
        if (tile > first_tile) __syncthreads();  // the previous tile's triples were read from the ring's memory
        // Per channel: exact statistics of COLS_STATS_ROWS rows at a time, Chan-merged into a running
        // triple. (Shifted sums s2 - s1^2 / n were no faster here and lost up to 5e-5 of the
        // variance on data of mean 1e4: benchmarks/NOTES.md.)
        Stats st[V];
        acc_t shift[V];  // each channel's set's first value K (see stats_rows)
#pragma unroll
        for (int e = 0; e < V; ++e) {
            st[e] = stats_empty();
            shift[e] = acc_t(0);
        }
        if (cp < n_packs) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const int64 c = cp * V + e;
                shift[e] = groups > 0 ? to_acc(xn[c - c % chans_per_group]) : to_acc(x[c]);
                if (addend != nullptr) shift[e] -= to_acc(addend[n * C + c]);  // per sample only
            }
            if constexpr (pipelined) {
                auto issue = [&](int64 b, int stage) {
#pragma unroll
                    for (int u = 0; u < COLS_STATS_ROWS; ++u)
                        cp_async16(staged + (stage * COLS_STATS_ROWS + u) * threads + tid,
                                   xn + (b * block_rows + ty + u * TY) * row_stride + cp * V);
                    cp_async_commit();
                };
                if (chunk < full_blocks) issue(chunk, 0);
                int stage = 0;
                for (int64 b = chunk; b < full_blocks; b += ctas_per_n, stage ^= 1) {
                    if (b + ctas_per_n < full_blocks) {
                        issue(b + ctas_per_n, stage ^ 1);
                        cp_async_wait<1>();
                    } else {
                        cp_async_wait<0>();
                    }
                    // each thread reads back only its own copies: no barrier
                    Pack<V> p[COLS_STATS_ROWS];
#pragma unroll
                    for (int u = 0; u < COLS_STATS_ROWS; ++u)
                        p[u] = staged[(stage * COLS_STATS_ROWS + u) * threads + tid];
                    stats_cols_push<V>(st, shift, p);
                }
            } else {
                for (int64 b = chunk; b < full_blocks; b += ctas_per_n) {
                    Pack<V> p[COLS_STATS_ROWS];
#pragma unroll
                    for (int u = 0; u < COLS_STATS_ROWS; ++u)
                        p[u] = load_pack<V>(xn + (b * block_rows + ty + u * TY) * row_stride, cp);
                    stats_cols_push<V>(st, shift, p);
                }
            }
            // the last, partial block of the sample: one row at a time
            if (full_blocks % ctas_per_n == chunk) {
                for (int64 r = full_blocks * block_rows + ty; r < R; r += TY) {
                    const Pack<V> p = load_pack<V>(xn + r * row_stride, cp);
#pragma unroll
                    for (int e = 0; e < V; ++e)
                        st[e] = stats_merge(st[e], Stats{acc_t(1), to_acc(p.v[e]) - shift[e], acc_t(0)});
                }
            }
        }
        __syncthreads();  // every thread is done with the ring that partial_rows overlays
#pragma unroll
        for (int e = 0; e < V; ++e) partial_rows[tid * V + e] = st[e];
        // merge the TY rows of triples as a tree (fixed pairs: reproducible); a sequential merge
        // by the TX threads of row 0 was the bottleneck (BatchNorm fp16 channels_last: 1.7 TB/s)
        for (int live = TY; live > 1;) {
            const int half = (live + 1) / 2;
            __syncthreads();
            if (ty < live - half) {
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    Stats& a = partial_rows[(ty * TX + tx) * V + e];
                    a = stats_merge(a, partial_rows[((ty + half) * TX + tx) * V + e]);
                }
            }
            live = half;
        }
        __syncthreads();
        if (ty == 0 && cp < n_packs) {
            for (int e = 0; e < V; ++e) {
                const Stats acc = partial_rows[tx * V + e];
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

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void __launch_bounds__(COLS_THREADS_MAX, 1)
strided_norm_stats_cols(const scalar_t* __restrict__ x, acc_t* __restrict__ partials, int64 N,
                        int64 R, int64 C, int64 row_stride, int64 sample_stride, int64 ctas_per_n,
                        int groups, int64 chans_per_group, int vectorized,
                        const scalar_t* __restrict__ addend) {
    if (vectorized)
        stats_cols<VEC>(x, partials, N, R, C, row_stride, sample_stride, ctas_per_n, groups,
                        chans_per_group, addend);
    else
        stats_cols<1>(x, partials, N, R, C, row_stride, sample_stride, ctas_per_n, groups,
                      chans_per_group, addend);
}
#endif

// ------------------------------------------------------------------------------------------------
// finalize: one warp per statistic set k merges its P triples (lane l takes l, l+32, ... in order,
// then a fixed shuffle tree). count is the exact element count of a set.
// The partial means are relative to each set's first value, read back here from x at
// (k / shift_div) * shift_a + (k % shift_div) * shift_b (rows: k * set_stride; columns, per
// sample: n * sample_stride + g * Cg; columns, per channel: c).
// Running statistics (batch norm), when given, are updated here as torch does:
//   new_running_mean = (1 - momentum) * running_mean + momentum * mean
//   new_running_var  = (1 - momentum) * running_var  + momentum * var * unbias  (count/(count-1))
// new_running_* is running_* itself (in place, eager) or another buffer (the functional custom op
// under torch.compile: no copy of the old statistics first); the pointers may alias, so they are
// not __restrict__. The module's batch counter (num_batches_tracked, int64), when given, is
// incremented by set 0: the add torch's module launches as a kernel of its own.
__device__ __forceinline__ void finalize_set(
    int64 k, int lane, const acc_t* __restrict__ partials, int64 P, double count, acc_t eps,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, acc_t* __restrict__ var,
    const scalar_t* __restrict__ x, int64 shift_div, int64 shift_a, int64 shift_b,
    const param_t* running_mean, const param_t* running_var, acc_t momentum, acc_t unbias,
    int64* __restrict__ batches_tracked, param_t* new_running_mean, param_t* new_running_var) {
    // the set's first value, loaded now and used last
    const acc_t shift = lane == 0 ? to_acc(x[(k / shift_div) * shift_a + (k % shift_div) * shift_b])
                                  : acc_t(0);
    // FINALIZE_BATCH triples per lane loaded before they are merged (in the same order: the
    // result does not depend on the batch): the loads overlap instead of one latency per triple
    Stats st = stats_empty();
    for (int64 p0 = lane; p0 < P; p0 += 32 * FINALIZE_BATCH) {
        Stats batch[FINALIZE_BATCH];
#pragma unroll
        for (int i = 0; i < FINALIZE_BATCH; ++i) {
            const int64 p = p0 + 32 * i;
            const acc_t* t = partials + 3 * (k * P + p);
            batch[i] = p < P ? Stats{LOAD_WRITTEN(t), LOAD_WRITTEN(t + 1), LOAD_WRITTEN(t + 2)}
                             : stats_empty();
        }
#pragma unroll
        for (int i = 0; i < FINALIZE_BATCH; ++i) st = stats_merge(st, batch[i]);
    }
    st = warp_stats(st);
    if (lane == 0) {
        const acc_t v = st.m2 / static_cast<acc_t>(count);
        const acc_t m = shift + st.mean;
        mean[k] = m;
        rstd[k] = rsqrt_acc(v + eps);
        if (var != nullptr) var[k] = v;
        const acc_t keep = acc_t(1) - momentum;
        if (running_mean != nullptr)
            new_running_mean[k] =
                from_acc<param_t>(keep * to_acc(running_mean[k]) + momentum * m);
        if (running_var != nullptr)
            new_running_var[k] =
                from_acc<param_t>(keep * to_acc(running_var[k]) + momentum * (v * unbias));
        if (batches_tracked != nullptr && k == 0) batches_tracked[0] += 1;
    }
}

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_finalize(
    const acc_t* __restrict__ partials, int64 K, int64 P, double count, acc_t eps,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, acc_t* __restrict__ var,
    const scalar_t* __restrict__ x, int64 shift_div, int64 shift_a, int64 shift_b,
    const param_t* running_mean, const param_t* running_var, acc_t momentum, acc_t unbias,
    int64* __restrict__ batches_tracked, param_t* new_running_mean, param_t* new_running_var) {
    const int64 k = (static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    if (k >= K) return;  // whole warps leave together
    finalize_set(k, threadIdx.x & 31, partials, P, count, eps, mean, rstd, var, x, shift_div,
                 shift_a, shift_b, running_mean, running_var, momentum, unbias, batches_tracked,
                 new_running_mean, new_running_var);
}
#endif

// eval-mode statistics from the running ones: mean = running_mean, rstd = 1 / sqrt(running_var + eps)
#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_running_stats(const param_t* __restrict__ running_mean,
                                                      const param_t* __restrict__ running_var,
                                                      int64 C, acc_t eps, acc_t* __restrict__ mean,
                                                      acc_t* __restrict__ rstd) {
    const int64 c = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    mean[c] = to_acc(running_mean[c]);
    rstd[c] = rsqrt_acc(to_acc(running_var[c]) + eps);
}
#endif

// ------------------------------------------------------------------------------------------------
// apply (elementwise), forward and backward in one body:
//   forward:   y  = (x - mean[k]) * a + b,                  a = rstd[k] * weight[c], b = bias[c]
//   backward:  dx = (x - mean[k]) * u[k] + v[k] + dy * g,   g = rstd[k] * weight[c]
// (u, v from strided_norm_bwd_finalize; see there for the derivation).
struct Coeffs {
    acc_t mean, a, b, g;
};

// What x is centred by: the set's mean, less the element's addend (see the top of this file).
__device__ __forceinline__ acc_t mean_of(int64 k, int64 nc, const acc_t* __restrict__ mean,
                                         const scalar_t* __restrict__ addend) {
    const acc_t m = LOAD_WRITTEN(mean + k);
    return addend != nullptr ? m - to_acc(addend[nc]) : m;
}

template <bool BACKWARD>
__device__ __forceinline__ Coeffs coeffs_of(int64 n, int64 c, const param_t* __restrict__ weight,
                                            const param_t* __restrict__ bias,
                                            const acc_t* __restrict__ mean,
                                            const acc_t* __restrict__ rstd,
                                            const acc_t* __restrict__ u,
                                            const acc_t* __restrict__ v, int groups,
                                            int64 chans_per_group, int64 C,
                                            const scalar_t* __restrict__ addend) {
    const int64 k = groups > 0 ? n * groups + c / chans_per_group : c;
    const acc_t w = weight != nullptr ? to_acc(weight[c]) : acc_t(1);
    Coeffs f;
    f.mean = mean_of(k, n * C + c, mean, addend);
    if (BACKWARD) {
        f.a = LOAD_WRITTEN(u + k);
        f.b = LOAD_WRITTEN(v + k);
        f.g = LOAD_WRITTEN(rstd + k) * w;
    } else {
        f.a = LOAD_WRITTEN(rstd + k) * w;
        f.b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
        f.g = acc_t(0);
    }
    return f;
}

// ------------------------------------------------------------------------------------------------
// Fused epilogue of the forward (BatchNorm + residual add + activation, ResNet's bottleneck tail):
//   y = act(t),  t = (x - mean) * a + b + z         z: the residual, in x's layout (or null)
// and the first step of its backward, dL/dt from dy, with t recomputed from x (and z), which the
// backward reads anyway (so nothing of the forward's output is kept):
//   ReLU: dt = dy * [t > 0]
//   SiLU: dt = dy * s * (1 + t * (1 - s)),  s = sigmoid(t)
// dt is rounded to the input type before it is summed -- what torch's unfused ops (the
// activation's backward, then the norm's) hand the norm. Without a residual, the sums pass and the
// dx pass both turn dy into dt (no extra traffic: the plain backward's 5 passes); with one, dt is
// also the residual's gradient, so the sums pass writes it (ep.dt) and the plain dx pass reads it.
// ReLU with a residual on 16-byte packs of 8 channels-innermost elements: the forward also keeps
// the ReLU's mask, bit e of byte j for element 8j + e of x's layout set where t > 0 (1/16 of a
// 16-bit tensor), and the backward's sums pass reads it instead of the residual (2 + 1/16 reads
// instead of 3: the pass that recomputes t for the mask alone). The mask is the recomputed t's
// sign, so both give the same bits.
// ACT is a template parameter: ACT_PLAIN (no epilogue: the plain kernels of this file, whose
// registers the epilogue must not cost) or one of the activations, whose kernels are the fused
// family's (fused_norm.cu, compiled only when a fused call needs it).
#define ACT_PLAIN -1
#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_SILU 2

struct Epilogue {
    const scalar_t* z;         // the residual (part of t) or null
    out_t* dt;                 // backward: where the sums pass writes dL/dt (dy's type), or null
    const unsigned char* mask; // backward, ReLU: the forward's mask (z null then), or null
};

template <int ACT>
__device__ __forceinline__ acc_t activate(acc_t t) {
    if (ACT == ACT_RELU) return t < acc_t(0) ? acc_t(0) : t;  // NaN stays NaN, as torch.relu
    if (ACT == ACT_SILU) return t * sigmoid_acc(t);
    return t;
}

// dy -> dt in place for one pack; x and z (read only when has_z) at the same elements; f the
// forward's coefficients, so t is computed exactly as the forward computed it. dt is rounded to
// dy's type (G): x's, or float32 under autocast, where torch's activation runs in float32.
template <int V, int ACT, typename G, typename Z>
__device__ __forceinline__ void activation_grad(PackOf<G, V>& g, const Pack<V>& x,
                                                const PackOf<Z, V>& z, const Coeffs* f,
                                                bool has_z) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
        acc_t t = (to_acc(x.v[e]) - f[e].mean) * f[e].a + f[e].b;
        if (has_z) t += to_acc(z.v[e]);
        acc_t d = to_acc(g.v[e]);
        if (ACT == ACT_RELU) {
            d = t > acc_t(0) ? d : acc_t(0);
        } else if (ACT == ACT_SILU) {
            const acc_t s = sigmoid_acc(t);
            d = d * s * (acc_t(1) + t * (acc_t(1) - s));
        }
        g.v[e] = from_acc<G>(d);
    }
}

// The mask bits of the V elements from element index i of x's layout (i % 8 == 0 when V == 8).
template <int V>
__device__ __forceinline__ unsigned relu_mask_bits(const unsigned char* __restrict__ mask, int64 i) {
    if (V == 8) return mask[i / 8];
    unsigned bits = 0;
#pragma unroll
    for (int e = 0; e < V; ++e) bits |= ((mask[(i + e) / 8] >> ((i + e) % 8)) & 1u) << e;
    return bits;
}

// dy -> dt for one pack from the mask: dy where t > 0, else 0 (activation_grad's ReLU, exactly)
template <int V, typename G>
__device__ __forceinline__ void relu_mask_grad(PackOf<G, V>& g, unsigned bits) {
#pragma unroll
    for (int e = 0; e < V; ++e)
        if (!((bits >> e) & 1u)) g.v[e] = from_acc<G>(acc_t(0));
}

// forward: other = z (read only when z is given); backward: other = dy. relu_bits (forward with
// an activation): where the pack's ReLU mask goes (bit e: t > 0), or null. The result is y
// (out_t) or dx (scalar_t).
template <bool BACKWARD> struct ApplyTypes {
    typedef typename Select<BACKWARD, out_t, scalar_t>::type other_t;  // dy, or the residual z
    typedef typename Select<BACKWARD, scalar_t, out_t>::type result_t;  // dx, or y
    // dy (BACKWARD) or z: both are kernel arguments, whatever the direction
    static __device__ __forceinline__ const other_t* other(const out_t* dy, const scalar_t* z);
};
template <>
__device__ __forceinline__ const out_t* ApplyTypes<true>::other(const out_t* dy, const scalar_t*) {
    return dy;
}
template <>
__device__ __forceinline__ const scalar_t* ApplyTypes<false>::other(const out_t*,
                                                                    const scalar_t* z) {
    return z;
}

template <int V, bool BACKWARD, int ACT>
__device__ __forceinline__ PackOf<typename ApplyTypes<BACKWARD>::result_t, V> apply_pack(
    const Pack<V>& x, const PackOf<typename ApplyTypes<BACKWARD>::other_t, V>& other,
    const Coeffs* f, bool has_z, unsigned* relu_bits = nullptr) {
    typedef typename ApplyTypes<BACKWARD>::result_t result_t;
    PackOf<result_t, V> out;
    if (relu_bits != nullptr) *relu_bits = 0;
#pragma unroll
    for (int e = 0; e < V; ++e) {
        const Coeffs& c = f[e];
        acc_t r = (to_acc(x.v[e]) - c.mean) * c.a + c.b;
        if (BACKWARD) {
            r += to_acc(other.v[e]) * c.g;
        } else if (ACT != ACT_PLAIN) {
            if (has_z) r += to_acc(other.v[e]);
            if (relu_bits != nullptr) *relu_bits |= static_cast<unsigned>(r > acc_t(0)) << e;
            r = activate<ACT>(r);
        }
        out.v[e] = from_acc<result_t>(r);
    }
    return out;
}

// rows layout. Grid (1-D): N * C * tiles_per_plane CTAs, each covering tile_len (a multiple of V)
// elements of one plane.
template <int V, bool BACKWARD, int ACT = ACT_PLAIN, bool RESID = false>
__device__ __forceinline__ void apply_rows(const scalar_t* __restrict__ x,
                                           const out_t* __restrict__ dy,
                                           typename ApplyTypes<BACKWARD>::result_t* __restrict__ out,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias,
                                           const acc_t* __restrict__ mean,
                                           const acc_t* __restrict__ rstd,
                                           const acc_t* __restrict__ u, const acc_t* __restrict__ v,
                                           int64 C, int64 S, int64 sample_stride, int64 chan_stride,
                                           int groups, int64 chans_per_group,
                                           int64 tiles_per_plane, int64 tile_len,
                                           const scalar_t* __restrict__ z,
                                           const scalar_t* __restrict__ addend) {
    const int64 plane = blockIdx.x / tiles_per_plane, tile = blockIdx.x % tiles_per_plane;
    const int64 n = plane / C, c = plane % C;
    // the second operand: dy (backward) or the residual (forward, when there is one)
    typedef typename ApplyTypes<BACKWARD>::other_t other_t;
    const other_t* __restrict__ other = ApplyTypes<BACKWARD>::other(dy, z);
    constexpr bool has_z = !BACKWARD && ACT != ACT_PLAIN && RESID;  // a runtime flag: 2x registers
    // the fused backward without a residual: dy -> dt here too (the forward's coefficients fw)
    constexpr bool grad_act = BACKWARD && ACT != ACT_PLAIN;
    Coeffs f[V], fw[grad_act ? V : 1];
    f[0] = coeffs_of<BACKWARD>(n, c, weight, bias, mean, rstd, u, v, groups, chans_per_group, C,
                               addend);
    if (grad_act)
        fw[0] = coeffs_of<false>(n, c, weight, bias, mean, rstd, u, v, groups, chans_per_group, C,
                                 addend);
#pragma unroll
    for (int e = 1; e < V; ++e) {
        f[e] = f[0];
        if (grad_act) fw[e] = fw[0];
    }
    const int64 offset = n * sample_stride + c * chan_stride;
    const int64 q_end = min(tile_len * (tile + 1), S) / V;
    const int64 step = blockDim.x;
    int64 q = tile * tile_len / V + threadIdx.x;
    for (; q + (UNROLL - 1) * step < q_end; q += UNROLL * step) {
        Pack<V> p[UNROLL];
        PackOf<other_t, V> g[UNROLL];
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            p[i] = load_pack<V>(x + offset, q + i * step);
            if (BACKWARD || has_z) g[i] = load_pack<V>(other + offset, q + i * step);
        }
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            if (grad_act) activation_grad<V, ACT>(g[i], p[i], g[i], fw, false);
            store_pack<V>(out + offset, q + i * step,
                          apply_pack<V, BACKWARD, ACT>(p[i], g[i], f, has_z));
        }
    }
    for (; q < q_end; q += step) {
        const Pack<V> p = load_pack<V>(x + offset, q);
        PackOf<other_t, V> g;
        if (BACKWARD || has_z) g = load_pack<V>(other + offset, q);
        if (grad_act) activation_grad<V, ACT>(g, p, g, fw, false);
        store_pack<V>(out + offset, q, apply_pack<V, BACKWARD, ACT>(p, g, f, has_z));
    }
}

#define APPLY_ROWS_ARGS                                                                         \
    x, dy, out, weight, bias, mean, rstd, u, v, C, S, sample_stride, chan_stride, groups,       \
        chans_per_group, tiles_per_plane, tile_len, z, addend
// z: the fused forward's residual (fused_norm.cu; null and unused elsewhere); addend: see the top
// OUT: the written tensor's type, out_t (y: the forward) or scalar_t (dx: the backward)
#define APPLY_ROWS_PARAMS(OUT)                                                                  \
    const scalar_t *__restrict__ x, const out_t *__restrict__ dy, OUT *__restrict__ out,        \
        const param_t *__restrict__ weight, const param_t *__restrict__ bias,                   \
        const acc_t *__restrict__ mean, const acc_t *__restrict__ rstd,                         \
        const acc_t *__restrict__ u, const acc_t *__restrict__ v, int64 C, int64 S,             \
        int64 sample_stride, int64 chan_stride, int groups, int64 chans_per_group,              \
        int64 tiles_per_plane, int64 tile_len, int vectorized, const scalar_t *__restrict__ z,  \
        const scalar_t *__restrict__ addend

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_apply_rows(APPLY_ROWS_PARAMS(out_t)) {
    if (vectorized)
        apply_rows<VEC, false>(APPLY_ROWS_ARGS);
    else
        apply_rows<1, false>(APPLY_ROWS_ARGS);
}
#endif

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_bwd_dx_rows(APPLY_ROWS_PARAMS(scalar_t)) {
    if (vectorized)
        apply_rows<VEC, true>(APPLY_ROWS_ARGS);
    else
        apply_rows<1, true>(APPLY_ROWS_ARGS);
}
#endif

// columns layout. Block (TX, TY) and grid as in stats_cols, each CTA taking its sample's blocks of
// UNROLL * TY rows as the statistics pass does. MASK: the forward of ReLU with a residual on packs
// of 8 keeps its mask in relu_mask (see "Fused epilogue"; a kernel of its own: the mask's stores
// cost the others registers even when off).
template <int V, bool BACKWARD, int ACT = ACT_PLAIN, bool RESID = false, bool MASK = false>
__device__ __forceinline__ void apply_cols(const scalar_t* __restrict__ x,
                                           const out_t* __restrict__ dy,
                                           typename ApplyTypes<BACKWARD>::result_t* __restrict__ out,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias,
                                           const acc_t* __restrict__ mean,
                                           const acc_t* __restrict__ rstd,
                                           const acc_t* __restrict__ u, const acc_t* __restrict__ v,
                                           int64 R, int64 C, int64 row_stride, int64 sample_stride,
                                           int groups, int64 chans_per_group, int64 ctas_per_n,
                                           const scalar_t* __restrict__ z,
                                           const scalar_t* __restrict__ addend,
                                           unsigned char* __restrict__ relu_mask = nullptr) {
    const int64 n = blockIdx.x / ctas_per_n, chunk = blockIdx.x % ctas_per_n;
    const int TY = blockDim.y;
    typedef typename ApplyTypes<BACKWARD>::other_t other_t;  // as in apply_rows
    const other_t* __restrict__ other = ApplyTypes<BACKWARD>::other(dy, z);
    constexpr bool has_z = !BACKWARD && ACT != ACT_PLAIN && RESID;  // a runtime flag: 2x registers
    // the mask's byte of a pack: element (base + r * row_stride + cp * 8) / 8
    constexpr bool masked = MASK && has_z && ACT == ACT_RELU && V == 8;
    const int64 mask_step = TY * row_stride / 8;
    const int64 block_rows = COLS_APPLY_UNROLL * TY;
    const int64 blocks = (R + block_rows - 1) / block_rows;
    const int64 n_packs = C / V;
    const int64 base = n * sample_stride;
    constexpr bool grad_act = BACKWARD && ACT != ACT_PLAIN;  // as in apply_rows
    // channel tiles of blockDim.x packs: this CTA takes tiles blockIdx.y, blockIdx.y + gridDim.y, ...
    const int64 pack_step = static_cast<int64>(blockDim.x) * gridDim.y;
    for (int64 cp = static_cast<int64>(blockIdx.y) * blockDim.x + threadIdx.x; cp < n_packs;
         cp += pack_step) {
        Coeffs f[V], fw[grad_act ? V : 1];
#pragma unroll
        for (int e = 0; e < V; ++e) {
            f[e] = coeffs_of<BACKWARD>(n, cp * V + e, weight, bias, mean, rstd, u, v, groups,
                                       chans_per_group, C, addend);
            if (grad_act)
                fw[e] = coeffs_of<false>(n, cp * V + e, weight, bias, mean, rstd, u, v, groups,
                                         chans_per_group, C, addend);
        }
        for (int64 b = chunk; b < blocks; b += ctas_per_n) {
            const int64 r1 = min(b * block_rows + block_rows, R);
            int64 r = b * block_rows + threadIdx.y;
            for (; r + (COLS_APPLY_UNROLL - 1) * TY < r1; r += COLS_APPLY_UNROLL * TY) {
                Pack<V> p[COLS_APPLY_UNROLL];
                PackOf<other_t, V> g[COLS_APPLY_UNROLL];
#pragma unroll
                for (int i = 0; i < COLS_APPLY_UNROLL; ++i) {
                    p[i] = load_pack<V>(x + base + (r + i * TY) * row_stride, cp);
                    if (BACKWARD || has_z)
                        g[i] = load_pack<V>(other + base + (r + i * TY) * row_stride, cp);
                }
                unsigned char* mask_row = masked ? relu_mask + (base + r * row_stride) / 8 + cp
                                                 : nullptr;
#pragma unroll
                for (int i = 0; i < COLS_APPLY_UNROLL; ++i) {
                    if (grad_act) activation_grad<V, ACT>(g[i], p[i], g[i], fw, false);
                    unsigned bits;
                    store_pack<V>(out + base + (r + i * TY) * row_stride, cp,
                                  apply_pack<V, BACKWARD, ACT>(p[i], g[i], f, has_z,
                                                               masked ? &bits : nullptr));
                    if (masked) mask_row[i * mask_step] = static_cast<unsigned char>(bits);
                }
            }
            for (; r < r1; r += TY) {  // the sample's last block may be partial
                const Pack<V> p = load_pack<V>(x + base + r * row_stride, cp);
                PackOf<other_t, V> g;
                if (BACKWARD || has_z) g = load_pack<V>(other + base + r * row_stride, cp);
                if (grad_act) activation_grad<V, ACT>(g, p, g, fw, false);
                unsigned bits;
                store_pack<V>(out + base + r * row_stride, cp,
                              apply_pack<V, BACKWARD, ACT>(p, g, f, has_z,
                                                           masked ? &bits : nullptr));
                if (masked)
                    relu_mask[(base + r * row_stride) / 8 + cp] = static_cast<unsigned char>(bits);
            }
        }
    }
}

#define APPLY_COLS_ARGS                                                                          \
    x, dy, out, weight, bias, mean, rstd, u, v, R, C, row_stride, sample_stride, groups,         \
        chans_per_group, ctas_per_n, z, addend
#define APPLY_COLS_PARAMS(OUT)                                                                   \
    const scalar_t *__restrict__ x, const out_t *__restrict__ dy, OUT *__restrict__ out,         \
        const param_t *__restrict__ weight, const param_t *__restrict__ bias,                   \
        const acc_t *__restrict__ mean, const acc_t *__restrict__ rstd,                         \
        const acc_t *__restrict__ u, const acc_t *__restrict__ v, int64 R, int64 C,             \
        int64 row_stride, int64 sample_stride, int groups, int64 chans_per_group,               \
        int64 ctas_per_n, int vectorized, const scalar_t *__restrict__ z,                      \
        const scalar_t *__restrict__ addend

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_apply_cols(APPLY_COLS_PARAMS(out_t)) {
    if (vectorized)
        apply_cols<VEC, false>(APPLY_COLS_ARGS);
    else
        apply_cols<1, false>(APPLY_COLS_ARGS);
}
#endif

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_bwd_dx_cols(APPLY_COLS_PARAMS(scalar_t)) {
    if (vectorized)
        apply_cols<VEC, true>(APPLY_COLS_ARGS);
    else
        apply_cols<1, true>(APPLY_COLS_ARGS);
}
#endif

// ------------------------------------------------------------------------------------------------
// backward. With xhat = (x - mean) * rstd, y = xhat * w_c + b_c and L elements per statistic set:
//   dL/dxhat_i = w_c dy_i
//   dx_i = rstd * (w_c dy_i - P / L - (x_i - mean) * rstd^2 * Q / L)
//        = (x_i - mean) * u + v + dy_i * rstd * w_c,   u = -rstd^3 Q / L,  v = -rstd P / L
//   P = sum_i w_c dy_i,  Q = sum_i w_c dy_i (x_i - mean)     (sums over the set)
//   dweight_c = sum over the channel's elements of dy * xhat,  dbias_c = sum of dy
// Pass 1 (bwd_sums_*) reduces, per plane (n, c) and tile t, sdy = sum dy and sdx = sum dy (x - mean)
// (x - mean, not x: no cancellation on offset data) into partials[(n*C + c)*T + t]. Pass 2
// (bwd_finalize) merges them in a fixed order into dweight, dbias, u, v. Pass 3 is bwd_dx_*.
// In eval mode (constant statistics) u = v = 0.

// rows layout, grid as apply_rows: one partial per (plane, tile). With an epilogue (ACT not
// ACT_PLAIN: fused_norm.cu), dy -> dt first and the sums are of dt; with a residual (RESID, a
// compile-time choice as in the apply: its loads cost registers the other kernels must not pay)
// t includes it and dt is also written to ep.dt.
template <int V, int ACT = ACT_PLAIN, bool RESID = false>
__device__ __forceinline__ void bwd_sums_rows(const scalar_t* __restrict__ x,
                                              const out_t* __restrict__ dy,
                                              const acc_t* __restrict__ mean,
                                              acc_t* __restrict__ partials, int64 C, int64 S,
                                              int64 sample_stride, int64 chan_stride, int groups,
                                              int64 chans_per_group, int64 tiles_per_plane,
                                              int64 tile_len, const Epilogue& ep,
                                              const param_t* __restrict__ weight,
                                              const param_t* __restrict__ bias,
                                              const acc_t* __restrict__ rstd,
                                              const scalar_t* __restrict__ addend) {
    __shared__ acc_t scratch[33];
    const int64 plane = blockIdx.x / tiles_per_plane, tile = blockIdx.x % tiles_per_plane;
    const int64 n = plane / C, c = plane % C;
    const acc_t m = mean_of(groups > 0 ? n * groups + c / chans_per_group : c, plane, mean, addend);
    const int64 offset = n * sample_stride + c * chan_stride;
    const int64 q_end = min(tile_len * (tile + 1), S) / V;
    const int64 step = blockDim.x;
    Coeffs f[V];
    const scalar_t* __restrict__ aux = nullptr;  // the residual (RESID only)
    if (ACT != ACT_PLAIN) {
        f[0] = coeffs_of<false>(n, c, weight, bias, mean, rstd, nullptr, nullptr, groups,
                                chans_per_group, C, addend);
#pragma unroll
        for (int e = 1; e < V; ++e) f[e] = f[0];
        if (RESID) aux = ep.z;
    }
    acc_t sdy = 0, sdx = 0;
    int64 q = tile * tile_len / V + threadIdx.x;
    for (; q + (UNROLL - 1) * step < q_end; q += UNROLL * step) {
        Pack<V> p[UNROLL], a[UNROLL];
        OutPack<V> g[UNROLL];
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            p[i] = load_pack<V>(x + offset, q + i * step);
            g[i] = load_pack<V>(dy + offset, q + i * step);
            if (ACT != ACT_PLAIN && RESID) a[i] = load_pack<V>(aux + offset, q + i * step);
        }
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            if (ACT != ACT_PLAIN) {
                activation_grad<V, ACT>(g[i], p[i], a[i], f, RESID);
                if (RESID) store_pack<V>(ep.dt + offset, q + i * step, g[i]);
            }
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const acc_t d = to_acc(g[i].v[e]);
                sdy += d;
                sdx += d * (to_acc(p[i].v[e]) - m);
            }
        }
    }
    for (; q < q_end; q += step) {
        const Pack<V> p = load_pack<V>(x + offset, q);
        OutPack<V> g = load_pack<V>(dy + offset, q);
        Pack<V> a;
        if (ACT != ACT_PLAIN) {
            if (RESID) a = load_pack<V>(aux + offset, q);
            activation_grad<V, ACT>(g, p, a, f, RESID);
            if (RESID) store_pack<V>(ep.dt + offset, q, g);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const acc_t d = to_acc(g.v[e]);
            sdy += d;
            sdx += d * (to_acc(p.v[e]) - m);
        }
    }
    sdy = block_sum(sdy, scratch);
    sdx = block_sum(sdx, scratch);
    if (threadIdx.x == 0) {
        partials[2 * blockIdx.x + 0] = sdy;  // blockIdx.x == plane * T + tile
        partials[2 * blockIdx.x + 1] = sdx;
    }
}

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_bwd_sums_rows(
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy, const acc_t* __restrict__ mean,
    acc_t* __restrict__ partials, int64 C, int64 S, int64 sample_stride, int64 chan_stride,
    int groups, int64 chans_per_group, int64 tiles_per_plane, int64 tile_len, int vectorized,
    const scalar_t* __restrict__ addend) {
    if (vectorized)
        bwd_sums_rows<VEC>(x, dy, mean, partials, C, S, sample_stride, chan_stride, groups,
                           chans_per_group, tiles_per_plane, tile_len, Epilogue{}, nullptr,
                           nullptr, nullptr, addend);
    else
        bwd_sums_rows<1>(x, dy, mean, partials, C, S, sample_stride, chan_stride, groups,
                         chans_per_group, tiles_per_plane, tile_len, Epilogue{}, nullptr, nullptr,
                         nullptr, addend);
}
#endif

// columns layout, grid and block as apply_cols: one partial per (n, c, chunk), T = ctas_per_n.
// Blocks of COLS_APPLY_UNROLL * TY rows as apply_cols. Dynamic shared memory: TX * TY * V * 2 * sizeof(acc_t).
// ACT as bwd_sums_rows; the residual is a runtime operand here (ep.z, null without one): with it
// a compile-time choice as in the rows kernel, the fused columns sums were slower (BatchNorm +
// ReLU over resnet50's layers 5.39 -> 5.52 ms per step, GroupNorm + SiLU channels_last backward
// 111 -> 126-131 us; benchmarks/NOTES.md).
template <int V, int ACT = ACT_PLAIN, bool MASK = false>
__device__ __forceinline__ void bwd_sums_cols(const scalar_t* __restrict__ x,
                                              const out_t* __restrict__ dy,
                                              const acc_t* __restrict__ mean,
                                              acc_t* __restrict__ partials, int64 R, int64 C,
                                              int64 row_stride, int64 sample_stride, int groups,
                                              int64 chans_per_group, int64 ctas_per_n,
                                              const Epilogue& ep,
                                              const param_t* __restrict__ weight,
                                              const param_t* __restrict__ bias,
                                              const acc_t* __restrict__ rstd,
                                              const scalar_t* __restrict__ addend) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    acc_t* sums = reinterpret_cast<acc_t*>(smem_raw);
    const int64 n = blockIdx.x / ctas_per_n, chunk = blockIdx.x % ctas_per_n;
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const int64 block_rows = COLS_APPLY_UNROLL * TY, blocks = (R + block_rows - 1) / block_rows;
    const int64 n_packs = C / V;
    const int64 base = n * sample_stride;
    const scalar_t* __restrict__ aux = ACT != ACT_PLAIN ? ep.z : nullptr;
    // MASK (ReLU): dt from the forward's mask instead of t (z is null then; a byte per 8 elements)
    static_assert(!MASK || ACT == ACT_RELU, "the mask is the ReLU's");
    const unsigned char* __restrict__ mask = MASK ? ep.mask : nullptr;
    for (int64 tile = static_cast<int64>(blockIdx.y) * TX; tile < n_packs;
         tile += static_cast<int64>(TX) * gridDim.y) {  // channel tiles as in stats_cols
        const int64 cp = tile + tx;
        acc_t sdy[V], sdx[V], m[V];
#pragma unroll
        for (int e = 0; e < V; ++e) sdy[e] = sdx[e] = m[e] = acc_t(0);
        if (cp < n_packs) {
            Coeffs f[V];
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const int64 c = cp * V + e;
                m[e] = mean_of(groups > 0 ? n * groups + c / chans_per_group : c, n * C + c, mean,
                               addend);
                if (ACT != ACT_PLAIN && !MASK)  // t is recomputed (with the mask it is not)
                    f[e] = coeffs_of<false>(n, c, weight, bias, mean, rstd, nullptr, nullptr,
                                            groups, chans_per_group, C, addend);
            }
            // row r's contribution once its packs are loaded (dy turned into dt first when fused)
            auto add_row = [&](int64 r, const Pack<V>& p, OutPack<V> g, const Pack<V>& a,
                               unsigned bits) {
                if (ACT != ACT_PLAIN) {
                    if (MASK)
                        relu_mask_grad<V>(g, bits);
                    else
                        activation_grad<V, ACT>(g, p, a, f, aux != nullptr);
                    if (ep.dt != nullptr) store_pack<V>(ep.dt + base + r * row_stride, cp, g);
                }
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const acc_t d = to_acc(g.v[e]);
                    sdy[e] += d;
                    sdx[e] += d * (to_acc(p.v[e]) - m[e]);
                }
            };
            // ROWS rows at a time with all their loads issued first (one row at a time was
            // load-latency bound); the same order of additions as one at a time. The fused
            // kernels also load the residual: 4 rows (bf16 167 registers) measured 1.4% faster
            // over resnet50's layers than 2 (117 registers). With the mask instead of the
            // residual, 8 rows (168 registers) beat 4 (124): resnet50's add + ReLU layers at
            // batch 64, H100, 6.16 against 6.19 ms for all the norm layers
            constexpr int ROWS =
                ACT == ACT_PLAIN || MASK ? COLS_APPLY_UNROLL : COLS_APPLY_UNROLL / 2;
            for (int64 b = chunk; b < blocks; b += ctas_per_n) {
                const int64 r1 = min(b * block_rows + block_rows, R);
                int64 r = b * block_rows + ty;
                for (; r + (ROWS - 1) * TY < r1; r += ROWS * TY) {
                    Pack<V> p[ROWS], a[ACT != ACT_PLAIN ? ROWS : 1];
                    OutPack<V> g[ROWS];
                    unsigned bits[ROWS];
#pragma unroll
                    for (int i = 0; i < ROWS; ++i) {
                        p[i] = load_pack<V>(x + base + (r + i * TY) * row_stride, cp);
                        g[i] = load_pack<V>(dy + base + (r + i * TY) * row_stride, cp);
                        if (ACT != ACT_PLAIN && !MASK && aux != nullptr)
                            a[i] = load_pack<V>(aux + base + (r + i * TY) * row_stride, cp);
                        bits[i] =
                            MASK ? relu_mask_bits<V>(mask, base + (r + i * TY) * row_stride + cp * V)
                                 : 0u;
                    }
#pragma unroll
                    for (int i = 0; i < ROWS; ++i)
                        add_row(r + i * TY, p[i], g[i], a[ACT != ACT_PLAIN ? i : 0], bits[i]);
                }
                for (; r < r1; r += TY) {  // the sample's last block may be partial
                    Pack<V> a;
                    if (ACT != ACT_PLAIN && !MASK && aux != nullptr)
                        a = load_pack<V>(aux + base + r * row_stride, cp);
                    const unsigned bits =
                        MASK ? relu_mask_bits<V>(mask, base + r * row_stride + cp * V) : 0u;
                    add_row(r, load_pack<V>(x + base + r * row_stride, cp),
                            load_pack<V>(dy + base + r * row_stride, cp), a, bits);
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < V; ++e) {
            sums[2 * ((ty * TX + tx) * V + e) + 0] = sdy[e];
            sums[2 * ((ty * TX + tx) * V + e) + 1] = sdx[e];
        }
        for (int live = TY; live > 1;) {  // tree over the TY rows, as in stats_cols
            const int half = (live + 1) / 2;
            __syncthreads();
            if (ty < live - half) {
                for (int i = 0; i < 2 * V; ++i)
                    sums[2 * (ty * TX + tx) * V + i] += sums[2 * ((ty + half) * TX + tx) * V + i];
            }
            live = half;
        }
        __syncthreads();
        if (ty == 0 && cp < n_packs) {
            for (int e = 0; e < V; ++e) {
                const int64 slot = (n * C + cp * V + e) * ctas_per_n + chunk;
                partials[2 * slot + 0] = sums[2 * (tx * V + e) + 0];
                partials[2 * slot + 1] = sums[2 * (tx * V + e) + 1];
            }
        }
    }
}

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_bwd_sums_cols(
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy, const acc_t* __restrict__ mean,
    acc_t* __restrict__ partials, int64 R, int64 C, int64 row_stride, int64 sample_stride,
    int groups, int64 chans_per_group, int64 ctas_per_n, int vectorized,
    const scalar_t* __restrict__ addend) {
    if (vectorized)
        bwd_sums_cols<VEC>(x, dy, mean, partials, R, C, row_stride, sample_stride, groups,
                           chans_per_group, ctas_per_n, Epilogue{}, nullptr, nullptr, nullptr,
                           addend);
    else
        bwd_sums_cols<1>(x, dy, mean, partials, R, C, row_stride, sample_stride, groups,
                         chans_per_group, ctas_per_n, Epilogue{}, nullptr, nullptr, nullptr,
                         addend);
}
#endif

// Pass 2. partials[(n*C + c)*T + t] for n < NP (NP = 1 when the columns pass folded the batch).
// Warps 0 .. C-1: dweight[c], dbias[c]; warps C .. C+K-1: u[k], v[k]. Each warp's lanes take items
// lane, lane+32, ... in order, then a fixed shuffle tree: bitwise reproducible.
__device__ __forceinline__ void bwd_finalize_warp(
    int64 warp, int lane, const acc_t* __restrict__ partials, int64 NP, int64 C, int64 T,
    const acc_t* __restrict__ rstd, const param_t* __restrict__ weight, int groups,
    int64 chans_per_group, int64 K, double count, int training, void* __restrict__ dweight,
    void* __restrict__ dbias, acc_t* __restrict__ u, acc_t* __restrict__ v) {
    if (warp < C) {
        if (dweight == nullptr && dbias == nullptr) return;
        const int64 c = warp;
        acc_t dw = 0, db = 0;
        for (int64 j = lane; j < NP * T; j += 32) {
            const int64 n = j / T, t = j % T;
            const acc_t* p = partials + 2 * ((n * C + c) * T + t);
            const int64 k = groups > 0 ? n * groups + c / chans_per_group : c;
            db += LOAD_WRITTEN(p);
            dw += rstd[k] * LOAD_WRITTEN(p + 1);
        }
        dw = warp_sum(dw);
        db = warp_sum(db);
        if (lane == 0) {  // in the weight's type (no conversion pass), in acc_t without weight
            if (weight != nullptr) {
                if (dweight != nullptr) static_cast<param_t*>(dweight)[c] = from_acc<param_t>(dw);
                if (dbias != nullptr) static_cast<param_t*>(dbias)[c] = from_acc<param_t>(db);
            } else {
                if (dweight != nullptr) static_cast<acc_t*>(dweight)[c] = dw;
                if (dbias != nullptr) static_cast<acc_t*>(dbias)[c] = db;
            }
        }
        return;
    }
    const int64 k = warp - C;
    if (k >= K || u == nullptr) return;
    acc_t P = 0, Q = 0;
    if (groups > 0) {  // set (n, g): channels g*Cg .. of sample n
        const int64 n = k / groups, c0 = (k % groups) * chans_per_group;
        for (int64 j = lane; j < chans_per_group * T; j += 32) {
            const int64 c = c0 + j / T, t = j % T;
            const acc_t* p = partials + 2 * ((n * C + c) * T + t);
            const acc_t w = weight != nullptr ? to_acc(weight[c]) : acc_t(1);
            P += w * LOAD_WRITTEN(p);
            Q += w * LOAD_WRITTEN(p + 1);
        }
    } else {  // set c: every sample
        const int64 c = k;
        for (int64 j = lane; j < NP * T; j += 32) {
            const int64 n = j / T, t = j % T;
            const acc_t* p = partials + 2 * ((n * C + c) * T + t);
            P += LOAD_WRITTEN(p);
            Q += LOAD_WRITTEN(p + 1);
        }
        const acc_t w = weight != nullptr ? to_acc(weight[c]) : acc_t(1);
        P *= w;
        Q *= w;
    }
    P = warp_sum(P);
    Q = warp_sum(Q);
    if (lane == 0) {
        const acc_t r = rstd[k], L = static_cast<acc_t>(count);
        u[k] = training ? -r * r * r * Q / L : acc_t(0);
        v[k] = training ? -r * P / L : acc_t(0);
    }
}

#ifndef STRIDED_NORM_DEVICE_ONLY
extern "C" __global__ void strided_norm_bwd_finalize(
    const acc_t* __restrict__ partials, int64 NP, int64 C, int64 T, const acc_t* __restrict__ rstd,
    const param_t* __restrict__ weight, int groups, int64 chans_per_group, int64 K, double count,
    int training, void* __restrict__ dweight, void* __restrict__ dbias, acc_t* __restrict__ u,
    acc_t* __restrict__ v) {
    const int64 warp = (static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    bwd_finalize_warp(warp, threadIdx.x & 31, partials, NP, C, T, rstd, weight, groups,
                      chans_per_group, K, count, training, dweight, dbias, u, v);
}
#endif
