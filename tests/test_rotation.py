import pytest
import torch

from oscarkv.rotation import (
    RotationError,
    bitrev_permutation,
    check_orthogonal,
    compose,
    hadamard,
    orthogonality_error,
    permutation_matrix,
    random_orthogonal,
    rotation_from_covariance,
    sorted_eigh,
)


@pytest.mark.parametrize("d", [1, 2, 4, 64, 128, 256])
def test_hadamard_orthogonal(d):
    h = hadamard(d)
    assert orthogonality_error(h) < 1e-5
    assert torch.allclose(h.abs(), torch.full((d, d), d**-0.5))


def test_hadamard_sylvester_recursion():
    h2 = hadamard(2, torch.float64) * 2**0.5
    assert h2.tolist() == [[1, 1], [1, -1]]
    h4 = hadamard(4, torch.float64) * 2
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


def test_not_power_of_two():
    with pytest.raises(RotationError, match="power of two"):
        hadamard(96)


def test_bitrev():
    assert bitrev_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    p = permutation_matrix(bitrev_permutation(8))
    y = torch.arange(8.0)
    out = y @ p
    assert out[4].item() == 1.0 and out[1].item() == 4.0


def test_compose_uhp_and_order():
    torch.manual_seed(0)
    a = torch.randn(500, 64) * torch.linspace(5, 0.1, 64)
    cov = a.T @ a / 500
    evals, u = sorted_eigh(cov)
    assert (evals[:-1] >= evals[1:]).all()
    r, ev = rotation_from_covariance(cov)
    assert orthogonality_error(r) < 1e-5
    expected = u @ hadamard(64, torch.float64) @ permutation_matrix(bitrev_permutation(64), torch.float64)
    assert torch.allclose(r.double(), expected, atol=1e-6)
    for comp in ("uh", "u", "h", "none"):
        assert orthogonality_error(compose(u, 64, comp)) < 1e-5
    # determinism of eigenvector signs
    assert torch.equal(rotation_from_covariance(cov)[0], r)


def test_check_orthogonal():
    check_orthogonal(random_orthogonal(32))
    with pytest.raises(RotationError):
        check_orthogonal(torch.randn(8, 8))
    with pytest.raises(RotationError):
        check_orthogonal(torch.randn(8, 4))
    batched = torch.stack([random_orthogonal(16) for _ in range(3)])
    check_orthogonal(batched)
