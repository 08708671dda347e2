"""`make demo`: build a small CNN file, grow it with add_residual, export to ONNX, check on onnxruntime.

Runs the real CLI (the same command a user types) and then replays the steps with
the Python API, so both entry points are shown working.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

OUT = Path("demo_out")


def build_model() -> nn.Sequential:
    """Features mapping 3×32×32 → 128×8×8, then global pooling and a classifier."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1),
        nn.BatchNorm2d(128),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def main() -> int:
    OUT.mkdir(exist_ok=True)
    model_path = OUT / "model.pt"
    torch.save(build_model(), model_path)
    print(f"built {model_path}: a Sequential of standard layers (loads without --trust)\n")

    cmd = [
        sys.executable,
        "-m",
        "graphgrow.cli",
        "mutate",
        str(model_path),
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        "-o",
        str(OUT / "model.grown.pt"),
        "--onnx",
        str(OUT / "model.grown.onnx"),
        "--check",
    ]
    print("$ graphgrow " + " ".join(cmd[3:]))
    rc = subprocess.call(cmd)
    if rc != 0:
        return rc

    print("\nThe same through the Python API:")
    import graphgrow as gg

    model = gg.load_model(model_path).module  # weights_only load: no code from the file runs
    gm = gg.trace(model, input_shape=(1, 3, 32, 32))
    result = gg.Pipeline.from_spec("add_residual").run(gm)
    print(result.results[0].summary())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        gm.eval(), result.gm.eval()
        print(f"max |grown − original| on a random batch of 4: {(result.gm(x) - gm(x)).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
