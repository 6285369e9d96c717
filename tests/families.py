"""Tiny random models of every family the transformers engine supports, built locally in fp32.

Each config is the family's own, shrunk: 4 blocks, hidden 64, vocab 256, and for windowed families
a window of ``WINDOW`` tokens, far shorter than the prompts + completions the tests run, so every
sliding layer really drops keys. Mixed families alternate sliding and full layers.
"""

from __future__ import annotations

import functools

import torch
import transformers as T

NUM_LAYERS, HIDDEN, VOCAB, WINDOW = 4, 64, 256, 5
HYBRID = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
ALTERNATING = ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2)

# linear attention (Gated DeltaNet, KDA) first and third, full attention second and fourth
GDN = ["linear_attention", "full_attention"] * (NUM_LAYERS // 2)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=NUM_LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
               initializer_range=0.3)  # wide weights: at 0.02 several families decode one token over and over

# family -> (config class, model class, config keywords). Keys double as test ids.
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": WINDOW, "head_dim": 16}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"sliding_window": WINDOW, "pad_token_id": 0}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               {"sliding_window": WINDOW, "layer_types": HYBRID, "head_dim": 16, "query_pre_attn_scalar": 16,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               {"sliding_window": WINDOW, "layer_types": HYBRID, "head_dim": 16, "query_pre_attn_scalar": 16}),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM,
                {"sliding_window": WINDOW, "layer_types": ALTERNATING, "head_dim": 16, "num_local_experts": 4,
                 "num_experts_per_tok": 2}),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel,
             {"n_layer": NUM_LAYERS, "n_embd": HIDDEN, "n_head": 4, "n_positions": 512, "vocab_size": VOCAB,
              "initializer_range": 0.3, "tie_word_embeddings": False}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {}),
    # chunked attention (chunks of WINDOW positions) on three layers, NoPE full attention on the fourth; MoE
    "llama4_text": (T.Llama4TextConfig, T.Llama4ForCausalLM,
                    {"head_dim": 16, "attention_chunk_size": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 1,
                     "intermediate_size_mlp": 2 * HIDDEN}),
    # per-layer input embeddings beside the residual stream; the last two layers reuse the keys and values of
    # the last earlier layer of their type (num_kv_shared_layers)
    "gemma4": (T.Gemma4TextConfig, T.Gemma4ForCausalLM,
               {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ALTERNATING, "vocab_size_per_layer_input": VOCAB,
                "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2}),
    # hyper-connections (4 streams between blocks), heavily compressed attention (windows of 4 tokens) in the first
    # three blocks, compressed sparse attention (windows of 2) in the fourth, hash-routed MoE in the first three.
    # index_topk 64 >= the entries of every test sequence (under 128 tokens): the lightning indexer scores with a
    # ReLU, and where fewer entries than it may pick score above zero its top-k breaks a tie of zeros by the length
    # of the list, so transformers' own cached decode and its own full forward keep different entries
    # (tests/test_compressed.py, the indexer's ties); with every entry kept, the two agree
    "deepseek_v4": (T.DeepseekV4Config, T.DeepseekV4ForCausalLM,
                    {"num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
                     "index_n_heads": 2, "index_head_dim": 16, "index_topk": 64, "sliding_window": WINDOW,
                     "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                     "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "bos_token_id": 1, "eos_token_id": 2}),
    # MLA with as many kv heads as query heads (real checkpoints), a dense first block then MoE
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                    {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 16, "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "glm4_moe": (T.Glm4MoeConfig, T.Glm4MoeForCausalLM,
                 {"head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "minimax_m2": (T.MiniMaxM2Config, T.MiniMaxM2ForCausalLM,
                   {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "bos_token_id": 1,
                    "eos_token_id": 2}),
    # sliding layers with sinks beside full ones, value head narrower than the query/key head; eager
    "mimo_v2_flash": (T.MiMoV2FlashConfig, T.MiMoV2FlashForCausalLM,
                      {"head_dim": 24, "v_head_dim": 16, "sliding_window": WINDOW, "layer_types": ALTERNATING[::-1],
                       "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2}),
    # recurrent layers beside attention (hsx.engine.hf.state)
    "qwen3_5": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, {"head_dim": 16, "layer_types": GDN, **_LINEAR}),
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,
                   {"head_dim": 16, "layer_types": GDN, **_LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM, {"layer_types": ["conv", "full_attention"] * (NUM_LAYERS // 2)}),
    "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM,
                  {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                   "mamba_n_groups": 1, "mamba_chunk_size": 8, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5}),
    # KDA linear attention beside MLA (as many kv heads as query heads, as in the real checkpoints), MoE
    "kimi_linear": (T.KimiLinearConfig, T.KimiLinearForCausalLM,
                    {"layer_types": GDN, "num_key_value_heads": 4, "pad_token_id": 0, "bos_token_id": 1,
                     "eos_token_id": 2, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
                     "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}),
}
# how far a draft is moved from its target (demo.models.perturbed_copy) so that the test prompts
# see drafts accepted and rejected, chains and trees alike (measured on these configs and seeds)
DRAFT_SCALE = {"gemma2": 0.1, "gemma3": 0.2, "gpt2": 0.2, "gpt_neox": 0.1}
# families whose attention has a window shorter than the test sequences
WINDOWED = ("mistral", "phi3", "gemma2", "gemma3", "gpt_oss", "mimo_v2_flash", "gemma4")
# families with chunked attention layers, chunks of WINDOW positions
CHUNKED = ("llama4_text",)
# families with recurrent layers (linear attention, short convolutions, Mamba-2): chains only, right padding
RECURRENT = ("qwen3_5", "qwen3_next", "lfm2", "falcon_h1", "kimi_linear")
# families whose layers keep a state per row (recurrent ones, and DeepSeek-V4's compressors): chains, right padding
STATEFUL = (*RECURRENT, "deepseek_v4")
# Their oracle runs the chunked form of the recurrence over a whole sequence; a decode step runs the
# recurrent form one token at a time and a prefill chunk restarts the chunking. fp32, transformers alone:
# the model's own token-by-token decode differs from its own full forward by up to 4.2e-5 of the largest
# state, its own prefill in chunks of 16 by up to 1.2e-4 (Qwen3-Next, a 70-token prompt; the engine's
# chunked rows equal that chunked forward's bit for bit). Rows of these families are held to 3e-4 of the
# largest reference value instead of 1e-5; a row of another position is off by O(1).
RECURRENT_REL_TOL = 3e-4


def rel_tol(family: str, default: float) -> float:
    return RECURRENT_REL_TOL if family in RECURRENT else default


def config(family: str, **kw):
    config_cls, _, extra = FAMILIES[family]
    args = {} if family == "gpt2" else dict(_COMMON)
    args.update(extra)
    args.update(kw)
    if "vocab_size_per_layer_input" in extra and "vocab_size_per_layer_input" not in kw:
        args["vocab_size_per_layer_input"] = args["vocab_size"]  # Gemma 4: one per-layer embedding per token
    return config_cls(**args)


def build(family: str, seed: int = 0, **kw):
    """A random fp32 model of ``family`` in eval mode; the global RNG is left as it was."""
    _, model_cls, _ = FAMILIES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config(family, **kw))
    _spread_small_parameters(model, seed)
    return model.float().eval()


def _spread_small_parameters(model, seed: int) -> None:
    """Some families start parameters at exactly 0 or 1 (GPT-OSS sinks and router biases, norm weights):
    move them so that the paths they control are exercised, not multiplied away."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("sinks" in name or "norm" in name or "bias" in name):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


@functools.cache
def cached(family: str, seed: int = 0):
    return build(family, seed)
