"""Build the demo's target model, draft model and tokenizer into a directory, deterministically.

    python -m hsx.demo.build OUT_DIR

writes ``OUT_DIR/target`` and ``OUT_DIR/draft`` (each a transformers model directory with the
tokenizer saved beside it). The target is a tiny Llama trained for a few seconds on the shipped
corpus, so that its text and hidden states have some structure; the draft is the target's first
two blocks with its norm and lm_head (a layer-skip draft), then distilled from the target on the
same corpus, so that it agrees with the target often enough for speculation to accept real tokens.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus


def train_on_corpus(model, tokenizer, steps: int, teacher=None, seq_len: int = 64, batch: int = 8,
                    lr: float = 5e-3, seed: int = 0) -> list[float]:
    """A short training run on the demo corpus (fixed seed and data order).

    Without ``teacher``: next-token cross-entropy. With ``teacher``: distillation, KL from the
    teacher's next-token distribution, which is what makes a draft agree with its target.
    """
    ids = torch.tensor(tokenizer(demo_corpus(), add_special_tokens=False)["input_ids"], dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])  # [B, T]
        if teacher is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with torch.no_grad():
                target = teacher(input_ids=x).logits.log_softmax(-1)  # [B, T, V]
            pred = model(input_ids=x).logits.log_softmax(-1)
            loss = torch.nn.functional.kl_div(pred.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _train_pair(tokenizer, train_steps: int, draft_steps: int, num_layers: int, hidden_size: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = build_tiny_llama(num_layers=num_layers, hidden_size=hidden_size, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        losses = train_on_corpus(target, tokenizer, train_steps) if train_steps else []
        draft = make_layerskip_draft(target, num_layers=2)
        if draft_steps:
            train_on_corpus(draft, tokenizer, draft_steps, teacher=target, seed=1)
    return target, draft, losses


def build_demo(out_dir: str | Path, train_steps: int = 200, draft_steps: int = 100, num_layers: int = 8,
               hidden_size: int = 128) -> dict:
    out = Path(out_dir)
    t0 = time.perf_counter()
    tokenizer = build_demo_tokenizer()
    threads = torch.get_num_threads()
    # One thread: single-threaded float reductions make the trained weights the same on every run on
    # one kind of CPU (not across kinds: the kernels an AVX2 CPU and an AMX one pick round differently,
    # and the demo's losses and accept lengths differ between them), and at this size threads buy little.
    torch.set_num_threads(1)
    try:
        target, draft, losses = _train_pair(tokenizer, train_steps, draft_steps, num_layers, hidden_size)
    finally:
        torch.set_num_threads(threads)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    return {
        "dir": str(out),
        "seconds": time.perf_counter() - t0,
        "loss_first": losses[0] if losses else None,
        "loss_last": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m hsx.demo.build OUT_DIR")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bars: one line says what was built
    info = build_demo(argv[0])
    loss = f", training loss {info['loss_first']:.2f} -> {info['loss_last']:.2f}" if info["loss_first"] else ""
    print(f"demo models in {info['dir']} ({info['seconds']:.1f} s{loss})")


if __name__ == "__main__":
    main()
