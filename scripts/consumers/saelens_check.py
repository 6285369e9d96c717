"""SAELens' own ActivationsStore reads `hsx export saelens`; its activations equal the shards' rows,
and SAE training steps on it lower the loss.

Runs in the SAELens virtualenv (scripts/consumers_check.sh), with this checkout on PYTHONPATH for
``hsx.open``. The store is built as SAELens builds it for a cache (no model, no text dataset,
``cached_activations_path``); every context comes out of ``get_raw_llm_batch`` and is compared with
the boundary's rows of the shards, back to back in dataset order. Then a StandardTrainingSAE is
trained by SAELens' ``SAETrainer.step`` on batches from the store's own mixing buffer.

    python scripts/consumers/saelens_check.py --shards DIR --export DIR --boundary 4 --context-size 32
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.training.activations_store import ActivationsStore
from sae_lens.training.sae_trainer import SAETrainer

import hsx


def shard_stream(shards_dir: str, boundary: int) -> tuple[torch.Tensor, torch.Tensor]:
    shards = hsx.open(shards_dir)
    unit = shards.metadata["model"]["hidden_size"]
    name, sources = next((g["name"], g["sources"]) for g in sorted(shards.metadata["layers"], key=lambda g: len(g["sources"]))
                         if boundary in g["sources"])
    k = sources.index(boundary)
    rows = [s.hidden(name)[:, k * unit:(k + 1) * unit].float() for s in shards]
    tokens = [s.input_ids.long()[s.positions] for s in shards]
    return torch.cat(rows), torch.cat(tokens)


def make_store(export: str, hook: str, context_size: int, d_in: int, batch_prompts: int, batch_tokens: int):
    return ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None, context_size=context_size,
        d_in=d_in, n_batches_in_buffer=4, total_training_tokens=10**6, store_batch_size_prompts=batch_prompts,
        train_batch_size_tokens=batch_tokens, prepend_bos=False, normalize_activations="none",
        device=torch.device("cpu"), dtype="float32", cached_activations_path=export)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--boundary", type=int, required=True)
    p.add_argument("--context-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    hook = f"blocks.{args.boundary}.hook_resid_pre"
    rows, tokens = shard_stream(args.shards, args.boundary)
    c, d_in = args.context_size, rows.shape[1]

    store = make_store(args.export, hook, c, d_in, batch_prompts=1, batch_tokens=64)
    got, got_tokens = [], []
    while True:
        try:
            acts, toks = store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break
        got.append(acts)
        got_tokens.append(toks)
    got, got_tokens = torch.cat(got), torch.cat(got_tokens)
    n = len(got)
    assert n == len(rows) // c * c and n > 0, (n, len(rows), c)
    assert torch.equal(got, rows[:n]), "activations differ from the shards' rows"
    assert torch.equal(got_tokens.long(), tokens[:n]), "token ids differ from the shards' tokens"

    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=1e-3))
    batch = 64
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=args.steps * batch, train_batch_size_samples=batch,
                                          lr=1e-3, lr_end=1e-3), sae, data_provider=make_store(args.export, hook, c, d_in, 4, batch))
    losses = [trainer.step(next(trainer.data_provider)).loss.detach().item() for _ in range(args.steps)]
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.5 * first, f"SAE loss did not fall: {first:.4f} -> {last:.4f}"
    result = {"contexts": n // c, "context_size": c, "d_in": d_in, "rows_compared": n,
              "rows_dropped": len(rows) - n, "steps": args.steps, "loss_first20": first, "loss_last20": last}
    print(f"[saelens] {args.export}: {n // c} contexts x {c} of {hook}: ActivationsStore rows and token ids equal the "
          f"shards ({n} rows); SAE loss {first:.4f} -> {last:.4f} over {args.steps} steps")
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
