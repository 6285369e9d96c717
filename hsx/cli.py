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


def _opt(help: str, *names: str, **kw):
    return typer.Option(*names, help=help, show_default=False, **kw)


def _engine_args(tp_size, dp_size, mem_fraction, attention_backend, pairs) -> dict:
    """sglang.Engine keyword arguments from the command line, under SGLang's own names."""
    args = {"tp_size": tp_size, "dp_size": dp_size, "mem_fraction_static": mem_fraction,
            "attention_backend": attention_backend}
    args = {k: v for k, v in args.items() if v is not None}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--engine-arg takes KEY=VALUE, got {pair!r}")
        try:
            args[key] = json.loads(value)
        except ValueError:
            args[key] = value
    return args


@app.command()
def extract(
    model: Annotated[Optional[str], _opt("Target model: a local path (or hub id where a hub is reachable).")] = None,
    dataset: Annotated[Optional[str], _opt("A local json/jsonl/parquet/csv file, a saved dataset directory, or a hub name.")] = None,
    output: Annotated[Optional[str], _opt("Output directory for shards and manifest.", "--output", "-o")] = None,
    draft_model: Annotated[Optional[str], _opt("Draft model for speculative decoding (shares the tokenizer).")] = None,
    engine: Annotated[Optional[str], _opt("Engine: hf (transformers, CPU or GPU) or sglang.")] = None,
    mode: Annotated[Optional[str], _opt("generate: prompt + completion; prefill: teacher-forced over whole conversations.")] = None,
    layers: Annotated[Optional[str], _opt("Comma-separated layer groups: final, eagle3, boundary numbers (0 = embeddings, L = last block before the norm).")] = None,
    dtype: Annotated[Optional[str], _opt("Stored dtype: bfloat16 (default, bit-exact), float16, float32.")] = None,
    split: Annotated[Optional[str], _opt("Dataset split (default train).")] = None,
    limit: Annotated[Optional[int], _opt("Process only the first N rows.")] = None,
    id_field: Annotated[Optional[str], _opt("Column holding a stable sample id (default: split:index).")] = None,
    text_field: Annotated[Optional[str], _opt("Column holding plain text (default: text/prompt/content/question).")] = None,
    chat_template: Annotated[Optional[str], _opt("A Jinja chat template file overriding the tokenizer's.")] = None,
    max_length: Annotated[Optional[int], _opt("Longest prompt accepted (default: the model's context length).")] = None,
    batch_size: Annotated[Optional[int], _opt("Requests per engine batch (default 8).")] = None,
    max_new_tokens: Annotated[Optional[int], _opt("Completion budget per sample in generate mode (default 128).")] = None,
    temperature: Annotated[Optional[float], _opt("Sampling temperature; 0 = greedy (default).")] = None,
    top_p: Annotated[Optional[float], _opt("Nucleus sampling threshold (default 1.0).")] = None,
    seed: Annotated[Optional[int], _opt("Random seed for sampling (default 0).")] = None,
    spec_num_steps: Annotated[Optional[int], _opt("Draft depth per verify step (default 3).")] = None,
    spec_topk: Annotated[Optional[int], _opt("Draft branching: 1 = chain, >1 = tree (default 1).")] = None,
    spec_num_draft_tokens: Annotated[Optional[int], _opt("Verify stride, root included (default num_steps + 1 for chains).")] = None,
    spec_algorithm: Annotated[Optional[str], _opt("--engine sglang: EAGLE or EAGLE3 (NGRAM, STANDALONE, DFLASH are refused).")] = None,
    sglang_capture: Annotated[Optional[str], _opt("--engine sglang: tensors (hsx's capture in SGLang's scheduler, default) or lists (SGLang's return_hidden_states float lists, slower, one column).")] = None,
    eagle3_layer_ids: Annotated[Optional[str], _opt("EAGLE3 aux layer ids as a draft config gives them, e.g. 1,15,28.")] = None,
    device: Annotated[Optional[str], _opt("auto, cpu, cuda or cuda:N (default auto).")] = None,
    model_dtype: Annotated[Optional[str], _opt("Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")] = None,
    compression: Annotated[Optional[str], _opt("none (default) or zstd (smaller, slower).")] = None,
    max_shard_mb: Annotated[Optional[int], _opt("Close a shard at about this size (default 512).")] = None,
    max_shard_samples: Annotated[Optional[int], _opt("Close a shard after this many samples (default 100000).")] = None,
    trust_remote_code: Annotated[Optional[bool], _opt("Allow model repositories to run their own code.", "--trust-remote-code")] = None,
    tp_size: Annotated[Optional[int], _opt("--engine sglang: tensor-parallel size (sglang.Engine tp_size).")] = None,
    dp_size: Annotated[Optional[int], _opt("--engine sglang: data-parallel size (dp_size).")] = None,
    mem_fraction: Annotated[Optional[float], _opt("--engine sglang: GPU memory fraction for weights and KV cache (mem_fraction_static).")] = None,
    attention_backend: Annotated[Optional[str], _opt("--engine sglang: attention backend (attention_backend).")] = None,
    engine_arg: Annotated[Optional[list[str]], _opt("--engine sglang: any other sglang.Engine argument, KEY=VALUE (VALUE parsed as JSON when it can be); repeatable.")] = None,
    config: Annotated[Optional[Path], _opt("A TOML or JSON file with any of these options (command-line options win).")] = None,
    overwrite: Annotated[bool, _opt("Replace an existing output written with a different configuration.")] = False,
    quiet: Annotated[bool, _opt("No progress bar.", "--quiet", "-q")] = False,
) -> None:
    """Extract per-token hidden states from a dataset into aligned shards (resumes an interrupted run)."""
    overrides = {k: v for k, v in locals().items() if k not in ("config", "overwrite", "quiet")}
    engine_args = _engine_args(overrides.pop("tp_size"), overrides.pop("dp_size"), overrides.pop("mem_fraction"),
                               overrides.pop("attention_backend"), overrides.pop("engine_arg"))
    from hsx.config import ExtractConfig
    from hsx.pipeline import extract as run_extract
    from hsx.report import format_run

    if eagle3_layer_ids is not None:
        try:
            overrides["eagle3_layer_ids"] = [int(x) for x in eagle3_layer_ids.split(",")]
        except ValueError:
            _fail(f"--eagle3-layer-ids must be comma-separated integers, got {eagle3_layer_ids!r}")
    base = ExtractConfig.from_file(config) if config else ExtractConfig()
    if engine_args:
        overrides["engine_args"] = {**base.engine_args, **engine_args}
    cfg = base.merged(overrides)
    summary = run_extract(cfg, overwrite=overwrite, progress=not quiet)
    typer.echo(format_run(summary))


@export_app.command("specforge")
def export_specforge(
    src: PathArg,
    dst: Annotated[Path, typer.Argument(help="Output directory for SpecForge's offline EAGLE3 layout.")],
    draft_vocab_size: Annotated[Optional[int], _opt("Draft vocabulary size for vocab_mapping.pt (default: the draft config's, else the whole target vocabulary).")] = None,
    draft_config: Annotated[Optional[Path], _opt("The draft's config.json (or its directory): checked against the shards' widths and eagle3 layers.")] = None,
    quiet: Annotated[bool, _opt("No progress bar.", "--quiet", "-q")] = False,
) -> None:
    """Write SpecForge offline EAGLE3 files (rows_*/data_*.ckpt, vocab_mapping/vocab_mapping.pt); resumable."""
    from hsx.eagle3.export import export_specforge as run_export

    s = run_export(src, dst, draft_vocab_size=draft_vocab_size, draft_config=draft_config, progress=not quiet)
    typer.echo(f"{s.dst}: {s.samples} samples, {s.tokens:,} tokens; {s.written} file(s) written "
               f"({s.replaced} replaced), {s.skipped} already complete; draft vocab {s.draft_vocab_size} of "
               f"{s.target_vocab_size} covers {s.vocab_coverage:.1%} of learned tokens")


def main() -> None:
    try:
        app()
    except HsxError as e:
        # Outside a command typer.Exit is not turned into an exit status: exit here.
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
