"""The `graphgrow` command: the group (`main`), with the commands of commands_growth (mutate, replay, fold,
search) and commands_read (export, check, inspect, targets, diff) added to it, `passes`, and the generated CLI
reference. The jobs behind them are graphgrow.jobs.workflow's.
"""

from __future__ import annotations

import dataclasses
import html
import json

import click
from rich.markup import escape

from ..core.errors import GraphgrowError
from . import commands_growth, commands_read
from .run import out
from .show import passes_markdown, type_name


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphgrow")
def main() -> None:
    """graphgrow: grow PyTorch models with verified, function-preserving graph passes,
    export them to ONNX and prove onnxruntime agrees.

    MODEL is a file written by torch.save (standard torch.nn layers load without
    --trust; graphgrow's own outputs too), a zoo name (timm:resnet26d,
    torchvision:resnet18, hf:MODEL_TYPE[/TASK] for Hugging Face transformers; random
    weights, input shape from the zoo) or a factory (package.module:factory), each
    optionally with literal arguments: 'timm:resnet26d(num_classes=10,drop_path_rate=0.1)',
    'hf:gpt2(n_layer=2,n_embd=64,n_head=4)', or a save_pretrained folder (safetensors).
    A named model takes trained weights with --weights FILE.safetensors.

    Exit codes: 0 ok, 1 a check failed, 2 bad input or a pass that cannot apply,
    3 internal error.
    """


# Click lists a group's commands sorted by name, so the order they are added in changes no help text.
for _command in (
    commands_growth.mutate,
    commands_growth.replay,
    commands_growth.fold,
    commands_growth.search,
    commands_read.export,
    commands_read.check,
    commands_read.inspect,
    commands_read.targets,
    commands_read.diff,
):
    main.add_command(_command)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option(
    "--markdown",
    is_flag=True,
    help="print the table of arguments docs/passes.md shows (from the passes' own field help)",
)
def passes(as_json, markdown):
    """List the installed passes with their arguments, defaults and what each argument means."""
    from ..jobs.registry import all_passes
    from .show import argument_type, contract

    found = all_passes()
    if markdown:
        print(passes_markdown(found))
        return
    if as_json:
        data = {}
        for name, cls in found.items():
            if isinstance(cls, GraphgrowError):
                data[name] = {"error": str(cls)}
            else:
                hints, helps, allowed = cls.argument_types(), cls.argument_help(), cls.argument_allowed()
                data[name] = {
                    "help": cls.help(),
                    "args": [
                        {
                            "name": f.name,
                            "type": type_name(hints[f.name]),
                            "default": f.default,
                            "help": helps[f.name],
                            "allowed": allowed[f.name].describe(),
                        }
                        for f in dataclasses.fields(cls)
                    ],
                    "requires": [r.name for r in cls.requires],
                    "ensures": [g.name for g in cls.ensures],
                }
        print(json.dumps(data, default=str))
        return
    for name, cls in found.items():
        if isinstance(cls, GraphgrowError):
            out.print(f"[bold]{name}[/]  [red]unavailable:[/] {cls}")
            continue
        out.print(f"[bold]{name}[/]  {escape(cls.help())}")
        if contract(cls):
            out.print(f"    ({escape(contract(cls))})")
        helps = cls.argument_help()
        for f in dataclasses.fields(cls):
            out.print(
                f"    {f.name}: {escape(argument_type(cls, f.name))} = {f.default!r}"
                + (f"  — {escape(helps[f.name])}" if helps[f.name] else "")
            )


def cli_reference(width: int = 100) -> str:
    """The README's CLI reference: `graphgrow --help` and every command's --help, at a fixed width so the
    text does not depend on the terminal that generated it."""
    root = click.Context(
        main, info_name="graphgrow", terminal_width=width, max_content_width=width, **main.context_settings
    )
    parts = []
    for cmd in [main, *(main.commands[n] for n in sorted(main.commands))]:
        ctx = root if cmd is main else click.Context(cmd, info_name=cmd.name, parent=root)
        name = ctx.command_path
        summary = "" if cmd is main else f" — {cmd.get_short_help_str(limit=300)}"
        parts.append(
            f"<details><summary><code>{name} --help</code>{html.escape(summary, quote=False)}</summary>\n\n```text\n"
            f"{cmd.get_help(ctx)}\n```\n\n</details>"
        )
    return "\n\n".join(parts)
