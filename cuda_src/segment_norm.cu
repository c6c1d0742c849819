// segment_norm.cu: normalization of contiguous segments held on chip (one read, one write).
// (Long: one family, forward and backward, for GroupNorm/InstanceNorm segments and the row norms.)
//
// A segment is a contiguous run of L = seg_len elements sharing one (mean, rstd):
//   GroupNorm / InstanceNorm on NCHW: segment (n, g) = channels g*Cg .. (g+1)*Cg-1 of sample n,
//     L = Cg * S (S = spatial size), element i belongs to channel c = g*Cg + i / S;
//   row norms: a row of D features (chan_len = D, one "channel").
//
//   mean = sum_i x_i / L,  var = sum_i (x_i - mean)^2 / L (biased),  rstd = 1 / sqrt(var + eps)
//   AFFINE epilogue:  y_i = (x_i - mean) * (rstd * weight[c]) + bias[c]
//   ADD_MUL epilogue: y_i = ((x_i - mean) * rstd + r_i) * r_i   (the seed-002 tail, r = other)
//   ROW epilogue (LayerNorm / RMSNorm over the last dims, weight and bias per position i of the
//     row): y_i = (x_i - mean) * rstd * weight[i] + bias[i]; with a residual, x_i is first
//     replaced by s_i = x_i + residual_i rounded to the input's type (s is written out: the
//     residual stream), as flash-attn's and Liger's fused add + norm do.
//   RMS statistic: mean = 0, var = sum_i x_i^2 / L (the mean square), same rstd.
//   ROW_CAST epilogue (Hugging Face's LlamaRMSNorm and its copies, no bias): the normalized
//     value is rounded to the input's type before the weight multiplies it,
//     y_i = round(weight[i] * round(x_i * rstd)), two roundings in half precision.
//   AFFINE_SILU epilogue (GroupNorm + SiLU, the diffusion ResNet block): y_i = silu(t_i) with t_i
//     the AFFINE value in float32, silu(t) = t * sigmoid(t) (common.cuh), one rounding, of y.
//   y is out_t: the input's type, or float beside half x (the float32 norm of autocast, in the
//     OUT_T module variant: GroupNorm's forward entries).
//   SHIFTED (AFFINE and AFFINE_SILU, the _shift entries): the segment normalized is
//     s_i = x_i + addend[n, c] (addend (N, C), the diffusion block's time embedding), formed in
//     acc_t and never stored: in the statistics per element, in the write as part of the bias,
//     (s - mean) * a + b = (x - mean) * a + (b + addend * a).
//
// Mapping: the segment is split into `team` slices of slice_len elements, one CTA each. Each CTA
// copies its slice into shared memory with cp.async and computes the slice's exact two-pass
// (count, mean, M2); the CTAs of a segment exchange those triples and Chan-merge them in rank order
// (every CTA gets the same bits); then each CTA writes its normalized slice from shared memory.
// The exchange goes through global memory: each CTA publishes its triple, bumps the segment's
// arrival counter and waits for the others. A CTA takes its (segment, rank) from a ticket counter
// when it starts, not from blockIdx, so every CTA a team waits for has already started (tickets
// are handed out in start order): no deadlock whatever order the hardware runs CTAs in, as long as
// one team fits on the GPU at once (the host keeps it well below that). Grid: segments * team.
// (A thread-block cluster exchanging through distributed shared memory was measured slower than
// the team on an H200, 5.1-5.3 ms vs 4.6-4.8 ms for InstanceNorm 112x64x512x512: see
// benchmarks/NOTES.md.)
#include "common.cuh"

#define EPILOGUE_AFFINE 0
#define EPILOGUE_ADD_MUL 1
#define EPILOGUE_ROW 2
#define EPILOGUE_ROW_CAST 3
#define EPILOGUE_AFFINE_SILU 4

#define STAT_MEAN_VAR 0
#define STAT_RMS 1

// ---- teams: CTAs sharing one segment -----------------------------------------------------------
// This CTA's (segment, rank): from the start-order ticket when team > 1, else from blockIdx.
__device__ __forceinline__ void team_place(int team, int* __restrict__ tickets, int64& seg,
                                           int& rank) {
    __shared__ int ticket;
    if (team > 1 && threadIdx.x == 0) ticket = atomicAdd(tickets, 1);
    __syncthreads();
    seg = team > 1 ? ticket / team : blockIdx.x;
    rank = team > 1 ? ticket % team : 0;
}

// Thread 0 only: publish this CTA's K values for the segment, then wait until the whole team has.
template <int K>
__device__ __forceinline__ void team_publish_and_wait(const acc_t (&values)[K], int64 seg, int rank,
                                                      int team, int* __restrict__ tickets,
                                                      acc_t* __restrict__ partials) {
    volatile acc_t* slot = partials + K * (seg * team + rank);
#pragma unroll
    for (int i = 0; i < K; ++i) slot[i] = values[i];
    __threadfence();
    atomicAdd(tickets + 1 + seg, 1);
    const volatile int* arrived = tickets + 1 + seg;
    while (*arrived < team) __nanosleep(100);
    __threadfence();
}

// ---- the forward's phases ------------------------------------------------------------------------
// Copy n elements of x + base into shared memory: 16-byte cp.async (V == VEC, not waited for
// here) or plain copies (V == 1).
template <int V>
__device__ __forceinline__ void slice_load(scalar_t* xs, const scalar_t* __restrict__ x, int64 base,
                                           int n) {
    if (V == VEC) {
        for (int p = threadIdx.x; p < n / V; p += blockDim.x) cp_async16(xs + p * V, x + base + p * V);
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = x[base + i];
    }
}

__device__ __forceinline__ void slice_load_wait() {
    cp_async_wait_all();
    __syncthreads();
}

// Exact two-pass statistics of a slice in shared memory (packs read from shared memory), relative
// to the segment's first value K: every CTA of a team uses the same K, so means stay small numbers
// with all their digits and data of mean 1e4 keeps the variance to ~1e-7 (benchmarks/NOTES.md).
// STAT_RMS keeps no mean: (n, 0, sum x^2), which the team's Chan merge adds up unchanged (the
// means it shifts by are all 0); shift is 0 then.
// The addends of the V elements at position pos of a segment whose channels are chan_len long
// (addend: the segment's first channel's): one load when the pack lies in one channel, one per
// element when it straddles two.
template <int V>
__device__ __forceinline__ void pack_addends(const scalar_t* __restrict__ addend, int pos,
                                             int chan_len, acc_t (&a)[V]) {
    int c = pos / chan_len, within = pos - c * chan_len;
    if (within + V <= chan_len) {
        const acc_t same = to_acc(addend[c]);
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = same;
        return;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
        if (within == chan_len) {
            ++c;
            within = 0;
        }
        ++within;
        a[j] = to_acc(addend[c]);
    }
}

// The slice's V values of pack p relative to shift, with their addends when SHIFTED.
template <int V, bool SHIFTED>
__device__ __forceinline__ void slice_values(const Pack<V>* packs, int p, acc_t shift,
                                             const scalar_t* __restrict__ addend, int start,
                                             int chan_len, acc_t (&v)[V]) {
    const Pack<V> x = packs[p];
    acc_t a[V];
    if (SHIFTED) pack_addends<V>(addend, start + p * V, chan_len, a);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = SHIFTED ? (to_acc(x.v[j]) + a[j]) - shift : to_acc(x.v[j]) - shift;
}

template <int V, int STAT, bool SHIFTED = false>
__device__ __forceinline__ Stats slice_stats(const scalar_t* xs, int n, acc_t shift,
                                             acc_t* scratch,
                                             const scalar_t* __restrict__ addend = nullptr,
                                             int start = 0, int chan_len = 1) {
    const Pack<V>* packs = reinterpret_cast<const Pack<V>*>(xs);
    acc_t slice_mean = 0;
    if (STAT == STAT_MEAN_VAR) {
        acc_t s = 0;
        for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
            acc_t v[V];
            slice_values<V, SHIFTED>(packs, p, shift, addend, start, chan_len, v);
#pragma unroll
            for (int j = 0; j < V; ++j) s += v[j];
        }
        s = block_sum(s, scratch);
        slice_mean = n > 0 ? s / acc_t(n) : acc_t(0);
    }
    acc_t q = 0;
    for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
        acc_t v[V];
        slice_values<V, SHIFTED>(packs, p, shift, addend, start, chan_len, v);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t d = v[j] - slice_mean;
            q += d * d;
        }
    }
    q = block_sum(q, scratch);
    return Stats{acc_t(n), slice_mean, q};
}

// s = x + residual (rounded to scalar_t) over a slice held in shared memory, in place, also
// written to sum_out. Each thread touches the packs it loaded (and later reduces).
template <int V>
__device__ __forceinline__ void slice_add_residual(scalar_t* xs,
                                                   const scalar_t* __restrict__ residual,
                                                   scalar_t* __restrict__ sum_out, int64 base,
                                                   int n) {
    for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
        Pack<V> v = *reinterpret_cast<const Pack<V>*>(xs + p * V);
        const Pack<V> r = load_pack<V>(residual + base, p);
#pragma unroll
        for (int j = 0; j < V; ++j) v.v[j] = from_acc<scalar_t>(to_acc(v.v[j]) + to_acc(r.v[j]));
        *reinterpret_cast<Pack<V>*>(xs + p * V) = v;
        store_pack<V>(sum_out + base, p, v);
    }
}

// After the team has published: its triples merged in rank order (every CTA gets the same bits),
// returned to every thread as (mean relative to K, M2).
__device__ __forceinline__ Stats team_merged(int64 seg, int team, const acc_t* partials,
                                             acc_t* scratch) {
    if (threadIdx.x < 32) {
        Stats m = stats_empty();
        for (int r = threadIdx.x; r < team; r += 32) {
            const volatile acc_t* slot = partials + 3 * (seg * team + r);
            m = stats_merge(m, Stats{slot[0], slot[1], slot[2]});
        }
        m = warp_stats(m);
        if (threadIdx.x == 0) {
            scratch[0] = m.mean;
            scratch[1] = m.m2;
        }
    }
    __syncthreads();
    const Stats merged{acc_t(0), scratch[0], scratch[1]};
    __syncthreads();  // scratch is free again
    return merged;
}

// The AFFINE value t, or silu(t) for the AFFINE_SILU epilogue (a compile-time choice: the plain
// affine kernel's code is unchanged).
template <int EPILOGUE>
__device__ __forceinline__ acc_t affine_out(acc_t t) {
    if (EPILOGUE == EPILOGUE_AFFINE_SILU) return t * sigmoid_acc(t);
    return t;
}

// Normalize a slice from shared memory into y (and write the segment's statistics from rank 0).
template <int V, int EPILOGUE, bool SHIFTED = false>
__device__ __forceinline__ void slice_write(
    const scalar_t* xs, const scalar_t* __restrict__ other, out_t* __restrict__ y,
    const param_t* __restrict__ weight, const param_t* __restrict__ bias,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out, acc_t* __restrict__ var_out,
    int64 seg, int rank, int start, int n, int seg_len, int chan_len, int chans_per_group,
    int groups, acc_t eps, acc_t shift, Stats st, const scalar_t* __restrict__ addend = nullptr) {
    const int64 base = seg * static_cast<int64>(seg_len) + start;
    const acc_t mean = shift + st.mean;
    const acc_t var = st.m2 / acc_t(seg_len);
    const acc_t rstd = rsqrt_acc(var + eps);
    if (rank == 0 && threadIdx.x == 0) {  // statistics the caller asked for
        if (mean_out != nullptr) mean_out[seg] = mean;
        if (rstd_out != nullptr) rstd_out[seg] = rstd;
        if (var_out != nullptr) var_out[seg] = var;
    }
    const int channel_base = static_cast<int>(seg % groups) * chans_per_group;
    for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
        const Pack<V> xv = *reinterpret_cast<const Pack<V>*>(xs + p * V);
        OutPack<V> out;
        if (EPILOGUE == EPILOGUE_ADD_MUL) {
            const Pack<V> rv = load_pack<V>(other + base, p);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t r = to_acc(rv.v[j]);
                out.v[j] = from_acc<out_t>(((to_acc(xv.v[j]) - mean) * rstd + r) * r);
            }
        } else if (EPILOGUE == EPILOGUE_ROW_CAST) {
            acc_t w[V];
            load_row_params<V>(weight, start + p * V, acc_t(1), w);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = to_acc(from_acc<scalar_t>((to_acc(xv.v[j]) - mean) * rstd));
                out.v[j] = from_acc<out_t>(w[j] * xhat);
            }
        } else if (EPILOGUE == EPILOGUE_ROW) {
            const int pos = start + p * V;  // weight and bias are indexed by position in the row
            acc_t w[V], b[V];
            load_row_params<V>(weight, pos, acc_t(1), w);
            load_row_params<V>(bias, pos, acc_t(0), b);
#pragma unroll
            for (int j = 0; j < V; ++j)
                out.v[j] = from_acc<out_t>((to_acc(xv.v[j]) - mean) * rstd * w[j] + b[j]);
        } else {
            // one division per pack; a pack within one channel shares its (a, b)
            const int pos = start + p * V;
            int c = pos / chan_len;
            int within = pos - c * chan_len;
            // (s - mean) * a + b = (x - mean) * a + (b + addend * a); addend: the segment's
            auto bias_of = [&](int c, acc_t a) {
                acc_t b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
                if (SHIFTED) b += to_acc(addend[c - channel_base]) * a;
                return b;
            };
            c += channel_base;
            if (within + V <= chan_len) {
                const acc_t a = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
                const acc_t b = bias_of(c, a);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    out.v[j] = from_acc<out_t>(
                        affine_out<EPILOGUE>((to_acc(xv.v[j]) - mean) * a + b));
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    if (within == chan_len) {
                        ++c;
                        within = 0;
                    }
                    ++within;
                    const acc_t a = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
                    const acc_t b = bias_of(c, a);
                    out.v[j] = from_acc<out_t>(
                        affine_out<EPILOGUE>((to_acc(xv.v[j]) - mean) * a + b));
                }
            }
        }
        store_pack<V>(y + base, p, out);
    }
}

// One slice per CTA: load, [residual add,] statistics, exchange (team > 1), write.
template <int V, int EPILOGUE, int STAT = STAT_MEAN_VAR, bool SHIFTED = false>
__device__ __forceinline__ void segment_norm_fwd(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
    scalar_t* __restrict__ sum_out, const scalar_t* __restrict__ other, out_t* __restrict__ y,
    const param_t* __restrict__ weight, const param_t* __restrict__ bias,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out, acc_t* __restrict__ var_out,
    int seg_len, int slice_len, int chan_len, int chans_per_group, int groups, acc_t eps, int team,
    int* __restrict__ tickets, acc_t* __restrict__ partials,
    const scalar_t* __restrict__ addend = nullptr) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    scalar_t* xs = reinterpret_cast<scalar_t*>(smem_raw);
    __shared__ acc_t scratch[33];
    int64 seg;
    int rank;
    team_place(team, tickets, seg, rank);
    const int start = rank * slice_len;
    const int n_local = max(0, min(slice_len, seg_len - start));
    const int64 seg_base = seg * static_cast<int64>(seg_len);
    slice_load<V>(xs, x, seg_base + start, n_local);
    acc_t shift = 0;  // loads with the slice
    if (STAT == STAT_MEAN_VAR) {
        shift = to_acc(x[seg_base]);
        if (residual != nullptr)  // the first value of the sum, rounded as the sum is
            shift = to_acc(from_acc<scalar_t>(shift + to_acc(residual[seg_base])));
    }
    slice_load_wait();
    if (residual != nullptr) {
        slice_add_residual<V>(xs, residual, sum_out, seg_base + start, n_local);
        __syncthreads();
    }
    // addend of segment (n, g): addend[n * C + g * Cg ...] == addend[seg * Cg ...]
    const scalar_t* __restrict__ seg_addend = SHIFTED ? addend + seg * chans_per_group : nullptr;
    Stats st = slice_stats<V, STAT, SHIFTED>(xs, n_local, shift, scratch, seg_addend, start, chan_len);
    if (team > 1) {
        if (threadIdx.x == 0) {
            const acc_t mine[3] = {st.n, st.mean, st.m2};
            team_publish_and_wait<3>(mine, seg, rank, team, tickets, partials);
        }
        __syncthreads();
        st = team_merged(seg, team, partials, scratch);
    }
    slice_write<V, EPILOGUE, SHIFTED>(xs, other, y, weight, bias, mean_out, rstd_out, var_out, seg,
                                      rank, start, n_local, seg_len, chan_len, chans_per_group,
                                      groups, eps, shift, st, seg_addend);
}

// GroupNorm / InstanceNorm (AFFINE) and GroupNorm + SiLU (AFFINE_SILU), each also SHIFTED (the
// _shift entries: addend (N, C) is read; the others ignore it). vectorized: slices start 16-byte
// aligned and hold whole packs (host checks pointers, seg_len and slice_len are multiples of VEC).
#define AFFINE_FWD_ENTRY(NAME, EPILOGUE, SHIFTED)                                                  \
    extern "C" __global__ void NAME(                                                              \
        const scalar_t* __restrict__ x, out_t* __restrict__ y,                                    \
        const param_t* __restrict__ weight, const param_t* __restrict__ bias,                     \
        acc_t* __restrict__ mean, acc_t* __restrict__ rstd, acc_t* __restrict__ var, int seg_len, \
        int slice_len, int chan_len, int chans_per_group, int groups, acc_t eps, int team,        \
        int* __restrict__ tickets, acc_t* __restrict__ partials, int vectorized,                  \
        const scalar_t* __restrict__ addend) {                                                    \
        if (vectorized)                                                                           \
            segment_norm_fwd<VEC, EPILOGUE, STAT_MEAN_VAR, SHIFTED>(                              \
                x, nullptr, nullptr, nullptr, y, weight, bias, mean, rstd, var, seg_len,          \
                slice_len, chan_len, chans_per_group, groups, eps, team, tickets, partials,       \
                addend);                                                                          \
        else                                                                                      \
            segment_norm_fwd<1, EPILOGUE, STAT_MEAN_VAR, SHIFTED>(                                \
                x, nullptr, nullptr, nullptr, y, weight, bias, mean, rstd, var, seg_len,          \
                slice_len, chan_len, chans_per_group, groups, eps, team, tickets, partials,       \
                addend);                                                                          \
    }

AFFINE_FWD_ENTRY(segment_norm_fwd_affine, EPILOGUE_AFFINE, false)
AFFINE_FWD_ENTRY(segment_norm_fwd_affine_silu, EPILOGUE_AFFINE_SILU, false)
AFFINE_FWD_ENTRY(segment_norm_fwd_affine_shift, EPILOGUE_AFFINE, true)
AFFINE_FWD_ENTRY(segment_norm_fwd_affine_silu_shift, EPILOGUE_AFFINE_SILU, true)

extern "C" __global__ void segment_norm_fwd_add_mul(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other, out_t* __restrict__ y,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int seg_len, int slice_len, acc_t eps,
    int team, int* __restrict__ tickets, acc_t* __restrict__ partials, int vectorized) {
    if (vectorized)
        segment_norm_fwd<VEC, EPILOGUE_ADD_MUL>(x, nullptr, nullptr, other, y, nullptr, nullptr,
                                                mean, rstd, nullptr, seg_len, slice_len, seg_len,
                                                1, 1, eps, team, tickets, partials);
    else
        segment_norm_fwd<1, EPILOGUE_ADD_MUL>(x, nullptr, nullptr, other, y, nullptr, nullptr,
                                              mean, rstd, nullptr, seg_len, slice_len, seg_len, 1,
                                              1, eps, team, tickets, partials);
}

// ------------------------------------------------------------------------------------------------
// Backward of the ADD_MUL epilogue, one CTA per row of D = seg_len elements, r = other:
//   xhat = (x - mean) * rstd,  out = (xhat + r) * r
//   dr   = dout * (xhat + 2 r)
//   g    = dout * r                                   (dL/dxhat)
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
// x, r and dout are read once; dr is written in the first pass, g and xhat stay in shared memory
// (acc_t, laid out [V][D / V] so a warp's stores hit distinct banks) for the dx pass.
template <int V>
__device__ __forceinline__ void add_mul_bwd(const scalar_t* __restrict__ x,
                                            const scalar_t* __restrict__ other,
                                            const scalar_t* __restrict__ dout,
                                            const acc_t* __restrict__ mean,
                                            const acc_t* __restrict__ rstd,
                                            scalar_t* __restrict__ dx, scalar_t* __restrict__ dother,
                                            int seg_len) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    acc_t* g_s = reinterpret_cast<acc_t*>(smem_raw);
    acc_t* xhat_s = g_s + seg_len;
    __shared__ acc_t scratch[33];
    const int64 row = blockIdx.x;
    const int64 base = row * static_cast<int64>(seg_len);
    const int n_packs = seg_len / V;
    const acc_t m = mean[row], rs = rstd[row];
    acc_t sg = 0, sgx = 0;
    for (int p = threadIdx.x; p < n_packs; p += blockDim.x) {
        const Pack<V> xv = load_pack<V>(x + base, p), rv = load_pack<V>(other + base, p),
                      dv = load_pack<V>(dout + base, p);
        Pack<V> dr;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t xhat = (to_acc(xv.v[j]) - m) * rs, r = to_acc(rv.v[j]), d = to_acc(dv.v[j]);
            const acc_t g = d * r;
            dr.v[j] = from_acc<scalar_t>(d * (xhat + acc_t(2) * r));
            g_s[j * n_packs + p] = g;
            xhat_s[j * n_packs + p] = xhat;
            sg += g;
            sgx += g * xhat;
        }
        store_pack<V>(dother + base, p, dr);
    }
    sg = block_sum(sg, scratch);
    sgx = block_sum(sgx, scratch);
    const acc_t mean_g = sg / acc_t(seg_len), mean_gx = sgx / acc_t(seg_len);
    for (int p = threadIdx.x; p < n_packs; p += blockDim.x) {  // the entries this thread wrote
        Pack<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t g = g_s[j * n_packs + p], xhat = xhat_s[j * n_packs + p];
            out.v[j] = from_acc<scalar_t>(rs * (g - mean_g - xhat * mean_gx));
        }
        store_pack<V>(dx + base, p, out);
    }
}

extern "C" __global__ void segment_norm_bwd_add_mul(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other,
    const scalar_t* __restrict__ dout, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx, scalar_t* __restrict__ dother,
    int seg_len, int vectorized) {
    if (vectorized)
        add_mul_bwd<VEC>(x, other, dout, mean, rstd, dx, dother, seg_len);
    else
        add_mul_bwd<1>(x, other, dout, mean, rstd, dx, dother, seg_len);
}

// ------------------------------------------------------------------------------------------------
// Backward of the AFFINE epilogue for one channel per segment (InstanceNorm on NCHW), on chip:
// x and dy of the slice are read once into shared memory, the slice's sums
//   sdy = sum dy,  sdx = sum dy (x - mean)
// are added over the team (rank order), and dx is written from shared memory:
//   dx = (x - mean) * u + v + dy * rstd * w,  u = -rstd^3 w sdx / L,  v = -rstd w sdy / L
// (strided_norm.cu derives it). The segment's (sdy, sdx) go to sums[seg] for dweight and dbias,
// which strided_norm_bwd_finalize reduces over the batch. Three passes instead of five.
template <int V>
__device__ __forceinline__ void segment_bwd(const scalar_t* __restrict__ x,
                                            const scalar_t* __restrict__ dy,
                                            const param_t* __restrict__ weight,
                                            const acc_t* __restrict__ mean,
                                            const acc_t* __restrict__ rstd,
                                            scalar_t* __restrict__ dx, acc_t* __restrict__ sums,
                                            int seg_len, int slice_len, int channels, int team,
                                            int* __restrict__ tickets,
                                            acc_t* __restrict__ partials) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    scalar_t* xs = reinterpret_cast<scalar_t*>(smem_raw);
    scalar_t* dys = xs + slice_len;
    __shared__ acc_t scratch[33];
    int64 seg;
    int rank;
    team_place(team, tickets, seg, rank);
    const int tid = threadIdx.x;
    const int start = rank * slice_len;
    const int n_local = max(0, min(slice_len, seg_len - start));
    const int64 base = seg * static_cast<int64>(seg_len) + start;
    if (V == VEC) {
        for (int p = tid; p < n_local / V; p += blockDim.x) {
            cp_async16(xs + p * V, x + base + p * V);
            cp_async16(dys + p * V, dy + base + p * V);
        }
        cp_async_wait_all();
    } else {
        for (int i = tid; i < n_local; i += blockDim.x) {
            xs[i] = x[base + i];
            dys[i] = dy[base + i];
        }
    }
    __syncthreads();
    const acc_t m = mean[seg], rs = rstd[seg];
    const Pack<V>* xp = reinterpret_cast<const Pack<V>*>(xs);
    const Pack<V>* dp = reinterpret_cast<const Pack<V>*>(dys);
    acc_t sdy = 0, sdx = 0;
    for (int p = tid; p < n_local / V; p += blockDim.x) {
        const Pack<V> a = xp[p], d = dp[p];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t g = to_acc(d.v[j]);
            sdy += g;
            sdx += g * (to_acc(a.v[j]) - m);
        }
    }
    sdy = block_sum(sdy, scratch);
    sdx = block_sum(sdx, scratch);
    if (team > 1) {
        if (tid == 0) {
            const acc_t mine[2] = {sdy, sdx};
            team_publish_and_wait<2>(mine, seg, rank, team, tickets, partials);
        }
        __syncthreads();
        if (tid < 32) {
            acc_t a = 0, b = 0;
            for (int r = tid; r < team; r += 32) {
                const volatile acc_t* slot = partials + 2 * (seg * team + r);
                a += slot[0];
                b += slot[1];
            }
            a = warp_sum(a);
            b = warp_sum(b);
            if (tid == 0) {
                scratch[0] = a;
                scratch[1] = b;
            }
        }
        __syncthreads();
        sdy = scratch[0];
        sdx = scratch[1];
    }
    if (rank == 0 && tid == 0) {
        sums[2 * seg + 0] = sdy;
        sums[2 * seg + 1] = sdx;
    }
    const acc_t w = weight != nullptr ? to_acc(weight[seg % channels]) : acc_t(1);
    const acc_t L = acc_t(seg_len);
    const acc_t u = -rs * rs * rs * w * sdx / L, v = -rs * w * sdy / L, g = rs * w;
    for (int p = tid; p < n_local / V; p += blockDim.x) {
        const Pack<V> a = xp[p], d = dp[p];
        Pack<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j)
            out.v[j] = from_acc<scalar_t>((to_acc(a.v[j]) - m) * u + v + to_acc(d.v[j]) * g);
        store_pack<V>(dx + base, p, out);
    }
}

extern "C" __global__ void segment_norm_bwd_instance(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const param_t* __restrict__ weight, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, scalar_t* __restrict__ dx, acc_t* __restrict__ sums,
    int seg_len, int slice_len, int channels, int team, int* __restrict__ tickets,
    acc_t* __restrict__ partials, int vectorized) {
    if (vectorized)
        segment_bwd<VEC>(x, dy, weight, mean, rstd, dx, sums, seg_len, slice_len, channels, team,
                         tickets, partials);
    else
        segment_bwd<1>(x, dy, weight, mean, rstd, dx, sums, seg_len, slice_len, channels, team,
                       tickets, partials);
}

// ================================================================================================
// Row norms: LayerNorm and RMSNorm over the last L = row_len elements of each row, weight and
// bias indexed by position in the row, optionally after a residual add s = x + residual (s is
// written out and normalized).
//
// Aligned rows of whole packs, up to 1024 of them, run on row_norm.cu (held in registers); the
// rest here.
// Forward, rows a team holds on chip: segment_norm_fwd with the ROW epilogue (one read, one
// write): segment_norm_fwd_layer / segment_norm_fwd_rms. Longer rows: the strided rows statistics
// (strided_norm.cu), segment_norm_rms_rstd for RMS, then segment_norm_apply_rows.
//
// Backward, with g_i = weight[i] * dy_i, xhat_i = (x_i - mean) * rstd (RMS: mean = 0) and <.> the
// mean over the row:
//   LayerNorm: dx_i = rstd * (g_i - <g> - xhat_i * <g xhat>)
//   RMSNorm:   dx_i = rstd * (g_i - xhat_i * <g xhat>)
//   dweight[i] = sum over rows of dy_i * xhat_i,  dbias[i] = sum over rows of dy_i
// With a residual, x is the sum s and the incoming gradient of s is added to dx (the gradient of
// both x and residual). Passes, all deterministic (fixed orders, no atomics):
//   segment_norm_bwd_rows_sums   per (row, tile): the partial sums (sum g, sum g * xhat)
//   segment_norm_bwd_rows_merge  per row: the tiles' sums added in tile order (tiles > 1 only)
//   segment_norm_bwd_rows_dx     per (column tile, group of rows): dx, and fp32 partial rows of
//                                dweight / dbias over the group's rows (kept in registers)
//   row_norm_bwd_params          column sums of those partial rows, in group order (row_norm.cu)
// ================================================================================================
// The row forwards share one argument list; residual, sum_out: both null (no residual add) or
// both set; bias: null for RMSNorm. vectorized: as segment_norm_fwd_affine.
#define ROW_FWD_ENTRY(NAME, EPILOGUE, STAT)                                                      \
    extern "C" __global__ void NAME(                                                             \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,                   \
        scalar_t* __restrict__ sum_out, out_t* __restrict__ y,                                   \
        const param_t* __restrict__ weight, const param_t* __restrict__ bias,                    \
        acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int row_len, int slice_len,          \
        acc_t eps, int team, int* __restrict__ tickets, acc_t* __restrict__ partials,            \
        int vectorized) {                                                                        \
        if (vectorized)                                                                          \
            segment_norm_fwd<VEC, EPILOGUE, STAT>(x, residual, sum_out, nullptr, y, weight, bias, \
                                                  mean, rstd, nullptr, row_len, slice_len,       \
                                                  row_len, 1, 1, eps, team, tickets, partials);  \
        else                                                                                     \
            segment_norm_fwd<1, EPILOGUE, STAT>(x, residual, sum_out, nullptr, y, weight, bias,   \
                                                mean, rstd, nullptr, row_len, slice_len, row_len, \
                                                1, 1, eps, team, tickets, partials);             \
    }

ROW_FWD_ENTRY(segment_norm_fwd_layer, EPILOGUE_ROW, STAT_MEAN_VAR)
ROW_FWD_ENTRY(segment_norm_fwd_rms, EPILOGUE_ROW, STAT_RMS)
// RMSNorm with the ROW_CAST epilogue (xhat rounded to the input's type before the weight)
ROW_FWD_ENTRY(segment_norm_fwd_rms_cast, EPILOGUE_ROW_CAST, STAT_RMS)

// RMS of rows too long for a team, from the strided passes' mean and biased variance:
// mean square = var + mean^2 (two non-negative terms: no cancellation).
extern "C" __global__ void segment_norm_rms_rstd(const acc_t* __restrict__ mean,
                                                 const acc_t* __restrict__ var,
                                                 acc_t* __restrict__ rstd, int64 rows, acc_t eps) {
    const int64 r = blockIdx.x * static_cast<int64>(blockDim.x) + threadIdx.x;
    if (r < rows) rstd[r] = rsqrt_acc(var[r] + mean[r] * mean[r] + eps);
}

// y = (x - mean) * rstd * weight[i] + bias[i] for rows too long for a team. Grid: tiles * rows,
// tile_len elements per CTA (a multiple of V). mean null: RMS. CAST: the ROW_CAST epilogue
// (RMS, no bias: y = round(weight[i] * round(x * rstd))).
//
// Tile-major (CTA = tile * rows + row): the rows' CTAs of one tile run together, so each tile of
// weight and bias is read from DRAM once and from L2 by the other rows. Row-major, every row read
// the parameters again once they had left L2 (LayerNorm((64, 256, 256)) fp32: 32 MB of them per
// row of 16 MB; forward 0.297 -> 0.220 ms on an H200, NOTES.md).
template <int V, bool CAST = false>
__device__ __forceinline__ void rows_apply(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                           const param_t* __restrict__ weight,
                                           const param_t* __restrict__ bias,
                                           const acc_t* __restrict__ mean,
                                           const acc_t* __restrict__ rstd, int64 row_len,
                                           int64 tiles, int64 tile_len) {
    const int64 rows = gridDim.x / tiles;
    const int64 row = blockIdx.x % rows, tile = blockIdx.x / rows;
    const int64 base = row * row_len;
    const acc_t m = mean != nullptr ? mean[row] : acc_t(0), rs = rstd[row];
    const int64 last = min(row_len, (tile + 1) * tile_len) / V;
    for (int64 p = tile * tile_len / V + threadIdx.x; p < last; p += blockDim.x) {
        const Pack<V> xv = load_pack<V>(x + base, p);
        acc_t w[V], b[V];
        load_row_params<V>(weight != nullptr ? weight + p * V : nullptr, 0, acc_t(1), w);
        load_row_params<V>(bias != nullptr ? bias + p * V : nullptr, 0, acc_t(0), b);
        Pack<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (CAST)
                out.v[j] =
                    from_acc<scalar_t>(w[j] * to_acc(from_acc<scalar_t>(to_acc(xv.v[j]) * rs)));
            else
                out.v[j] = from_acc<scalar_t>((to_acc(xv.v[j]) - m) * rs * w[j] + b[j]);
        }
        store_pack<V>(y + base, p, out);
    }
}

// vectorized: pointers 16-byte aligned, row_len and tile_len multiples of VEC.
extern "C" __global__ void segment_norm_apply_rows(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, int64 row_len, int64 tiles, int64 tile_len, int vectorized) {
    if (vectorized)
        rows_apply<VEC>(x, y, weight, bias, mean, rstd, row_len, tiles, tile_len);
    else
        rows_apply<1>(x, y, weight, bias, mean, rstd, row_len, tiles, tile_len);
}

// segment_norm_apply_rows with the ROW_CAST epilogue (mean and bias null).
extern "C" __global__ void segment_norm_apply_rows_cast(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, int64 row_len, int64 tiles, int64 tile_len, int vectorized) {
    if (vectorized)
        rows_apply<VEC, true>(x, y, weight, bias, mean, rstd, row_len, tiles, tile_len);
    else
        rows_apply<1, true>(x, y, weight, bias, mean, rstd, row_len, tiles, tile_len);
}

// ---- backward ----------------------------------------------------------------------------------
// Per (row, tile): sums[2 * (row * tiles + tile) + {0, 1}] = (sum g, sum g * xhat) over the
// tile. Grid tile-major, as rows_apply (the weight's tiles read once from DRAM).
template <int V>
__device__ __forceinline__ void rows_bwd_sums(const scalar_t* __restrict__ x,
                                              const scalar_t* __restrict__ dy,
                                              const param_t* __restrict__ weight,
                                              const acc_t* __restrict__ mean,
                                              const acc_t* __restrict__ rstd,
                                              acc_t* __restrict__ sums, int64 row_len, int64 tiles,
                                              int64 tile_len) {
    __shared__ acc_t scratch[33];
    const int64 rows = gridDim.x / tiles;
    const int64 row = blockIdx.x % rows, tile = blockIdx.x / rows;
    const int64 base = row * row_len;
    const acc_t m = mean != nullptr ? mean[row] : acc_t(0), rs = rstd[row];
    const int64 last = min(row_len, (tile + 1) * tile_len) / V;
    acc_t sg = 0, sgx = 0;
    for (int64 p = tile * tile_len / V + threadIdx.x; p < last; p += blockDim.x) {
        const Pack<V> xv = load_pack<V>(x + base, p), dv = load_pack<V>(dy + base, p);
        acc_t w[V];
        load_row_params<V>(weight != nullptr ? weight + p * V : nullptr, 0, acc_t(1), w);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t g = w[j] * to_acc(dv.v[j]);
            sg += g;
            sgx += g * ((to_acc(xv.v[j]) - m) * rs);
        }
    }
    sg = block_sum(sg, scratch);
    sgx = block_sum(sgx, scratch);
    if (threadIdx.x == 0) {
        sums[2 * (row * tiles + tile)] = sg;
        sums[2 * (row * tiles + tile) + 1] = sgx;
    }
}

extern "C" __global__ void segment_norm_bwd_rows_sums(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const param_t* __restrict__ weight, const acc_t* __restrict__ mean,
    const acc_t* __restrict__ rstd, acc_t* __restrict__ sums, int64 row_len, int64 tiles,
    int64 tile_len, int vectorized) {
    if (vectorized)
        rows_bwd_sums<VEC>(x, dy, weight, mean, rstd, sums, row_len, tiles, tile_len);
    else
        rows_bwd_sums<1>(x, dy, weight, mean, rstd, sums, row_len, tiles, tile_len);
}

// One warp per row: row_sums[2 r + k] = sum over tiles t of tile_sums[2 (r tiles + t) + k].
extern "C" __global__ void segment_norm_bwd_rows_merge(const acc_t* __restrict__ tile_sums,
                                                       acc_t* __restrict__ row_sums, int64 rows,
                                                       int64 tiles) {
    const int64 row = blockIdx.x * static_cast<int64>(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // the whole warp: warp_sum below sees all 32 lanes
    acc_t a = 0, b = 0;
    for (int64 t = lane; t < tiles; t += 32) {
        a += tile_sums[2 * (row * tiles + t)];
        b += tile_sums[2 * (row * tiles + t) + 1];
    }
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        row_sums[2 * row] = a;
        row_sums[2 * row + 1] = b;
    }
}

// Packs of a column tile each thread of segment_norm_bwd_rows_dx owns (the host's
// ROWS_BWD_PACKS_PER_THREAD): their weight and dweight / dbias partials stay in registers.
#define ROWS_BWD_PACKS 2

// Grid: col_tiles * groups; CTA (group, column tile) walks rows [group * rows_per_group, ...)
// over columns [tile * blockDim.x * ROWS_BWD_PACKS * V, ...). dx null: weight gradients only.
// dsum: the incoming gradient of the residual sum, or null. CAST (the ROW_CAST epilogue): the
// weight multiplied xhat rounded to the input's type, so dweight sums dy * round(xhat); dx is
// unchanged (the rounding's gradient is the identity).
template <int V, bool CAST = false>
__device__ __forceinline__ void rows_bwd_dx(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
    const acc_t* __restrict__ row_sums, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int64 row_len,
    int64 col_tiles, int64 rows_per_group) {
    const int64 col_tile = blockIdx.x % col_tiles, group = blockIdx.x / col_tiles;
    const int64 packs = row_len / V;
    int64 pk[ROWS_BWD_PACKS];
    acc_t w[ROWS_BWD_PACKS][V], dw[ROWS_BWD_PACKS][V], db[ROWS_BWD_PACKS][V];
#pragma unroll
    for (int k = 0; k < ROWS_BWD_PACKS; ++k) {
        pk[k] = (col_tile * ROWS_BWD_PACKS + k) * blockDim.x + threadIdx.x;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            w[k][j] = weight != nullptr && pk[k] < packs ? to_acc(weight[pk[k] * V + j]) : acc_t(1);
            dw[k][j] = db[k][j] = acc_t(0);
        }
    }
    const acc_t L = acc_t(row_len);
    const int64 last = min(rows, (group + 1) * rows_per_group);
    for (int64 r = group * rows_per_group; r < last; ++r) {
        const int64 base = r * row_len;
        const acc_t m = mean != nullptr ? mean[r] : acc_t(0), rs = rstd[r];
        acc_t mean_g = 0, mean_gx = 0;
        if (dx != nullptr) {
            mean_g = mean != nullptr ? row_sums[2 * r] / L : acc_t(0);  // RMS: no mean term
            mean_gx = row_sums[2 * r + 1] / L;
        }
#pragma unroll
        for (int k = 0; k < ROWS_BWD_PACKS; ++k) {
            if (pk[k] >= packs) continue;
            const Pack<V> xv = load_pack<V>(x + base, pk[k]), dv = load_pack<V>(dy + base, pk[k]);
            Pack<V> sv, out;
            if (dsum != nullptr) sv = load_pack<V>(dsum + base, pk[k]);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t xhat = (to_acc(xv.v[j]) - m) * rs, d = to_acc(dv.v[j]);
                dw[k][j] += d * (CAST ? to_acc(from_acc<scalar_t>(xhat)) : xhat);
                db[k][j] += d;
                acc_t v = rs * (w[k][j] * d - mean_g - xhat * mean_gx);
                if (dsum != nullptr) v += to_acc(sv.v[j]);
                out.v[j] = from_acc<scalar_t>(v);
            }
            if (dx != nullptr) store_pack<V>(dx + base, pk[k], out);
        }
    }
#pragma unroll
    for (int k = 0; k < ROWS_BWD_PACKS; ++k) {
        if (pk[k] >= packs) continue;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int64 i = group * row_len + pk[k] * V + j;
            if (dweight_part != nullptr) dweight_part[i] = dw[k][j];
            if (dbias_part != nullptr) dbias_part[i] = db[k][j];
        }
    }
}

// vectorized: pointers 16-byte aligned and row_len a multiple of VEC.
extern "C" __global__ void segment_norm_bwd_rows_dx(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
    const acc_t* __restrict__ row_sums, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int64 row_len,
    int64 col_tiles, int64 rows_per_group, int vectorized) {
    if (vectorized)
        rows_bwd_dx<VEC>(x, dy, dsum, weight, mean, rstd, row_sums, dx, dweight_part, dbias_part,
                         rows, row_len, col_tiles, rows_per_group);
    else
        rows_bwd_dx<1>(x, dy, dsum, weight, mean, rstd, row_sums, dx, dweight_part, dbias_part,
                       rows, row_len, col_tiles, rows_per_group);
}

// segment_norm_bwd_rows_dx of the ROW_CAST epilogue (dweight of the rounded xhat).
extern "C" __global__ void segment_norm_bwd_rows_dx_cast(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
    const scalar_t* __restrict__ dsum, const param_t* __restrict__ weight,
    const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
    const acc_t* __restrict__ row_sums, scalar_t* __restrict__ dx,
    acc_t* __restrict__ dweight_part, acc_t* __restrict__ dbias_part, int64 rows, int64 row_len,
    int64 col_tiles, int64 rows_per_group, int vectorized) {
    if (vectorized)
        rows_bwd_dx<VEC, true>(x, dy, dsum, weight, mean, rstd, row_sums, dx, dweight_part,
                               dbias_part, rows, row_len, col_tiles, rows_per_group);
    else
        rows_bwd_dx<1, true>(x, dy, dsum, weight, mean, rstd, row_sums, dx, dweight_part,
                             dbias_part, rows, row_len, col_tiles, rows_per_group);
}
