"""Streaming growth of checkpoints larger than memory (issue 42; docs/streaming.md).

The proof (slow: one process, ~0.6 GB written): a float32 LLaMA folder of 255 MiB grown by `mutate` under a
--max-memory far below what an in-memory growth needs streams by itself, window by window. The child first grows a
small folder of the same shapes but one vocabulary window (everything capture, verification and the windows import and
allocate once is then in its peak), then the large one: the peak may rise by a small fraction of the model's size
only. The output is a sharded folder that from_pretrained loads and that computes the original's logits. The rest:
the writer's pieces and the refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphgrow.core.errors import NotApplicable, SaveError
from graphgrow.io.shards import LazyCheckpoint, ShardWriter


def llama_folder(where: Path, hidden: int, layers: int, vocab: int, mlp: int, shard: str = "100MB") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=mlp,
        vocab_size=vocab,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)  # norms that are not all ones: their rescaling is seen
    model.save_pretrained(where, max_shard_size=shard)
    (where / "tokenizer_config.json").write_text('{"model_max_length": 64}')  # a companion file, carried over
    return where


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from graphgrow.jobs import workflow
    small, big, out, spec, limit = sys.argv[1:6]
    workflow.mutate(small, [spec], out=out + "-small", max_memory=limit, seed=3)  # the same windows, one of vocabulary
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = workflow.mutate(big, [spec], out=out, max_memory=limit, seed=3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kib": base, "peak_kib": peak, "report": report}, default=str))
    """
)


@pytest.mark.slow
def test_a_checkpoint_over_max_memory_streams_within_a_fraction_of_its_size(tmp_path):
    from transformers import AutoModelForCausalLM

    source = llama_folder(tmp_path / "big", hidden=256, layers=2, vocab=128_000, mlp=512)
    small = llama_folder(tmp_path / "small", hidden=256, layers=2, vocab=8192, mlp=512)  # one vocabulary window
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert size > 250e6 and len(list(source.glob("*.safetensors"))) > 1  # a few hundred MB, sharded
    out = tmp_path / "grown"
    spec = "grow_hidden(to=384),grow_heads(heads=6),deepen(block=copy,after=model.layers.0)"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(small), str(source), str(out), spec, "20M"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    report, grown_by = got["report"], (got["peak_kib"] - got["base_kib"]) * 1024
    assert report["output_note"].startswith("streamed (grown in memory it would need at least")
    assert report["streamed"]["layers"] == "2 → 3"
    # holding the model once in float32 would add its whole size; the large model's many windows add next to nothing
    assert grown_by < 0.15 * size, f"peak {grown_by / 2**20:.0f} MiB above start-up for a {size / 2**20:.0f} MiB model"
    pres = report["preservation"]
    assert pres["tolerance"] == 1e-5 and pres["eval"]["ok"] and pres["train"]["ok"]  # float32: the exact protocol
    assert pres["boundaries"] == 2 and pres["eval"]["logits_rel_err"] < 1e-5
    assert report["native"]["config"]["hidden_size"] == [256, 384]
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    a = AutoModelForCausalLM.from_pretrained(source).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (b.config.hidden_size, b.config.num_attention_heads, b.config.num_hidden_layers) == (384, 6, 3)
    ids = torch.randint(0, 128_000, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert ((la - lb).norm() / la.norm()).item() < 1e-5


def test_rows_written_by_blocks_read_back_as_one_tensor(tmp_path):
    t = torch.randn(10, 3).to(torch.bfloat16)
    with ShardWriter(tmp_path / "out", shard_bytes=64) as w:
        w.add("a.weight", torch.ones(4))
        sink = w.rows("emb.weight", (10, 3), torch.bfloat16)
        for start in range(0, 10, 4):
            sink.write(t[start : start + 4])
        sink.close()
        w.add("b.weight", torch.zeros(20))  # over shard_bytes with a.weight: a shard of its own
        w.commit({"model_type": "x"})
    back = LazyCheckpoint(tmp_path / "out")
    assert torch.equal(back.tensor("emb.weight"), t) and torch.equal(back.rows("emb.weight", 2, 5), t[2:5])
    assert torch.equal(back.tensor("a.weight"), torch.ones(4))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and index["metadata"]["total_size"] == 16 + 60 + 80


def test_a_sink_short_of_rows_or_a_failure_leaves_no_folder(tmp_path):
    with pytest.raises(SaveError, match="of its 60 bytes"), ShardWriter(tmp_path / "out") as w:
        sink = w.rows("emb.weight", (10, 3), torch.bfloat16)
        sink.write(torch.zeros(4, 3, dtype=torch.bfloat16))
        sink.close()
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "out") as w:
        w.add("a", torch.ones(3))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out").mkdir()
    with pytest.raises(SaveError, match="exists"):
        ShardWriter(tmp_path / "out")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("add_residual", "add_residual does not stream"),
        ("deepen(block=transformer)", r"deepen\(block=transformer\) does not stream"),
        ("grow_heads(at=model.layers.0.self_attn,heads=6)", r"grow_heads\(at=…\) grows one place"),
    ],
)
def test_what_does_not_stream_is_refused_before_any_weight_is_read(tmp_path, spec, message):
    from graphgrow.jobs.pipeline import Pipeline
    from graphgrow.jobs.stream_plan import make_plan

    source = llama_folder(tmp_path / "m", hidden=32, layers=1, vocab=100, mlp=64)
    with pytest.raises(NotApplicable, match=message):
        make_plan(source, Pipeline.from_spec([spec]).passes)


def test_the_plan_finds_fields_and_vocabulary_tensors_by_probing_also_when_one_chunk_holds_the_vocabulary(tmp_path):
    from graphgrow.jobs.pipeline import Pipeline
    from graphgrow.jobs.stream_plan import make_plan

    source = llama_folder(tmp_path / "m", hidden=32, layers=3, vocab=100, mlp=64)
    plan = make_plan(source, Pipeline.from_spec(["grow_hidden(to=48)"]).passes)
    assert (plan.stack, plan.layers, plan.count_field, plan.vocab_field) == (
        "model.layers",
        3,
        "num_hidden_layers",
        "vocab_size",
    )
    assert plan.chunk == 100 and plan.vocab_dims == {"model.embed_tokens.weight": 0, "lm_head.weight": 0}
    assert plan.stored_dtype == torch.float32 and plan.order == [0, 1, 2]
    assert plan.window_config(7).vocab_size == 7 and plan.window_config(7).num_hidden_layers == 1
