"""A small byte-level BPE tokenizer with a chat template, trained from the shipped demo corpus.

It needs no download and trains in well under a second. Byte-level means every string can be
encoded, whatever the vocabulary size. Plain text gets ``<|bos|>`` in front (like Llama); chats
are rendered by the template below, which writes ``<|bos|>`` itself, and are tokenized without
added special tokens, as ``apply_chat_template`` does.

Rendered chat::

    <|bos|><|system|>\\n{content}<|end|>\\n<|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n

``<|end|>`` closes every turn and is the eos token, so generation stops at the end of the
assistant's turn. The assistant content and its ``<|end|>`` sit inside ``{% generation %}``
markers, which is what ``return_assistant_tokens_mask`` reads.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, END, PAD, *ROLE_TOKENS]  # ids 0..5, in this order

# The HF renderer compiles templates with trim_blocks/lstrip_blocks, so every newline is written
# as an explicit '\n' literal and the layout whitespace below never reaches the output.
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<|' + message['role'] + '|>\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}
{%- else %}
{{- message['content'] + '<|end|>' }}
{%- endif %}
{{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\n' }}
{%- endif %}"""


def demo_corpus() -> str:
    return files("hsx").joinpath("demo_data/corpus.txt").read_text(encoding="utf-8")


def build_demo_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the demo tokenizer (deterministic: same corpus and size give the same vocab and merges)."""
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([demo_corpus()], trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
