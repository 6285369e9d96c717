"""speculators' own code reads `hsx export speculators`; its tensors equal the shards'.

Runs in the speculators virtualenv (scripts/consumers_check.sh), with this checkout on PYTHONPATH
for ``hsx.open``. For each SHARDS=EXPORT pair: every sample through ``ArrowDataset`` (its file and
dataset readers, ``on_missing="raise"``), ``check_hidden_states`` on every raw file, then
``shift_batch`` and ``CollateFn`` into a packed training batch, and the draft vocabulary built
from the exported token frequencies by ``build_vocab_mappings_from_distribution``.

    python scripts/consumers/speculators_check.py --aux 2,4,5 --layers 8 SHARDS=EXPORT [...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.data_generation.offline import check_hidden_states
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

import hsx


def expected(shards) -> list:
    """The samples an export must hold, in order: dataset order, at least 2 tokens after the generate cut."""
    cut = shards.metadata["mode"] == "generate"
    return [s for s in shards if len(s.input_ids) - cut >= 2]


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                                                     b.contiguous().view(torch.int16))


def check_pair(shards_dir: Path, export: Path, aux: list[int], num_layers: int) -> dict:
    shards = hsx.open(shards_dir)
    samples = expected(shards)
    cut = shards.metadata["mode"] == "generate"
    ds = ArrowDataset(max_len=4096, datapath=export, on_missing="raise")
    assert len(ds) == len(samples), (len(ds), len(samples))
    unit = shards.metadata["model"]["hidden_size"]
    sources = {g["name"]: g["sources"] for g in shards.metadata["layers"]}

    def boundary(s, b):
        name = next(n for n, src in sources.items() if b in src)
        k = sources[name].index(b)
        return s.hidden(name)[:, k * unit:(k + 1) * unit]

    rows = 0
    for i, s in enumerate(samples):
        t = len(s.input_ids) - cut
        raw = load_file(export / "hidden_states" / f"hs_{i}.safetensors")
        check_hidden_states(raw, s.input_ids[:t].tolist())
        item = ds[i]
        assert torch.equal(item["input_ids"], s.input_ids[:t].long()), f"{s.sample_id}: input_ids differ"
        assert torch.equal(item["loss_mask"], s.loss_mask[:t].long()), f"{s.sample_id}: loss_mask differs"
        want_aux = torch.cat([boundary(s, b)[:t] for b in aux], dim=-1)  # [T, K*H], ascending boundaries
        assert bit_equal(item["hidden_states"], want_aux), f"{s.sample_id}: aux states differ from the shards"
        assert bit_equal(item["verifier_last_hidden_states"], boundary(s, num_layers)[:t]), f"{s.sample_id}: verifier state differs from boundary L"
        shifted = shift_batch(item)  # position k: aux after token k, token k+1, verifier state after k+1
        assert torch.equal(shifted["input_ids"], item["input_ids"][1:])
        assert bit_equal(shifted["hidden_states"], want_aux[:-1])
        assert bit_equal(shifted["verifier_last_hidden_states"], boundary(s, num_layers)[1:t])
        rows += t
    collate = CollateFn(max_len=256, hidden_size=unit, num_target_layers=len(aux), preprocess=shift_batch)
    batch = collate([ds[i] for i in range(min(4, len(ds)))])
    assert batch["hidden_states"].shape == (1, 256, len(aux) * unit), batch["hidden_states"].shape
    assert batch["verifier_last_hidden_states"].shape == (1, 256, unit)
    freq = torch.load(export / "token_freq.pt", weights_only=True)
    vocab = shards.metadata["tokenizer"]["vocab_size"]
    d2t, t2d = build_vocab_mappings_from_distribution(freq, min(32, vocab), vocab)
    assert d2t.shape == (min(32, vocab),) and int(t2d.sum()) == min(32, vocab)
    return {"export": str(export), "samples": len(samples), "tokens": rows, "mode": shards.metadata["mode"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--aux", required=True, help="aux boundaries, comma-separated")
    p.add_argument("--layers", type=int, required=True, help="L, the target's block count")
    p.add_argument("pairs", nargs="+", help="SHARDS=EXPORT")
    args = p.parse_args()
    aux = [int(x) for x in args.aux.split(",")]
    results = [check_pair(Path(a), Path(b), aux, args.layers) for a, b in (x.split("=", 1) for x in args.pairs)]
    for r in results:
        print(f"[speculators] {r['export']}: {r['samples']} samples ({r['mode']}), {r['tokens']} tokens: ArrowDataset "
              "tensors equal the shards (token ids, loss mask, aux states, verifier state), shift_batch/CollateFn ok")
    json.dump(results, sys.stdout)
    print()


if __name__ == "__main__":
    main()
