"""The models people bring, through the command line a user runs (issue 22's "done when").

Each architecture is named as a user names it (`hf:` zoo names with small configs, random weights; a plain
nn.TransformerEncoder over token ids and a Conv1d audio model as factories with --input), grown with every pass
that applies at its default place chained in one pipeline, exported to ONNX and checked on onnxruntime (`--check`:
named inputs, two sequence lengths where the sequence is dynamic); add_branch, which needs 2-D feature maps, applies
or refuses with its reason (exit 2, never 1 or 3). The whole pass × architecture table through the Python API is
tests/test_hf_pass_matrix.py.
"""

from __future__ import annotations

import json

import pytest

from graphgrow.cli import main

pytest.importorskip("transformers")

IDS = "input_ids:int64[1,8]"
MODELS: dict[str, tuple[str, tuple[str, ...]]] = {  # architecture → (model name, --input values)
    "gpt2": (
        "hf:gpt2/causal-lm(vocab_size=50,n_embd=16,n_layer=1,n_head=2,n_positions=16,bos_token_id=0,eos_token_id=0)",
        (),
    ),
    "llama": (
        "hf:llama/causal-lm(vocab_size=50,hidden_size=16,intermediate_size=32,num_hidden_layers=1,"
        "num_attention_heads=4,num_key_value_heads=2,max_position_embeddings=16)",
        (),
    ),
    "bert": (
        "hf:bert/sequence-classification(vocab_size=50,hidden_size=16,num_hidden_layers=1,num_attention_heads=2,"
        "intermediate_size=32,max_position_embeddings=16)",
        (),
    ),
    "bart": (
        "hf:bart/seq2seq-lm(vocab_size=50,d_model=16,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,"
        "decoder_attention_heads=2,encoder_ffn_dim=32,decoder_ffn_dim=32,max_position_embeddings=16)",
        (IDS, "decoder_input_ids:int64[1,4]"),
    ),
    "vit": (
        "hf:vit/image-classification(image_size=16,patch_size=4,hidden_size=16,num_hidden_layers=1,"
        "num_attention_heads=2,intermediate_size=32,num_labels=3)",
        (),
    ),
    "convnext": (
        "hf:convnext/image-classification(hidden_sizes=[8,16],depths=[1,1],num_stages=2,num_labels=3,image_size=32)",
        (),
    ),
    "resnet": (
        "hf:resnet/image-classification(embedding_size=8,hidden_sizes=[8,16],depths=[1,1],layer_type='basic',"
        "num_labels=3)",
        ("pixel_values:float32[1,3,32,32]",),
    ),
    "token_encoder": ("factories:token_classifier", (IDS,)),
    "audio_conv1d": ("factories:audio_cnn", ("input:float32[1,1,4000]",)),
}
GROWTH = "add_residual,deepen,grow_width,insert_adapter"
ADD_BRANCH_REFUSED = {"gpt2", "llama", "bert", "bart", "vit", "token_encoder", "audio_conv1d"}


def _args(arch: str) -> list[str]:
    name, inputs = MODELS[arch]
    return [name, *[a for i in inputs for a in ("--input", i)]]


def invoke(runner, *args: str):
    return runner.invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_grow_export_and_check_on_onnxruntime(runner, tmp_path, arch):
    onnx_path = tmp_path / f"{arch}.onnx"
    res = invoke(
        runner,
        "mutate",
        *_args(arch),
        "--pass",
        GROWTH,
        "-o",
        str(tmp_path / "g.pt"),
        "--onnx",
        str(onnx_path),
        "--check",
        "--json",
    )
    assert res.exit_code == 0, res.output[-2000:]
    report = json.loads(res.output)
    assert [p["name"] for p in report["passes"]] == GROWTH.split(",")
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    eq = report["equivalence"]
    assert eq["passed"] and eq["vs_original"]["passed"], eq
    assert onnx_path.exists()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_add_branch_applies_or_says_why(runner, arch):
    res = runner.invoke(main, ["mutate", *_args(arch), "--pass", "add_branch", "--dry-run"])
    if arch in ADD_BRANCH_REFUSED:
        assert res.exit_code == 2, res.output[-2000:]
        assert res.output.startswith("error: ") and "add_branch" in res.output or "Conv2d" in res.output, res.output
    else:
        assert res.exit_code == 0, res.output[-2000:]
