"""The ``hsx`` command line: option declarations and one call into the library per command.

Every command turns :class:`hsx.HsxError` into ``error: ...`` and exit code 2 in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from hsx.errors import HsxError

app = typer.Typer(
    name="hsx",
    help="Per-token hidden states from speculative decoding engines, aligned and written as Parquet shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
export_app = typer.Typer(help="Write shards in another tool's layout.", no_args_is_help=True)
app.add_typer(export_app, name="export")

PathArg = Annotated[Path, typer.Argument(help="An hsx output directory (with manifest.json) or one shard file.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


@app.command()
def inspect(path: PathArg, as_json: AsJson = False) -> None:
    """Summarise shards: samples, tokens, bytes, dtype, layer groups, model, engine, acceptance."""
    from hsx.shards.verify import inspect as inspect_shards

    summary = inspect_shards(path)
    if as_json:
        typer.echo(json.dumps(summary, indent=1, default=str))
        return
    from hsx.report import format_inspect

    typer.echo(format_inspect(summary))


@app.command()
def verify(path: PathArg, as_json: AsJson = False) -> None:
    """Check manifest vs files, checksums, schema, alignment row counts and NaN/Inf; exit 1 on any fault."""
    from hsx.report import format_verify
    from hsx.shards.verify import verify as verify_shards

    report = verify_shards(path)
    if as_json:
        import dataclasses

        typer.echo(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=1))
    else:
        typer.echo(format_verify(report))
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except HsxError as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
