"""Native results (issue 40, items 1-2 and part of 4): a Hugging Face folder in, the model's own class back.

`graphgrow.as_native` turns a grown graph into an instance of the original's class with a solved config; the CLI
reads a save_pretrained folder and, given `-o FOLDER`, writes one that `from_pretrained` loads. Checked per family:
the native model's logits equal the original's on a left-padded batch (attention_mask), greedy `generate()` with
the KV cache gives the same tokens, `labels=` gives a loss. Refusals say what the class cannot express.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import graphgrow as gg
from graphgrow.io.hf_zoo import default_spec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

H = 64
# family → (config class, config arguments, model class, passes the class can hold)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        {"num_key_value_heads": 2, "intermediate_size": 128},
        "LlamaForCausalLM",
        ["grow_hidden(by=64)", "grow_heads(heads=8)"],
    ),
    "qwen2": (
        "Qwen2Config",
        {"num_key_value_heads": 2, "intermediate_size": 128},
        "Qwen2ForCausalLM",
        ["grow_heads(heads=8)"],
    ),
    "mistral": (
        "MistralConfig",
        {"num_key_value_heads": 2, "intermediate_size": 128},
        "MistralForCausalLM",
        ["grow_hidden(by=16)"],
    ),
    "gpt2": (
        "GPT2Config",
        {},
        "GPT2LMHeadModel",
        ["grow_hidden(by=16)", "grow_heads(heads=5)"],
    ),  # Conv1D, n_inner=None
}


def _model(family: str, seed: int = 0):
    config_name, extra, model_name, _ = FAMILIES[family]
    sizes = (
        {"n_embd": H, "n_layer": 2, "n_head": 4}
        if family == "gpt2"
        else {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4}
    )
    config = getattr(transformers, config_name)(
        vocab_size=256, use_cache=False, bos_token_id=1, eos_token_id=2, **sizes, **extra
    )
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def _grow(model, passes):
    gm = gg.trace(model, input_shape=default_spec(model.config, type(model)))
    return gg.Pipeline.from_spec(passes).run(gm).gm


def _same_behaviour(a, b) -> None:
    x = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # a left-padded row
    with torch.no_grad():
        la = a(input_ids=x, attention_mask=mask).logits
        lb = b(input_ids=x, attention_mask=mask).logits
    assert (la - lb)[mask.bool()].abs().max().item() <= 1e-5 * max(1.0, la.abs().max().item())
    a.generation_config.use_cache = b.generation_config.use_cache = True
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert a.generate(x, attention_mask=mask, **kw).tolist() == b.generate(x, attention_mask=mask, **kw).tolist()
    assert torch.isfinite(b(input_ids=x, attention_mask=mask, labels=x).loss)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_class_computes_what_the_original_did(family):
    model = _model(family)
    grown = _grow(model, FAMILIES[family][3])
    native = gg.as_native(grown, model)
    assert type(native) is type(model)
    assert sum(p.numel() for p in native.parameters()) > sum(p.numel() for p in model.parameters())
    _same_behaviour(model, native)


def test_native_config_holds_the_grown_sizes():
    model = _model("llama")
    native = gg.as_native(_grow(model, ["grow_hidden(by=64)", "grow_heads(heads=8)"]), model)
    c = native.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        128,
        8,
        4,
        16,
        128,
    )
    assert c.rms_norm_eps == pytest.approx(model.config.rms_norm_eps * 64 / 128)  # grow_hidden rescaled the norms' eps
    gpt2 = _model("gpt2")
    c2 = gg.as_native(_grow(gpt2, FAMILIES["gpt2"][3]), gpt2).config
    assert (c2.n_embd, c2.n_head, c2.n_inner) == (80, 5, 256)  # the MLP width GPT-2 derived (4 × 64) written down


@pytest.mark.parametrize(
    "passes,why",
    [
        (["grow_width"], r"needs intermediate_size=\d+ and .* needs intermediate_size=\d+"),  # one layer's MLP only
        (
            ["grow_hidden(by=16)", "grow_heads(heads=6)"],
            "refuses the grown sizes: The hidden size .80. is not a multiple",
        ),
        (["deepen"], "adds deepen_transformer"),
    ],
)
def test_what_the_class_cannot_hold_is_refused(passes, why):
    model = _model("llama")
    with pytest.raises(gg.NotApplicable, match=why):
        gg.as_native(_grow(model, passes), model)


def test_a_model_that_is_not_hugging_face_comes_back_as_a_copy():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    native = gg.as_native(gg.trace(net, input_shape=(1, 4)), net)
    x = torch.randn(2, 4)
    assert type(native) is torch.nn.Sequential and native is not net and torch.equal(native(x), net(x))
    assert native[0].weight is not net[0].weight  # a copy: training it leaves the original alone


def _folder(tmp_path: Path, dtype=torch.float32) -> Path:
    model = _model("llama").to(dtype)
    model.config.use_cache = True  # as transformers writes it by default
    folder = tmp_path / "my-llama"
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')  # a companion file, carried untouched
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cli_folder_in_folder_out(runner, tmp_path, dtype):
    from graphgrow.cli.commands import main

    folder, out = _folder(tmp_path, dtype), tmp_path / "grown"
    result = runner.invoke(
        main,
        [
            "mutate",
            str(folder),
            "--pass",
            "grow_hidden(by=64)",
            "--pass",
            "grow_heads(heads=8)",
            "-o",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["outputs"][0] == str(out) and report["native"]["class"] == "LlamaForCausalLM"
    assert report["native"]["config"]["hidden_size"] == [64, 128]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # the folder's own setting, not capture's
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    grown = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert grown.dtype == dtype
    if dtype == torch.float32:
        _same_behaviour(original, grown)
    else:  # the same weights rounded to bfloat16: logits within its rounding, the same greedy tokens
        x = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            la, lb = original(input_ids=x).logits.float(), grown(input_ids=x).logits.float()
        assert (la - lb).abs().max().item() <= 2**-7 * la.abs().max().item() * 2
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers  # the staging folder was renamed into place


def test_cli_folder_refusals(runner, tmp_path):
    from graphgrow.cli.commands import main

    folder = _folder(tmp_path)
    exists = tmp_path / "taken"
    exists.mkdir()
    result = runner.invoke(main, ["mutate", str(folder), "--pass", "grow_hidden(by=64)", "-o", str(exists)])
    assert result.exit_code == 2 and "exists" in result.output
    cannot = runner.invoke(main, ["mutate", str(folder), "--pass", "grow_width", "-o", str(tmp_path / "new")])
    assert cannot.exit_code == 2 and "the growth verified, but" in cannot.output and "-o NAME.pt" in cannot.output
    assert not (tmp_path / "new").exists()
    pt = runner.invoke(main, ["mutate", str(folder), "--pass", "grow_width", "-o", str(tmp_path / "g.pt")])
    assert pt.exit_code == 0 and (tmp_path / "g.pt").is_file()  # graphgrow's own file keeps any growth

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    bad = runner.invoke(main, ["mutate", str(pickled), "--pass", "grow_width"])
    assert bad.exit_code == 2 and "pytorch_model.bin, which graphgrow does not read" in bad.output

    remote = tmp_path / "remote"
    remote.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    (remote / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    code = runner.invoke(main, ["mutate", str(remote), "--pass", "grow_width"])
    assert code.exit_code == 2 and "needs remote code" in code.output


def test_the_example_trains_grows_and_trains_on(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    monkeypatch.chdir(tmp_path)
    from grow_hf_folder import main

    out = main(["--steps", "4", "--workdir", str(tmp_path)])
    assert out["before"] == pytest.approx(out["after"], rel=1e-5) and out["same_text"]
    assert out["trained"] < out["after"]  # the grown model learns on under the Trainer


class UserNet(torch.nn.Module):
    """A user's own class with a method of its own besides forward."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(16, 4)

    def embed(self, x):
        return self.features(x).mean((2, 3))

    def forward(self, x):
        return self.head(self.embed(x))


def _resized(factory, shape, passes):
    torch.manual_seed(0)
    model = factory().eval()
    grown = gg.Pipeline.from_spec(passes).run(gg.trace(model, input_shape=shape)).gm
    return model, grown, gg.as_native(grown, model)


@pytest.mark.parametrize("name", ["user", "timm_resnet", "torchvision_mobilenet"])
def test_width_growth_comes_back_as_the_users_class(name):
    import timm
    import torchvision

    factory = {
        "user": UserNet,
        "timm_resnet": lambda: timm.create_model("resnet10t", num_classes=5),
        "torchvision_mobilenet": lambda: torchvision.models.mobilenet_v3_small(num_classes=5),
    }[name]
    model, grown, native = _resized(factory, (1, 3, 32, 32), ["grow_width"])
    assert type(native) is type(model) and native is not model
    assert sum(p.numel() for p in native.parameters()) > sum(p.numel() for p in model.parameters())
    x = torch.randn(3, 3, 32, 32)
    native.eval()
    grown.eval()
    model.eval()
    with torch.no_grad():
        assert torch.allclose(native(x), grown(x), atol=1e-6) and torch.allclose(native(x), model(x), atol=1e-5)
    if name == "user":
        assert native.embed(x).shape[1] >= 16  # the class's own method runs on the grown layers
    if name == "timm_resnet":
        assert native.forward_features(x).shape[1] == native.num_features  # the feature count follows the head
        native.reset_classifier(7)
        assert native(x).shape == (3, 7)


def test_structural_and_baked_sizes_are_refused():
    import timm

    with pytest.raises(gg.NotApplicable, match="has no place for it"):
        _resized(UserNet, (1, 3, 16, 16), ["add_residual"])
    vit = lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, depth=1)  # noqa: E731
    with pytest.raises(gg.NotApplicable, match="with the grown layers does not run"):  # C = heads × head size, baked
        _resized(vit, (1, 3, 32, 32), ["grow_heads(heads=4)"])


def test_hostile_folders_are_refused_before_anything_is_built(tmp_path):
    import struct

    from graphgrow.io import load

    def folder(name: str, files: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        for f, data in files.items():
            (d / f).write_bytes(data if isinstance(data, bytes) else data.encode())
        return d

    def safetensors(header: dict) -> bytes:
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw

    outside = folder(
        "outside", {"model.safetensors.index.json": json.dumps({"weight_map": {"w": "../stolen.safetensors"}})}
    )
    huge = folder(
        "huge",
        {
            "model.safetensors": safetensors(
                {"w": {"dtype": "BF16", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 0]}}
            )
        },
    )
    lying = folder("lying", {"model.safetensors": struct.pack("<Q", 1 << 40) + b"{}"})
    garbage = folder("garbage", {"model.safetensors": struct.pack("<Q", 4) + b"\xff\xfe{]"})
    cases = [
        (outside, "names shards that are not files in the folder"),
        (huge, r"1,099,511,627,776 values .* limit"),
        (lying, "not a safetensors file"),
        (garbage, "not a safetensors file"),
    ]
    for path, why in cases:
        with pytest.raises(gg.LoadError, match=why):
            load.load_model(str(path))
    (tmp_path / "nocfg").mkdir()
    with pytest.raises(gg.LoadError, match="no config.json"):
        load.load_model(str(tmp_path / "nocfg"))
    notjson = folder("notjson", {})
    (notjson / "config.json").write_text("[1, 2")
    with pytest.raises(gg.LoadError, match="not valid JSON"):
        load.load_model(str(notjson))


# family → (config class, config arguments, model class, the MLP's first layer in layer {i}); every layer's MLP is
# widened alike (grow_width at each), which any of these classes holds as one intermediate size
WIDENED = {
    "llama": (
        "LlamaConfig",
        {"intermediate_size": 128, "num_key_value_heads": 2},
        "LlamaForCausalLM",
        "model.layers.{i}.mlp.up_proj",
    ),
    "qwen3": (
        "Qwen3Config",
        {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16},
        "Qwen3ForCausalLM",
        "model.layers.{i}.mlp.up_proj",
    ),
    "gemma": (
        "GemmaConfig",
        {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16},
        "GemmaForCausalLM",
        "model.layers.{i}.mlp.up_proj",
    ),
    "phi3": (
        "Phi3Config",
        {"intermediate_size": 128, "num_key_value_heads": 2, "pad_token_id": 0},
        "Phi3ForCausalLM",
        "model.layers.{i}.mlp.gate_up_proj",
    ),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": H}, "OPTForCausalLM", "model.decoder.layers.{i}.fc1"),
    "gpt_neox": (
        "GPTNeoXConfig",
        {"intermediate_size": 128},
        "GPTNeoXForCausalLM",
        "gpt_neox.layers.{i}.mlp.dense_h_to_4h",
    ),
    "olmo": (
        "OlmoConfig",
        {"intermediate_size": 128, "pad_token_id": 0},
        "OlmoForCausalLM",
        "model.layers.{i}.mlp.up_proj",
    ),
    "granite": ("GraniteConfig", {"intermediate_size": 128}, "GraniteForCausalLM", "model.layers.{i}.mlp.up_proj"),
    "bert": ("BertConfig", {"intermediate_size": 128}, "BertForMaskedLM", "bert.encoder.layer.{i}.intermediate.dense"),
    "roberta": (
        "RobertaConfig",
        {"intermediate_size": 128, "pad_token_id": 1},
        "RobertaForMaskedLM",
        "roberta.encoder.layer.{i}.intermediate.dense",
    ),
    "electra": (
        "ElectraConfig",
        {"intermediate_size": 128, "embedding_size": H},
        "ElectraForMaskedLM",
        "electra.encoder.layer.{i}.intermediate.dense",
    ),
    "vit": (
        "ViTConfig",
        {"intermediate_size": 128, "image_size": 32, "patch_size": 8},
        "ViTForImageClassification",
        "vit.layers.{i}.mlp.fc1",
    ),
}


@pytest.mark.parametrize("family", list(WIDENED))
def test_every_layers_mlp_widened_comes_back_native(family):
    config_name, extra, model_name, target = WIDENED[family]
    sizes = {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4}
    vocab = {} if family == "vit" else {"vocab_size": 256}
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(
        getattr(transformers, config_name)(use_cache=False, **vocab, **sizes, **extra)
    ).eval()
    grown = _grow(model, [f"grow_width(target={target.format(i=i)})" for i in range(2)])
    native = gg.as_native(grown, model)
    changed = {
        k: v
        for k, v in (native.config.to_dict().items())
        if model.config.to_dict().get(k) != v and k not in ("use_cache", "dtype")
    }
    assert list(changed.values()) == [256], changed  # one field: the intermediate size, doubled
    if family == "vit":
        x = {"pixel_values": torch.randn(2, 3, 32, 32)}
        with torch.no_grad():
            assert torch.allclose(model(**x).logits, native(**x).logits, atol=1e-5)
    elif "CausalLM" in model_name:
        _same_behaviour(model, native)
    else:  # an encoder: the padded batch only
        x = torch.randint(3, 256, (2, 12))
        mask = torch.ones_like(x)
        mask[0, :3] = 0
        with torch.no_grad():
            a, b = model(input_ids=x, attention_mask=mask).logits, native(input_ids=x, attention_mask=mask).logits
        assert (a - b)[mask.bool()].abs().max().item() <= 1e-5


def test_a_model_with_its_cache_on_is_captured_with_it_off_and_gets_it_back():
    model = _model("llama")
    model.config.use_cache = True  # transformers' default: a DynamicCache in the output, which export cannot capture
    grown = _grow(model, ["grow_heads(heads=8)"])
    assert model.config.use_cache is True  # restored after capture
    assert any("use_cache=False" in n for n in grown.meta["graphgrow"]["trace"]["notes"])
    assert gg.as_native(grown, model).config.use_cache is True


def test_a_capture_failure_after_export_is_typed_and_names_the_versions(monkeypatch):
    from graphgrow.capture import export_capture as ec

    def broken(model, inputs, fixed=None):  # torch 2.11 + transformers 5.17 failed: a raw RuntimeError from the program
        raise RuntimeError("Node submod_3 target submod_3 references nonexistent attribute")

    monkeypatch.setattr(ec, "export_capture", broken)
    model = _model("llama")
    with pytest.raises(
        gg.TraceError,
        match=r"failed after torch.export on torch [\d.]+.* and transformers [\d.]+: RuntimeError: Node submod_3",
    ):
        gg.trace(model, input_shape=default_spec(model.config, type(model)))


def test_a_folder_whose_class_has_no_cache_loads_and_comes_back_without_one(runner, tmp_path):
    from graphgrow.cli.commands import main

    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
        )
    )
    vit.save_pretrained(tmp_path / "vit")
    out = tmp_path / "vit-grown"
    result = runner.invoke(
        main, ["mutate", str(tmp_path / "vit"), "--pass", "grow_width(target=vit.layers.0.mlp.fc1)", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["intermediate_size"] == 128 and "use_cache" not in config  # ViT has no cache: none is invented
    grown = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(grown(pixel_values=x).logits, vit.eval()(pixel_values=x).logits, atol=1e-5)


def test_a_two_tower_config_sizes_its_images_in_its_vision_config():
    """CLIP's top config has no image_size: the default input is the vision tower's (a 224 input would not match
    the positions of a 32-pixel tower)."""
    config = transformers.CLIPConfig(vision_config={"image_size": 32, "patch_size": 8, "num_channels": 1})
    spec = default_spec(config, transformers.CLIPForImageClassification)
    assert spec is not None and [(t.name, t.shape) for t in spec] == [("pixel_values", (1, 1, 32, 32))]
