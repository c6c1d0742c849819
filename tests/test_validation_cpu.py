"""Bad arguments give a ValueError/TypeError that names the problem (runs without a GPU).

Inputs are torch FakeTensors on "cuda": shapes, dtypes and devices without memory or a driver.

| case                                   | error      |
|----------------------------------------|------------|
| numpy array / list / CPU torch tensor  | TypeError  |
| integer or bool dtype                  | TypeError  |
| fewer than 2 dims                      | ValueError |
| C not divisible by num_groups, G <= 0  | ValueError |
| num_groups not an int                  | TypeError  |
| weight/bias/running-stat shape         | ValueError |
| weight/bias dtype, weight != bias      | TypeError  |
| weight on another device / CPU         | ValueError |
| weight of another framework            | TypeError  |
| BatchNorm training, 1 value / channel  | ValueError |
| BatchNorm eval without running stats   | ValueError |
| InstanceNorm, 1 spatial element        | ValueError |
| row_norm_add_mul shape/dtype mismatch  | ValueError / TypeError |
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses import FakeTensorMode

import cupynorm


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def cuda(*shape, dtype=torch.float32, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device)


def test_numpy_input_rejected() -> None:
    with pytest.raises(TypeError, match="numpy.ndarray in host memory"):
        cupynorm.group_norm(np.zeros((2, 4, 3), np.float32), 2)


def test_list_input_rejected() -> None:
    with pytest.raises(TypeError, match="must be a CuPy array, a torch CUDA tensor"):
        cupynorm.batch_norm([[1.0, 2.0]], None, None, training=True)


def test_cpu_tensor_rejected() -> None:
    with pytest.raises(TypeError, match="torch tensor on cpu"):
        cupynorm.instance_norm(torch.randn(2, 3, 4, 4))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_dtype_rejected(fake, dtype) -> None:
    with pytest.raises(TypeError, match="must have dtype float32, float64, float16 or bfloat16"):
        cupynorm.group_norm(cuda(2, 4, 3, dtype=dtype), 2)


def test_too_few_dims(fake) -> None:
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got shape \(4,\)"):
        cupynorm.group_norm(cuda(4), 2)


def test_groups_must_divide_channels(fake) -> None:
    with pytest.raises(ValueError, match="divisible by num_groups.*num_groups=4"):
        cupynorm.group_norm(cuda(2, 6, 5), 4)


@pytest.mark.parametrize("groups", [0, -2])
def test_groups_positive(fake, groups) -> None:
    with pytest.raises(ValueError, match="num_groups must be positive"):
        cupynorm.group_norm(cuda(2, 6, 5), groups)


def test_groups_int(fake) -> None:
    with pytest.raises(TypeError, match="num_groups must be an int"):
        cupynorm.group_norm(cuda(2, 6, 5), 2.0)


def test_weight_shape(fake) -> None:
    with pytest.raises(ValueError, match=r"expected weight of shape \(6,\).*got shape \(3,\)"):
        cupynorm.group_norm(cuda(2, 6, 5), 2, weight=cuda(3))


def test_bias_dtype(fake) -> None:
    with pytest.raises(TypeError, match="bias must have the input's dtype"):
        cupynorm.group_norm(
            cuda(2, 6, 5, dtype=torch.float16), 2, bias=cuda(6, dtype=torch.float64)
        )


def test_weight_bias_same_dtype(fake) -> None:
    x = cuda(2, 6, 5, dtype=torch.float16)
    with pytest.raises(TypeError, match="weight and bias must have the same dtype"):
        cupynorm.group_norm(x, 2, cuda(6, dtype=torch.float16), cuda(6, dtype=torch.float32))


def test_weight_on_other_device(fake) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        # with a CUDA driver present, even a fake tensor on cuda:1 needs a second device
        pytest.skip("a machine with CUDA needs a second GPU for a tensor on cuda:1")
    with pytest.raises(ValueError, match="weight is on cuda:1 but the input is on cuda:0"):
        cupynorm.group_norm(cuda(2, 6, 5), 2, weight=cuda(6, device="cuda:1"))


def test_weight_on_cpu(fake) -> None:
    with pytest.raises(ValueError, match="weight is on cpu but the input is on cuda:0"):
        cupynorm.batch_norm(cuda(2, 6, 5), None, None, weight=cuda(6, device="cpu"), training=True)


def test_weight_other_framework(fake) -> None:
    with pytest.raises(TypeError, match="weight must be the same kind of array"):
        cupynorm.group_norm(cuda(2, 6, 5), 2, weight=np.ones(6, np.float32))


def test_running_stat_shape(fake) -> None:
    with pytest.raises(ValueError, match=r"expected running_var of shape \(6,\)"):
        cupynorm.batch_norm(cuda(2, 6, 5), cuda(6), cuda(5), training=True)


def test_batch_norm_one_value_per_channel(fake) -> None:
    with pytest.raises(ValueError, match="more than 1 value per channel when training"):
        cupynorm.batch_norm(cuda(1, 6, 1, 1), cuda(6), cuda(6), training=True)


def test_batch_norm_eval_needs_running_stats(fake) -> None:
    with pytest.raises(ValueError, match="required when training=False"):
        cupynorm.batch_norm(cuda(2, 6, 5), None, None, training=False)


def test_batch_norm_running_stats_together(fake) -> None:
    with pytest.raises(ValueError, match="given together"):
        cupynorm.batch_norm(cuda(2, 6, 5), cuda(6), None, training=True)


def test_instance_norm_one_spatial_element(fake) -> None:
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        cupynorm.instance_norm(cuda(4, 6, 1, 1))


def test_instance_norm_running_stats_needed(fake) -> None:
    with pytest.raises(ValueError, match="use_input_stats=False needs running_mean"):
        cupynorm.instance_norm(cuda(4, 6, 3), use_input_stats=False)


def test_momentum_number(fake) -> None:
    with pytest.raises(TypeError, match="momentum must be a number"):
        cupynorm.batch_norm(cuda(2, 6, 5), cuda(6), cuda(6), training=True, momentum="0.1")


def test_row_norm_add_mul_shapes(fake) -> None:
    with pytest.raises(ValueError, match="same shape"):
        cupynorm.row_norm_add_mul(cuda(4, 8), cuda(4, 9))


def test_row_norm_add_mul_dtypes(fake) -> None:
    with pytest.raises(TypeError, match="same dtype"):
        cupynorm.row_norm_add_mul(cuda(4, 8), cuda(4, 8, dtype=torch.float16))
