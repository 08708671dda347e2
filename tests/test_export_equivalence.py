"""ONNX export (checker, dynamic batch, metadata, one file) and the onnxruntime equivalence report."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from graphgrow.passes.add_residual import AddResidual

import graphgrow as gg
from graphgrow.io.export import export_onnx, mutation_log
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence, compare_arrays

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def grown_onnx(tmp_path_factory):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from conftest import randomize_bn, small_cnn

    original = randomize_bn(small_cnn()).eval()
    r = AddResidual()(gg.trace(original, (1, 3, 32, 32)))
    path = tmp_path_factory.mktemp("onnx") / "grown.onnx"
    proto = export_onnx(r.gm, (1, 3, 32, 32), path, max_ir_version=max_ir_version())
    return original, r, path, proto


@pytest.mark.slow
def test_export_is_one_checked_file_with_dynamic_batch_and_the_log(grown_onnx):
    _, r, path, proto = grown_onnx
    assert [p.name for p in path.parent.iterdir()] == ["grown.onnx"]  # no external-data side file
    loaded = onnx.load(str(path))
    onnx.checker.check_model(loaded, full_check=True)
    dims = loaded.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]
    assert loaded.ir_version <= max_ir_version()
    log = mutation_log(loaded)
    assert [e["pass"] for e in log] == ["add_residual"] and log[0]["params_after"] == r.params_after
    meta = {p.key: p.value for p in loaded.metadata_props}
    assert json.loads(meta["graphgrow.input_shape"]) == [1, 3, 32, 32]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_onnxruntime_matches_the_original_model(grown_onnx, batch):
    original, _, path, _ = grown_onnx
    sess = open_session(path, "cpu")
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        ref = original(x).numpy()
    got = sess.run(x.numpy())[0]
    scale = np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= 1e-5 * scale + 1e-4 * np.abs(ref))


@pytest.mark.slow
def test_equivalence_report(grown_onnx):
    original, r, path, _ = grown_onnx
    rep = check_equivalence(r.gm, open_session(path, "cpu"), (1, 3, 32, 32))
    assert rep.passed and rep.provider == "cpu"
    assert [o.case for o in rep.outputs] == ["seed 0, batch 1", "seed 1, batch 1", "seed 2, batch 3"]
    assert all(o.cosine > 0.999999 and not o.nan_torch and not o.nan_ort for o in rep.outputs)
    j = rep.to_json()
    assert {"provider", "max_abs_err", "max_rel_err", "passed"} <= j.keys()


def test_compare_arrays_flags_nan_and_reports_the_needed_tolerance():
    ref = np.array([1.0, -2.0, 4.0], dtype=np.float32)
    ok = compare_arrays(ref, ref + np.float32(1e-7), 1e-4, 1e-5, "c", 0)
    assert ok.passed and ok.max_abs == pytest.approx(1e-7, rel=0.2)
    off = compare_arrays(ref, ref + np.array([0, 0, 0.01], dtype=np.float32), 1e-4, 1e-5, "c", 0)
    assert not off.passed
    assert off.min_atol == pytest.approx((0.01 - 1e-4 * 4.0) / 4.0, rel=1e-3)
    assert compare_arrays(ref, ref + off.min_atol * 4.0 * 0, 1e-4, off.min_atol, "c", 0).passed
    nan = compare_arrays(ref, np.array([1.0, np.nan, 4.0], dtype=np.float32), 1e-4, 1e-5, "c", 0)
    assert nan.nan_ort and not nan.passed
    inf_ref = compare_arrays(
        np.array([np.inf], dtype=np.float32), np.array([np.inf], dtype=np.float32), 1e-4, 1e-5, "c", 0
    )
    assert inf_ref.nan_torch and not inf_ref.passed


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU fallback on a machine without CUDA")
def test_auto_falls_back_to_cpu_and_says_so(grown_onnx):
    _, _, path, _ = grown_onnx
    sess = open_session(path, "auto")
    assert sess.provider == "cpu" and sess.session.get_providers()[0] == "CPUExecutionProvider"
    assert "CPU" in sess.note and ("fell back" in sess.note or "ran on CPU" in sess.note)
    with pytest.raises(gg.RuntimeUnavailable):
        open_session(path, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_provider_really_runs_and_agrees(grown_onnx):
    _, r, path, _ = grown_onnx
    sess = open_session(path, "cuda")
    assert sess.session.get_providers()[0] == "CUDAExecutionProvider"
    rep = check_equivalence(r.gm.cuda(), sess, (1, 3, 32, 32))
    assert rep.passed and rep.provider == "cuda" and rep.rtol == 1e-3


def test_export_errors_are_typed(tmp_path):
    class Bad(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.qr(x)[0]  # no ONNX translation

    with pytest.raises(gg.ExportError, match="torch.onnx.export failed: .*qr") as e:
        export_onnx(gg.trace(Bad(), (2, 3, 3)), (2, 3, 3), tmp_path / "bad.onnx")
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "bad.onnx").exists()


@pytest.mark.slow
def test_isolated_export_gives_the_same_model_and_typed_errors(grown_onnx, tmp_path):
    _, r, _, proto = grown_onnx
    isolated = export_onnx(r.gm, (1, 3, 32, 32), max_ir_version=max_ir_version(), isolate=True)
    assert [n.op_type for n in isolated.graph.node] == [n.op_type for n in proto.graph.node]
    assert [i.raw_data for i in isolated.graph.initializer] == [i.raw_data for i in proto.graph.initializer]

    class Bad(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.qr(x)[0]

    with pytest.raises(gg.ExportError, match="qr"):
        export_onnx(gg.trace(Bad(), (2, 3, 3)), (2, 3, 3), isolate=True)


def test_a_cuda_provider_that_does_not_load_says_why(monkeypatch):
    """Where torch sees a GPU but onnxruntime's CUDA provider does not load, the reason is the libraries, not 'no
    GPU'."""
    from graphgrow.io import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    failed = runtime.cuda_failure_reason("onnxruntime.preload_dlls() failed: OSError: libcudnn.so.9: not found")
    assert "torch sees 1 GPU" in failed and "libcudnn" in failed and "no CUDA device" not in failed
    mismatch = runtime.cuda_failure_reason(None)
    assert "preload_dlls" in mismatch and "do not match" in mismatch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible" in runtime.cuda_failure_reason(None)


class RelPosAttention(torch.nn.Module):
    """timm's BEiT attention (fused path): a per-head relative position bias gathered from a table — a mask
    computed from parameters — into scaled_dot_product_attention, then x.transpose(1, 2).reshape(B, N, C)."""

    def __init__(self, dim: int = 16, num_heads: int = 2, window: int = 2):
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.qkv, self.proj = torch.nn.Linear(dim, dim * 3), torch.nn.Linear(dim, dim)
        tokens = window * window + 1
        self.relative_position_bias_table = torch.nn.Parameter(torch.randn(3 * tokens, num_heads))
        self.register_buffer(
            "relative_position_index", torch.randint(0, 3 * tokens, (tokens, tokens)), persistent=False
        )

    def _get_rel_pos_bias(self):
        n = self.window * self.window + 1
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self._get_rel_pos_bias())
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


def test_attention_with_a_computed_mask_exports_and_agrees(tmp_path):
    """Issue 39 (beitv2_base_patch16_224, exit 1 "Cannot view a tensor ... as a tensor with shape (s77, 197, 768)"):
    the exporter's two passes disagreed on SDPA's output layout; export now runs without autograd."""
    torch.manual_seed(0)
    gm = gg.trace(RelPosAttention(), (1, 5, 16))
    export_onnx(gm, (1, 5, 16), tmp_path / "beit_attention.onnx", max_ir_version=max_ir_version())
    assert check_equivalence(gm, open_session(tmp_path / "beit_attention.onnx", "cpu"), (3, 5, 16)).passed
    assert torch.is_grad_enabled()  # the caller's grad mode is back


@pytest.mark.slow  # a real timm model exported: make test runs it, not the edit loop
def test_timm_beit_grown_exports_and_agrees(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("beitv2_base_patch16_224", depth=1, embed_dim=32, num_heads=2, img_size=32, patch_size=16)
    r = gg.get_pass("deepen")()(gg.trace(model.eval(), (1, 3, 32, 32)))
    export_onnx(r.gm, (1, 3, 32, 32), tmp_path / "beit.onnx", max_ir_version=max_ir_version())
    assert check_equivalence(r.gm, open_session(tmp_path / "beit.onnx", "cpu"), (2, 3, 32, 32)).passed
