"""Where people train (issue 40, item 5): the native result of a growth trains with the Hugging Face Trainer (the
loss from labels) and takes a PEFT LoRA adapter, as the original class does."""

from __future__ import annotations

import pytest
import torch

import graphgrow as gg
from graphgrow.io.hf_zoo import default_spec

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")  # the Trainer's own requirement

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def grown_llama():
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gm = gg.trace(model, input_shape=default_spec(model.config, type(model)))
    grown = gg.Pipeline.from_spec(["grow_hidden(by=32)", "deepen(block=copy)"]).run(gm).gm
    return model, gg.as_native(grown, model)


class _Bytes(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(3, 100, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]), "labels": self.x[i]}


def test_the_native_result_trains_with_the_trainer(grown_llama, tmp_path):
    model, native = grown_llama
    x = _Bytes()[0]
    with torch.no_grad():  # the loss from labels, as the original gives it (growth preserved the function)
        want = model(**{k: v[None] for k, v in x.items()}).loss
        got = native(**{k: v[None] for k, v in x.items()}).loss
    assert torch.allclose(want, got, atol=1e-5)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
    )
    trainer = transformers.Trainer(model=native, args=args, train_dataset=_Bytes())
    before = {k: v.detach().clone() for k, v in native.named_parameters()}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = [k for k, v in native.named_parameters() if not torch.equal(v, before[k])]
    assert any(".layers.1." in k for k in moved)  # the copied layer (its zero projections) learns
    assert any(k.endswith("o_proj.weight") and ".layers.1." in k for k in moved)


def test_the_native_result_takes_a_lora_adapter(grown_llama):
    _, native = grown_llama
    x = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = native(input_ids=x).logits
    lora = peft.get_peft_model(
        native, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    trainable = [k for k, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in k for k in trainable)
    assert sum("lora_A" in k for k in trainable) == 2 * native.config.num_hidden_layers  # q and v of every layer
    with torch.no_grad():
        assert torch.allclose(lora(input_ids=x).logits, want, atol=1e-6)  # LoRA's B starts at zero
    loss = lora(input_ids=x, labels=x).loss
    loss.backward()
    assert all(p.grad is not None for k, p in lora.named_parameters() if "lora_B" in k)
    lora.unload()  # the base model back, as peft hands it
