"""Train a small EAGLE3-style draft head on hsx shards (CPU, minutes) and measure it honestly.

    python scripts/train_eagle3_demo.py [--shards demo_out/shards] [--steps 300] [--out FILE.json]
    python scripts/train_eagle3_demo.py --online RUN.toml [--steps 300] [--out FILE.json]
    python scripts/train_eagle3_demo.py --shards DIR --in-order [--steps 300]   # the same batches, from shards

The head (one decoder layer, as in EAGLE3):
    aux [T, 3H] --(optional RMSNorm over the whole 3H: norm_before_fc)--> fc --> h [T, H]
    x = [RMSNorm(embed(next token)); RMSNorm(h)]  [T, 2H] -> causal self-attention + MLP -> h'
    logits = lm_head(RMSNorm(h'))
The embedding is copied from the target and frozen. Samples come from hsx.eagle3.Eagle3Dataset
and are shifted by hsx.eagle3.shift_for_draft: position t sees the aux state after token t and
token t+1, and learns the target's distribution of token t+2, computed here from the stored
final state after token t+1 through the target's own lm_head (loaded from the shards' metadata
``model.path``). Loss: KL(target || draft) over the full vocabulary on loss-masked positions.
One prediction step per position (no multi-step test-time-training unroll).

Measured and written to JSON: the training loss (first vs last steps), and top-1 agreement with
the target (draft argmax == target argmax) on held-out samples, split by sample id, for the
untrained head (same initialisation), the trained head, and a constant most-frequent-token guess.
``--online RUN.toml`` trains from a live run (:class:`hsx.eagle3.Eagle3Stream` over the extract config in
the file; no shards): batches are consecutive training samples in source order, one pass of the
stream after another (each pass runs the engine again) until ``--steps``; held-out samples (split
by a hash of the sample id) are kept from the first pass. ``--in-order`` trains from shards in
exactly that way, so the two give the same loss curve when the shards came from the same config.

``--save-head DIR`` also writes the trained head in SGLang's ``LlamaForCausalLMEagle3`` format, so
``--engine sglang --spec-algorithm EAGLE3 --draft-model DIR`` can draft with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import hsx
from hsx.config import ExtractConfig
from hsx.eagle3 import Eagle3Dataset, Eagle3Stream, collate, load_draft_config, shift_for_draft


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` [B, heads, T, d]."""
    d, t = x.shape[-1], x.shape[-2]
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * freq[None]  # [T, d/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class DraftHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, heads: int = 4, norm_before_fc: bool = False, eps: float = 1e-6):
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.embed = nn.Embedding(vocab, hidden)
        self.aux_norm = RMSNorm(3 * hidden, eps) if norm_before_fc else None  # one norm over the whole 3H
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.emb_norm, self.hid_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.qkv = nn.Linear(2 * hidden, 3 * hidden, bias=False)  # EAGLE3: attention input is 2H wide
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        b, t, _ = aux.shape
        if self.aux_norm is not None:
            aux = self.aux_norm(aux)
        h = self.fc(aux)  # [B, T, H]
        x = torch.cat([self.emb_norm(self.embed(input_ids)), self.hid_norm(h)], dim=-1)  # [B, T, 2H]
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, heads, T, d]
        # right padding: causal attention alone keeps real positions from seeing padding
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.up(self.mlp_norm(h)).chunk(2, dim=-1)
        h = h + self.down(F.silu(gate) * up)
        return self.lm_head(self.norm(h))  # [B, T, V]


def export_sglang_head(model: DraftHead, out: Path, target: str, aux_boundaries, norm_before_fc: bool) -> Path:
    """Write the head in SGLang's ``LlamaForCausalLMEagle3`` format (config.json + model.safetensors).

    Same computation, SGLang's names and conventions: this head rotates interleaved pairs (2i, 2i+1)
    of each head, SGLang's Llama rotates halves (i, i + d/2) at the same frequencies, so the q and k
    rows of every head are reordered (scores are unchanged). SGLang captures boundary ``id + 1`` for
    a Llama target, so the aux ids are the boundaries minus one, and the config's ``hsx`` marker says
    so (``aux_layer_ids_rule: "sglang"``, ``aux_boundaries``). Full draft vocabulary: d2t = 0.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target)
    H, heads, V = model.hidden, model.heads, model.lm_head.weight.shape[0]
    d = H // heads
    halves = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # neox position -> interleaved position
    rows = (torch.arange(heads)[:, None] * d + halves[None]).flatten()
    q, k, v = model.qkv.weight.detach().chunk(3, dim=0)
    gate, up = model.up.weight.detach().chunk(2, dim=0)
    w = {"fc.weight": model.fc.weight, "midlayer.input_layernorm.weight": model.emb_norm.weight,
         "midlayer.hidden_norm.weight": model.hid_norm.weight, "midlayer.self_attn.q_proj.weight": q[rows],
         "midlayer.self_attn.k_proj.weight": k[rows], "midlayer.self_attn.v_proj.weight": v,
         "midlayer.self_attn.o_proj.weight": model.o.weight, "midlayer.post_attention_layernorm.weight": model.mlp_norm.weight,
         "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up, "midlayer.mlp.down_proj.weight": model.down.weight,
         "norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight, "embed_tokens.weight": model.embed.weight,
         "d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool)}
    if model.aux_norm is not None:
        w["input_norm.weight"] = model.aux_norm.weight
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": model.down.weight.shape[1], "num_attention_heads": heads, "num_key_value_heads": heads,
              "head_dim": d, "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": V, "target_hidden_size": H,
              "rms_norm_eps": model.norm.eps, "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "max_position_embeddings": tcfg.max_position_embeddings, "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id, "pad_token_id": tcfg.pad_token_id,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [b - 1 for b in aux_boundaries],
                               "use_aux_hidden_state": True, "norm_before_fc": norm_before_fc},
              # which rule the ids follow, and the boundaries they name (docs/EAGLE3.md): vLLM needs
              # `hsx export vllm-head` first, and refuses this head without it
              "hsx": {"aux_layer_ids_rule": "sglang", "aux_boundaries": [int(b) for b in aux_boundaries]}}
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().float().contiguous() if t.is_floating_point() else t.contiguous() for n, t in w.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def load_target_head(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach().clone(), model.get_output_embeddings().weight.detach().clone()


def batch_tensors(samples, lm_head_w):
    view = shift_for_draft(collate(samples))
    with torch.no_grad():
        target_logits = view["target_hidden_state"].float() @ lm_head_w.T  # [B, T, V]
    return view["input_ids"], view["aux_hidden_state"].float(), target_logits, view["loss_mask"].bool()


def kl_loss(logits, target_logits, mask):
    """KL(target || draft) per masked position: cross-entropy against the target's distribution
    minus its entropy (same gradient), so 0 means the draft reproduces the target exactly."""
    logp_t = target_logits.log_softmax(-1)
    per_pos = (logp_t.exp() * (logp_t - logits.log_softmax(-1))).sum(-1)  # [B, T]
    return (per_pos * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def agreement(model, samples, lm_head_w, batch: int = 16) -> dict:
    hit, n = 0, 0
    for i in range(0, len(samples), batch):
        ids, aux, tl, mask = batch_tensors(samples[i : i + batch], lm_head_w)
        pred = model(ids, aux).argmax(-1)
        hit += int(((pred == tl.argmax(-1)) & mask).sum())
        n += int(mask.sum())
    return {"top1": hit / n if n else float("nan"), "positions": n}


@torch.no_grad()
def constant_guess(train, test, lm_head_w) -> dict:
    """Always answer the target's most frequent top-1 token on the training positions."""
    counts = torch.zeros(lm_head_w.shape[0], dtype=torch.int64)
    for s in range(0, len(train), 16):
        _, _, tl, mask = batch_tensors(train[s : s + 16], lm_head_w)
        counts += torch.bincount(tl.argmax(-1)[mask], minlength=len(counts))
    return guess_agreement(int(counts.argmax()), test, lm_head_w)


@torch.no_grad()
def guess_agreement(guess: int, test, lm_head_w) -> dict:
    hit, n = 0, 0
    for s in range(0, len(test), 16):
        _, _, tl, mask = batch_tensors(test[s : s + 16], lm_head_w)
        hit += int((tl.argmax(-1)[mask] == guess).sum())
        n += int(mask.sum())
    return {"top1": hit / n if n else float("nan"), "positions": n, "token": guess}


def new_head(hidden: int, vocab: int, norm_before_fc: bool, embed_w, seed: int) -> DraftHead:
    """A fresh head (the same weights for the same seed) with the target's embedding, frozen."""
    torch.manual_seed(seed)
    model = DraftHead(hidden, vocab, norm_before_fc=norm_before_fc)
    with torch.no_grad():
        model.embed.weight.copy_(embed_w)
    model.embed.weight.requires_grad_(False)
    return model


def train_steps(model, batches, lm_head_w, steps: int, lr: float, log_every: int, on_batch=None) -> list[float]:
    """AdamW with warm-up and cosine decay over ``steps``, one step per batch of samples; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    for step, picked in zip(range(steps), batches):
        ids_b, aux, tl, mask = batch_tensors(picked, lm_head_w)
        if on_batch is not None:
            on_batch(tl, mask)
        loss = kl_loss(model(ids_b, aux), tl, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    return losses


def is_held_out(sample_id: str, share: float) -> bool:
    """A split that needs no list of all ids (a stream has none): a hash of the id against ``share``."""
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) < share * 2**32


def in_order_batches(make_pass, batch: int, held_out: float, test: list):
    """Batches of consecutive training samples, pass after pass of ``make_pass()``; the held-out
    samples of the first pass are appended to ``test``."""
    first = True
    while True:
        picked, trained = [], 0
        for s in make_pass():
            if is_held_out(s["sample_id"], held_out):
                if first:
                    test.append(s)
                continue
            picked.append(s)
            trained += 1
            if len(picked) == batch:
                yield picked
                picked = []
        if picked:
            yield picked
        if not trained:
            raise SystemExit("no training samples: the data gave none, or every one is held out")
        first = False


def run_in_order(source: str, online: bool, steps: int = 300, batch: int = 8, lr: float = 3e-3, held_out: float = 0.2,
                 seed: int = 0, target: str | None = None, draft_config: str | None = None,
                 norm_before_fc: bool | None = None, threads: int = 2, log_every: int = 50, ahead: int = 64) -> dict:
    """Train on batches in source order, from a live run (``online``: ``source`` is an extract config
    file) or from shards; the same config gives the same batches, so the same losses."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    draft = load_draft_config(draft_config)
    if norm_before_fc is None:
        norm_before_fc = bool(draft and draft.get("norm_before_fc"))
    data = Eagle3Stream(source, draft, ahead=ahead) if online else Eagle3Dataset(source, draft)
    metadata = data.metadata if online else data.shards.metadata
    target = target or metadata["model"]["path"]
    embed_w, lm_head_w = load_target_head(target)
    make_pass = (lambda: iter(data)) if online else (lambda: (data[i] for i in range(len(data))))
    model = new_head(data.layout.hidden_size, lm_head_w.shape[0], norm_before_fc, embed_w, seed)
    counts = torch.zeros(lm_head_w.shape[0], dtype=torch.int64)  # the target's top-1 on the training positions

    def count_top1(tl, mask):
        counts.add_(torch.bincount(tl.argmax(-1)[mask], minlength=len(counts)))

    test: list = []
    batches = in_order_batches(make_pass, batch, held_out, test)
    losses = train_steps(model, batches, lm_head_w, steps, lr, log_every, on_batch=count_top1)
    batches.close()  # online: stops the engine's thread mid-pass
    untrained = new_head(data.layout.hidden_size, lm_head_w.shape[0], norm_before_fc, embed_w, seed)
    k = max(1, min(20, steps // 5))
    return {
        "source": str(source), "online": online, "target": str(target),
        "samples": {"held_out": len(test), "held_out_ids": [s["sample_id"] for s in test]},
        "steps": steps, "batch": batch, "lr": lr, "seed": seed, "norm_before_fc": norm_before_fc,
        "hidden_size": data.layout.hidden_size, "aux_boundaries": list(data.layout.aux_boundaries),
        "loss": {"first": losses[0], "last": losses[-1], f"mean_first_{k}": sum(losses[:k]) / k,
                 f"mean_last_{k}": sum(losses[-k:]) / k},
        "losses": losses,
        "held_out_top1": {"untrained": agreement(untrained, test, lm_head_w), "trained": agreement(model, test, lm_head_w),
                          "constant_guess": guess_agreement(int(counts.argmax()), test, lm_head_w)},
        "stream": {"failures": len(data.failures), "summary": vars(data.summary)} if online else None,
        "seconds": time.perf_counter() - t0,
        "threads": threads,
    }


def run(shards: str, steps: int = 300, batch: int = 8, lr: float = 3e-3, held_out: float = 0.2, seed: int = 0,
        target: str | None = None, draft_config: str | None = None, norm_before_fc: bool | None = None,
        threads: int = 2, log_every: int = 50, save_head: str | None = None) -> dict:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    draft = load_draft_config(draft_config)
    if norm_before_fc is None:
        norm_before_fc = bool(draft and draft.get("norm_before_fc"))
    shard_ds = hsx.open(shards)
    target = target or shard_ds.metadata["model"]["path"]
    embed_w, lm_head_w = load_target_head(target)

    ids = sorted(shard_ds.sample_ids)
    random.Random(seed).shuffle(ids)
    n_test = max(1, round(len(ids) * held_out))
    if len(ids) - n_test < 1:
        raise SystemExit(f"need at least 2 samples to split, found {len(ids)}")
    test_ids, train_ids = ids[:n_test], ids[n_test:]
    train_ds = Eagle3Dataset(shard_ds.select(train_ids), draft)
    test_ds = Eagle3Dataset(shard_ds.select(test_ids), draft)
    train, test = [train_ds[i] for i in range(len(train_ds))], [test_ds[i] for i in range(len(test_ds))]
    hidden = train_ds.layout.hidden_size

    model = new_head(hidden, lm_head_w.shape[0], norm_before_fc, embed_w, seed)
    before = agreement(model, test, lm_head_w)
    before_train = agreement(model, train, lm_head_w)

    rng = random.Random(seed + 1)
    batches = ([train[rng.randrange(len(train))] for _ in range(batch)] for _ in range(steps))
    losses = train_steps(model, batches, lm_head_w, steps, lr, log_every)
    k = max(1, min(20, steps // 5))
    result = {
        "shards": str(shards),
        "target": str(target),
        "samples": {"train": len(train), "held_out": len(test), "held_out_ids": test_ids},
        "steps": steps, "batch": batch, "lr": lr, "seed": seed, "norm_before_fc": norm_before_fc,
        "hidden_size": hidden, "aux_boundaries": list(train_ds.layout.aux_boundaries),
        "loss": {"first": losses[0], "last": losses[-1], f"mean_first_{k}": sum(losses[:k]) / k,
                 f"mean_last_{k}": sum(losses[-k:]) / k},
        "held_out_top1": {"untrained": before, "trained": agreement(model, test, lm_head_w),
                          "constant_guess": constant_guess(train, test, lm_head_w)},
        "train_top1": {"untrained": before_train, "trained": agreement(model, train, lm_head_w)},
        "seconds": time.perf_counter() - t0,
        "threads": threads,
    }
    if save_head:
        result["sglang_head"] = str(export_sglang_head(model, Path(save_head), target, train_ds.layout.aux_boundaries,
                                                       norm_before_fc))
    ho = result["held_out_top1"]
    if ho["constant_guess"]["top1"] >= ho["trained"]["top1"]:
        result["note"] = ("a constant guess agrees with the target as often as the trained head: the target's top-1 "
                          "barely varies on these positions, so agreement here does not show that the head learned much")
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="demo_out/shards", help="hsx shards with final and eagle3 columns")
    p.add_argument("--target", default=None, help="target model directory (default: the shards' model.path)")
    p.add_argument("--draft-config", default=None, help="a draft config.json: checked against the shards; norm_before_fc")
    p.add_argument("--norm-before-fc", action="store_true", default=None, help="RMSNorm over the whole 3H aux vector before fc")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--held-out", type=float, default=0.2, help="share of samples held out (split by sample id)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results here (default: SHARDS/../eagle3_train.json; "
                   "--online: the config's output/../eagle3_train_online.json)")
    p.add_argument("--save-head", default=None, help="also write the trained head here in SGLang's EAGLE3 format")
    p.add_argument("--online", default=None, metavar="RUN.toml",
                   help="train from a live run of this extract config (no shards), batches in source order")
    p.add_argument("--in-order", action="store_true", help="from --shards, batches in source order as --online makes them")
    p.add_argument("--ahead", type=int, default=64, help="--online: samples the engine may run ahead of training")
    a = p.parse_args(argv)
    if a.online or a.in_order:
        if a.save_head:
            p.error("--save-head goes with the shuffled training from --shards")
        result = run_in_order(a.online or a.shards, bool(a.online), a.steps, a.batch, a.lr, a.held_out, a.seed, a.target,
                              a.draft_config, a.norm_before_fc, a.threads, ahead=a.ahead)
        if a.online:  # next to where the run's shards would go, else here
            output = ExtractConfig.from_file(a.online).output
            default_out = (Path(output).resolve().parent if output else Path.cwd()) / "eagle3_train_online.json"
        else:
            default_out = Path(a.shards).resolve().parent / "eagle3_train_in_order.json"
    else:
        result = run(a.shards, a.steps, a.batch, a.lr, a.held_out, a.seed, a.target, a.draft_config, a.norm_before_fc,
                     a.threads, save_head=a.save_head)
        default_out = Path(a.shards).resolve().parent / "eagle3_train.json"
    out = Path(a.out) if a.out else default_out
    out.write_text(json.dumps(result, indent=1))
    ho = result["held_out_top1"]
    print(f"loss {result['loss']['first']:.3f} -> {result['loss']['last']:.3f}; held-out top-1 agreement with the target: "
          f"untrained {ho['untrained']['top1']:.3f}, trained {ho['trained']['top1']:.3f}, constant guess "
          f"{ho['constant_guess']['top1']:.3f} over {ho['trained']['positions']} positions ({result['seconds']:.0f} s) -> {out}")
    if "note" in result:
        print("note: " + result["note"])
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
