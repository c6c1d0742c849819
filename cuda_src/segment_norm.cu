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
// Mapping: the segment is split into CLUSTER_SIZE slices of slice_len elements, one CTA each (a
// thread-block cluster on sm_90 when CLUSTER_SIZE > 1). Each CTA copies its slice into shared
// memory with cp.async, computes the slice's exact two-pass (count, mean, M2), the CTAs of a
// cluster exchange those triples through distributed shared memory and Chan-merge them in rank
// order (every CTA gets the same bits), then each CTA writes its normalized slice from shared
// memory. Grid: one CTA per slice, blockIdx.x = segment * CLUSTER_SIZE + rank.
#include "common.cuh"

#ifndef CLUSTER_SIZE
#define CLUSTER_SIZE 1
#endif

#define EPILOGUE_AFFINE 0
#define EPILOGUE_ADD_MUL 1

#if CLUSTER_SIZE > 1
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Read an acc_t from the same shared-memory variable of CTA `rank` in this cluster.
__device__ __forceinline__ acc_t load_peer(const acc_t* local, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    acc_t v;
    if (sizeof(acc_t) == 8) {
        double d;
        asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(d) : "r"(remote) : "memory");
        v = static_cast<acc_t>(d);
    } else {
        float f;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(f) : "r"(remote) : "memory");
        v = static_cast<acc_t>(f);
    }
    return v;
}
#endif

template <int V, int EPILOGUE>
__device__ __forceinline__ void segment_norm_fwd(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other, scalar_t* __restrict__ y,
    const param_t* __restrict__ weight, const param_t* __restrict__ bias,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ rstd_out, acc_t* __restrict__ var_out,
    int seg_len, int slice_len, int chan_len, int chans_per_group, int groups, acc_t eps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    scalar_t* xs = reinterpret_cast<scalar_t*>(smem_raw);
    __shared__ acc_t scratch[33];
    __shared__ acc_t slice_stats[3];

    const int64 seg = blockIdx.x / CLUSTER_SIZE;
#if CLUSTER_SIZE > 1
    const int rank = static_cast<int>(cluster_rank());
#else
    const int rank = 0;
#endif
    const int start = rank * slice_len;
    const int n_local = max(0, min(slice_len, seg_len - start));
    const int64 base = seg * static_cast<int64>(seg_len) + start;
    const int tid = threadIdx.x;

    // 1. slice -> shared memory (V == VEC: 16-byte cp.async; V == 1: plain copies)
    if (V == VEC) {
        for (int p = tid; p < n_local / V; p += blockDim.x) cp_async16(xs + p * V, x + base + p * V);
        cp_async_wait_all();
    } else {
        for (int i = tid; i < n_local; i += blockDim.x) xs[i] = x[base + i];
    }
    __syncthreads();

    // 2. exact two-pass statistics of the slice
    acc_t s = 0;
    for (int i = tid; i < n_local; i += blockDim.x) s += to_acc(xs[i]);
    s = block_sum(s, scratch);
    const acc_t slice_mean = n_local > 0 ? s / acc_t(n_local) : acc_t(0);
    acc_t q = 0;
    for (int i = tid; i < n_local; i += blockDim.x) {
        const acc_t d = to_acc(xs[i]) - slice_mean;
        q += d * d;
    }
    q = block_sum(q, scratch);
    Stats st{acc_t(n_local), slice_mean, q};

#if CLUSTER_SIZE > 1
    // 3. merge the slices of the cluster in rank order
    if (tid == 0) {
        slice_stats[0] = st.n;
        slice_stats[1] = st.mean;
        slice_stats[2] = st.m2;
    }
    cluster_sync();
    if (tid < 32) {
        st = stats_empty();
        for (int r = 0; r < CLUSTER_SIZE; ++r) {
            Stats o{load_peer(slice_stats + 0, r), load_peer(slice_stats + 1, r),
                    load_peer(slice_stats + 2, r)};
            st = stats_merge(st, o);
        }
        if (tid == 0) {
            scratch[0] = st.mean;
            scratch[1] = st.m2;
        }
    }
    cluster_sync();  // peers are done reading our slice_stats; scratch is visible in the CTA
    st.mean = scratch[0];
    st.m2 = scratch[1];
#else
    (void)slice_stats;
#endif

    const acc_t mean = st.mean;
    const acc_t var = st.m2 / acc_t(seg_len);
    const acc_t rstd = rsqrt_acc(var + eps);
    if (rank == 0 && tid == 0) {
        mean_out[seg] = mean;
        rstd_out[seg] = rstd;
        if (var_out != nullptr) var_out[seg] = var;
    }

    // 4. normalize from shared memory
    const int channel_base = static_cast<int>(seg % groups) * chans_per_group;
    for (int p = tid; p < n_local / V; p += blockDim.x) {
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
            // one division per pack; the pack may straddle a channel boundary
            const int pos = start + p * V;
            int c = pos / chan_len;
            int within = pos - c * chan_len;
            c += channel_base;
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
        store_pack<V>(y + base, p, out);
    }
}

#if CLUSTER_SIZE > 1
#define SEGMENT_KERNEL extern "C" __global__ void __cluster_dims__(CLUSTER_SIZE, 1, 1)
#else
#define SEGMENT_KERNEL extern "C" __global__ void
#endif

// vectorized: slices start 16-byte aligned and hold whole packs (host checks pointers, seg_len
// and slice_len are multiples of VEC).
SEGMENT_KERNEL segment_norm_fwd_affine(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ y, const param_t* __restrict__ weight,
    const param_t* __restrict__ bias, acc_t* __restrict__ mean, acc_t* __restrict__ rstd,
    acc_t* __restrict__ var, int seg_len, int slice_len, int chan_len, int chans_per_group,
    int groups, acc_t eps, int vectorized) {
    if (vectorized)
        segment_norm_fwd<VEC, EPILOGUE_AFFINE>(x, nullptr, y, weight, bias, mean, rstd, var, seg_len,
                                               slice_len, chan_len, chans_per_group, groups, eps);
    else
        segment_norm_fwd<1, EPILOGUE_AFFINE>(x, nullptr, y, weight, bias, mean, rstd, var, seg_len,
                                             slice_len, chan_len, chans_per_group, groups, eps);
}

SEGMENT_KERNEL segment_norm_fwd_add_mul(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ other, scalar_t* __restrict__ y,
    acc_t* __restrict__ mean, acc_t* __restrict__ rstd, int seg_len, int slice_len, acc_t eps,
    int vectorized) {
    if (vectorized)
        segment_norm_fwd<VEC, EPILOGUE_ADD_MUL>(x, other, y, nullptr, nullptr, mean, rstd, nullptr,
                                                seg_len, slice_len, seg_len, 1, 1, eps);
    else
        segment_norm_fwd<1, EPILOGUE_ADD_MUL>(x, other, y, nullptr, nullptr, mean, rstd, nullptr,
                                              seg_len, slice_len, seg_len, 1, 1, eps);
}
