"""A Hugging Face folder in, a larger folder of the same class out (README "What you get back").

A small LLaMA-style model is trained here on bytes of the standard library's own source, saved with
save_pretrained, grown by the CLI (hidden size 64 → 128, heads 4 → 8) into a new folder, loaded back with
AutoModelForCausalLM.from_pretrained, and trained on with the Hugging Face Trainer (loss from labels). Printed:
the loss before and after growth (equal: growth preserves the function), greedy generate() before and after
(the same text), and the loss after further training.

    python examples/grow_hf_folder.py [--steps 60] [--workdir DIR]

The growth step is the CLI, as from a shell in the work folder:

    graphgrow mutate ./my-llama --pass "grow_hidden(by=64)" --pass "grow_heads(heads=8)" -o ./my-llama-grown
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

SEQ = 32


def byte_batches(n: int, batch: int, seed: int) -> torch.Tensor:
    """Random windows of bytes of the standard library's `inspect` module source (no download, the same everywhere)."""
    data = torch.tensor(list(inspect.getsource(inspect).encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - SEQ, (n * batch,), generator=g)
    return torch.stack([data[s : s + SEQ] for s in starts]).view(n, batch, SEQ)


def train(model, steps: int, seed: int, lr: float = 3e-3) -> float:
    """Plain AdamW steps on byte windows; the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for x in byte_batches(steps, 16, seed):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def eval_loss(model) -> float:
    model.eval()
    x = byte_batches(1, 32, seed=99)[0]
    with torch.no_grad():
        return model(input_ids=x, labels=x).loss.item()


def greedy(model, prompt: bytes = b"def ") -> bytes:
    model.eval()
    out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    return bytes(out[0].tolist())


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.x = byte_batches(n, 1, seed=7).view(n, SEQ)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="grow-hf-"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    small = transformers.LlamaForCausalLM(config)
    print(f"training the small model ({sum(p.numel() for p in small.parameters()):,} parameters, {a.steps} steps)")
    train(small, a.steps, seed=1)
    small.save_pretrained(work / "my-llama")

    grown_dir = work / "my-llama-grown"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "graphgrow.cli",
            "mutate",
            str(work / "my-llama"),
            "--pass",
            "grow_hidden(by=64)",
            "--pass",
            "grow_heads(heads=8)",
            "-o",
            str(grown_dir),
        ],
        check=True,
    )
    grown = transformers.AutoModelForCausalLM.from_pretrained(grown_dir)
    before, after = eval_loss(small), eval_loss(grown)
    text_before, text_after = greedy(small), greedy(grown)
    print(
        f"{type(grown).__name__}: {sum(p.numel() for p in grown.parameters()):,} parameters, hidden "
        f"{grown.config.hidden_size}, {grown.config.num_attention_heads} heads"
    )
    print(
        f"loss before growth {before:.4f}, after {after:.4f}; generate() the same: {text_before == text_after} "
        f"({text_after!r})"
    )

    args = transformers.TrainingArguments(
        output_dir=str(work / "trainer"),
        per_device_train_batch_size=16,
        max_steps=max(a.steps // 2, 1),
        learning_rate=3e-3,
        report_to=[],
        logging_steps=10,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    transformers.Trainer(model=grown, args=args, train_dataset=Bytes(16 * args.max_steps)).train()
    trained = eval_loss(grown)
    print(f"after {args.max_steps} Trainer steps on the grown model: loss {trained:.4f}")
    return {"before": before, "after": after, "same_text": text_before == text_after, "trained": trained}


if __name__ == "__main__":
    main()
