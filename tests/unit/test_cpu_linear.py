import pytest
import torch

from services.modeling.cpu_linear import packed_linear


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (9, 64), (2, 5, 64)])
def test_packed_linear_matches_plain_linear(with_bias, shape):
    torch.manual_seed(0)
    weights = [torch.randn(48, 64), torch.randn(16, 64)]
    biases = [torch.randn(48), torch.randn(16)] if with_bias else [None, None]
    linear = packed_linear(weights, biases)
    assert linear is not None, "oneDNN is available in the CPU build of torch this project pins"
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, torch.cat(weights), torch.cat(biases) if with_bias else None)
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_inputs_fall_back_to_none():
    assert packed_linear([torch.randn(4, 4, dtype=torch.float64)], [None]) is None
    assert packed_linear([torch.randn(4, 4), torch.randn(4, 4)], [torch.randn(4), None]) is None
