"""The one typed configuration of an extraction run, shared by the CLI, config files and Python."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from hsx.errors import HsxError
from hsx.shards.positions import check_rule

Mode = Literal["generate", "prefill"]


# options of one run of the command, not of what it extracts (they stay out of the config hash)
RUN_OPTIONS = {"quiet": "progress=False", "overwrite": "overwrite=True"}


@dataclass
class ExtractConfig:
    """What an extraction produces: the model, the data, what to capture and how to decode.

    How a run reports or replaces output is not part of it: the CLI's ``--quiet`` and
    ``--overwrite`` are ``hsx.extract(cfg, progress=False, overwrite=True)`` from Python.
    """

    # what to run
    model: str = ""
    draft_model: str | None = None
    engine: str = "hf"  # a name in hsx.engine.registry.ENGINES (hf, sglang, vllm); its runner checks the rest
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    model_dtype: str = "auto"  # compute dtype: auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    trust_remote_code: bool = False
    # data
    dataset: str = ""
    split: str = "train"
    limit: int | None = None
    id_field: str | None = None
    text_field: str | None = None
    chat_template: str | None = None  # path to a Jinja template file
    max_length: int | None = None  # context limit; default: the model's max_position_embeddings
    # what to capture
    output: str = ""
    mode: Mode = "generate"
    layers: str = "final"
    eagle3_layer_ids: list[int] | None = None  # draft-config ids; default: read from the draft config if any
    dtype: Literal["bfloat16", "float16", "float32", "int8", "float8_e4m3"] = "bfloat16"
    keep: Literal["all", "completion", "loss", "last"] = "all"  # which positions get rows (hsx.shards.positions)
    # decoding
    batch_size: int = 8  # rows per forward: requests decoding together (generate), sequences per forward (prefill)
    max_batch_tokens: int | None = None  # padded prompt tokens per prefill forward (both modes); None: no limit
    prefill_chunk: int | None = None  # hf engine: prompt tokens per prefill forward, through the KV cache; None: whole prompts
    window: int | None = None  # source rows scheduled together (prefill: sorted by length); default 32 batches
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    spec_num_steps: int | None = None
    spec_topk: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_algorithm: str | None = None  # --engine sglang: EAGLE or EAGLE3 (the hf engine runs --draft-model)
    sglang_capture: Literal["tensors", "lists"] = "tensors"  # --engine sglang: hsx's capture, or SGLang's float lists
    # output layout
    compression: Literal["planes-zstd", "zstd", "none"] = "planes-zstd"  # hidden-state codec (hsx.shards.format.CODECS)
    max_shard_mb: int = 512
    max_shard_samples: int = 100_000
    writer_lanes: int | None = None  # shards encoded and written at once; None: min(4, CPUs) (hsx.shards.sink.DEFAULT_LANES)
    # engine pass-through (sglang.Engine keyword arguments)
    engine_args: dict[str, Any] = field(default_factory=dict)
    # many engines on Ray (hsx.run.scale)
    ray: bool = False
    ray_address: str | None = None  # None: RAY_ADDRESS, else the cluster `ray start` made on this machine, else a new local one
    num_workers: int | None = None  # default: the cluster's GPUs / gpus_per_worker (CPUs / cpus_per_worker without GPUs)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # default: tp_size (1) where the cluster has GPUs and device is not cpu, else 0
    unit_size: int | None = None  # source rows per work unit, a multiple of batch_size; default 32 batches

    # Fields that change neither which samples exist nor their values: a resumed run may differ in them.
    # (The batching fields are among them: they change a row's bits, within the engines' tolerance,
    # never which samples exist; a window is re-run whole on resume, see hsx.run.core.results.)
    _LAYOUT_ONLY = ("output", "limit", "batch_size", "max_batch_tokens", "prefill_chunk", "window", "max_shard_mb",
                    "max_shard_samples", "writer_lanes", "ray", "ray_address", "num_workers", "cpus_per_worker",
                    "gpus_per_worker", "unit_size")

    def validate(self, *, output: bool = True) -> "ExtractConfig":
        """Refuse a config no run can start from; ``output=False``: one that writes nothing (the online feed)."""
        if not self.model:
            raise HsxError("no model given (--model PATH or model = ... in the config file)")
        if not self.dataset:
            raise HsxError("no dataset given (--dataset NAME_OR_PATH)")
        if output and not self.output:
            raise HsxError("no output directory given (--output DIR)")
        if self.mode not in ("generate", "prefill"):
            raise HsxError(f"--mode must be generate or prefill, got {self.mode!r}")
        if self.dtype not in ("bfloat16", "float16", "float32", "int8", "float8_e4m3"):
            raise HsxError(f"--dtype must be bfloat16, float16, float32, int8 or float8_e4m3, got {self.dtype!r}")
        if self.compression not in ("planes-zstd", "zstd", "none"):
            raise HsxError(f"--compression must be planes-zstd, zstd or none, got {self.compression!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise HsxError("--batch-size and --max-new-tokens must be >= 1")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise HsxError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if self.window is not None and self.window < 1:
            raise HsxError(f"--window must be >= 1, got {self.window}")
        lanes = self.writer_lanes
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
            raise HsxError(f"--writer-lanes must be a number of shard writers >= 1, got {lanes!r} (leave it out for "
                           "min(4, CPUs))")
        self._validate_prefill_chunk()
        check_rule(self.keep, self.mode)
        if not isinstance(self.engine, str) or not self.engine:
            raise HsxError(f"--engine must name an engine (hf, sglang or vllm), got {self.engine!r}")
        if self.sglang_capture not in ("tensors", "lists"):
            raise HsxError(f"--sglang-capture must be tensors or lists, got {self.sglang_capture!r}")
        if self.ray:
            self._validate_ray()
        elif self.ray_address is not None or self.num_workers is not None:
            raise HsxError("--ray-address and --num-workers go with --ray")
        return self

    def _validate_prefill_chunk(self) -> None:
        chunk = self.prefill_chunk
        if chunk is None:
            return
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise HsxError(f"--prefill-chunk must be a number of prompt tokens >= 1, got {chunk!r} (leave it out to "
                           "prefill each prompt in one forward)")

    def _validate_ray(self) -> None:
        if self.num_workers is not None and self.num_workers < 1:
            raise HsxError(f"--num-workers must be >= 1, got {self.num_workers}")
        if self.cpus_per_worker <= 0 or (self.gpus_per_worker is not None and self.gpus_per_worker < 0):
            raise HsxError("--cpus-per-worker must be > 0 and --gpus-per-worker >= 0")
        if self.unit_size is not None and (self.unit_size < 1 or self.unit_size % self.window_rows):
            raise HsxError(f"--unit-size must be a multiple of the scheduling window ({self.window_rows} rows, "
                           f"--window), got {self.unit_size}: a unit holds whole windows")
        if self.device.startswith("cuda:"):
            raise HsxError(f"--device {self.device} with --ray: each worker gets its own GPUs from Ray "
                           "(--gpus-per-worker); use --device auto or cuda")

    @property
    def rows_per_unit(self) -> int:
        return self.unit_size or max(32 * self.batch_size, self.window_rows)

    @property
    def window_rows(self) -> int:
        """Source rows ``[k * w, (k + 1) * w)`` scheduled together: ``--window``, else 32 batches. It does
        not depend on Ray's options, so a run with and without Ray schedules the same requests together."""
        return self.window if self.window is not None else 32 * self.batch_size

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or any(
            v is not None for v in (self.spec_num_steps, self.spec_topk, self.spec_num_draft_tokens, self.spec_algorithm)
        )

    def spec_settings(self) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens) with SGLang-like defaults filled in."""
        steps = self.spec_num_steps or 3
        topk = self.spec_topk or 1
        draft_tokens = self.spec_num_draft_tokens or (steps + 1 if topk == 1 else min(steps * topk, 8) + 1)
        return steps, topk, draft_tokens

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that decides the output's samples and values."""
        d = {k: v for k, v in self.to_dict().items() if k not in self._LAYOUT_ONLY}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "ExtractConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            run = [f"{k} (hsx.extract(cfg, {RUN_OPTIONS[k]}), or --{k})" for k in unknown if k in RUN_OPTIONS]
            hint = f"; {', '.join(run)} belong to a run, not to its configuration" if run else ""
            raise HsxError(f"{where}: unknown keys {unknown}{hint}; known keys: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | Path) -> "ExtractConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise HsxError(f"cannot read config file {path}: {e}") from None
        try:
            d = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, ValueError) as e:
            raise HsxError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({e})") from None
        return cls.from_dict(d, str(path))

    def merged(self, overrides: dict) -> "ExtractConfig":
        """A copy with the given (non-None) fields replaced, e.g. CLI options over a config file."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def differences(old, new, prefix: str = "") -> list[str]:
    """``field: old -> new`` for every leaf field that differs between two JSON-like dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    if old == new:
        return []
    return [f"{prefix[:-1]}: {_short(old)} -> {_short(new)}"]


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
