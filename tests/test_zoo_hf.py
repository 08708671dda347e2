"""Hugging Face names (issue 22 item 4): `hf:MODEL_TYPE[/TASK](config arguments)` build transformers models from
a config with random weights and report a default input spec; names that ask for more are refused."""

from __future__ import annotations

import sys
import time

import pytest
import torch

import graphgrow as gg
from graphgrow.graph.inputs import TensorSpec, spec_inputs
from graphgrow.io.zoo import parse_name

transformers = pytest.importorskip("transformers")

TEXT = "input_ids"
# name → (class built, default spec as (name, shape, dtype, high))
NAMES = {
    "hf:gpt2(n_layer=2,n_embd=64,n_head=4)": ("GPT2Model", [(TEXT, (1, 16), "int64", 50257)]),
    "hf:llama/causal-lm(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
    "num_key_value_heads=2)": (
        "LlamaForCausalLM",
        [(TEXT, (1, 16), "int64", 32000)],
    ),
    "hf:bert/sequence-classification(hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64)": (
        "BertForSequenceClassification",
        [(TEXT, (1, 16), "int64", 30522)],
    ),
    "hf:vit/image-classification(hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,"
    "image_size=32,patch_size=8)": (
        "ViTForImageClassification",
        [("pixel_values", (1, 3, 32, 32), "float32", None)],
    ),
    "hf:t5/seq2seq-lm(d_model=32,d_ff=64,num_layers=2,num_heads=4,d_kv=8,vocab_size=1000)": (
        "T5ForConditionalGeneration",
        [(TEXT, (1, 16), "int64", 1000), ("decoder_input_ids", (1, 16), "int64", 1000)],
    ),
    "hf:resnet/image-classification(embedding_size=8,hidden_sizes=[8,16],depths=[1,1],num_channels=1)": (
        "ResNetForImageClassification",
        [("pixel_values", (1, 1, 224, 224), "float32", None)],
    ),  # no image_size: 224
    # transformers maps deit's image classification to two classes (with and without a distillation head)
    "hf:deit/image-classification(hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64,"
    "image_size=32,patch_size=8)": (
        "DeiTForImageClassification",
        [("pixel_values", (1, 3, 32, 32), "float32", None)],
    ),
    "hf:convnext/image-classification(hidden_sizes=[8,16],depths=[1,1],num_stages=2,image_size=64)": (
        "ConvNextForImageClassification",
        [("pixel_values", (1, 3, 64, 64), "float32", None)],
    ),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_a_name_builds_its_class_with_its_default_spec_and_runs(name):
    cls, spec = NAMES[name]
    loaded = gg.load_model(name)
    assert type(loaded.module).__name__ == cls
    assert loaded.input_shape == tuple(TensorSpec(*t) for t in spec)
    out = loaded.module(**spec_inputs(loaded.module, loaded.input_shape))
    assert torch.isfinite(out[0]).all()
    if hasattr(loaded.module.config, "use_cache"):  # no DynamicCache in the output: torch.export could not capture it
        assert loaded.module.config.use_cache is False and getattr(out, "past_key_values", None) is None


def test_the_name_parses_as_the_hf_zoo_and_use_cache_is_the_users_when_given():
    name = parse_name("hf:llama/causal-lm(hidden_size=64)")
    assert (name.zoo, name.target, name.kwargs, name.short) == (
        "hf",
        "hf:llama/causal-lm",
        {"hidden_size": 64},
        "llama_causal-lm",
    )
    loaded = gg.load_model("hf:gpt2(n_layer=1,n_embd=32,n_head=4,vocab_size=100,use_cache=True)")
    assert loaded.module.config.use_cache is True


def test_same_name_same_weights():
    a, b = (
        gg.load_model(
            "hf:bert(hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=64,vocab_size=50)"
        )
        for _ in range(2)
    )
    assert all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values()))


@pytest.mark.parametrize(
    "text, message",
    [
        ("hf:gpt3", r"no model type 'gpt3'.*did you mean .*gpt2"),
        ("hf:gpt2/summarize", r"unknown task 'summarize'.*causal-lm, masked-lm, seq2seq-lm, sequence-classification"),
        ("hf:gpt2/image-classification", r"no image-classification model for gpt2.*its tasks: causal-lm"),
        ("hf:gpt2(n_layers=2)", r"GPT2Config has no field 'n_layers'.*did you mean n_layer"),
        ("hf:gpt2(trust_remote_code=True)", r"trust_remote_code is refused: remote code is never run"),
        ("hf:gpt2(auto_map={'AutoModel': 'x.Model'})", r"auto_map is refused"),
        ("hf:bert(pretrained=True)", r"pretrained=True asks for stored weights"),
        ("hf:bert/masked-lm(tokenizer_class='/tmp/tok.json')", r"names a file, folder or URL"),
        ("hf:llama(attn_implementation='kernels-community/flash-attn')", r"names a file, folder or URL"),
        ("hf:llama(attn_implementation='flash_attention_2')", r"one of eager, sdpa"),
        ("hf:llama(num_hidden_layers=1,hidden_size=64,num_attention_heads=5)", r"config refused the arguments"),
    ],
)
def test_refused_names_say_what_is_valid(text, message):
    with pytest.raises(gg.LoadError, match=message):
        gg.load_model(text)


def test_a_default_config_too_large_is_refused_on_the_meta_device_naming_its_parameters(monkeypatch):
    devices = []
    real = transformers.AutoModel.from_config.__func__

    def recording(cls, config, **kwargs):
        devices.append(torch.get_default_device().type)
        return real(cls, config, **kwargs)

    monkeypatch.setattr(transformers.AutoModel, "from_config", classmethod(recording))
    start = time.perf_counter()
    with pytest.raises(
        gg.LoadError, match=r"hf:llama would hold .* MiB of parameters and buffers \(6,607,343,616 parameters; limit"
    ):
        gg.load_model("hf:llama")  # transformers' default LLaMA backbone: 6.6B parameters, 25 GiB in float32
    assert devices == ["meta"]  # sized without storage, never built for real
    assert time.perf_counter() - start < 60  # building 25 GiB for real would take minutes (or fail); a margin for load


def test_without_transformers_the_name_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(gg.LoadError, match=r"pip install graphgrow\[hf\]"):
        gg.load_model("hf:gpt2(n_layer=1)")


@pytest.mark.parametrize(
    "fails, message",
    [
        (  # transformers' requires_backends: an optional package missing (DiNAT's natten)
            lambda config: ImportError("\nGPT2Model requires the natten library but it was not found"),
            r"cannot build hf:gpt2: GPT2Model needs an optional package that is not installed \(GPT2Model requires "
            r"the natten library",
        ),
        (  # every config fails alike, the default one too (DBRX on transformers 5.24): transformers', not the name's
            lambda config: AttributeError("'AttentionConfig' object has no attribute 'rope_theta'"),
            r"cannot build hf:gpt2: transformers \S+ cannot build gpt2 even from its default config \(AttributeError",
        ),
        (  # only the arguments fail: their error as it was
            lambda config: ValueError("one layer is too few") if config.n_layer == 1 else None,
            r"hf:gpt2\(n_layer=1,n_embd=32,n_head=4\) failed: ValueError: one layer is too few",
        ),
    ],
)
def test_a_model_that_does_not_build_says_whose_failure_it_is(monkeypatch, fails, message):
    real = transformers.AutoModel.from_config.__func__

    def failing(cls, config, **kwargs):
        error = fails(config)
        if error is not None:
            raise error
        return real(cls, config, **kwargs)

    monkeypatch.setattr(transformers.AutoModel, "from_config", classmethod(failing))
    with pytest.raises(gg.LoadError, match=message):
        gg.load_model("hf:gpt2(n_layer=1,n_embd=32,n_head=4)")


@pytest.mark.parametrize(
    "name",
    [
        "hf:mt5/sequence-classification(d_model=32,d_ff=64,num_layers=2,num_heads=4,d_kv=8,vocab_size=256)",
        "hf:bart/sequence-classification(d_model=32,encoder_layers=1,decoder_layers=1,encoder_attention_heads=4,"
        "decoder_attention_heads=4,encoder_ffn_dim=64,decoder_ffn_dim=64,vocab_size=256)",
    ],
)
def test_token_ids_end_with_eos_where_the_forward_pools_at_it(name):
    """T5's and BART's classification heads pool at the end-of-sequence token and fail on an input without one
    (the sweep's mt5 could not run at batch 3: a select on 0 eos positions). Their example ids end with the eos id,
    as a tokenizer's output does, at every batch and seed; a model whose forward does not read it keeps random ids."""
    loaded = gg.load_model(name)
    eos = loaded.module.config.eos_token_id
    assert loaded.input_shape[0].last == eos
    for seed, batch in ((0, 1), (1, 3)):
        x = spec_inputs(loaded.module, loaded.input_shape, seed=seed, batch=batch)
        assert (x[TEXT][:, -1] == eos).all() and (x[TEXT][:, :-1] < 256).all() and (x[TEXT][:, :-1] != eos).all()
        assert loaded.module(**x).logits.shape[0] == batch
    llama = gg.load_model(next(n for n in NAMES if n.startswith("hf:llama")))
    assert llama.input_shape[0].last is None


def test_a_spec_keeps_its_last_id_through_records_and_refuses_one_past_its_bound():
    from graphgrow.core.errors import InputError
    from graphgrow.graph.inputs import parse_spec, records

    spec = parse_spec([{"name": "input_ids", "shape": [1, 8], "dtype": "int64", "high": 100, "last": 2}])
    assert spec[0].last == 2 and parse_spec(records(spec)) == spec
    for bad in (100, -1, "2"):
        with pytest.raises(InputError, match="last="):
            parse_spec([{"name": "input_ids", "shape": [1, 8], "dtype": "int64", "high": 100, "last": bad}])
    with pytest.raises(InputError, match="last="):
        parse_spec([{"name": "x", "shape": [1, 8], "dtype": "float32", "last": 1}])


def test_a_composite_config_draws_token_ids_below_its_text_vocabulary():
    """A config of several towers keeps vocab_size in its text config (the sweep's moss_transcribe_diarize drew ids
    below another embedding's size: 'index out of range' in the language model's embed_tokens)."""
    from graphgrow.io.hf_zoo import default_spec

    config = transformers.AutoConfig.for_model("llava", text_config={"model_type": "llama", "vocab_size": 300})
    assert getattr(config, "vocab_size", None) is None
    spec = default_spec(config, transformers.LlavaForConditionalGeneration)
    assert spec is not None and spec[0].high == 300


def test_a_main_input_of_another_name_that_takes_token_ids_gets_them():
    """Perceiver's masked LM names its main input `inputs` and also takes `input_ids` (the sweep could not tell its
    example input): the default spec gives token ids."""
    loaded = gg.load_model("hf:perceiver/masked-lm(d_model=64,vocab_size=256,num_latents=16,d_latents=64)")
    assert [t.name for t in loaded.input_shape] == [TEXT] and loaded.input_shape[0].high == 256
    out = loaded.module(**spec_inputs(loaded.module, loaded.input_shape))
    assert out.logits.shape[0] == 1 and out.logits.shape[-1] == 256


@pytest.mark.parametrize(
    "model_type, arguments",
    [
        ("llava", {"text_config": {"model_type": "llama", "vocab_size": 300}}),  # a text config named by its type
        ("gemma3", {"text_config": {"hidden_size": 64}}),  # a typed sub-config given a size
        ("qwen3_5", {}),  # the sub-config's default
    ],
)
def test_sub_configs_have_their_cache_off_unless_the_arguments_set_it(model_type, arguments):
    """A vision-language config's text config has its own use_cache, which its language model reads: off like the
    top one's (Qwen 3.5 with 2 layers of linear attention only could not run with it on)."""
    from graphgrow.io.hf_zoo import _config

    config = _config(transformers, f"hf:{model_type}", arguments, model_type)
    assert config.get_text_config().use_cache is False
    given = {**arguments, "text_config": {**arguments.get("text_config", {}), "use_cache": True}}
    assert _config(transformers, f"hf:{model_type}", given, model_type).get_text_config().use_cache is True


def test_a_hybrid_language_model_under_a_multimodal_config_runs_as_built():
    """Qwen 3.5's text config with 2 layers has only linear-attention layers: with its cache on, the forward asks
    the cache for its length and raises; built by name, the model runs."""
    loaded = gg.load_model(
        "hf:qwen3_5/causal-lm(vision_config={'hidden_size':32,'num_heads':2,'intermediate_size':64,"
        "'out_hidden_size':32,'depth':1},text_config={'hidden_size':32,'num_hidden_layers':2,"
        "'num_attention_heads':2,'num_key_value_heads':1,'head_dim':16,'intermediate_size':64,'vocab_size':64})"
    )
    out = loaded.module(**spec_inputs(loaded.module, loaded.input_shape))
    assert torch.isfinite(out.logits).all()


BERT_SIZES = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,vocab_size=64"


@pytest.mark.parametrize(
    "name",
    [
        f"hf:bert/causal-lm({BERT_SIZES})",  # BertLMHeadModel
        f"hf:roberta/causal-lm({BERT_SIZES})",  # RobertaForCausalLM
        "hf:reformer/causal-lm(vocab_size=64)",  # refuses to build without it
    ],
)
def test_a_causal_lm_of_an_encoder_family_is_built_as_a_decoder(name):
    """An encoder family's causal-LM head is a decoder only with `is_decoder`: built by name for causal-lm, it is set
    (a token's logits do not depend on later tokens); Reformer refused to build without it."""
    loaded = gg.load_model(name)
    assert loaded.module.config.is_decoder is True
    inputs = spec_inputs(loaded.module, loaded.input_shape)
    ids = inputs["input_ids"]
    later = ids.clone()
    later[:, -1] = (ids[:, -1] + 1) % 64
    loaded.module.eval()
    with torch.no_grad():
        a, b = loaded.module(input_ids=ids).logits, loaded.module(input_ids=later).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])


def test_a_users_is_decoder_is_kept():
    loaded = gg.load_model(f"hf:bert/causal-lm({BERT_SIZES},is_decoder=False)")
    assert loaded.module.config.is_decoder is False
    assert gg.load_model(f"hf:bert/masked-lm({BERT_SIZES})").module.config.is_decoder is False
