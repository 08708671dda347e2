"""The registry sweep (tools/sweep.py, issue 39): on a fixed subset of tiny models it runs the real CLI, classifies
the exits (a run that verifies, a forced refusal, a run past its time limit), resumes from its state file without
running anything again, and writes the table. The classification of reasons is checked on its own too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from sweep_report import broken_kind, part_of, reason_class, render, status_of  # noqa: E402


def sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sweep.py"), "--registry", "smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_sweep_runs_classifies_resumes_and_writes_the_table(tmp_path):
    state, table = tmp_path / "state.jsonl", tmp_path / "sweep.md"
    # small_cnn grows a branch; token_classifier has no conv, so add_branch is refused there (the forced refusal)
    proc = sweep("--passes", "add_branch", "--state", str(state), "--table", str(table))
    assert proc.returncode == 0, proc.stderr
    runs = {r["model"]: r for r in map(json.loads, state.read_text().splitlines())}
    assert runs["small_cnn"]["status"] == "verified" and runs["small_cnn"]["rc"] == 0
    refused = runs["token_classifier"]
    assert (refused["status"], refused["rc"], refused["class"]) == ("refused", 2, "no place"), refused
    assert "has none" in refused["message"] and "\n" not in refused["message"]
    text = table.read_text()
    assert "2 runs over 2 models: **1 verified, 1 refused, 0 broken**" in text
    assert "| small_cnn | ✓ |" in text and "| token_classifier | R: no place |" in text

    # resuming runs nothing the state holds (a run would take seconds and add a line)
    again = sweep("--passes", "add_branch", "--state", str(state), "--table", str(table))
    assert again.returncode == 0 and len(state.read_text().splitlines()) == 2
    assert "small_cnn" not in again.stdout

    # a run past its time limit is killed and counted as broken; the table lists it with its message; the pass after
    # it runs in a fresh process (and runs out of time too)
    late = sweep(
        "--passes",
        "grow_width,deepen",
        "--only",
        "small_cnn",
        "--timeout",
        "0.5",
        "--state",
        str(state),
        "--table",
        str(table),
    )
    assert late.returncode == 0, late.stderr
    for line in state.read_text().splitlines()[-2:]:
        last = json.loads(line)
        assert (last["status"], last["class"], last["rc"]) == ("broken", "timeout", None), last
    text = table.read_text()
    assert "4 runs over 2 models: **1 verified, 1 refused, 2 broken**" in text
    assert "| small_cnn | grow_width | timeout | no result after 0.5 CPU seconds |" in text

    # --retry-timeouts runs it again; its new record replaces the old one in the counts
    retry = sweep(
        "--passes",
        "grow_width",
        "--only",
        "small_cnn",
        "--retry-timeouts",
        "--state",
        str(state),
        "--table",
        str(table),
    )
    assert retry.returncode == 0, retry.stderr
    assert "4 runs over 2 models: **2 verified, 1 refused, 1 broken**" in table.read_text()


@pytest.mark.slow
def test_models_run_in_parallel_with_jobs(tmp_path):
    """--jobs 2: both smoke models run at once (one worker process each, one thread each), with the same records as
    one at a time; a count past the cores is refused."""
    state = tmp_path / "state.jsonl"
    proc = sweep("--passes", "add_branch", "--jobs", "2", "--state", str(state), "--table", "")
    assert proc.returncode == 0, proc.stderr
    runs = {r["model"]: r for r in map(json.loads, state.read_text().splitlines())}
    assert runs["small_cnn"]["status"] == "verified", runs["small_cnn"]
    assert (runs["token_classifier"]["status"], runs["token_classifier"]["class"]) == ("refused", "no place")
    too_many = sweep("--jobs", "100000", "--state", str(state), "--table", "")
    assert too_many.returncode == 2 and "--jobs" in too_many.stderr


def test_parallel_workers_get_one_thread_each(monkeypatch, tmp_path):
    """A worker started with threads=1 (--jobs > 1) has OMP_NUM_THREADS=1: two workers on two cores do not each
    start a thread per core; threads=0 (one job) leaves the environment as it is."""
    import sweep
    from sweep_models import Model

    seen = []

    class Proc:
        pid, returncode = 0, 0

        def __init__(self, cmd, env, **_):
            seen.append(env)

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(sweep.subprocess, "Popen", Proc)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = Model("smoke", "m", "tests.factories:small_cnn", ())
    sweep._run_worker(model, ["deepen"], 1.0, tmp_path, threads=1)
    sweep._run_worker(model, ["deepen"], 1.0, tmp_path, threads=0)
    assert seen[0]["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in seen[1]
    assert not sweep.LIVE  # a finished worker is no longer counted as running


def test_a_worker_stops_after_a_pass_out_of_time(capsys):
    """The limit may interrupt anything (an import half done): the passes after it must not run in that process."""
    import signal

    import sweep_worker

    try:
        sweep_worker.main(
            ["--passes", "grow_width,deepen", "--timeout", "0.01", "--", "tests.factories:small_cnn"]
            + ["--input-shape", "1,3,16,16"]
        )
    finally:
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["pass"], r["timed_out"]) for r in lines] == [("grow_width", True)]


def test_exit_codes_and_reason_classes():
    assert [status_of(rc, False) for rc in (0, 1, 2, 3, -9)] == ["verified", "broken", "refused", "broken", "broken"]
    assert status_of(None, True) == "broken" and broken_kind(None, True) == "timeout"
    assert broken_kind(3, False) == "internal error (exit 3)" and broken_kind(-11, False) == "crash (exit -11)"
    assert reason_class("cannot save the model: the stored-graph allow-list lacks aten.topk") == "cannot save"
    assert reason_class("add_branch runs 2-D conv branches beside a Conv2d; this model has none") == "no place"
    assert reason_class("hf:x/causal-lm: the config refused the arguments: ValueError") == "model does not build"
    assert reason_class("something nobody wrote a pattern for") == "other"
    # a refusal inside a captured part says nothing of the whole model: never a stated impossibility
    assert (
        reason_class("in the part 'encoder.ff' and 2 more that capture: the model has no scaled_dot_product_attention")
        == "cannot capture"
    )


def test_a_run_grown_inside_a_part_is_marked_so_in_the_table():
    from types import SimpleNamespace

    from graphgrow.capture.parts import Part

    # the CLI's note, in the words Part.summary writes (cli/show.py prints it after "note: ")
    part = SimpleNamespace(
        path="backbone.body",
        module=torch.nn.Identity(),
        params=10,
        total=40,
        share=0.25,
        spec=(),
        after=None,
        why_whole="torch.export cannot capture FasterRCNN",
    )
    stdout = f"graphgrow mutate torchvision:x (input)\nnote: {Part.summary(part)}\n1. grow_width()\n"
    assert part_of(stdout) == "backbone.body"
    assert part_of("graphgrow mutate torchvision:y\n1. grow_width()\nequivalence: PASS\n") == ""
    runs = [
        {
            "registry": "torchvision",
            "model": "det",
            "pass": "grow_width",
            "status": "verified",
            "class": "",
            "message": "",
            "part": "backbone.body",
        },
        {
            "registry": "torchvision",
            "model": "cls",
            "pass": "grow_width",
            "status": "verified",
            "class": "",
            "message": "",
        },
    ]
    table = render(runs, "# t", ("grow_width",))
    assert "| det | ✓ part |" in table and "| cls | ✓ |" in table
    assert "1 of the verified runs (✓ part) grew inside a part" in table and "det ('backbone.body')" in table


def test_the_transformers_config_shrinker_keeps_what_the_models_rely_on():
    """_shrunk on small stand-ins for transformers' config classes (dataclasses, as in transformers 5): an optional
    top-k left None, multi-head latent attention's key/value heads, a vision tower's sub-config, a count of groups
    that must divide the shrunk channels, a vocabulary under another name (only ever made smaller)."""
    from dataclasses import dataclass

    from sweep_models import HEADS, HIDDEN, VOCAB, _shrunk

    @dataclass
    class Latent:
        hidden_size: int = 4096
        num_attention_heads: int = 128
        num_key_value_heads: int | None = 128
        kv_lora_rank: int = 512
        num_experts_per_tok: int | None = None  # the model calls topk(k=None) if left so
        head_dim: int | None = None  # derived when None: left None

    kw = _shrunk(Latent)
    assert kw["num_key_value_heads"] == kw["num_attention_heads"] == HEADS and kw["num_experts_per_tok"] == 2
    assert "head_dim" not in kw

    @dataclass
    class Grouped:
        embedding_size: int = 64
        hidden_sizes: tuple = (256, 512, 1024, 2048)
        num_groups: int = 32
        type_vocab_size: int = 2
        hash_vocab: int = 500_002

    @dataclass
    class Towers:
        projection_dim: int = 512
        sub_configs = {"vision_config": Grouped}
        vision_config: dict | None = None

    kw = _shrunk(Towers)["vision_config"]
    assert all(c % kw["num_groups"] == 0 for c in [kw["embedding_size"], *kw["hidden_sizes"]])
    assert kw["num_groups"] > 1 and kw["hash_vocab"] == VOCAB and "type_vocab_size" not in kw
    assert _shrunk(Grouped)["embedding_size"] == HIDDEN


def test_the_shrinker_restores_the_relations_a_config_checks():
    """Stand-ins for configs whose validation refuses sizes set one by one: no grouped-query attention (ESMC),
    layer types given per layer (a list the length of the old layer count), a run-length list of layer patterns
    (GPT-Neo's attention_types), a count of shared layers checked only when a property is read (Gemma 3n), a size
    that must equal the hidden size; and a sub-config typed AutoConfig (Fuyu), shrunk as its default instance's
    class. A config that accepts the plain shrink keeps it."""
    from dataclasses import dataclass, field

    from sweep_models import HEADS, LAYERS, _shrunk

    @dataclass
    class NoGqa:
        hidden_size: int = 960
        num_attention_heads: int = 15
        num_key_value_heads: int = 15
        num_hidden_layers: int = 6
        layer_types: list = field(default_factory=lambda: ["local", "local", "global"] * 2)
        adapter_in_dim: int = 960
        num_shared_layers: int = 3

        def __post_init__(self):
            assert self.num_key_value_heads == self.num_attention_heads, "no grouped-query attention"
            assert len(self.layer_types) == self.num_hidden_layers
            assert self.adapter_in_dim == self.hidden_size

        @property
        def first_shared(self) -> int:  # the model reads it
            assert self.num_shared_layers < self.num_hidden_layers, "more shared layers than layers"
            return self.num_hidden_layers - self.num_shared_layers

    kw = _shrunk(NoGqa)
    assert kw["num_key_value_heads"] == kw["num_attention_heads"] == HEADS
    assert kw["layer_types"] == ["local", "global"] and kw["adapter_in_dim"] == kw["hidden_size"]
    assert kw["num_shared_layers"] == 1  # 3 of 6 layers → 1 of 2
    NoGqa(**kw).first_shared  # noqa: B018 (the property checks)

    @dataclass
    class Patterns:
        num_layers: int = 24
        attention_types: list = field(default_factory=lambda: [[["global", "local"], 12]])

        def __post_init__(self):
            assert sum(len(p) * n for p, n in self.attention_types) == self.num_layers

    assert _shrunk(Patterns) == {"num_layers": LAYERS, "attention_types": [[["global", "local"], 1]]}

    @dataclass
    class Text:
        model_type = "text"
        hidden_size: int = 4096

    class Auto:  # AutoConfig: not built without a model type
        def __init__(self):
            raise OSError("use from_pretrained")

    @dataclass
    class Composite:
        sub_configs = {"text_config": Auto}
        text_config: object = field(default_factory=Text)

    assert _shrunk(Composite) == {"text_config": {"model_type": "text", "hidden_size": 64}}

    @dataclass
    class Gqa:  # accepted as shrunk: kept grouped
        num_attention_heads: int = 32
        num_key_value_heads: int = 8

    assert _shrunk(Gqa)["num_key_value_heads"] < HEADS


def test_the_shrinker_keeps_stage_channels_head_widths_and_rotary_parts():
    """Per-stage channel lists beside hidden_sizes (HGNet-V2: the classifier read hidden_sizes[-1] = 128 while the
    backbone ended at 2048) shrink by hidden_sizes' factor, equal counts staying equal and the image's 3 channels
    kept; heads that split a multiple of the hidden size (Mamba-2: hidden_size * expand == num_heads * head_dim,
    checked by its config) keep that multiple; a latent-attention head_dim that was the rotary part's size (LongCat)
    follows it when the config keeps it as given, and is left alone when the config derives it (DeepSeek-V2)."""
    from dataclasses import dataclass

    from sweep_models import HIDDEN, _shrunk

    @dataclass
    class Stages:
        hidden_sizes: tuple = (256, 512, 1024, 2048)
        stem_channels: tuple = (3, 32, 48)
        stage_in_channels: tuple = (48, 128, 512, 1024)
        stage_out_channels: tuple = (128, 512, 1024, 2048)

    kw = _shrunk(Stages)
    assert kw["stage_out_channels"][-1] == kw["hidden_sizes"][-1]
    assert kw["stem_channels"][0] == 3 and kw["stem_channels"][-1] == kw["stage_in_channels"][0]
    assert kw["stage_out_channels"][:-1] == kw["stage_in_channels"][1:]

    @dataclass
    class Mamba2:
        hidden_size: int = 4096
        num_heads: int = 128
        head_dim: int = 64
        expand: int = 2

        def __post_init__(self):
            assert self.hidden_size * self.expand == self.num_heads * self.head_dim

    kw = _shrunk(Mamba2)
    assert kw["hidden_size"] == HIDDEN and kw["num_heads"] * kw["head_dim"] == 2 * HIDDEN
    Mamba2(**kw)

    @dataclass
    class Latent:
        hidden_size: int = 6144
        kv_lora_rank: int = 512
        qk_rope_head_dim: int = 64
        head_dim: int = 64  # the rotary embedding's size

    @dataclass
    class Derived(Latent):
        def __post_init__(self):
            self.head_dim = self.qk_rope_head_dim

    kw = _shrunk(Latent)
    assert kw["head_dim"] == kw["qk_rope_head_dim"] < HIDDEN // 4
    assert _shrunk(Derived)["head_dim"] == HIDDEN // 4  # not changed: the config sets it itself


def test_six_layout_embeddings_keep_their_share_of_the_hidden_size():
    """LayoutLMv3 concatenates four coordinate_size and two shape_size embeddings into its hidden size (768 = 4 ×
    128 + 2 × 128): shrunk to 64 beside them it failed (64 vs 768); LiLT's code cuts six of hidden_size // 6 (60
    of 64). Both take a hidden size of six equal shares; a layout model that adds its embeddings keeps HIDDEN."""
    from dataclasses import dataclass

    from sweep_models import HIDDEN, _shrunk

    @dataclass
    class LayoutV3:
        hidden_size: int = 768
        max_2d_position_embeddings: int = 1024
        coordinate_size: int = 128
        shape_size: int = 128

    @dataclass
    class Lilt:
        model_type = "lilt"
        hidden_size: int = 768
        max_2d_position_embeddings: int = 1024

    @dataclass
    class LayoutV1:
        hidden_size: int = 768
        max_2d_position_embeddings: int = 1024

    kw = _shrunk(LayoutV3)
    assert 4 * kw["coordinate_size"] + 2 * kw["shape_size"] == kw["hidden_size"] and kw["coordinate_size"] > 0
    assert _shrunk(Lilt)["hidden_size"] % 6 == 0 and _shrunk(Lilt)["hidden_size"] % 16 == 0
    assert _shrunk(LayoutV1)["hidden_size"] == HIDDEN


def test_sizes_that_split_the_hidden_size_are_split_the_same_way_when_it_shrinks():
    """Reformer concatenates two axial position embeddings of (64, 192) channels into its 256: shrunk to 64 beside
    them its model refused to build (the config itself accepts it). A split is scaled with the hidden size, as a list
    or a tuple; sizes that do not sum to the hidden size, and a split that would not stay whole, are left alone."""
    from dataclasses import dataclass, field

    from sweep_models import HIDDEN, _shrunk

    @dataclass
    class Axial:
        hidden_size: int = 256
        axial_pos_embds_dim: tuple = (64, 192)
        axial_pos_shape: tuple = (64, 64)  # multiplies to the sequence length: not a split of the hidden size
        parts_as_list: list = field(default_factory=lambda: [128, 128])

    @dataclass
    class Uneven:
        hidden_size: int = 768
        split: tuple = (1, 767)  # 64/768 of each is not whole

    kw = _shrunk(Axial)
    assert kw["hidden_size"] == HIDDEN
    assert kw["axial_pos_embds_dim"] == (16, 48) and kw["parts_as_list"] == [32, 32]
    assert "axial_pos_shape" not in kw
    assert "split" not in _shrunk(Uneven)


def test_heads_under_other_names_and_aliased_counts_shrink():
    """A linear attention's own heads beside the softmax attention's (Kimi-Linear's linear_num_heads = 32 of
    linear_head_dim = 128, Qwen3-Next's linear_num_value_heads) were left at their defaults: its chunked attention then
    held 3 x 32 x 64 x 64 x 128 floats per layer (an 8.2 GiB estimate for a 64-wide model) and took minutes per pass.
    A count declared as a field under an alias whose target is no field (Kimi-Linear's num_local_experts, kept as
    num_experts: 256 experts) is set under the alias; an alias whose target is a field is not set twice."""
    from dataclasses import dataclass

    from sweep_models import HEADS, HIDDEN, _shrunk

    @dataclass
    class Hybrid:
        attribute_map = {"num_local_experts": "num_experts", "n_embd": "hidden_size"}  # noqa: RUF012
        hidden_size: int = 2304
        n_embd: int = 2304  # an alias of a field: set as hidden_size only
        num_attention_heads: int = 32
        linear_num_heads: int = 32
        linear_head_dim: int = 128
        linear_num_value_heads: int = 32
        swa_num_key_value_heads: int = 2  # already small: left
        num_local_experts: int = 256

    kw = _shrunk(Hybrid)
    assert kw["linear_num_heads"] == kw["linear_num_value_heads"] == HEADS
    assert kw["linear_head_dim"] == HIDDEN // HEADS
    assert kw["num_local_experts"] == 4 and "n_embd" not in kw
    assert "swa_num_key_value_heads" not in kw


def test_a_config_whose_default_is_refused_gets_the_features_its_checks_demand_off():
    """Gemma 4's assistant refuses its own default: its text config's per-layer inputs must be off (0) and MoE off
    while the text config's defaults have them on. Features are turned off one at a time, keeping each change
    after which the checks fail later or not at all; the demanded values win over the small sizes."""
    from dataclasses import dataclass

    from sweep_models import HIDDEN, _shrunk

    @dataclass
    class Text:
        model_type = "text"
        hidden_size: int = 2048
        hidden_size_per_layer_input: int = 256
        enable_moe: bool = True
        use_bias: bool = True

    @dataclass
    class Assistant:
        sub_configs = {"text_config": Text}
        text_config: dict | None = None

        def __post_init__(self):
            text = Text(**{k: v for k, v in (self.text_config or {}).items() if k != "model_type"})
            if text.hidden_size_per_layer_input != 0:
                raise ValueError("hidden_size_per_layer_input must be 0")
            if text.enable_moe:
                raise ValueError("enable_moe must be False")

    kw = _shrunk(Assistant)["text_config"]
    assert kw["hidden_size_per_layer_input"] == 0 and kw["enable_moe"] is False and kw["hidden_size"] == HIDDEN
    assert "use_bias" not in kw  # not demanded: left as it was
    Assistant(text_config=_shrunk(Assistant)["text_config"])


def test_values_a_model_cannot_build_without_are_filled_only_then(monkeypatch):
    """Hunyuan's config leaves head_dim None and its attention raises it to a power; LFM2-MoE's leaves its layer
    types None and indexes them; Cohere Compass keys its rotary parameters by layer type and has none: the ordinary
    value is filled where the model does not build without it (a stand-in Auto class here, which reads what the
    models read) and builds with it. A model that builds without (Mixtral derives head_dim in its code) is left."""
    from dataclasses import dataclass, field

    import transformers
    from sweep_models import _ordinary_values

    @dataclass
    class Cfg:
        hidden_size: int = 64
        num_attention_heads: int = 4
        num_hidden_layers: int = 2
        head_dim: int | None = None
        layer_types: list | None = None
        rope_parameters: dict = field(default_factory=dict)

    class Strict:  # reads all three as the models do
        @staticmethod
        def from_config(config):
            [config.rope_parameters[t] for t in config.layer_types]
            return config.head_dim**-0.5

    class Lenient:  # derives the head size itself, and needs no layer types
        @staticmethod
        def from_config(config):
            return config.head_dim or config.hidden_size // config.num_attention_heads

    monkeypatch.setattr(transformers, "StandInStrict", Strict, raising=False)
    monkeypatch.setattr(transformers, "StandInLenient", Lenient, raising=False)
    kw: dict = {}
    _ordinary_values(Cfg, "StandInStrict", kw)
    assert kw["head_dim"] == 16 and kw["layer_types"] == ["full_attention"] * 2
    assert kw["rope_parameters"]["full_attention"]["rope_type"] == "default"
    kw = {}
    _ordinary_values(Cfg, "StandInLenient", kw)
    assert kw == {}


def test_a_hybrid_model_keeps_every_kind_of_layer(monkeypatch):
    """Jamba puts attention at layer 4 of every 8: 2 layers would sweep a pure state-space model under its name.
    The layer count becomes the smallest that builds every module class 8 layers build (a stand-in Auto class that
    builds real modules on the meta device); a model whose layers are all alike keeps 2."""
    from dataclasses import dataclass

    import torch.nn as nn
    import transformers
    from sweep_models import _layer_kinds_kept

    class Mixer(nn.Module):
        pass

    class Attention(nn.Module):
        pass

    @dataclass
    class Cfg:
        num_hidden_layers: int = 32
        attn_layer_period: int = 8
        attn_layer_offset: int = 4

    class Hybrid:
        @staticmethod
        def from_config(config):
            p, o = config.attn_layer_period, config.attn_layer_offset
            return nn.ModuleList(Attention() if i % p == o else Mixer() for i in range(config.num_hidden_layers))

    monkeypatch.setattr(transformers, "StandInHybrid", Hybrid, raising=False)
    kw: dict = {"num_hidden_layers": 2}
    _layer_kinds_kept(Cfg, "StandInHybrid", kw)
    assert kw == {"num_hidden_layers": 5}
    kw = {"num_hidden_layers": 2, "attn_layer_offset": 1, "attn_layer_period": 2}  # already both kinds at 2
    _layer_kinds_kept(Cfg, "StandInHybrid", kw)
    assert kw["num_hidden_layers"] == 2

    @dataclass
    class Outer:  # the layer count inside a sub-config (Qwen 3.5's text_config)
        text_config: dict

    class Nested:
        @staticmethod
        def from_config(config):
            return Hybrid.from_config(Cfg(**config.text_config))

    monkeypatch.setattr(transformers, "StandInNested", Nested, raising=False)
    kw = {"text_config": {"num_hidden_layers": 2}}
    _layer_kinds_kept(Outer, "StandInNested", kw)
    assert kw == {"text_config": {"num_hidden_layers": 5}}


def test_heads_per_stage_divide_the_shrunk_stage_widths():
    """PVT's heads per stage, [1, 2, 5, 8], split its default widths; the shrunk widths take powers of two."""
    from dataclasses import dataclass, field

    from sweep_models import _shrunk

    @dataclass
    class Pvt:
        hidden_sizes: list = field(default_factory=lambda: [64, 128, 320, 512])
        num_attention_heads: list = field(default_factory=lambda: [1, 2, 5, 8])

    kw = _shrunk(Pvt)
    assert kw["hidden_sizes"] == [16, 32, 64, 128] and kw["num_attention_heads"] == [1, 2, 4, 8]


def test_a_masked_lm_whose_mask_token_is_left_none_gets_one():
    """ESM's config leaves its mask and padding ids None, and its forward compares the token ids with both (ne()
    received NoneType): a masked LM's are set inside the small vocabulary; a config without a mask token is not."""
    from dataclasses import dataclass

    from sweep_models import VOCAB, _masking_tokens

    @dataclass
    class Esm:
        vocab_size: int = 33
        pad_token_id: int | None = None
        mask_token_id: int | None = None

    @dataclass
    class Funnel:
        pad_token_id: int | None = None

    kw: dict = {}
    _masking_tokens(kw, Esm)
    assert kw == {"pad_token_id": 1, "mask_token_id": 2} and max(kw.values()) < VOCAB
    kw = {}
    _masking_tokens(kw, Funnel)
    assert kw == {}
