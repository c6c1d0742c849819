// segment_norm.cu: normalization of contiguous segments held on chip (one read, one write).
//
// A segment is a contiguous run of L = seg_len elements sharing one (mean, rstd):
//   GroupNorm / InstanceNorm on NCHW: segment (n, g) = channels g*Cg .. (g+1)*Cg-1 of sample n,
//     L = Cg * S (S = spatial size), element i belongs to channel c = g*Cg + i / S;
//   row norms: a row of D features (chan_len = D, one "channel").
//
//   mean = sum_i x_i / L,  var = sum_i (x_i - mean)^2 / L (biased),  rstd = 1 / sqrt(var + eps)
//   AFFINE epilogue:  y_i = (x_i - mean) * (rstd * weight[c]) + bias[c]
//   ADD_MUL epilogue: y_i = ((x_i - mean) * rstd + r_i) * r_i   (the seed-002 tail, r = other)
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
template <int V>
__device__ __forceinline__ Stats slice_stats(const scalar_t* xs, int n, acc_t shift,
                                             acc_t* scratch) {
    const Pack<V>* packs = reinterpret_cast<const Pack<V>*>(xs);
    acc_t s = 0;
    for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
        const Pack<V> v = packs[p];
#pragma unroll
        for (int j = 0; j < V; ++j) s += to_acc(v.v[j]) - shift;
    }
    s = block_sum(s, scratch);
    const acc_t slice_mean = n > 0 ? s / acc_t(n) : acc_t(0);
    acc_t q = 0;
    for (int p = threadIdx.x; p < n / V; p += blockDim.x) {
        const Pack<V> v = packs[p];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const acc_t d = (to_acc(v.v[j]) - shift) - slice_mean;
            q += d * d;
        }
    }
    q = block_sum(q, scratch);
    return Stats{acc_t(n), slice_mean, q};
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

// Normalize a slice from shared memory into y (and write the segment's statistics from rank 0).
template <int V, int EPILOGUE>
__device__ __forceinline__ void slice_write(
    const scalar_t* xs, const scalar_t* __restrict__ other, scalar_t* __restrict__ y,
    const param_t* __restrict__ weight, const param_t* __restrict__ bias,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out, acc_t* __restrict__ var_out,
    int64 seg, int rank, int start, int n, int seg_len, int chan_len, int chans_per_group,
    int groups, acc_t eps, acc_t shift, Stats st) {
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
        Pack<V> out;
        if (EPILOGUE == EPILOGUE_ADD_MUL) {
            const Pack<V> rv = load_pack<V>(other + base, p);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const acc_t r = to_acc(rv.v[j]);
                out.v[j] = from_acc<scalar_t>(((to_acc(xv.v[j]) - mean) * rstd + r) * r);
            }
        } else {
            // one division per pack; a pack within one channel shares its (a, b)
            const int pos = start + p * V;
            int c = pos / chan_len;
            int within = pos - c * chan_len;
            c += channel_base;
            if (within + V <= chan_len) {
                const acc_t a = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
                const acc_t b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    out.v[j] = from_acc<scalar_t>((to_acc(xv.v[j]) - mean) * a + b);
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    if (within == chan_len) {
                        ++c;
                        within = 0;
                    }
                    ++within;
                    const acc_t a = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
                    const acc_t b = bias != nullptr ? to_acc(bias[c]) : acc_t(0);
                    out.v[j] = from_acc<scalar_t>((to_acc(xv.v[j]) - mean) * a + b);
                }
            }
        }
        store_pack<V>(y + base, p, out);
    }
}

// One slice per CTA: load, statistics, exchange (team > 1), write.
template <int V, int EPILOGUE>
__device__ __forceinline__ void segment_norm_fwd(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other, scalar_t* __restrict__ y,
    const param_t* __restrict__ weight, const param_t* __restrict__ bias,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out, acc_t* __restrict__ var_out,
    int seg_len, int slice_len, int chan_len, int chans_per_group, int groups, acc_t eps, int team,
    int* __restrict__ tickets, acc_t* __restrict__ partials) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    scalar_t* xs = reinterpret_cast<scalar_t*>(smem_raw);
    __shared__ acc_t scratch[33];
    int64 seg;
    int rank;
    team_place(team, tickets, seg, rank);
    const int start = rank * slice_len;
    const int n_local = max(0, min(slice_len, seg_len - start));
    slice_load<V>(xs, x, seg * static_cast<int64>(seg_len) + start, n_local);
    const acc_t shift = to_acc(x[seg * static_cast<int64>(seg_len)]);  // loads with the slice
    slice_load_wait();
    Stats st = slice_stats<V>(xs, n_local, shift, scratch);
    if (team > 1) {
        if (threadIdx.x == 0) {
            const acc_t mine[3] = {st.n, st.mean, st.m2};
            team_publish_and_wait<3>(mine, seg, rank, team, tickets, partials);
        }
        __syncthreads();
        st = team_merged(seg, team, partials, scratch);
    }
    slice_write<V, EPILOGUE>(xs, other, y, weight, bias, mean_out, rstd_out, var_out, seg, rank,
                             start, n_local, seg_len, chan_len, chans_per_group, groups, eps, shift,
                             st);
}

// vectorized: slices start 16-byte aligned and hold whole packs (host checks pointers, seg_len
// and slice_len are multiples of VEC).
extern "C" __global__ void segment_norm_fwd_affine(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean, acc_t* __restrict__ rstd,
    acc_t* __restrict__ var, int seg_len, int slice_len, int chan_len, int chans_per_group,
    int groups, acc_t eps, int team, int* __restrict__ tickets, acc_t* __restrict__ partials,
    int vectorized) {
    if (vectorized)
        segment_norm_fwd<VEC, EPILOGUE_AFFINE>(x, nullptr, y, weight, bias, mean, rstd, var, seg_len,
                                               slice_len, chan_len, chans_per_group, groups, eps,
                                               team, tickets, partials);
    else
        segment_norm_fwd<1, EPILOGUE_AFFINE>(x, nullptr, y, weight, bias, mean, rstd, var, seg_len,
                                             slice_len, chan_len, chans_per_group, groups, eps,
                                             team, tickets, partials);
}

extern "C" __global__ void segment_norm_fwd_add_mul(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other, scalar_t* __restrict__ y,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int seg_len, int slice_len, acc_t eps,
    int team, int* __restrict__ tickets, acc_t* __restrict__ partials, int vectorized) {
    if (vectorized)
        segment_norm_fwd<VEC, EPILOGUE_ADD_MUL>(x, other, y, nullptr, nullptr, mean, rstd, nullptr,
                                                seg_len, slice_len, seg_len, 1, 1, eps, team,
                                                tickets, partials);
    else
        segment_norm_fwd<1, EPILOGUE_ADD_MUL>(x, other, y, nullptr, nullptr, mean, rstd, nullptr,
                                              seg_len, slice_len, seg_len, 1, 1, eps, team,
                                              tickets, partials);
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
