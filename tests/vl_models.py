"""Tiny random vision-language targets built from transformers' config classes, saved with the demo
tokenizer (plus the family's image tokens and a chat template that writes them) and the family's PIL
image processor; images drawn locally. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hsx.demo.tokenizer import build_demo_tokenizer

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
LLAVA_IMAGE = "<image>\n"
GEMMA_IMAGE = "<start_of_image>"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<image>"]
# Gemma 3's tokenizer names its image tokens (Gemma3Processor reads them from these attributes)
GEMMA_TOKENS = {"boi_token": GEMMA_IMAGE, "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA_IMAGE_TOKENS = 16  # mm_tokens_per_image of the tiny Gemma 3: a 112-pixel image, 8 x 8 patches pooled 2 x 2

# The demo template, with content given as a string or as a list of text and image parts.
TEMPLATE = r"""{%- macro render(content) -%}
{%- if content is string -%}{{ content }}{%- else -%}
{%- for part in content -%}{%- if part['type'] == 'image' -%}IMAGE{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- for message in messages %}
{{- '<|' + message['role'] + '|>\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{ render(message['content']) + '<|end|>' }}{% endgeneration %}
{%- else %}
{{- render(message['content']) + '<|end|>' }}
{%- endif %}
{{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\n' }}
{%- endif %}"""

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "llava", "gemma3")
# Qwen3.5 language models: Gated DeltaNet (linear-attention) blocks around a full-attention one
QWEN3_5_LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def vl_tokenizer(image_text: str, vocab_size: int = 512):
    tok = build_demo_tokenizer(vocab_size=vocab_size)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = TEMPLATE.replace("IMAGE", image_text.replace("\n", "\\n"))
    return tok


def build_vl(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a tiny random ``family`` target (model, tokenizer, image processor) under ``out_dir``."""
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, initializer_range=0.1)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = vl_tokenizer(QWEN_IMAGE)
        ids = tok.convert_tokens_to_ids(VISION_TOKENS)
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tok), rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                    "rope_theta": 10000.0}, **text),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                               window_size=56),
            vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
        processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 24, patch_size=14,
                                             merge_size=2, temporal_patch_size=2)
    elif family == "qwen2_vl":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = vl_tokenizer(QWEN_IMAGE)
        ids = tok.convert_tokens_to_ids(VISION_TOKENS)
        config = Qwen2VLConfig(
            text_config=dict(vocab_size=len(tok), rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                    "rope_theta": 10000.0}, **text),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2),
            vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
        processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 24, patch_size=14,
                                             merge_size=2, temporal_patch_size=2)
    elif family == "qwen3_vl":  # deepstack: vision features of blocks 0 and 1 of the tower added after blocks 0, 1
        from transformers import Qwen3VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = vl_tokenizer(QWEN_IMAGE)
        ids = tok.convert_tokens_to_ids(VISION_TOKENS)
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=len(tok), head_dim=16, rope_parameters={
                "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0},
                **text),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[0, 1]),
            vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
        processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 24, patch_size=16,
                                             merge_size=2, temporal_patch_size=2)
    elif family == "qwen3_vl_moe":  # Qwen3-VL's deepstack with sparse MoE blocks
        from transformers import Qwen3VLMoeConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = vl_tokenizer(QWEN_IMAGE)
        ids = tok.convert_tokens_to_ids(VISION_TOKENS)
        config = Qwen3VLMoeConfig(
            text_config=dict(vocab_size=len(tok), head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, rope_parameters={
                "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0},
                **text),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[0, 1]),
            vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
        processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 24, patch_size=16,
                                             merge_size=2, temporal_patch_size=2)
    elif family in ("qwen3_5", "qwen3_5_moe"):  # no deepstack; Gated DeltaNet blocks keep a recurrent state
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = vl_tokenizer(QWEN_IMAGE)
        ids = tok.convert_tokens_to_ids(VISION_TOKENS)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        # rotary on a quarter of head_dim 32 (partial_rotary_factor 0.25): 4 frequencies, split 2 + 1 + 1
        config = (Qwen3_5MoeConfig if family == "qwen3_5_moe" else Qwen3_5Config)(
            text_config=dict(vocab_size=len(tok), head_dim=32, layer_types=QWEN3_5_LAYERS, linear_conv_kernel_dim=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, rope_parameters={
                "rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "rope_theta": 10000.0},
                **(moe if family == "qwen3_5_moe" else {}), **text),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
            vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
        processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 24, patch_size=16,
                                             merge_size=2, temporal_patch_size=2)
    elif family == "llava":
        from transformers import LlavaConfig
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        tok = vl_tokenizer(LLAVA_IMAGE)
        config = LlavaConfig(
            text_config=dict(model_type="llama", vocab_size=len(tok), **text),
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=42, patch_size=14, projection_dim=32),
            image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
            vision_feature_layer=-1, projector_hidden_act="gelu")
        processor = CLIPImageProcessorPil(size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42})
    elif family == "gemma3":  # image tokens attend both ways inside their block; sliding layers of window 12
        from transformers import Gemma3Config
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        # the processor's framing "\n\n" merges with the text beside it: vocab 1024 learns the merge of "\n\n",
        # and runs of newlines are added tokens that are not special, as in Gemma's own vocabulary
        tok = vl_tokenizer(GEMMA_IMAGE, vocab_size=1024)
        tok.add_tokens(list(GEMMA_TOKENS.values()), special_tokens=True)
        tok.add_tokens(["\n" * k for k in range(2, 6)], special_tokens=False)
        tok._set_model_specific_special_tokens(GEMMA_TOKENS)
        ids = tok.convert_tokens_to_ids(list(GEMMA_TOKENS.values()))
        config = Gemma3Config(
            text_config=dict(vocab_size=len(tok), head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, **text),
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=112, patch_size=14),
            mm_tokens_per_image=GEMMA_IMAGE_TOKENS, boi_token_index=ids[0], image_token_index=ids[1],
            eoi_token_index=ids[2])
        processor = Gemma3ImageProcessorPil(size={"height": 112, "width": 112})
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    if family == "gemma3":  # its projector starts at zero: every image token would embed to zeros, pixels unseen
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.15)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def draw(path: str | Path, width: int, height: int, seed: int) -> str:
    """A random RGB image of ``width x height`` saved as PNG."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return str(path)


def oracle(t, prompt, ids: torch.Tensor, token_types: bool = True) -> tuple[tuple, torch.Tensor | None]:
    """One unbatched teacher-forced forward of the target ``t`` over ``ids`` with the pixels of ``prompt`` (a
    :class:`hsx.data.render.VisionPrompt`); the model places the
    image features and (Qwen) computes its own mRoPE positions from the token types. On deepstack models
    boundary b in 1..L-1 is block b's input, taken by hooks of this function's own. Gemma 3 gets
    ``token_type_ids`` 1 at the config's image token, as its processor writes them (``token_types=False``: none,
    causal attention inside the image blocks)."""
    extra = {}
    if t.model.config.model_type == "gemma3" and token_types:
        extra["token_type_ids"] = (ids == t.model.config.image_token_id).long()[None]
    v = prompt.vision
    if v.images:
        extra["pixel_values"] = v.pixel_values
        if v.image_grid_thw is not None:
            extra["image_grid_thw"] = v.image_grid_thw
    positions = None
    if t.spec.mrope:
        extra["mm_token_type_ids"] = (ids == t.spec.image_token_id).int()[None]
        positions, _ = t.model.model.get_rope_index(ids[None], extra["mm_token_type_ids"],
                                                    image_grid_thw=extra.get("image_grid_thw"))
        t.model.model.rope_deltas = None
    received = {}  # deepstack models: what each block receives, its own hooks (hidden_states are before the add)
    blocks = t.model.model.language_model.layers
    hooks = [blocks[b].register_forward_pre_hook(lambda m, args, b=b: received.__setitem__(b, args[0].clone()))
             for b in range(1, len(blocks))] if t.spec.deepstack else []
    try:
        with torch.inference_mode():
            out = t.model(input_ids=ids[None], output_hidden_states=True, **extra)
    finally:
        for h in hooks:
            h.remove()
    if t.spec.mrope:
        t.model.model.rope_deltas = None  # the model caches it between calls
    hs = tuple(received.get(b, h) for b, h in enumerate(out.hidden_states))
    return hs, positions
