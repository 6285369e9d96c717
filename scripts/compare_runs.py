"""Check extract outputs against a teacher-forced forward of the target, and against each other.

    python scripts/compare_runs.py --model TARGET OUT_A [OUT_B ...]

For every output directory: verify steps and mean accept length (completion tokens after the first
per verify step, the last step's overshoot trimmed: engines that report per-step accept lengths and
engines that report only a count are counted alike); every stored row of every column against one unbatched teacher-forced
forward of the target over the sample's tokens (largest difference relative to the row's largest
value; boundaries as in docs/FORMAT.md). For every directory after the first: per sample, whether
the tokens and the number of verify steps equal the first directory's. Exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM

import hsx


def reference(model, ids: torch.Tensor) -> dict:
    """Boundaries 0..L and "final" for every position of ``ids``."""
    box = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: box.__setitem__("pre", a[0][0]))
    try:
        with torch.no_grad():
            hs = model(input_ids=ids[None].long(), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    L = model.config.num_hidden_layers
    out = {b: hs[b][0] for b in range(L)}
    out[L], out["final"] = box["pre"], hs[L][0]
    return out


def summarise(model, path: str, tol: float) -> tuple[dict, dict]:
    ds = hsx.open(path)
    groups = ds.metadata["layers"]
    per_sample, worst, steps, tokens = {}, 0.0, 0, 0
    for s in ds:
        ids = torch.as_tensor(s.input_ids).long()
        ref = reference(model, ids)
        for g in groups:
            want = torch.cat([ref[b] for b in g["sources"]], -1)[: s.num_rows]
            got = s.hidden(g["name"]).float()
            scale = want.abs().amax(-1, keepdim=True).clamp(min=1e-6)
            worst = max(worst, float(((got - want).abs() / scale).max()))
        a = s.accept_lens
        n = int(a.numel()) if a is not None else int(s.verify_steps or 0)
        completion = len(ids) - int(s.prompt_len)
        steps += n
        tokens += completion - 1  # tokens after the prefill's, overshoot trimmed: the same count for every engine
        per_sample[s.sample_id] = (ids.tolist(), n)
    summary = {"dir": path, "samples": len(per_sample), "verify_steps": steps,
               "mean_accept_len": tokens / steps if steps else None, "worst_rel_row_error": worst,
               "rows_ok": worst <= tol}
    return summary, per_sample


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("dirs", nargs="+")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ok = True
    base = None
    for d in a.dirs:
        summary, per = summarise(model, d, a.tol)
        ok &= summary["rows_ok"]
        if base is not None:
            shared = sorted(set(per) & set(base))
            summary["compared_samples"] = len(shared)
            summary["tokens_differ"] = [k for k in shared if per[k][0] != base[k][0]]
            summary["verify_steps_differ"] = [k for k in shared if per[k][1] != base[k][1]]
            ok &= not summary["tokens_differ"] and not summary["verify_steps_differ"] and len(shared) == len(per)
        else:
            base = per
        print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
