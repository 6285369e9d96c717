"""The ``hsx`` command line: option declarations and one call into the library per command.

Every command turns :class:`hsx.HsxError` into ``error: ...`` and exit code 2 in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.run.report import quiet_libraries

app = typer.Typer(
    name="hsx",
    help="Per-token hidden states from speculative decoding engines, aligned and written as Parquet shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: wraps to the terminal's width (COLUMNS; click alone stops at 80) without
    # cutting option names, and reads help text as text (rich markup would eat "[ray]")
    rich_markup_mode=None,
    context_settings={"max_content_width": 400},
)
export_app = typer.Typer(help="Write shards in another tool's layout.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(export_app, name="export")

LocationArg = Annotated[str, typer.Argument(help="An hsx output directory (with its manifest), s3://BUCKET/PREFIX, or one shard file.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (and the report).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Also show the libraries' own progress bars, "
                                       "info lines and warnings.")]
_D = ExtractConfig()  # the one source of the defaults --help shows


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


@app.command()
def inspect(
    path: LocationArg,
    as_json: AsJson = False,
    errors: Annotated[bool, typer.Option("--errors", help="List every error record (by default the first 10).")] = False,
) -> None:
    """Summarise shards: samples, tokens, bytes, dtype, layer groups, model, engine, acceptance, error records."""
    from hsx.run.report import format_inspect
    from hsx.shards.verify import inspect as inspect_shards

    summary = inspect_shards(path)
    if as_json:
        typer.echo(json.dumps(summary, indent=1, default=str))
        return
    typer.echo(format_inspect(summary, all_errors=errors))


def _opt(help: str, *names: str, **kw):
    return typer.Option(*names, help=help, show_default=False, **kw)


@app.command()
def verify(
    path: LocationArg,
    as_json: AsJson = False,
    recompute: Annotated[bool, _opt("Also re-run a teacher-forced forward of the model and check every stored row of every column against it.", "--recompute")] = False,
    model: Annotated[Optional[str], _opt("--recompute: the model to use (default: the path in the shard metadata); its config must match.")] = None,
    force: Annotated[bool, _opt("--recompute: use --model even if its config differs from the recorded one.", "--force")] = False,
    device: Annotated[str, _opt("--recompute: auto (cuda when present), cpu, cuda or cuda:N.")] = "auto",
    model_dtype: Annotated[str, _opt("--recompute: compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")] = "auto",
    samples: Annotated[Optional[int], _opt("--recompute: check only N samples, chosen reproducibly with --seed.")] = None,
    seed: Annotated[int, _opt("--recompute: seed for --samples.")] = 0,
    batch_size: Annotated[int, _opt("--recompute: samples per forward (default 8).")] = 8,
    recompute_chunk: Annotated[str, _opt("--recompute: a sample longer than N tokens is checked alone, N tokens at a time through a KV cache, its memory bounded by N: N, off (every sample in one forward) or auto (N = 2048, fewer above 16,384 tokens so that a chunk's attention mask stays within 2^25 entries, at least 256).")] = "auto",
    rtol: Annotated[Optional[float], _opt("--recompute: per-row relative error limit (default: by stored and compute dtypes, see docs/RECOMPUTE.md).")] = None,
    trust_remote_code: Annotated[bool, _opt("--recompute: allow the model repository to run its own code.", "--trust-remote-code")] = False,
    dataset: Annotated[Optional[str], _opt("--recompute of a vision-language output whose images came from a dataset column: the run's dataset where it is now (default: the source in the metadata).")] = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Check manifest vs files, checksums, schema, alignment row counts and NaN/Inf; with --recompute, every
    row against an independent forward of the model. Exit 1 on any fault."""
    import dataclasses

    from hsx.run.report import format_recompute, format_verify
    from hsx.shards.verify import verify as verify_shards

    quiet_libraries(verbose)
    report = verify_shards(path)
    checked = None
    if recompute and report.ok:
        from hsx.shards.reader import open_shards as hsx_open
        from hsx.run.preflight import model_config
        from hsx.recompute import recompute as run_recompute

        # the forward reads stored token ids: no tokenizer needed
        if model:
            model_config(model, "--model", tokenizer=False)
        else:
            ds = hsx_open(path)
            found = ds.model_path()  # the recorded directory, from any working directory
            recorded = str(found) if found else (ds.metadata.get("model") or {}).get("path")
            if recorded:
                model_config(recorded, "the shards' model (another copy: --model)", tokenizer=False)
        checked = run_recompute(path, model=model, device=device, dtype=model_dtype, samples=samples, seed=seed,
                                batch_size=batch_size, rtol=rtol, force=force, trust_remote_code=trust_remote_code,
                                progress=not quiet and not as_json, chunk=recompute_chunk, dataset=dataset)
    if as_json:
        out = {**dataclasses.asdict(report), "ok": report.ok}
        if recompute:
            out["recompute"] = None if checked is None else checked.to_dict()
        typer.echo(json.dumps(out, indent=1, default=str))
    else:
        typer.echo(format_verify(report))
        if checked is not None:
            typer.echo(format_recompute(checked))
        elif recompute:
            typer.echo("recompute: not run (fix the faults above first)")
    if not report.ok or (checked is not None and not checked.ok):
        raise typer.Exit(1)


def _cfg(help: str, *names: str, **kw):
    """An option whose default is ExtractConfig's (shown in --help; a config file's value wins over it)."""
    return typer.Option(*names, help=help, show_default=True, **kw)


_REQUIRED_FROM_CONFIG = ("model", "dataset", "output")


def _load_required(ctx: typer.Context, config: Optional[Path]) -> Optional[Path]:
    """``--config`` is read first: the options marked required may come from the file instead."""
    if config is not None:
        from hsx.config import ExtractConfig

        given = ExtractConfig.from_file(config).to_dict()
        ctx.default_map = {**(ctx.default_map or {}), **{k: given[k] for k in _REQUIRED_FROM_CONFIG if given[k]}}
    return config


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
    ctx: typer.Context,
    model: Annotated[str, _opt("Target model: a model directory (config.json, weights, tokenizer files), or a hub id (name or org/name, from the hub or its local cache); or model in --config.")],
    dataset: Annotated[str, _opt("A local json/jsonl/parquet/csv file, a saved dataset directory, or a hub name; or dataset in --config.")],
    output: Annotated[str, _opt("Output directory for shards and manifest, or s3://BUCKET/PREFIX in an S3-compatible store (endpoint and credentials from AWS_* variables or ~/.aws); or output in --config.", "--output", "-o")],
    draft_model: Annotated[Optional[str], _opt("Draft model for speculative decoding, named as --model (shares its tokenizer).")] = None,
    engine: Annotated[str, _cfg("Engine: hf (transformers, CPU or GPU), sglang or vllm.")] = _D.engine,
    mode: Annotated[str, _cfg("generate: prompt + completion; prefill: teacher-forced over whole conversations.")] = _D.mode,
    layers: Annotated[str, _cfg("Comma-separated layer groups: final, eagle3, boundary numbers (0 = embeddings, L = last block before the norm).")] = _D.layers,
    keep: Annotated[str, _cfg("Positions that get rows: all, completion (rows that produced the completion), loss (rows predicting a loss_mask token), last (one row per sample).")] = _D.keep,
    dtype: Annotated[str, _cfg("Stored dtype: bfloat16 (bit-exact), float16, float32; lossy: int8, float8_e4m3 (docs/STORAGE.md).")] = _D.dtype,
    split: Annotated[str, _cfg("Dataset split.")] = _D.split,
    limit: Annotated[Optional[int], _opt("Process only the first N rows.")] = None,
    id_field: Annotated[Optional[str], _opt("Column holding a stable sample id (default: split:index).")] = None,
    text_field: Annotated[Optional[str], _opt("Column holding plain text (default: text/prompt/content/question).")] = None,
    chat_template: Annotated[Optional[str], _opt("A Jinja chat template file overriding the tokenizer's.")] = None,
    max_length: Annotated[Optional[int], _opt("Longest prompt accepted (default: the model's context length).")] = None,
    batch_size: Annotated[int, _cfg("Rows per forward: requests decoding together (generate), sequences per forward (prefill).")] = _D.batch_size,
    max_batch_tokens: Annotated[Optional[int], _opt("Padded prompt tokens per prefill forward, both modes (default: no limit; raise --batch-size with it).")] = None,
    window: Annotated[Optional[int], _opt("Source rows scheduled together, sorted by length in prefill mode (default 32 batches).")] = None,
    max_new_tokens: Annotated[int, _cfg("Completion budget per sample in generate mode.")] = _D.max_new_tokens,
    temperature: Annotated[float, _cfg("Sampling temperature; 0 = greedy.")] = _D.temperature,
    top_p: Annotated[float, _cfg("Nucleus sampling threshold.")] = _D.top_p,
    seed: Annotated[int, _cfg("Random seed for sampling.")] = _D.seed,
    spec_num_steps: Annotated[Optional[int], _opt("Draft depth per verify step (default 3).")] = None,
    spec_topk: Annotated[Optional[int], _opt("Draft branching: 1 = chain, >1 = tree (default 1).")] = None,
    spec_num_draft_tokens: Annotated[Optional[int], _opt("Verify stride, root included (default num_steps + 1 for chains).")] = None,
    spec_algorithm: Annotated[Optional[str], _opt("--engine sglang: EAGLE or EAGLE3 (NGRAM, STANDALONE, DFLASH are refused); --engine vllm: EAGLE, EAGLE3 or NGRAM.")] = None,
    sglang_capture: Annotated[str, _cfg("--engine sglang: tensors (hsx's capture in SGLang's scheduler) or lists (SGLang's return_hidden_states float lists, slower, one column).")] = _D.sglang_capture,
    eagle3_layer_ids: Annotated[Optional[str], _opt("EAGLE3 aux layer ids as a draft config gives them, e.g. 1,15,28 (default: the draft config's, else SGLang's [2, L//2, L-3] boundaries).")] = None,
    device: Annotated[str, _cfg("auto, cpu, cuda or cuda:N.")] = _D.device,
    model_dtype: Annotated[str, _cfg("Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")] = _D.model_dtype,
    prefill_chunk: Annotated[Optional[int], _opt("--engine hf: prefill prompts N tokens at a time through the KV cache, so that a forward's activations are bounded by N tokens, not the prompt (default: each prompt in one forward).")] = None,
    compression: Annotated[str, _cfg("Hidden-state codec, all lossless: planes-zstd (byte planes + zstd, ~0.56x raw on SmolLM2 states), zstd, none (zero-copy reads).")] = _D.compression,
    max_shard_mb: Annotated[int, _cfg("Close a shard at about this size.")] = _D.max_shard_mb,
    max_shard_samples: Annotated[int, _cfg("Close a shard after this many samples.")] = _D.max_shard_samples,
    writer_lanes: Annotated[Optional[int], _opt("Shards encoded and written at once, a thread each (default: min(4, CPUs)); raise it where the writer cannot keep up with the engine (docs/PERFORMANCE.md).")] = None,
    trust_remote_code: Annotated[bool, _opt("Allow model repositories to run their own code (off unless given).", "--trust-remote-code")] = False,
    tp_size: Annotated[Optional[int], _opt("--engine sglang: tensor-parallel size (sglang.Engine tp_size).")] = None,
    dp_size: Annotated[Optional[int], _opt("--engine sglang: data-parallel size (dp_size).")] = None,
    mem_fraction: Annotated[Optional[float], _opt("--engine sglang: GPU memory fraction for weights and KV cache (mem_fraction_static).")] = None,
    attention_backend: Annotated[Optional[str], _opt("--engine sglang: attention backend (attention_backend).")] = None,
    engine_arg: Annotated[Optional[list[str]], _opt("--engine sglang or vllm: any other sglang.Engine or vllm.LLM argument, KEY=VALUE (VALUE parsed as JSON when it can be); repeatable.")] = None,
    ray: Annotated[Optional[bool], _opt("Run one engine per Ray worker (needs hsx[ray]); the output must be on a filesystem every node shares, or in an object store every node reaches.", "--ray")] = None,
    ray_address: Annotated[Optional[str], _opt("--ray: the cluster to join (auto or HOST:PORT; local: a new local instance); default RAY_ADDRESS, else the cluster `ray start` made on this machine, else a new local one.")] = None,
    num_workers: Annotated[Optional[int], _opt("--ray: workers, one engine each (default: the cluster's GPUs / --gpus-per-worker).")] = None,
    cpus_per_worker: Annotated[Optional[float], _opt("--ray: CPUs Ray reserves per worker; fractions allowed (default 1).")] = None,
    gpus_per_worker: Annotated[Optional[float], _opt("--ray: GPUs per worker (default: --tp-size, or 1, on a cluster with GPUs; else 0).")] = None,
    unit_size: Annotated[Optional[int], _opt("--ray: source rows per work unit, a multiple of --window (default 32 batches).")] = None,
    config: Annotated[Optional[Path], _opt("A TOML or JSON file with any of these options (command-line options win).",
                                           is_eager=True, callback=_load_required)] = None,
    overwrite: Annotated[bool, _opt("Replace an existing output written with a different configuration.", "--overwrite")] = False,
    quiet: Annotated[bool, _opt("Print nothing but errors: no progress bar, no summary.", "--quiet", "-q")] = False,
    verbose: Verbose = False,
    dry_run: Annotated[bool, _opt("Write nothing: print the tokens, bytes on disk and shards the run would write "
                                  "(the model's config and tokenizer and the dataset only; no forward).", "--dry-run")] = False,
) -> None:
    """Extract per-token hidden states from a dataset into aligned shards (resumes an interrupted run)."""
    # Only options given on the command line override the config file (defaults shown in --help are
    # ExtractConfig's own, and the file's values win over them).
    given = {k for k in ctx.params if getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE"}
    overrides = {k: v for k, v in locals().items() if k in given and k not in ("config", "overwrite", "quiet", "verbose", "dry_run")}
    engine_args = _engine_args(tp_size, dp_size, mem_fraction, attention_backend, engine_arg)
    for name in ("tp_size", "dp_size", "mem_fraction", "attention_backend", "engine_arg"):
        overrides.pop(name, None)
    if eagle3_layer_ids is not None:
        try:
            overrides["eagle3_layer_ids"] = [int(x) for x in eagle3_layer_ids.split(",")]
        except ValueError:
            _fail(f"--eagle3-layer-ids must be comma-separated integers, got {eagle3_layer_ids!r}")
    base = ExtractConfig.from_file(config) if config else ExtractConfig()
    if engine_args:
        overrides["engine_args"] = {**base.engine_args, **engine_args}
    if ray_address is not None:
        overrides["ray"] = True
    cfg = base.merged(overrides)
    quiet_libraries(verbose)
    if dry_run:
        from hsx.run.estimate import estimate

        for line in estimate(cfg).lines():
            typer.echo(line)
        return
    from hsx.run.stopping import Terminated, exit_code, sigterm_interrupts

    try:
        with sigterm_interrupts():  # a scheduler's SIGTERM stops the run as Ctrl-C does
            from hsx.run.preflight import check_extract

            cfg = check_extract(cfg, overwrite)  # before torch is imported: a mistake costs a second, not a model load
            from hsx.run.pipeline import extract as run_extract

            summary = run_extract(cfg, overwrite=overwrite, progress=not quiet, checked=True)
    except KeyboardInterrupt as stop:
        from hsx.run.report import format_interrupted

        typer.echo(format_interrupted(cfg.output, "SIGTERM" if isinstance(stop, Terminated) else None), err=True)
        raise typer.Exit(exit_code(stop)) from None
    if not quiet:
        from hsx.run.report import format_run

        typer.echo(format_run(summary))


@export_app.command("specforge")
def export_specforge(
    src: LocationArg,
    dst: Annotated[Path, typer.Argument(help="Output directory for SpecForge's offline EAGLE3 layout.")],
    draft_vocab_size: Annotated[Optional[int], _opt("Draft vocabulary size for vocab_mapping.pt (default: the draft config's, else the whole target vocabulary).")] = None,
    draft_config: Annotated[Optional[Path], _opt("The draft's config.json (or its directory): checked against the shards' widths and eagle3 layers.")] = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Write SpecForge offline EAGLE3 files (rows_*/data_*.ckpt, vocab_mapping/vocab_mapping.pt); resumable."""
    quiet_libraries(verbose)
    from hsx.export.specforge import export_specforge as run_export

    s = run_export(src, dst, draft_vocab_size=draft_vocab_size, draft_config=draft_config, progress=not quiet)
    typer.echo(f"{s.dst}: {s.samples} samples, {s.tokens:,} tokens; {s.written} file(s) written "
               f"({s.replaced} replaced), {s.skipped} already complete; draft vocab {s.draft_vocab_size} of "
               f"{s.target_vocab_size} covers {s.vocab_coverage:.1%} of learned tokens")


def _int_list(text: Optional[str], option: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"{option} must be comma-separated integers, got {text!r}")


@export_app.command("speculators")
def export_speculators(
    src: LocationArg,
    dst: Annotated[Path, typer.Argument(help="Output directory: speculators' --data-path (dataset + hidden_states/).")],
    target_layer_ids: Annotated[Optional[str], _opt("Aux boundaries, vLLM's target_layer_ids (block inputs = hsx boundaries), e.g. 2,15,27 (default: the eagle3 column's). Boundary L is always added last.")] = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Write speculators' offline EAGLE3 data (hidden_states/hs_*.safetensors + its Arrow dataset); resumable."""
    quiet_libraries(verbose)
    from hsx.export import export_speculators as run_export

    ids = _int_list(target_layer_ids, "--target-layer-ids")
    s = run_export(src, dst, target_layer_ids=ids, progress=not quiet)
    typer.echo(f"{s.dst}: {s.samples} samples, {s.tokens:,} tokens; {s.written} file(s) written, {s.kept} already "
               f"complete, {s.skipped_short} sample(s) under 2 tokens skipped; train with --target-layer-ids "
               f"{' '.join(map(str, s.target_layer_ids))}")


@export_app.command("saelens")
def export_saelens(
    src: LocationArg,
    dst: Annotated[Path, typer.Argument(help="Output directory: SAELens' cached_activations_path.")],
    column: Annotated[str, _opt("The boundary to export (b5 or 5, wherever it is stored) or final.")],
    context_size: Annotated[int, _opt("Tokens per context (SAELens' context_size).")],
    hook_name: Annotated[Optional[str], _opt("Column name (default: TransformerLens' hook for the boundary, e.g. blocks.5.hook_resid_pre).")] = None,
    dtype: Annotated[str, _opt("float32 (exact for every stored dtype) or float16.")] = "float32",
    concat: Annotated[bool, _opt("Pack samples back to back (default) or one context per sample (--no-concat).", "--concat/--no-concat")] = True,
    quiet: Quiet = False,
    verbose: Verbose = False,
) -> None:
    """Write one column as SAELens cached activations (a save_to_disk dataset of fixed contexts)."""
    quiet_libraries(verbose)
    from hsx.export import export_saelens as run_export

    s = run_export(src, dst, column=column, context_size=context_size, hook_name=hook_name, dtype=dtype,
                   concat=concat, progress=not quiet)
    state = "already complete, left as it is" if s.skipped else f"{s.bytes_written:,} bytes written"
    typer.echo(f"{s.dst}: {s.contexts} contexts x {s.context_size} tokens of {s.hook_name} (d_in {s.d_in}); "
               f"{s.dropped_tokens} token(s) dropped (last partial context / short samples); {state}")


@export_app.command("vllm-head")
def export_vllm_head(
    src: Annotated[Path, typer.Argument(help="An EAGLE3 (LlamaForCausalLMEagle3, SpecForge's) or EAGLE (LlamaForCausalLMEagle) head in SGLang's format.")],
    dst: Annotated[Path, typer.Argument(help="Output directory for the head in vLLM 0.32's format (config.json, model.safetensors).")],
    model: Annotated[Optional[str], _opt("The target model: needed for a head whose config has no hsx marker (SGLang's id rule depends on the target); checks widths and vocabulary when given.")] = None,
    force: Annotated[bool, _opt("Replace DST if it exists and is not empty.", "--force")] = False,
    trust_remote_code: Annotated[bool, _opt("Let transformers run the target config's own code.", "--trust-remote-code")] = False,
) -> None:
    """Rewrite an SGLang-format draft head as vLLM loads it: aux layer ids as vLLM reads them, d2t folded, marked "vllm"."""
    from hsx.heads.vllm_head import convert_vllm_head

    done = convert_vllm_head(src, dst, model=model, overwrite=force, trust_remote_code=trust_remote_code)
    typer.echo(done.describe())


def main() -> None:
    try:
        app()
    except HsxError as e:
        # Outside a command typer.Exit is not turned into an exit status: exit here.
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
