"""Integer powers and sums exported exactly (issue 39: hf BLT's ONNX check failed by max abs 5.3).

onnxruntime's CPU Pow and ReduceSum on int64 compute in double precision: past 2^53 the low bits are lost, past the
type's range the value saturates, where PyTorch is exact and wraps. BLT hashes byte groups with a rolling polynomial
hash (Σ tokenᵢ·primeⁱ over int64, then % buckets), so onnxruntime looked up other embedding rows. graphgrow rewrites
integer powers into multiplications and integer sums into a cumulative sum's last element before export
(io/onnx_integers.py); floating-point ones are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.onnx_integers import exact_integers, int_pow, int_sum
from graphgrow.io.runtime import open_session
from graphgrow.verify.equivalence import check_equivalence

PRIME = 1000000007


class BufferHash(nn.Module):
    """BLT's spelling: a prime held as a tensor to the power arange(n) (pow.Tensor_Tensor), a method sum, % buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.register_buffer("prime", torch.tensor(PRIME))

    def forward(self, x):  # x: (B, T) floats, from which token ids are made
        ids = (x.abs() * 1000).long()
        windows = torch.stack([ids.roll(k, -1) for k in range(4)], -1)
        h = (windows * self.prime ** torch.arange(4)).sum(-1) % 256
        return self.emb(h).sum(-2) + x[..., :8]


class ScalarBaseHash(nn.Module):
    """A Python number as the base (pow.Scalar: 31 ** arange), torch.sum with a keyword dim and keepdim."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, 8)

    def forward(self, x):
        ids = (x.abs() * 1e6).long() + 2**40
        h = torch.sum(ids.unfold(-1, 4, 1) * PRIME ** torch.arange(4), dim=-1, keepdim=True) % 97
        return self.emb(h.squeeze(-1)).mean(-2) + x[..., :8]


class ConstantPowers(nn.Module):
    """Constant exponents (pow.Tensor_Scalar) as the ** operator, torch.pow and the method, on values whose powers
    pass 2^53; a sum over every dim (sum.default) and one with dtype= from int32."""

    def forward(self, x):
        ids = (x.abs() * 1e4).long() + 70001
        a = (ids**3 + torch.pow(ids, 4) + ids.pow(5)) % 1009
        total = ids.pow(4).sum() % 1009 + torch.sum(ids.int() * 65537, dtype=torch.int64) % 1009
        return x * (a + total).float()


class InputExponent(nn.Module):
    """An exponent computed from the input (every bit of it may be set), some of it negative (PyTorch's rule: 0, or
    ±1 for a base of ±1), and a sum over two dims."""

    def forward(self, x):
        ids = (x.abs() * 1e3).long()
        base = ids % 7 - 3
        e = ids % 90 - 5
        p = torch.pow(base, e)
        return x * (p.reshape(x.shape[0], -1, 2).sum((1, 2), keepdim=True).reshape(-1, 1) % 1013).float()


MODELS = [(BufferHash, (2, 16)), (ScalarBaseHash, (2, 12)), (ConstantPowers, (2, 6)), (InputExponent, (3, 8))]


@pytest.mark.parametrize("capture", ["fx", "export"])  # torch functions and methods, or ATen ops
@pytest.mark.parametrize("cls, shape", MODELS)
def test_the_rewrite_computes_what_the_graph_does_without_integer_pow_or_sum(cls, shape, capture):
    torch.manual_seed(0)
    m = cls().eval()
    gm = gg.trace(m, shape, capture=capture)
    rewritten = exact_integers(gm, shape)
    assert rewritten is not gm
    assert any(n.target in (int_pow, int_sum) for n in rewritten.graph.nodes)
    for seed in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(rewritten(x), m(x), rtol=0, atol=0)


def test_floating_point_powers_and_sums_stay_as_they_are():
    class Norm(nn.Module):
        def forward(self, x):
            return x * x.pow(2).mean(-1, keepdim=True) + torch.sum(x**3, -1, keepdim=True) + 2.0**x

    gm = gg.trace(Norm(), (2, 4))
    assert exact_integers(gm, (2, 4)) is gm
    plain = fx.symbolic_trace(nn.Linear(3, 3))
    assert exact_integers(plain, (2, 3)) is plain


def test_a_fixed_exponent_needs_only_its_own_bits_a_random_one_all():
    class Random(nn.Module):
        def forward(self, x):
            e = torch.randint(0, 5, (4,), device=x.device)  # computed from no input, yet not the same on every run
            return x * (torch.arange(4, device=x.device) ** e).float()

    fixed = exact_integers(gg.trace(BufferHash().eval(), (2, 16), capture="export"), (2, 16))
    [call] = [n for n in fixed.graph.nodes if n.target is int_pow]
    assert call.kwargs["bits"] == 2  # exponents 0..3
    rand = exact_integers(gg.trace(Random(), (2, 4), capture="export"), (2, 4))  # (fx would fold it to a constant)
    [call] = [n for n in rand.graph.nodes if n.target is int_pow]
    assert call.kwargs["bits"] == 63


def test_int_pow_and_int_sum_match_torch_on_wrapping_values():
    g = torch.Generator().manual_seed(0)
    b, e = torch.randint(-50, 50, (7, 5), generator=g), torch.randint(-3, 200, (7, 5), generator=g)
    assert torch.equal(int_pow(b, e, dtype=torch.int64, bits=63), b**e)
    assert torch.equal(int_pow(3, e, dtype=torch.int64, bits=63), 3**e)
    u = torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g)
    assert torch.equal(int_pow(u, u, dtype=torch.uint8, bits=8), u**u)
    for k in (0, 1, 2, 7, 64, 65):
        assert torch.equal(int_pow(b, k, dtype=torch.int64, bits=0), b**k)
    x = torch.randint(-(2**62), 2**62, (3, 4, 5), generator=g)
    for dim, keep in ((-1, False), ((0, 2), True), ([1], False), ([], False)):
        assert torch.equal(int_sum(x, dim, keep, dtype=torch.int64), torch.sum(x, dim, keepdim=keep))
    assert torch.equal(int_sum(x, None, False, dtype=torch.int64), x.sum())
    assert torch.equal(int_sum(x[:, :0], 1, False, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.int64))


@pytest.mark.slow  # an ONNX export and onnxruntime per model, like test_onnx_semantics's
@pytest.mark.parametrize("cls, shape", MODELS)
def test_integer_hashes_and_powers_agree_on_onnxruntime(tmp_path, cls, shape):
    """Before the rewrite each of these failed its ONNX check (onnxruntime's double-precision Pow and ReduceSum)."""
    torch.manual_seed(0)
    gm = gg.trace(cls().eval(), shape)
    export_onnx(gm, shape, tmp_path / "m.onnx")
    report = check_equivalence(gm, open_session(tmp_path / "m.onnx", "cpu"), shape)
    assert report.passed, report.to_json()
