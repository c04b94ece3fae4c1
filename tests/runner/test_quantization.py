"""Weight-only int8 (services/engine/layers/quantization.py): the kernel computes x @ dequant(Wq)^T, the
cut-over between the int8 and the full-precision weight sits exactly at QUANTIZED_MAX_ROWS, and the flag is
parsed, validated and refused where the kernel does not run (CUDA, tensor parallelism)."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from services.engine import LLM
from services.engine.layers.linear import Linear, RowParallelLinear
from services.engine.layers.quantization import QUANTIZED_MAX_ROWS, Int8Weight, linear, quantize_model
from services.engine.runner.quantization_choice import resolve_quantization
from services.engine.serving.cli_args import add_engine_args, engine_args_from

K, N = 96, 40


@pytest.fixture
def weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(N, K, generator=generator) * 0.05  # [N, K]


def _rows(m: int, *lead: int) -> torch.Tensor:
    return torch.randn(*lead, m, K, generator=torch.Generator().manual_seed(m))  # [..., M, K]


def test_int8_weight_rounds_each_row_to_its_own_scale(weight):
    q = Int8Weight(weight)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (N, K) and q.scales.shape == (N,)
    assert q.qweight.abs().amax(dim=1).min() >= 126  # every row spans (nearly) the whole int8 range
    step = q.scales.float()[:, None]  # [N, 1]
    assert ((q.dequantized() - weight).abs() <= step * 0.51).all()


def _int8_product(x: torch.Tensor, q: Int8Weight) -> torch.Tensor:
    """What the kernel computes: the bf16-rounded input times the dequantized weight, rounded to bf16."""
    return (x.bfloat16().float() @ q.dequantized().T).bfloat16().float()  # [M, N]


def test_int8_linear_is_x_times_dequantized_weight_transposed(weight):
    q = Int8Weight(weight)
    x = _rows(3)  # [3, K]
    y = linear(x, weight, None, q)
    assert q.calls == 1 and y.dtype == torch.float32 and y.shape == (3, N)
    torch.testing.assert_close(y, _int8_product(x, q), rtol=2 ** -7, atol=1e-6)  # within a bf16 rounding
    assert not torch.allclose(y, F.linear(x, weight), rtol=1e-5, atol=1e-6)  # it is not the fp32 weight
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    assert torch.equal(linear(x, weight, bias, q), y + bias)


def test_cut_over_rows_use_int8_one_more_uses_the_full_weight(weight):
    q = Int8Weight(weight)
    at = _rows(QUANTIZED_MAX_ROWS)
    torch.testing.assert_close(linear(at, weight, None, q), _int8_product(at, q), rtol=2 ** -7, atol=1e-6)
    assert q.calls == 1
    over = _rows(QUANTIZED_MAX_ROWS + 1)
    assert torch.equal(linear(over, weight, None, q), F.linear(over, weight))
    assert q.calls == 1


def test_rows_are_counted_over_every_leading_dim(weight):
    q = Int8Weight(weight)
    linear(_rows(QUANTIZED_MAX_ROWS // 2, 2), weight, None, q)  # [2, 4, K]: 8 rows
    assert q.calls == 1
    y = linear(_rows(QUANTIZED_MAX_ROWS // 2 + 1, 2), weight, None, q)  # 10 rows
    assert q.calls == 1 and y.shape == (2, QUANTIZED_MAX_ROWS // 2 + 1, N)


def test_linear_modules_route_through_their_int8_copy(weight):
    for module in (Linear(K, N), RowParallelLinear(K, N)):
        module.weight.copy_(weight)
        x = _rows(1)
        assert torch.equal(module(x), F.linear(x, weight))  # no copy: the full weight
        assert quantize_model(module, "int8") == 1
        y = module(x)
        assert module.quantized.calls == 1
        torch.testing.assert_close(y, _int8_product(x, module.quantized), rtol=2 ** -7, atol=1e-6)
    assert quantize_model(Linear(K, N), "none") == 0


def _parse(*argv: str) -> argparse.Namespace:
    return add_engine_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_quantization_flag_parses_and_rejects_unknown_values(capsys):
    assert engine_args_from(_parse()).quantization == "none"
    assert engine_args_from(_parse("--quantization", "int8")).quantization == "int8"
    assert engine_args_from(_parse("--quantization", "gguf")).quantization == "gguf"
    with pytest.raises(SystemExit):
        _parse("--quantization", "int4")
    assert "--quantization" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization 'int4'"):
        resolve_quantization("int4", torch.device("cpu"), 1)
    assert resolve_quantization("int8", torch.device("cpu"), 1) == "int8"


def test_int8_is_refused_on_cuda_and_with_tensor_parallelism():
    with pytest.raises(ValueError, match="quantization 'int8' runs on CPU only"):
        resolve_quantization("int8", torch.device("cuda", 0), 1)
    with pytest.raises(ValueError, match="quantization 'int8' is not supported with tensor_parallel_size 2"):
        resolve_quantization("int8", torch.device("cpu"), 2)
    assert resolve_quantization("none", torch.device("cuda", 0), 2) == "none"


def test_llm_refuses_before_loading_anything():
    with pytest.raises(ValueError, match="quantization 'int8' runs on CPU only"):
        LLM(device="cuda", dtype="float32", quantization="int8")
    with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
        LLM(device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'int8' is not supported with tensor_parallel_size 2"):
        LLM(device="cpu", quantization="int8", tensor_parallel_size=2)
