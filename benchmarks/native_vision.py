"""timm and torchvision classifiers grown by width come back as their own classes (issue 40's Done-when), checked.

    python benchmarks/native_vision.py [--model timm:resnet18,...] [--pass grow_width] [--markdown]

Per model (random weights, nothing downloaded; 5 classes, a 64×64 input): trace, grow (default `grow_width`, every
layer the pass picks by default), `graphgrow.as_native` (jobs/native_resized.py: the original deep-copied with the
resized layers swapped in, checked against the grown graph in eval and train mode), then here again: the result is
an instance of the model's own class, runs its own forward on another batch size, equals the original's eval output
there, and its class's own methods run (timm: forward_features then forward_head, reset_classifier; torchvision:
the model's `features`/`fc`/`classifier`/`heads` where it has them). A cell reads `own class` or the reason.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

MODELS = [
    "timm:resnet10t",
    "timm:resnet18",
    "timm:mobilenetv3_small_050",
    "timm:efficientnet_b0",
    "timm:convnext_atto",
    "timm:regnetx_002",
    "timm:vit_tiny_patch16_224",
    "torchvision:resnet18",
    "torchvision:mobilenet_v3_small",
    "torchvision:mobilenet_v2",
    "torchvision:efficientnet_b0",
    "torchvision:shufflenet_v2_x0_5",
    "torchvision:squeezenet1_1",
    "torchvision:regnet_y_400mf",
]
SIZE = 64


def build(name: str) -> torch.nn.Module:
    zoo, _, arch = name.partition(":")
    torch.manual_seed(0)
    if zoo == "timm":
        import timm

        extra = {"img_size": SIZE, "depth": 2} if arch.startswith("vit") else {}
        return timm.create_model(arch, num_classes=5, **extra).eval()
    import torchvision

    return getattr(torchvision.models, arch)(num_classes=5).eval()


def own_methods(model: torch.nn.Module, x: torch.Tensor) -> None:
    """The class's own API beyond forward, on the grown layers."""
    if hasattr(model, "forward_features") and hasattr(model, "forward_head"):
        assert model.forward_head(model.forward_features(x)).shape == (x.shape[0], 5)
        if hasattr(model, "reset_classifier"):
            model.reset_classifier(7)
            assert model(x).shape == (x.shape[0], 7)
    elif hasattr(model, "features"):
        model.features(x)


def check(name: str, passes: list[str]) -> tuple[str, float]:
    import graphgrow as gg

    start = time.perf_counter()
    model = build(name)
    if "vit" in name and passes == ["grow_width"]:  # the MLPs: timm's attention reshapes to the embedding width
        passes = [f"grow_width(target=blocks.{i}.mlp.fc1)" for i in range(len(model.blocks))]
    try:
        grown = gg.Pipeline.from_spec(passes).run(gg.trace(model, input_shape=(1, 3, SIZE, SIZE))).gm
        native = gg.as_native(grown, model)
    except gg.GraphgrowError as e:
        return f"{type(e).__name__}: {' '.join(e.message.split())[:140]}", time.perf_counter() - start
    if type(native) is not type(model):
        return f"FAIL: came back as {type(native).__name__}", time.perf_counter() - start
    grown_params = sum(p.numel() for p in native.parameters())
    if grown_params <= sum(p.numel() for p in model.parameters()):
        return "FAIL: no larger", time.perf_counter() - start
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    native.eval()
    with torch.no_grad():
        a, b = model(x), native(x)
        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        if rel > 1e-4:
            return f"FAIL: output differs by {rel:.2e}", time.perf_counter() - start
        try:
            own_methods(native, x)
        except Exception as e:  # noqa: BLE001 - the class's own method on the grown layers is the verdict
            return f"FAIL: own method: {type(e).__name__}: {str(e)[:100]}", time.perf_counter() - start
    growth = grown_params / sum(p.numel() for p in model.parameters())
    return f"own class ({type(native).__name__}, ×{growth:.3f} parameters, Δ {rel:.0e})", time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=",".join(MODELS))
    ap.add_argument("--pass", dest="passes", default="grow_width")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.model.split(","):
        verdict, seconds = check(name, args.passes.split(";"))
        rows.append((name, verdict))
        print(f"{name:34} {verdict}  ({seconds:.1f} s)", flush=True)
    if args.markdown:
        print("\n| model | " + args.passes + " |\n|---|---|")
        for name, verdict in rows:
            print(f"| {name} | {verdict} |")


if __name__ == "__main__":
    sys.exit(main())
