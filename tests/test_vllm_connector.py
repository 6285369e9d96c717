"""hsx's stored prompt rows against vLLM's own hidden-state path, for the same token ids.

vLLM 0.32 writes hidden states itself through its ``extract_hidden_states`` speculative method and a
hidden-states KV connector (``ExampleHiddenStatesConnector``): per request, a safetensors file of
``hidden_states`` ``[T, K, H]`` (K = the draft config's ``eagle_aux_hidden_state_layer_ids``, inputs of
those layers) and ``token_ids`` ``[T]`` for the prompt, its path in
``RequestOutput.kv_transfer_params["hidden_states_path"]``. This test runs ``hsx extract --engine vllm``
with boundaries equal to those ids (vLLM id i = hsx boundary i), then vLLM's path over the token ids
hsx stored, and compares the prompt rows: equal bit for bit (float32 engines, float32 shards, the same
kernels in one process). Chunked prefill is on in both (64-token chunks); the batch holds prompts of
several lengths, some longer than a chunk.

The stock connector copies rows into pinned host memory, which needs CUDA; on CPU it fails in
``_submit_async_write``. :class:`UnpinnedHiddenStatesConnector` below reads the same rows from the
same cache slots and writes them synchronously, in the engine step after the request finished.
Runs inside the vLLM CPU lane only:
``bash scripts/vllm_cpu.sh python -m pytest -m vllm tests/test_vllm_connector.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="runs inside the vLLM CPU lane: bash scripts/vllm_cpu.sh python -m pytest -m vllm")

from safetensors.torch import save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
    load_hidden_states,
)

import hsx  # noqa: E402
from hsx.cli import app  # noqa: E402
from hsx.demo.spec_models import build_spec_models  # noqa: E402

BOUNDARIES = [0, 3, 8]  # hsx boundaries = vLLM aux layer ids; 8 = L, the last block's output before the norm
CHUNK = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


class _Written:
    """Stands in for the stock connector's CUDA copy event: the rows are on disk when it exists."""

    def query(self) -> bool:
        return True


class UnpinnedHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with its CUDA copy replaced by a plain read of the same slots."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": rows, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock load_hidden_states waits on
        self._req_copy_events[pending.req_id] = _Written()


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_spec_models(tmp_path_factory.mktemp("vllm-models"))


def texts() -> list[str]:
    """Prompts from a few tokens to several chunks long."""
    words = ["a b", "the cat sat on a mat", "speculative decoding keeps what the target says",
             "hidden states are rows of numbers", "one two three four five six seven eight"]
    return [w * n for w, n in zip(words, (1, 2, 6, 12, 25), strict=True)]


def hsx_extract(models, tmp_path) -> hsx.Shards:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()))
    layers = ",".join(["final"] + [f"b{b}" for b in BOUNDARIES])
    run = CliRunner().invoke(app, [
        "extract", "--model", str(models.target), "--dataset", str(data), "-o", str(out), "--engine", "vllm",
        "--device", "cpu", "--model-dtype", "float32", "--dtype", "float32", "--layers", layers,
        "--max-new-tokens", "4", "--batch-size", str(len(texts())), "--quiet",
        "--engine-arg", f"max_num_batched_tokens={CHUNK}", "--engine-arg", "max_model_len=1024"])
    assert run.exit_code == 0, run.output
    return hsx.open(str(out))


def vllm_rows(models, prompts: list[list[int]], tmp_path) -> list[dict[str, torch.Tensor]]:
    """vLLM's own hidden-state path over ``prompts``: one ``{"hidden_states", "token_ids"}`` per prompt."""
    import vllm

    llm = vllm.LLM(
        model=str(models.target), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
        skip_tokenizer_init=True, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True, max_model_len=1024,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": BOUNDARIES}}},
        kv_transfer_config={"kv_connector": UnpinnedHiddenStatesConnector.__name__,
                            "kv_connector_module_path": __name__, "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "vllm-hs")}})
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts)
    paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outs]
    assert all(paths), f"no hidden_states_path in {[out.kv_transfer_params for out in outs]}"
    # The connector writes a finished request's rows in the engine's next step; with the engine core in
    # this process (the lane's default) nothing runs that step once generate has returned.
    for _ in range(4):
        if all(os.path.exists(p) for p in paths):
            break
        llm.llm_engine.step()
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"the connector wrote no file for {missing} after 4 more engine steps"
    return [load_hidden_states(p) for p in paths]


def test_stored_prompt_rows_equal_vllms_hidden_state_connector(models, tmp_path):
    shards = hsx_extract(models, tmp_path)
    samples = list(shards)
    lengths = [int(s.prompt_len) for s in samples]
    assert len(samples) == len(texts()) and len(set(lengths)) == len(lengths), lengths
    assert max(lengths) > 2 * CHUNK and min(lengths) < CHUNK, lengths  # chunked and unchunked prompts
    prompts = [s.input_ids[: s.prompt_len].tolist() for s in samples]
    theirs = vllm_rows(models, prompts, tmp_path)
    for s, prompt, ref in zip(samples, prompts, theirs, strict=True):
        P = len(prompt)
        assert ref["token_ids"].tolist() == prompt, s.sample_id
        assert tuple(ref["hidden_states"].shape) == (P, len(BOUNDARIES), models_hidden(shards)), s.sample_id
        assert s.positions[:P].tolist() == list(range(P))
        for k, b in enumerate(BOUNDARIES):
            mine, want = s.hidden[f"b{b}"][:P], ref["hidden_states"][:, k]
            assert mine.dtype == want.dtype == torch.float32
            assert torch.equal(mine, want), (f"{s.sample_id} b{b} (prompt of {P} tokens): rows differ by up to "
                                             f"{float((mine - want).abs().max()):.3g}")


def models_hidden(shards) -> int:
    return int(next(g["width"] for g in shards.metadata["layers"] if g["name"] == "b0"))
