// common.cuh: types, vector packs and reductions shared by every cupynorm kernel family.
//
// The sources are compiled by NVRTC with no CUDA headers at all: fp16 and bf16 travel as raw
// 16-bit storage and are converted with PTX `cvt`; the async copies are PTX too.
// That keeps the build independent of where (or whether) the CUDA toolkit headers live.
//
// Each module is compiled once per element type, chosen with -DSCALAR_T=<float|double|half_t|bf16_t>,
// weight/bias type -DPARAM_T and a row norm's output type -DOUT_T (both default to SCALAR_T).
// Accumulation is in fp32 (fp64 for double inputs); statistics are stored in that type.
#pragma once

#ifndef SCALAR_T
#error "compile with -DSCALAR_T=<float|double|half_t|bf16_t>"
#endif

typedef long long int64;

struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

template <typename T> struct AccOf { typedef float type; };
template <> struct AccOf<double> { typedef double type; };

#ifndef PARAM_T
#define PARAM_T SCALAR_T
#endif
#ifndef OUT_T
#define OUT_T SCALAR_T
#endif

typedef SCALAR_T scalar_t;  // input / output elements
typedef PARAM_T param_t;    // weight and bias: the input's type or float (mixed precision)
typedef OUT_T out_t;        // a row norm's y and dy: the input's type, or float (autocast)
typedef AccOf<scalar_t>::type acc_t;

// ---- conversions -------------------------------------------------------------------------------
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(half_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float to_acc(bf16_t v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_acc(acc_t v);
template <> __device__ __forceinline__ float from_acc<float>(acc_t v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(acc_t v) { return v; }
template <> __device__ __forceinline__ half_t from_acc<half_t>(acc_t v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(acc_t v) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
}

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

// sigmoid(t) = 1 / (1 + exp(-t)), the fused SiLU's: in float with the hardware's approximate
// exp2 and reciprocal (a few ulp, far below a half-precision output's rounding); expf and an IEEE
// division made the SiLU epilogue compute-bound (GroupNorm(32) + SiLU fp16 16x320x64x64 on an
// H200: forward 0.050 ms, 0.037 with this, against the plain GroupNorm's 0.033; backward 0.138,
// 0.106 with this). Exact in double. Large |t| gives 0 or 1, NaN stays NaN.
__device__ __forceinline__ float sigmoid_acc(float t) {
    return __fdividef(1.0f, 1.0f + __expf(-t));
}
__device__ __forceinline__ double sigmoid_acc(double t) { return 1.0 / (1.0 + exp(-t)); }

// ---- vector packs: V elements moved as one access (V * sizeof(scalar_t) <= 16 bytes) ----------
constexpr int VEC = 16 / sizeof(scalar_t);

// V elements of T moved together: one access of up to 16 bytes, or 16-byte accesses when the
// pack spans more (the float32 y or dy of autocast beside a 16-byte pack of half x: 32 bytes).
template <int BYTES> struct PackAlign { static constexpr int value = BYTES < 16 ? BYTES : 16; };
template <typename T, int V> struct __align__(PackAlign<sizeof(T) * V>::value) PackOf { T v[V]; };

template <int V> using Pack = PackOf<scalar_t, V>;  // V <= VEC: one access
// The out_t values at the elements of a pack of x: a norm's y or dy beside its x (Pack<V> itself
// unless out_t is wider).
template <int V> using OutPack = PackOf<out_t, V>;
static_assert(sizeof(out_t) >= sizeof(scalar_t), "OUT_T narrower than SCALAR_T");

// pack i of V elements from p (Pack<V> from scalar_t, OutPack<V> from out_t)
template <int V, typename T>
__device__ __forceinline__ PackOf<T, V> load_pack(const T* __restrict__ p, int64 i) {
    return reinterpret_cast<const PackOf<T, V>*>(p)[i];
}
template <int V, typename T>
__device__ __forceinline__ void store_pack(T* __restrict__ p, int64 i, const PackOf<T, V>& v) {
    reinterpret_cast<PackOf<T, V>*>(p)[i] = v;
}

// Select<B, T, F>::type: T when B, else F
template <bool B, typename T, typename F> struct Select { typedef T type; };
template <typename T, typename F> struct Select<false, T, F> { typedef F type; };

// V consecutive per-position parameters (a row norm's weight or bias) from position pos, or
// `absent` when there are none. One vector load per 16 bytes when the pointer allows it (a
// scalar load per element made the LayerNorm forward issue-bound: 16 loads per 8 bf16 values).
template <int V>
__device__ __forceinline__ void load_row_params(const param_t* __restrict__ p, int pos,
                                                acc_t absent, acc_t (&out)[V]) {
    if (p == nullptr) {
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = absent;
        return;
    }
    constexpr int PER16 = 16 / sizeof(param_t);  // parameters in 16 bytes
    if (V % PER16 == 0 && reinterpret_cast<unsigned long long>(p + pos) % 16 == 0) {
#pragma unroll
        for (int q = 0; q < V / PER16; ++q) {
            const uint4 raw = *reinterpret_cast<const uint4*>(p + pos + q * PER16);
            const param_t* vals = reinterpret_cast<const param_t*>(&raw);
#pragma unroll
            for (int j = 0; j < PER16; ++j) out[q * PER16 + j] = to_acc(vals[j]);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = to_acc(p[pos + j]);
}

// ---- Welford / Chan statistics -----------------------------------------------------------------
// (count, mean, M2) with M2 = sum (x - mean)^2. Never E[x^2] - E[x]^2: merging two sets shifts by
// the difference of their means, so offset data (mean 1e4, std 1) keeps its digits.
struct Stats {
    acc_t n, mean, m2;
};

__device__ __forceinline__ Stats stats_empty() { return Stats{acc_t(0), acc_t(0), acc_t(0)}; }

__device__ __forceinline__ Stats stats_merge(const Stats& a, const Stats& b) {
    const acc_t n = a.n + b.n;
    if (n == acc_t(0)) return a;
    const acc_t wb = b.n / n;
    const acc_t delta = b.mean - a.mean;
    return Stats{n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
}

// Exact two-pass statistics of K values held in registers. Callers pass values already shifted
// by their statistic set's first value (see strided_norm.cu), so the plain sum keeps its digits.
template <int K>
__device__ __forceinline__ Stats stats_of(const acc_t (&v)[K]) {
    acc_t s = 0;
#pragma unroll
    for (int i = 0; i < K; ++i) s += v[i];
    const acc_t mean = s / acc_t(K);
    acc_t m2 = 0;
#pragma unroll
    for (int i = 0; i < K; ++i) m2 += (v[i] - mean) * (v[i] - mean);
    return Stats{acc_t(K), mean, m2};
}

// Chan merge of a running triple with the exact statistics of K more values (v as for stats_of).
// The running count is never zero here, so the weight K / n takes a fast reciprocal (1 ulp, the
// same instruction every run) instead of an IEEE division: the merge of every few values was the
// cost of the columns statistics pass on fp16 data (benchmarks/NOTES.md).
__device__ __forceinline__ float fast_rcp(float x) { return __fdividef(1.0f, x); }
__device__ __forceinline__ double fast_rcp(double x) { return 1.0 / x; }

template <int K>
__device__ __forceinline__ void stats_push(Stats& a, const acc_t (&v)[K]) {
    const Stats b = stats_of<K>(v);
    const acc_t n = a.n + acc_t(K);
    const acc_t wb = acc_t(K) * fast_rcp(n);
    const acc_t delta = b.mean - a.mean;
    a = Stats{n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
}

// ---- warp / block reductions (fixed order: bitwise reproducible) ------------------------------
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ Stats warp_stats(Stats s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        Stats o;
        o.n = __shfl_down_sync(0xffffffffu, s.n, off);
        o.mean = __shfl_down_sync(0xffffffffu, s.mean, off);
        o.m2 = __shfl_down_sync(0xffffffffu, s.m2, off);
        s = stats_merge(s, o);
    }
    return s;
}

// Sum over the block, result returned to every thread. blockDim.x must be a multiple of 32.
// `scratch` holds 33 values; the call begins and ends with a barrier so it can be reused.
__device__ __forceinline__ acc_t block_sum(acc_t v, acc_t* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        acc_t t = lane < nwarps ? scratch[lane] : acc_t(0);
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// Statistics merged over a 1-D block; the result is valid in thread 0 only.
__device__ __forceinline__ Stats block_stats(Stats s, Stats* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    s = warp_stats(s);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < nwarps ? scratch[lane] : stats_empty();
        s = warp_stats(s);
    }
    return s;
}

// ---- PTX helpers -------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return static_cast<unsigned>(a);
}

// 16-byte global -> shared copy that bypasses registers (sm_80+).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem_dst)),
                 "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// wait until at most `pending` of this thread's committed groups are still in flight
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}
