"""The server lanes' side of the 2026 families, run in hsx's own virtualenv (transformers new enough for them).

The SGLang and vLLM lanes have an older transformers, so the lane tests hand this script the two steps that need
the pinned stack, each as a subprocess:

    python tests/lane_families.py build FAMILY DIR LANE   # tests/families.py's tiny model, the demo tokenizer, data
    python tests/lane_families.py check OUT [RTOL]    # the oracle's verdict on an `hsx extract` output, as JSON

``check`` runs ``hsx verify --recompute`` on OUT (every row of every column against a teacher-forced forward of
the saved model), checks that each completion token is the argmax of that forward's logits at the position
before it (the engines decode greedily), and runs the negative control: a copy of OUT whose first sample's
rows are moved by one position must be caught, named "position p-1".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROWS = [
    {"id": "tides", "messages": [{"role": "user", "content": "How do tides work, and why are there two a day?"}]},
    {"id": "river", "text": "The river ran past the old mill and under the stone bridge to the sea."},
    {"id": "bees", "text": "Bees"},
]

# What the server engines read from a checkpoint's config.json that transformers 5.25 leaves out when it saves
# a model built from its config class: keys every published checkpoint of the family carries, written with the
# values that give the same layers as the tiny config (so transformers' own forward, the oracle, is unchanged).
CHECKPOINT_KEYS = {
    # sigmoid routing with a correction bias ("noaux_tc"), a MoE in every block after the dense ones
    "deepseek_v3": {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 10000.0},
    # the real checkpoints name their layout by an interval (full attention every 4th layer there, every 2nd here)
    "qwen3_next": {"full_attention_interval": 2},
    # KDA layers and MLA layers by 1-based index, the dense first block by count
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 16,
                                           "num_heads": 4, "short_conv_kernel_size": 4},
                    "first_k_dense_replace": 1},
    # sigmoid routing with a correction bias, q/k norms over all heads of a layer
    "minimax_m2": {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                   "qk_norm_type": "per_layer"},
}
# DeepSeek-V3's published checkpoints use YaRN RoPE (factor 40 over 4,096 positions); SGLang's CPU rotary
# embedding for MLA exists only in that form. The same scaling, shrunk to the tiny model's 512 positions.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
OVERRIDES = {"deepseek_v3": {"rope_parameters": YARN}}
# vLLM 0.32's CPU attention runs head sizes 32, 64, 80, ... only: its cells widen the tiny configs' heads of 16
WIDE_HEADS = {"head_dim": 32}
# and its CPU MLA only DeepSeek's latent width, kv_lora_rank 512 + rope 64 = 576
MLA_576 = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
VLLM_OVERRIDES = {"lfm2": {"num_attention_heads": 2, "num_key_value_heads": 1},
                  "mimo_v2_flash": {"head_dim": 32, "v_head_dim": 32},
                  "deepseek_v3": MLA_576, "kimi_linear": MLA_576}


def build_model(family: str, out: Path, lane: str = "sglang") -> None:
    import torch
    from families import build

    from hsx.demo.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    torch.set_num_threads(1)
    from families import FAMILIES

    extra = dict(OVERRIDES.get(family, {}))
    if lane == "vllm":
        extra.update(VLLM_OVERRIDES.get(family, WIDE_HEADS if FAMILIES[family][2].get("head_dim") == 16 else {}))
    model = build(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id, **extra)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    keys = dict(CHECKPOINT_KEYS.get(family, {}))
    if family == "minimax_m2":  # rotary over the whole head (the published checkpoints rotate 64 of 128)
        keys["rotary_dim"] = model.config.head_dim
    if family == "lfm2":  # the blocks' and the short convolutions' width, named apart from hidden_size
        keys.update(dict.fromkeys(("block_dim", "conv_dim", "conv_dim_out"), model.config.hidden_size))
    if keys:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2))
    if family == "kimi_linear":  # transformers saves the dense block's MLP under the MoE's name; checkpoints don't
        _rename_weights(out / "model.safetensors", ".block_sparse_moe.", ".mlp.",
                        [f"model.layers.{i}." for i, t in enumerate(model.config.mlp_layer_types) if t == "dense"])
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))


def _rename_weights(path: Path, old: str, new: str, prefixes: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    renamed = {(k.replace(old, new) if k.startswith(tuple(prefixes)) else k): v for k, v in weights.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def greedy_mismatches(out: Path) -> tuple[int, list[str]]:
    """Completion tokens checked, and the samples whose completion is not the teacher-forced argmax."""
    import torch
    from transformers import AutoModelForCausalLM

    import hsx

    ds = hsx.open(str(out))
    model = AutoModelForCausalLM.from_pretrained(ds.metadata["model"]["path"], dtype=torch.float32).eval()
    checked, wrong = 0, []
    for s in ds:
        ids = s.input_ids.long()
        if ids.numel() <= s.prompt_len:
            continue
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        want = logits[s.prompt_len - 1: -1].argmax(-1)
        checked += want.numel()
        if not torch.equal(want, ids[s.prompt_len:]):
            wrong.append(s.sample_id)
    return checked, wrong


def _recompute(out: Path, rtol: float | None = None) -> dict:
    import hsx
    from hsx.recompute.run import recompute

    # force: the lanes' transformers 5.19 writes keys into the config's dict that 5.25 keeps elsewhere (GLM-4.5's
    # partial_rotary_factor), so the recorded config hash differs while the saved model is the same
    model = hsx.open(str(out)).metadata["model"]["path"]
    return recompute(str(out), model=model, force=True, device="cpu", dtype="float32", rtol=rtol,
                     progress=False).to_dict()


def check(out: Path, rtol: float | None = None) -> dict:
    import torch
    from shard_fixtures import rewrite

    import hsx

    torch.set_num_threads(1)
    clean = _recompute(out, rtol)
    tokens, wrong = greedy_mismatches(out)
    first = next(iter(hsx.open(str(out)))).sample_id

    def shifted(k, s, hidden):  # row p holds the state of p-1 (the first row kept)
        if s.sample_id == first:
            for name, h in hidden.items():
                hidden[name] = torch.cat([h[:1], h[:-1]])

    fault = _recompute(rewrite(out, out.with_name(out.name + "-shifted"), shifted), rtol)
    caught = {s["sample_id"]: sorted({f["matched"] for f in s["findings"]}) for s in fault["samples"] if s["findings"]}
    return {"ok": clean["ok"], "verdicts": sorted({s["verdict"] for s in clean["samples"]}),
            "samples": len(clean["samples"]), "rows": clean["rows"], "row_checks": clean["row_checks"],
            "columns": sorted(hsx.open(str(out)).columns), "worst": max(src["worst_rel"] for src in clean["sources"]),
            "greedy_tokens": tokens, "greedy_wrong": wrong, "shifted_ok": fault["ok"], "shifted_caught": caught,
            "shifted_sample": first}


# ---- the lane side (the lane's own Python; nothing above is imported there) --------------------------------

def hsx_python() -> str:
    """hsx's own virtualenv ($HSX_VENV, default .venv), where transformers is new enough for these families."""
    python = Path(os.environ.get("HSX_VENV", ROOT / ".venv")) / "bin" / "python"
    assert python.exists(), f"{python}: hsx's virtualenv (bash scripts/setup.sh, or set HSX_VENV)"
    return str(python)


def _in_hsx_venv(*args: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SGLANG_", "VLLM_", "VIRTUAL_ENV", "PYTHONPATH", "TRITON_", "HSX_LANE"))}
    done = subprocess.run([hsx_python(), __file__, *args], check=False, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def build_in_hsx_venv(family: str, out: Path, lane: str) -> Path:
    _in_hsx_venv("build", family, str(out), lane)
    return out


def check_in_hsx_venv(out: Path, mode: str, rtol: float | None = None) -> dict:
    """The oracle's verdict on ``out`` (see ``check``), asserted: every row of every column checked and equal,
    greedy tokens, and the shifted copy caught on its first sample and nowhere else."""
    args = ("check", str(out)) + (() if rtol is None else (str(rtol),))
    report = json.loads(_in_hsx_venv(*args).strip().splitlines()[-1])
    assert report["ok"] and report["verdicts"] == ["ok"], report
    assert report["samples"] == len(ROWS) and report["rows"] > 0, report
    sources = len(report["columns"])  # the lane cells store single-boundary columns and final: one source each
    assert report["row_checks"] == report["rows"] * sources, report
    assert report["greedy_wrong"] == [], report
    assert (report["greedy_tokens"] > 0) == (mode == "generate"), report
    assert not report["shifted_ok"] and report["shifted_caught"] == {report["shifted_sample"]: ["position p-1"]}, report
    return report


if __name__ == "__main__":
    command, arg = sys.argv[1], sys.argv[2:]
    if command == "build":
        build_model(arg[0], Path(arg[1]), *arg[2:])
    elif command == "check":
        print(json.dumps(check(Path(arg[0]), *(float(a) for a in arg[1:]))))
    else:
        sys.exit(f"unknown command {command!r}: build FAMILY DIR, or check OUT")
