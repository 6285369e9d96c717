"""The output directory of a run: start it afresh, resume it, or refuse it (another run's shards).

``out`` is a :class:`pathlib.Path` or, for an object store, an :class:`hsx.storage.store.ObjectPath`
(:func:`hsx.storage.store.as_path`): the same code runs on both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hsx.config import ExtractConfig, differences
from hsx.errors import HsxError
from hsx.storage.lease import LEASE
from hsx.storage.lock import LOCK
from hsx.storage.store import is_remote
from hsx.shards.commitlog import LOG_DIR
from hsx.shards.manifest import (CONFIG, LEGACY_CONFIG, LEGACY_MANIFEST, MANIFEST, Manifest, atomic_write_bytes,
                                 foreign_names, load_manifest, manifest_path, save_manifest)

NAMES_SHOWN = 5  # foreign files a refusal names


def _saved_config(out: Path) -> dict | None:
    try:
        return json.loads((out / CONFIG).read_text())
    except (OSError, ValueError):
        return None


def config_refusal(out: Path, m: Manifest, cfg: ExtractConfig) -> HsxError:
    saved = _saved_config(out)
    if saved is None:
        what = f"config hash {m.config_hash}, this run {cfg.fingerprint()}; {out / CONFIG} is missing or unreadable"
    else:
        ignore = set(ExtractConfig._LAYOUT_ONLY)
        new = {k: v for k, v in cfg.to_dict().items() if k not in ignore}
        diff = differences({k: v for k, v in saved.items() if k not in ignore}, new)
        what = "; ".join(diff) if diff else f"config hash {m.config_hash}, this run {cfg.fingerprint()}"
    return HsxError(f"{out} holds a run with a different configuration ({what}). "
                    "Use a new --output, or --overwrite to replace it.")


def check_foreign(out: Path, overwrite: bool) -> None:
    """Refuse an output holding visible files hsx did not write, with or without ``--overwrite``:
    hsx never deletes them, and beside the shards they would break ``pd.read_parquet(out)``."""
    found = foreign_names(out) if out.is_dir() else []
    if not found:
        return
    names = ", ".join(found[:NAMES_SHOWN]) + (f" and {len(found) - NAMES_SHOWN} more" if len(found) > NAMES_SHOWN else "")
    why = ("--overwrite replaces only what hsx wrote and never deletes other files; " if overwrite else "")
    raise HsxError(f"{out} holds {len(found)} file(s) or folder(s) hsx did not write ({names}): hsx writes only "
                   "into an empty directory or its own output, which pandas, pyarrow and datasets read as one "
                   f"Parquet dataset (every visible file in it); {why}move them out or choose another --output")


def prepare_output(out: Path, cfg: ExtractConfig, overwrite: bool) -> Manifest | None:
    """The manifest to resume from, or None for a fresh run; refuses a different config, and an
    output holding files hsx did not write (:func:`check_foreign`).

    An output whose manifest commits nothing yet (a run stopped before its first shard, e.g. by a
    dataset it could not read) holds nothing to lose: a new run replaces it without ``--overwrite``.
    """
    check_foreign(out, overwrite)
    if manifest_path(out).exists():
        m = load_manifest(out)
        if m.config_hash == cfg.fingerprint() and not overwrite:
            return m
        if not overwrite and m.shards:
            raise config_refusal(out, m, cfg)
        overwrite = True
    elif out.exists() and any(p.name not in (LOCK, LEASE) for p in out.iterdir()) and not overwrite:
        raise HsxError(f"{out} exists, is not empty and has no {MANIFEST}; refusing to write into it (use --overwrite)")
    if overwrite and out.exists():
        for p in out.iterdir():
            if p.name in (MANIFEST, CONFIG, LEGACY_MANIFEST, LEGACY_CONFIG, LOG_DIR) or p.name.startswith(("shard-", ".shard-", "part-", f".{MANIFEST}", f".{LEGACY_MANIFEST}")):
                _remove(p)
    return None


def _remove(p: Path) -> None:
    """A file, or a folder of them (the manifest's log, a fanned-out folder of shards); in a store, the objects."""
    if p.is_file():
        p.unlink()
    elif is_remote(p):
        for child in list(p.iterdir()):
            child.unlink()
    else:
        shutil.rmtree(p)


def check_resume(out: Path, resume: Manifest | None, metadata: dict) -> Manifest | None:
    """The manifest to resume from, refusing one whose run had other metadata; one that committed
    nothing yet holds nothing to lose, so the run starts afresh instead."""
    if resume is None or resume.metadata == metadata:
        return resume
    if resume.shards:
        differs = "; ".join(differences(resume.metadata, metadata)[:8])
        raise HsxError(f"{out}: the model, tokenizer, dataset or engine differ from the run being resumed "
                       f"({differs}); use a new --output or --overwrite")
    return None


def open_manifest(out: Path, cfg: ExtractConfig, resume: Manifest | None, metadata: dict) -> Manifest:
    """The run's manifest (the resumed one, or a new one saved now) with ``cfg`` saved beside it."""
    resume = check_resume(out, resume, metadata)
    manifest = resume or Manifest(metadata=metadata, config_hash=cfg.fingerprint())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / CONFIG, json.dumps(cfg.to_dict(), indent=1).encode())
    if resume is None:
        save_manifest(out, manifest)
    return manifest
