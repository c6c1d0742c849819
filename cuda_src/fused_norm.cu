// fused_norm.cu: the strided family's passes with a fused epilogue -- a norm over per-channel
// (BatchNorm) or per-group statistics, then a residual add and an activation:
//
//   forward:   y = act(t),  t = (x - mean) * rstd * weight + bias + z      z: the residual, or null
//   backward:  dt = dy * act'(t), t recomputed; then the norm's own backward on dt. With a
//              residual the sums pass writes dt (the residual's gradient) and the plain dx pass
//              reads it; without one, the sums and the dx pass each turn dy into dt themselves
//
// (see "Fused epilogue" in strided_norm.cu for the numerics). The statistics and finalize passes
// are the plain ones; this file holds the entries of the apply, the backward sums and the dx
// passes with an epilogue: one kernel per (pass, layout, activation), with the activation a
// template parameter so the plain kernels never carry its registers. Compiled only when a fused
// call needs it. (The identity needs no backward of its own: dt = dy, the plain passes.)
#define STRIDED_NORM_DEVICE_ONLY
#include "strided_norm.cu"

// NAME: the activation, prefixed add_ with a residual (also a template parameter: a runtime
// flag doubled the apply's registers).
#define FUSED_APPLY(NAME, ACT, RESID)                                                           \
    extern "C" __global__ void fused_norm_apply_rows_##NAME(APPLY_ROWS_PARAMS(out_t)) {            \
        if (vectorized)                                                                        \
            apply_rows<VEC, false, ACT, RESID>(APPLY_ROWS_ARGS);                               \
        else                                                                                   \
            apply_rows<1, false, ACT, RESID>(APPLY_ROWS_ARGS);                                 \
    }                                                                                          \
    extern "C" __global__ void fused_norm_apply_cols_##NAME(APPLY_COLS_PARAMS(out_t)) {            \
        if (vectorized)                                                                        \
            apply_cols<VEC, false, ACT, RESID>(APPLY_COLS_ARGS);                               \
        else                                                                                   \
            apply_cols<1, false, ACT, RESID>(APPLY_COLS_ARGS);                                 \
    }

// The backward sums with the epilogue's arguments after the plain ones: the residual z (part of
// t), dt (written) and the forward's weight, bias and rstd (for t). The rows entries take the
// residual's presence as a template parameter (add_ prefix: z and dt are read; without it they
// are ignored and the kernel has ~half the registers: GroupNorm + SiLU NCHW backward 105 -> 79
// us); the columns entries take it at run time (z, dt null without one): see bwd_sums_cols.
#define FUSED_SUMS_EPILOGUE_PARAMS                                                              \
    const scalar_t *__restrict__ z, out_t *__restrict__ dt,                                    \
        const param_t *__restrict__ weight, const param_t *__restrict__ bias,                 \
        const acc_t *__restrict__ rstd, const scalar_t *__restrict__ addend

#define FUSED_SUMS_ROWS(NAME, ACT, RESID)                                                       \
    extern "C" __global__ void fused_norm_bwd_sums_rows_##NAME(                                 \
        const scalar_t* __restrict__ x, const out_t* __restrict__ dy,                           \
        const acc_t* __restrict__ mean, acc_t* __restrict__ partials, int64 C, int64 S,         \
        int64 sample_stride, int64 chan_stride, int groups, int64 chans_per_group,              \
        int64 tiles_per_plane, int64 tile_len, int vectorized, FUSED_SUMS_EPILOGUE_PARAMS) {    \
        const Epilogue ep{z, dt, nullptr};                                                     \
        if (vectorized)                                                                        \
            bwd_sums_rows<VEC, ACT, RESID>(x, dy, mean, partials, C, S, sample_stride,         \
                                           chan_stride, groups, chans_per_group,               \
                                           tiles_per_plane, tile_len, ep, weight, bias, rstd,  \
                                           addend);                                            \
        else                                                                                   \
            bwd_sums_rows<1, ACT, RESID>(x, dy, mean, partials, C, S, sample_stride,           \
                                         chan_stride, groups, chans_per_group, tiles_per_plane, \
                                         tile_len, ep, weight, bias, rstd, addend);            \
    }

#define FUSED_SUMS_COLS(ACT_NAME, ACT)                                                          \
    extern "C" __global__ void fused_norm_bwd_sums_cols_##ACT_NAME(                             \
        const scalar_t* __restrict__ x, const out_t* __restrict__ dy,                           \
        const acc_t* __restrict__ mean, acc_t* __restrict__ partials, int64 R, int64 C,         \
        int64 row_stride, int64 sample_stride, int groups, int64 chans_per_group,               \
        int64 ctas_per_n, int vectorized, FUSED_SUMS_EPILOGUE_PARAMS) {                         \
        const Epilogue ep{z, dt, nullptr};                                                     \
        if (vectorized)                                                                        \
            bwd_sums_cols<VEC, ACT>(x, dy, mean, partials, R, C, row_stride, sample_stride,    \
                                    groups, chans_per_group, ctas_per_n, ep, weight, bias,     \
                                    rstd, addend);                                             \
        else                                                                                   \
            bwd_sums_cols<1, ACT>(x, dy, mean, partials, R, C, row_stride, sample_stride,      \
                                  groups, chans_per_group, ctas_per_n, ep, weight, bias,       \
                                  rstd, addend);                                               \
    }

// The dx pass without a residual (bias: the forward's, for t; z unused).
#define FUSED_DX(NAME, ACT)                                                                     \
    extern "C" __global__ void fused_norm_bwd_dx_rows_##NAME(APPLY_ROWS_PARAMS(scalar_t)) {        \
        if (vectorized)                                                                        \
            apply_rows<VEC, true, ACT>(APPLY_ROWS_ARGS);                                       \
        else                                                                                   \
            apply_rows<1, true, ACT>(APPLY_ROWS_ARGS);                                         \
    }                                                                                          \
    extern "C" __global__ void fused_norm_bwd_dx_cols_##NAME(APPLY_COLS_PARAMS(scalar_t)) {        \
        if (vectorized)                                                                        \
            apply_cols<VEC, true, ACT>(APPLY_COLS_ARGS);                                       \
        else                                                                                   \
            apply_cols<1, true, ACT>(APPLY_COLS_ARGS);                                         \
    }

FUSED_APPLY(relu, ACT_RELU, false)
FUSED_APPLY(silu, ACT_SILU, false)
FUSED_APPLY(add_identity, ACT_IDENTITY, true)
FUSED_APPLY(add_relu, ACT_RELU, true)
FUSED_APPLY(add_silu, ACT_SILU, true)

// ReLU with a residual on the columns, keeping the ReLU's mask for the backward (see "Fused
// epilogue" in strided_norm.cu): the forward on 16-byte packs of 8 elements only (the host asks
// for a mask only then), and the backward sums reading the mask instead of the residual (z null)
// with any packs. Kernels of their own: the mask's code costs the others registers even when off.
extern "C" __global__ void fused_norm_apply_cols_add_relu_mask(APPLY_COLS_PARAMS(out_t),
                                                               unsigned char* relu_mask) {
    if (vectorized && VEC == 8)
        apply_cols<VEC, false, ACT_RELU, true, true>(APPLY_COLS_ARGS, relu_mask);
    else
        __trap();  // no mask layout for these packs: never launched so
}

extern "C" __global__ void fused_norm_bwd_sums_cols_relu_mask(
    const scalar_t* __restrict__ x, const out_t* __restrict__ dy,
    const acc_t* __restrict__ mean, acc_t* __restrict__ partials, int64 R, int64 C,
    int64 row_stride, int64 sample_stride, int groups, int64 chans_per_group, int64 ctas_per_n,
    int vectorized, FUSED_SUMS_EPILOGUE_PARAMS, const unsigned char* __restrict__ relu_mask) {
    const Epilogue ep{nullptr, dt, relu_mask};
    if (vectorized)
        bwd_sums_cols<VEC, ACT_RELU, true>(x, dy, mean, partials, R, C, row_stride, sample_stride,
                                           groups, chans_per_group, ctas_per_n, ep, weight, bias,
                                           rstd, addend);
    else
        bwd_sums_cols<1, ACT_RELU, true>(x, dy, mean, partials, R, C, row_stride, sample_stride,
                                         groups, chans_per_group, ctas_per_n, ep, weight, bias,
                                         rstd, addend);
}
FUSED_SUMS_ROWS(relu, ACT_RELU, false)
FUSED_SUMS_ROWS(silu, ACT_SILU, false)
FUSED_SUMS_ROWS(add_relu, ACT_RELU, true)
FUSED_SUMS_ROWS(add_silu, ACT_SILU, true)
FUSED_SUMS_COLS(relu, ACT_RELU)
FUSED_SUMS_COLS(silu, ACT_SILU)
FUSED_DX(relu, ACT_RELU)
FUSED_DX(silu, ACT_SILU)
