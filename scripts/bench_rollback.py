"""What rolling a recurrent or compressed layer back after a verify step costs, as a ratio in one run.

A verify step of ``n`` tokens (root + drafts) on a model with recurrent layers records the state
after every token (transformers' past recording: the recurrence runs token by token over the
step instead of in one chunk, and each state is kept), and the commit gives each row the state
after its accepted prefix (hsx.engine.hf.state). On DeepSeek-V4 the step snapshots each row's
compressor state and the commit replays the compressor over the accepted tokens of each row that
dropped some (hsx.engine.hf.compressed). The baseline is the same forward unrecorded,
every token kept: what a step would cost if the layers could be cut back like a key/value cache.
Both run alternately on the same batch, random tiny models built from transformers' config
classes; the script prints and writes the median time of each and their ratio.

``--decode`` times instead a plain one-token decode step of the engine's cache against
transformers' own cache (``DynamicCache``) over the same tokens, rows of one length (all that
cache can hold): on DeepSeek-V4 what driving the compressors row by row costs, with the engine's
masks and slots.

    python scripts/bench_rollback.py --family qwen3_5 --hidden 256 --batch 4 --steps 20
    python scripts/bench_rollback.py --family deepseek_v4 --decode
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers as T

from hsx.engine.hf.capture import Driven
from hsx.engine.hf.kv import KV

LINEAR = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=32, linear_value_head_dim=32)
FAMILIES = {
    "qwen3_5": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, LINEAR),
    "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM, dict(layer_types=["conv", "full_attention"] * 2)),
    "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM,
                  dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256, mamba_d_state=32, mamba_n_groups=1)),
    # heavily compressed attention (windows of 16 tokens) in three blocks, compressed sparse (4) in the fourth
    "deepseek_v4": (T.DeepseekV4Config, T.DeepseekV4ForCausalLM,
                    dict(num_key_value_heads=1, q_lora_rank=64, o_groups=2, o_lora_rank=32, index_n_heads=4,
                         index_head_dim=32, index_topk=64, sliding_window=16, moe_intermediate_size=128,
                         n_routed_experts=4, num_experts_per_tok=2,
                         compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})),
}


def build(family: str, hidden: int):
    config_cls, model_cls, extra = FAMILIES[family]
    kw = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8)
    config = config_cls(**{**kw, **extra})
    torch.manual_seed(0)
    return model_cls(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_5")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4, help="tokens per verify step (root + drafts)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", action="store_true", help="a decode step against transformers' own cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.family, args.hidden)
    times = decode_times(model, args) if args.decode else verify_times(model, args)
    median = {k: statistics.median(v) for k, v in times.items()}
    first, second = median
    report = {"settings": vars(args), "median_s": median, "ratio": median[first] / median[second]}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def decode_times(model, args) -> dict[str, list[float]]:
    from transformers import DynamicCache

    b, p = args.batch, args.prompt
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1024, (b, p), generator=gen)
    kv = KV(Driven.of(model, "target"), b, torch.device("cpu"), p + args.steps + 2)
    cache = DynamicCache(config=model.config)
    times: dict[str, list[float]] = {"engine": [], "transformers": []}
    with torch.inference_mode():
        kv.run(prompt, torch.arange(p).expand(b, -1), torch.ones(p, p, dtype=torch.bool).tril().expand(b, -1, -1))
        kv.commit(torch.ones(b, p, dtype=torch.bool))
        model(input_ids=prompt, cache=cache, use_cache=True)
        for step in range(args.steps + 1):  # the first pair warms up
            ids, positions = torch.randint(0, 1024, (b, 1), generator=gen), torch.full((b, 1), p + step)
            t0 = time.perf_counter()
            kv.run(ids, positions, torch.ones(b, 1, 1, dtype=torch.bool))
            kv.commit(torch.ones(b, 1, dtype=torch.bool))
            t1 = time.perf_counter()
            model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            if step:
                times["engine"].append(t1 - t0)
                times["transformers"].append(time.perf_counter() - t1)
    return times


def verify_times(model, args) -> dict[str, list[float]]:
    b, n = args.batch, args.tokens
    kv = KV(Driven.of(model, "target"), b, torch.device("cpu"), args.prompt + 2 * (args.steps + 2) * n)
    gen = torch.Generator().manual_seed(0)
    causal = lambda q: torch.ones(q, q, dtype=torch.bool).tril().expand(b, -1, -1)  # noqa: E731
    times: dict[str, list[float]] = {"recorded": [], "unrecorded": []}
    with torch.inference_mode():
        kv.run(torch.randint(0, 1024, (b, args.prompt), generator=gen),
               torch.arange(args.prompt).expand(b, -1), causal(args.prompt))
        kv.commit(torch.ones(b, args.prompt, dtype=torch.bool))
        for step in range(args.steps + 1):  # the first pair warms up
            for kind in ("recorded", "unrecorded"):
                ids = torch.randint(0, 1024, (b, n), generator=gen)
                positions = kv.lengths[:, None] + torch.arange(n)
                kept = torch.randint(1, n + 1, (b,), generator=gen) if kind == "recorded" else torch.full((b,), n)
                t0 = time.perf_counter()
                kv.run(ids, positions, causal(n), partial=kind == "recorded")
                kv.commit(torch.arange(n)[None] < kept[:, None])
                if step:
                    times[kind].append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    main()
