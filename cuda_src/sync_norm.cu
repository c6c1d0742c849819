// sync_norm.cu: the per-channel steps of a synchronised batch norm (cupynorm.torch.SyncBatchNorm)
// around its two collectives -- one small launch each where a chain of ~30 torch operations ran
// (each a launch and a Python call: the layer's host time paces every rank at its collectives).
//
//   forward:   [statistics: strided_norm.cu] -> sync_norm_pack_row -> all_reduce(SUM) of the rows
//              -> sync_norm_merge -> [apply: strided_norm.cu]
//   backward:  [sums: strided_norm.cu] -> all_reduce(SUM) of (P, Q) -> sync_norm_bwd_coeffs
//              -> [dx: strided_norm.cu]
//
// The rows buffer is (world, 2C + 1) float64, row r = (n_r, mean_r[C], var_r[C]) of rank r; every
// rank writes its own row and zeros elsewhere, so the sum over ranks *is* every rank's row (adding
// zeros is exact). The merge walks the rows in rank order (deterministic) in float64.
#include "common.cuh"

// Row `rank` of rows = (count, mean[C], var[C]) (count 0: an empty rank, zeros; mean and var may
// then be null); every other row zero. Grid-stride over the whole (world, 2C + 1) buffer.
extern "C" __global__ void sync_norm_pack_row(const acc_t* __restrict__ mean,
                                              const acc_t* __restrict__ var,
                                              double* __restrict__ rows, int64 C, int64 world,
                                              int64 rank, double count) {
    const int64 width = 2 * C + 1;
    const int64 stride = static_cast<int64>(gridDim.x) * blockDim.x;
    for (int64 i = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x; i < world * width;
         i += stride) {
        const int64 r = i / width, j = i - r * width;
        double value = 0.0;
        if (r == rank && count > 0.0)
            value = j == 0 ? count : j <= C ? static_cast<double>(mean[j - 1])
                                            : static_cast<double>(var[j - 1 - C]);
        rows[i] = value;
    }
}

// Chan's merge of the ranks' (n_r, mean_r, var_r) in rank order, in float64, one thread per
// channel: n = sum n_r, mean = sum n_r mean_r / n, var = sum n_r (var_r + (mean_r - mean)^2) / n.
// Writes mean and rstd = 1 / sqrt(var + eps) (acc_t), the global count (count_out[0], for the
// backward), and updates the running statistics (either may be null) as torch does, in float64:
//   running = (1 - momentum) * running + momentum * value, value = mean or var * n / (n - 1).
extern "C" __global__ void sync_norm_merge(const double* __restrict__ rows, int64 C, int64 world,
                                           double eps, double momentum, acc_t* __restrict__ mean,
                                           acc_t* __restrict__ rstd, double* __restrict__ count_out,
                                           param_t* __restrict__ running_mean,
                                           param_t* __restrict__ running_var) {
    const int64 c = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int64 width = 2 * C + 1;
    double n = 0.0, sum = 0.0;
    for (int64 r = 0; r < world; ++r) n += rows[r * width];
    for (int64 r = 0; r < world; ++r) sum += rows[r * width] * rows[r * width + 1 + c];
    const double m = sum / n;
    double m2 = 0.0;
    for (int64 r = 0; r < world; ++r) {
        const double d = rows[r * width + 1 + c] - m;
        m2 += rows[r * width] * (rows[r * width + 1 + C + c] + d * d);
    }
    const double v = m2 / n;
    mean[c] = static_cast<acc_t>(m);
    rstd[c] = static_cast<acc_t>(1.0 / sqrt(v + eps));
    if (c == 0) count_out[0] = n;
    const double keep = 1.0 - momentum;
    if (running_mean != nullptr) {
        const double old = static_cast<double>(to_acc(running_mean[c]));
        running_mean[c] = from_acc<param_t>(static_cast<acc_t>(keep * old + momentum * m));
    }
    if (running_var != nullptr) {
        const double old = static_cast<double>(to_acc(running_var[c]));
        const double unbiased = v * (n / (n - 1.0));
        running_var[c] = from_acc<param_t>(static_cast<acc_t>(keep * old + momentum * unbiased));
    }
}

// The dx coefficients of the strided dx pass from the sums over every rank, totals = (P[C], Q[C])
// (P = sum dy, Q = sum dy * xhat), and the global count n (count[0]):
//   u = -rstd * gain * Q / n,  v = -gain * P / n,  gain = rstd * weight (rstd without a weight).
extern "C" __global__ void sync_norm_bwd_coeffs(const acc_t* __restrict__ totals,
                                                const acc_t* __restrict__ rstd,
                                                const param_t* __restrict__ weight,
                                                const double* __restrict__ count, int64 C,
                                                acc_t* __restrict__ u, acc_t* __restrict__ v) {
    const int64 c = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const acc_t n = static_cast<acc_t>(count[0]);
    const acc_t r = rstd[c];
    const acc_t gain = weight != nullptr ? r * to_acc(weight[c]) : r;
    u[c] = -r * gain * totals[C + c] / n;
    v[c] = -gain * totals[c] / n;
}
