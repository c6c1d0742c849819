// fused_norm.cu: the strided family's passes with a fused epilogue -- a norm over per-channel
// (BatchNorm) or per-group statistics, then a residual add and an activation:
//
//   forward:   y = act((x - mean) * rstd * weight + bias + z)          z: the residual, or null
//   backward:  dt = dy * act'(t)  (the sums pass writes dt and sums it), then the norm's own
//              finalize and dx passes on dt; dt is also the residual's gradient
//
// (see "Fused epilogue" in strided_norm.cu for the numerics). The statistics, finalize and dx
// passes are the plain ones; only the apply and the backward sums change, so this file holds
// just their entries: one kernel per (pass, layout, activation), with the activation a template
// parameter so the plain kernels never carry its registers. Compiled only when a fused call
// needs it. (The identity needs no backward sums of its own: dt = dy, the plain passes.)
#define STRIDED_NORM_DEVICE_ONLY
#include "strided_norm.cu"

// NAME: the activation, prefixed add_ with a residual (also a template parameter: a runtime
// flag doubled the apply's registers).
#define FUSED_APPLY(NAME, ACT, RESID)                                                           \
    extern "C" __global__ void fused_norm_apply_rows_##NAME(APPLY_ROWS_PARAMS) {                \
        if (vectorized)                                                                        \
            apply_rows<VEC, false, ACT, RESID>(APPLY_ROWS_ARGS);                               \
        else                                                                                   \
            apply_rows<1, false, ACT, RESID>(APPLY_ROWS_ARGS);                                 \
    }                                                                                          \
    extern "C" __global__ void fused_norm_apply_cols_##NAME(APPLY_COLS_PARAMS) {                \
        if (vectorized)                                                                        \
            apply_cols<VEC, false, ACT, RESID>(APPLY_COLS_ARGS);                               \
        else                                                                                   \
            apply_cols<1, false, ACT, RESID>(APPLY_COLS_ARGS);                                 \
    }

// The backward sums with the epilogue's arguments after the plain ones: the residual z (SiLU
// recomputes t from it), the forward's output y (ReLU's mask), dt (written), and the forward's
// weight, bias and rstd (SiLU's t).
#define FUSED_SUMS_EPILOGUE_PARAMS                                                              \
    const scalar_t *__restrict__ z, const scalar_t *__restrict__ y, scalar_t *__restrict__ dt, \
        const param_t *__restrict__ weight, const param_t *__restrict__ bias,                 \
        const acc_t *__restrict__ rstd

#define FUSED_SUMS(ACT_NAME, ACT)                                                               \
    extern "C" __global__ void fused_norm_bwd_sums_rows_##ACT_NAME(                             \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,                        \
        const acc_t* __restrict__ mean, acc_t* __restrict__ partials, int64 C, int64 S,         \
        int64 sample_stride, int64 chan_stride, int groups, int64 chans_per_group,              \
        int64 tiles_per_plane, int64 tile_len, int vectorized, FUSED_SUMS_EPILOGUE_PARAMS) {    \
        const Epilogue ep{z, y, dt};                                                           \
        if (vectorized)                                                                        \
            bwd_sums_rows<VEC, ACT>(x, dy, mean, partials, C, S, sample_stride, chan_stride,   \
                                    groups, chans_per_group, tiles_per_plane, tile_len, ep,    \
                                    weight, bias, rstd);                                       \
        else                                                                                   \
            bwd_sums_rows<1, ACT>(x, dy, mean, partials, C, S, sample_stride, chan_stride,     \
                                  groups, chans_per_group, tiles_per_plane, tile_len, ep,      \
                                  weight, bias, rstd);                                         \
    }                                                                                          \
    extern "C" __global__ void fused_norm_bwd_sums_cols_##ACT_NAME(                             \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,                        \
        const acc_t* __restrict__ mean, acc_t* __restrict__ partials, int64 R, int64 C,         \
        int64 row_stride, int64 sample_stride, int groups, int64 chans_per_group,               \
        int64 ctas_per_n, int vectorized, FUSED_SUMS_EPILOGUE_PARAMS) {                         \
        const Epilogue ep{z, y, dt};                                                           \
        if (vectorized)                                                                        \
            bwd_sums_cols<VEC, ACT>(x, dy, mean, partials, R, C, row_stride, sample_stride,    \
                                    groups, chans_per_group, ctas_per_n, ep, weight, bias,     \
                                    rstd);                                                     \
        else                                                                                   \
            bwd_sums_cols<1, ACT>(x, dy, mean, partials, R, C, row_stride, sample_stride,      \
                                  groups, chans_per_group, ctas_per_n, ep, weight, bias,       \
                                  rstd);                                                       \
    }

FUSED_APPLY(relu, ACT_RELU, false)
FUSED_APPLY(silu, ACT_SILU, false)
FUSED_APPLY(add_identity, ACT_IDENTITY, true)
FUSED_APPLY(add_relu, ACT_RELU, true)
FUSED_APPLY(add_silu, ACT_SILU, true)
FUSED_SUMS(relu, ACT_RELU)
FUSED_SUMS(silu, ACT_SILU)
