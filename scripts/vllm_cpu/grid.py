"""The vLLM grid: hsx's vLLM engine, plain and speculative, every row checked against an oracle.

Run inside the lane (``bash scripts/vllm_cpu_check.sh`` = ``scripts/vllm_cpu.sh python
scripts/vllm_cpu/grid.py``). It builds the target and drafts of :mod:`hsx.demo.spec_models`, rewrites
the drafts in vLLM's formats (``heads.py``), and starts one real ``vllm.LLM`` per engine through
hsx's own ``VLLMRunner`` (fp32, greedy, eager, the engine core in this process):

- plain, ``final,eagle3,b0,b3,b8`` (boundaries 0 and L included), chunked prefill in chunks of 64
  tokens; plain with chunked prefill off; plain with a KV cache of a few blocks, so that requests are
  preempted and recomputed (12 blocks of 32 tokens for 12 requests of 52-118 tokens; the cell fails
  unless some position was computed twice);
- EAGLE3 ``final,eagle3`` and EAGLE ``final``, 3 draft tokens per step, over the follow / mixed /
  miss regimes of the demo drafts; n-gram ``final,b2`` over prompts that repeat what the model says;

each at batch 1 and 5 (prompt lengths 37 and 1..300), plus, per speculative engine, a stop cell (one
request ends on ``eos`` inside an accepted run) and a prefill-mode cell, and on the first engine the
``--keep`` rules (completion, loss, last) applied as hsx writes records. ``max_new_tokens`` is 12
with up to 4 tokens a verify step, so the last step overshoots and must be trimmed.

Each request is checked against an independent teacher-forced transformers forward
(``tests/oracle.py``): the stored prompt is the request; every completion token is the argmax of the
oracle's logits at the previous position, and the run ends on eos or at max_new_tokens; P + C - 1 rows
(P in prefill mode) from position 0; every row within 1e-4 of the oracle relative to its largest
value; under speculation ``accept_lens`` (int16) covers the completion (sum >= C - 1, the last step
reaching it); under EAGLE3 the ``eagle3`` column is boundaries 2, 4, 6 for vLLM ids [2, 4, 6] and not
the boundaries 3, 5, 7 that SGLang's id + 1 rule would name. Mean accept lengths per regime must be
ordered as built: follow > mixed > miss ~ 1.

Then a negative control: in the EAGLE3 engine, with every captured row moved one position (row p
holding position p + 1's state) before hsx builds the sample, a batch must be reported as misaligned. Exit 0 only if every cell passes and
the control is detected.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heads import vllm_heads  # noqa: E402
from oracle import oracle_sources  # noqa: E402

import hsx.engine.vllm.runner as vllm_engine  # noqa: E402
from hsx.align import AlignedSample  # noqa: E402
from hsx.config import ExtractConfig  # noqa: E402
from hsx.run.core import make_record  # noqa: E402
from hsx.data.render import Prompt  # noqa: E402
from hsx.demo.spec_models import REGIMES, SpecModels, build_spec_models  # noqa: E402
from hsx.engine.vllm.runner import VLLMRunner  # noqa: E402
from hsx.shards.positions import sample_positions  # noqa: E402

TOLERANCE = 1e-4  # max |row - oracle| / max |oracle|, fp32
OFF_BY_ONE_MIN = 1e-2  # rows compared with the wrong boundaries must be at least this far off
MAX_NEW_TOKENS = 12
BATCHES = {1: [37], 5: [1, 9, 64, 180, 300]}  # prompt lengths
PREEMPT_BATCH = [40 + 6 * i for i in range(12)]
KEEP_RULES = ("completion", "loss", "last")
ASSEMBLE = vllm_engine.assemble  # hsx's own assembly of a request's captured rows


@dataclass
class Cell:
    engine: str
    name: str
    regime: str = "-"
    rows: int = 0
    worst: float = 0.0
    off_by_one: float | None = None
    tokens: int = 0
    verify_steps: int = 0
    recomputed: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def accept(self) -> float | None:
        return (self.tokens / self.verify_steps) if self.verify_steps else None

    @property
    def ok(self) -> bool:
        return not self.failures and self.rows > 0


class Recomputed:
    """Counts positions the capture saw more than once (hsx's own assembly, wrapped)."""

    def __init__(self):
        self.count = 0

    def __call__(self, record):
        got = ASSEMBLE(record)
        if not isinstance(got, str):
            self.count += got.recomputed
        return got


def shifted_assemble(record):
    """The negative control: row p replaced by the row of position p + 1 (the last row repeated)."""
    got = ASSEMBLE(record)
    if isinstance(got, str):
        return got
    rows = {k: torch.cat([v[1:], v[-1:]]) for k, v in got.rows.items()}
    return dataclasses.replace(got, rows=rows)


def make_prompts(models: SpecModels, regime: str, lengths: list[int], seed: int, tag: str) -> list[Prompt]:
    """Random ordinary tokens, the last from ``regime``'s class (it decides the regime of the completion)."""
    g = torch.Generator().manual_seed(seed)
    context = torch.tensor(sum(models.classes.values(), []))
    tail = torch.tensor(models.classes[regime])
    prompts = []
    for i, n in enumerate(lengths):
        ids = context[torch.randint(len(context), (n,), generator=g)]
        ids[-1] = tail[torch.randint(len(tail), (1,), generator=g)]
        prompts.append(Prompt(f"{tag}-{i}", i, ids.tolist(), [1] * n))
    return prompts


class Oracle:
    def __init__(self, models: SpecModels):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
        self.eos = int(self.model.config.eos_token_id)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n greedy tokens after ``ids`` (teacher-forced forwards, no cache)."""
        seq = list(ids)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(self.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids):]

    def check(self, cell: Cell, prompt: Prompt, sample, groups, mode: str, algorithm: str | None,
              off_by_one: dict | None = None) -> None:
        sid = prompt.sample_id
        if not isinstance(sample, AlignedSample):
            cell.failures.append(f"{sid}: hsx refused the output: {sample.reason}")
            return
        ids, P = sample.input_ids, len(prompt.input_ids)
        if ids[:P].tolist() != prompt.input_ids:
            cell.failures.append(f"{sid}: stored prompt differs from the request")
        src = oracle_sources(self.model, ids)
        self._check_greedy(cell, sid, ids, P, self.model.lm_head(src["final"]), mode)
        if algorithm is not None and mode == "generate":
            a, decoded = sample.accept_lens, len(ids) - P - 1
            if a is None or a.dtype != torch.int16 or int(a.sum()) < decoded \
                    or (a.numel() and int(a.sum()) - int(a[-1]) >= max(decoded, 1)):
                cell.failures.append(f"{sid}: accept lengths {None if a is None else a.tolist()} for {decoded} "
                                     "decoded tokens")
            else:
                cell.tokens += decoded
                cell.verify_steps += a.numel()
        want_rows = len(ids) if mode == "prefill" else len(ids) - 1
        for group in groups:
            rows = sample.hidden[group.name].float()
            if rows.shape[0] != want_rows or sample.first_position != 0:
                cell.failures.append(f"{sid}: {rows.shape[0]} rows from position {sample.first_position}, "
                                     f"expected {want_rows} from 0 (P={P}, C={len(ids) - P})")
                continue
            ref = torch.cat([src[s] for s in group.sources], -1)[:want_rows]
            self._compare(cell, sid, group.name, rows, ref)
            wrong = (off_by_one or {}).get(group.name)
            if wrong is not None:
                shifted = torch.cat([src[s] for s in wrong], -1)[:want_rows]
                miss = float((rows - shifted).abs().max()) / float(ref.abs().max())
                cell.off_by_one = miss if cell.off_by_one is None else min(cell.off_by_one, miss)
                if miss < OFF_BY_ONE_MIN:
                    cell.failures.append(f"{sid}: rows also match boundaries {list(wrong)} ({miss:.2e})")

    def check_kept(self, cell: Cell, prompt: Prompt, sample, groups, mode: str, keep: str) -> None:
        """The rows a record keeps under ``keep`` (as hsx writes them) against the oracle at those positions."""
        sid = prompt.sample_id
        if not isinstance(sample, AlignedSample):
            cell.failures.append(f"{sid}: hsx refused the output: {sample.reason}")
            return
        record = make_record(prompt, sample, mode, keep)
        pos = sample_positions(keep, mode, record.input_ids.numel(), record.prompt_len, record.loss_mask.numpy())
        src = oracle_sources(self.model, record.input_ids)
        for group in groups:
            rows = record.hidden[group.name].float()
            ref = torch.cat([src[s] for s in group.sources], -1)[torch.from_numpy(np.asarray(pos, dtype=np.int64))]
            if rows.shape != ref.shape:  # (a 1-token prefill sample keeps no row under --keep loss)
                cell.failures.append(f"{sid}: --keep {keep}: {tuple(rows.shape)} rows, expected {tuple(ref.shape)}")
                continue
            self._compare(cell, sid, f"{group.name} (keep {keep})", rows, ref)

    def _compare(self, cell: Cell, sid: str, name: str, rows: torch.Tensor, ref: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        scale = float(ref.abs().max())
        err = float((rows - ref).abs().max()) / scale
        cell.worst, cell.rows = max(cell.worst, err), cell.rows + rows.shape[0]
        if err > TOLERANCE:
            bad = int(((rows - ref).abs().amax(-1) > TOLERANCE * scale).nonzero()[0])
            cell.failures.append(f"{sid}: column {name}: rows off by {err:.2e} (relative) from row {bad}")

    def _check_greedy(self, cell, sid, ids, P, logits, mode) -> None:
        if mode == "prefill":
            return
        completion = ids[P:]
        greedy = logits[P - 1:-1].argmax(-1)  # the argmax after each prefix, for each completion token
        wrong = (greedy != completion).nonzero()
        if wrong.numel():
            j = int(wrong[0])
            cell.failures.append(f"{sid}: completion token {j} is {int(completion[j])}, greedy is {int(greedy[j])}")
        eos_at = (completion == self.eos).nonzero()
        ends_on_eos = eos_at.numel() == 1 and int(eos_at[0]) == len(completion) - 1
        if not (ends_on_eos or (eos_at.numel() == 0 and len(completion) == MAX_NEW_TOKENS)):
            cell.failures.append(f"{sid}: {len(completion)} tokens, eos at {eos_at.flatten().tolist()}: neither "
                                 f"stopped at eos nor at max_new_tokens {MAX_NEW_TOKENS}")


@dataclass(frozen=True)
class Engine:
    label: str
    algorithm: str | None
    layers: str
    engine_args: dict
    draft: str | None = None


def start(models: SpecModels, engine: Engine) -> VLLMRunner:
    cfg = ExtractConfig(model=str(models.target), engine="vllm", device="cpu", model_dtype="float32",
                        dtype="float32", layers=engine.layers, max_new_tokens=MAX_NEW_TOKENS, seed=0,
                        spec_algorithm=engine.algorithm, draft_model=engine.draft,
                        spec_num_steps=3 if engine.algorithm else None, engine_args=dict(engine.engine_args))
    return VLLMRunner(cfg)


def run_cell(oracle: Oracle, runner: VLLMRunner, cell: Cell, prompts: list[Prompt], mode: str = "generate",
             off_by_one: dict | None = None, keep: str | None = None) -> Cell:
    if mode != runner.cfg.mode:
        runner.cfg = dataclasses.replace(runner.cfg, mode=mode)
    try:
        samples = runner.run(prompts)
    finally:
        runner.cfg = dataclasses.replace(runner.cfg, mode="generate")
    for prompt, sample in zip(prompts, samples, strict=True):
        if keep is None:
            oracle.check(cell, prompt, sample, runner.groups, mode, runner.plan.algorithm, off_by_one)
        else:
            oracle.check_kept(cell, prompt, sample, runner.groups, mode, keep)
    return cell


def ngram_prompts(oracle: Oracle, models: SpecModels, lengths: list[int], seed: int) -> list[Prompt]:
    """Prompts that end by repeating their own start, which the model then continues as before: n-gram
    lookups in the prompt find the continuation."""
    out = []
    for p in make_prompts(models, "mixed", lengths, seed, "ngram"):
        head = p.input_ids[-6:]
        said = oracle.greedy(head, MAX_NEW_TOKENS + 4)
        ids = p.input_ids + said + head
        out.append(Prompt(p.sample_id, p.source_index, ids, [1] * len(ids)))
    return out


def engine_cells(oracle, models, runner, engine: Engine, seed: int) -> list[Cell]:
    label, algorithm = engine.label, engine.algorithm
    cells = []
    off_by_one = None
    if algorithm == "EAGLE3":  # SGLang's rule would read vLLM ids [2, 4, 6] as boundaries 3, 5, 7
        eagle3 = next(g for g in runner.groups if g.name == "eagle3")
        off_by_one = {"eagle3": tuple(s + 1 for s in eagle3.sources)}
    if algorithm in ("EAGLE", "EAGLE3"):
        for r, regime in enumerate(REGIMES):
            for batch, lengths in BATCHES.items():
                prompts = make_prompts(models, regime, lengths, seed + 100 * r + batch, f"{regime}{batch}")
                cells.append(run_cell(oracle, runner, Cell(label, f"{regime} b{batch}", regime), prompts,
                                      off_by_one=off_by_one))
        stop = make_prompts(models, "follow", BATCHES[5], seed + 7, "stop")
        stop[0].input_ids[-1] = models.stop_prompt_tail  # p -> q -> z -> eos: eos inside the first accepted run
        cells.append(run_cell(oracle, runner, Cell(label, "stop+continue b5"), stop))
    else:
        for batch, lengths in BATCHES.items():
            prompts = (ngram_prompts(oracle, models, lengths, seed + batch) if algorithm == "NGRAM"
                       else make_prompts(models, "mixed", lengths, seed + batch, f"plain{batch}"))
            cells.append(run_cell(oracle, runner, Cell(label, f"b{batch}"), prompts))
    prefill = make_prompts(models, "mixed", BATCHES[5], seed + 9, "prefill")
    cells.append(run_cell(oracle, runner, Cell(label, "prefill b5"), prefill, mode="prefill"))
    return cells


def run_engine(oracle, models, engine: Engine, seed: int, keep_rules: bool = False,
               control: list | None = None) -> list[Cell]:
    """The engine's cells; with ``control`` (a list), the negative control's cell is appended to it."""
    t0 = time.perf_counter()
    try:
        runner = start(models, engine)
    except Exception as e:  # reported as a failed cell: the other engines still run
        print(f"[grid] {engine.label}: the engine did not start: {type(e).__name__}: {e}", flush=True)
        return [Cell(engine.label, "start", failures=[f"{type(e).__name__}: {e}"])]
    started = time.perf_counter() - t0
    try:
        if "num_gpu_blocks_override" in engine.engine_args:  # the preemption engine
            counter = Recomputed()
            vllm_engine.assemble = counter
            try:
                cell = run_cell(oracle, runner, Cell(engine.label, f"preempted b{len(PREEMPT_BATCH)}"),
                                make_prompts(models, "mixed", PREEMPT_BATCH, seed, "preempt"))
            finally:
                vllm_engine.assemble = ASSEMBLE
            cell.recomputed = counter.count
            if counter.count == 0:
                cell.failures.append("no request was preempted: no position was computed twice")
            cells = [cell]
        else:
            cells = engine_cells(oracle, models, runner, engine, seed)
        if keep_rules:
            for keep in KEEP_RULES:
                for mode in ("generate", "prefill"):
                    prompts = make_prompts(models, "mixed", BATCHES[5], seed + 11, f"keep-{keep}")
                    if keep == "loss":  # loss on the second half of each prompt only
                        for p in prompts:
                            p.loss_mask[: len(p.loss_mask) // 2] = [0] * (len(p.loss_mask) // 2)
                    if keep == "completion" and mode == "prefill":
                        continue  # a prefill sample has no completion
                    cells.append(run_cell(oracle, runner, Cell(engine.label, f"keep {keep} {mode}"), prompts,
                                          mode=mode, keep=keep))
        if control is not None:
            control.append(negative_control(oracle, models, runner, engine.label, seed=77))
    finally:
        del runner
        gc.collect()
    print(f"[grid] {engine.label}: engine start {started:.1f} s, cells {time.perf_counter() - t0 - started:.1f} s, "
          f"{sum(c.ok for c in cells)}/{len(cells)} cells OK", flush=True)
    for c in cells:
        for f in c.failures[:3]:
            print(f"[grid]   {c.name}: {f}", flush=True)
    return cells


def print_table(cells: list[Cell]) -> None:
    print(f"\n{'engine':<30} {'cell':<20} {'accept':>6} {'rows':>6} {'max rel err':>11} {'off-by-one':>10} "
          f"{'recomp':>6}  result")
    for c in cells:
        acc = f"{c.accept:.2f}" if c.accept is not None else "-"
        obo = f"{c.off_by_one:.2e}" if c.off_by_one is not None else "-"
        print(f"{c.engine:<30} {c.name:<20} {acc:>6} {c.rows:>6} {c.worst:>11.2e} {obo:>10} {c.recomputed or '-':>6}  "
              f"{'OK' if c.ok else 'FAIL'}")
        for f in c.failures[:5]:
            print(f"    {f}")


def accept_by_regime(cells: list[Cell]) -> dict[tuple[str, str], float]:
    """(algorithm, regime) -> mean tokens per verify step (accepted drafts + the bonus token)."""
    out = {}
    for algorithm in ("EAGLE", "EAGLE3"):
        for regime in REGIMES:
            mine = [c for c in cells if c.engine.startswith(algorithm + " ") and c.regime == regime]
            steps = sum(c.verify_steps for c in mine)
            if steps:
                out[(algorithm, regime)] = sum(c.tokens for c in mine) / steps
    return out


def regimes_as_designed(acc: dict, algorithms: set[str]) -> list[str]:
    problems = []
    for algorithm in sorted(algorithms & {"EAGLE", "EAGLE3"}):
        f, m, x = (acc.get((algorithm, r), float("nan")) for r in REGIMES)
        if not (f > m + 0.3 and m > x + 0.3 and x < 1.15 and f > 2.5):
            problems.append(f"{algorithm}: accept lengths follow {f:.2f}, mixed {m:.2f}, miss {x:.2f} are not "
                            "ordered as the models were built (follow > 2.5, mixed in between, miss ~ 1)")
    return problems


def negative_control(oracle, models, runner: VLLMRunner, label: str, seed: int) -> Cell:
    """Every captured row moved by one position (in the running engine) must show up as misaligned rows."""
    vllm_engine.assemble = shifted_assemble
    try:
        return run_cell(oracle, runner, Cell(label, "control: rows +1", "follow"),
                        make_prompts(models, "follow", BATCHES[5], seed, "control"))
    finally:
        vllm_engine.assemble = ASSEMBLE


def control_detected(cell: Cell | None) -> bool:
    if cell is None:
        print("[grid] negative control: did not run")
        return False
    print_table([cell])
    if cell.failures:
        print(f"[grid] negative control: {len(cell.failures)} fault(s) reported with every row moved one position "
              "-> detected as designed")
        return True
    print("[grid] negative control: NOT detected: rows moved one position gave no fault")
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="where to build the models (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="the plain and EAGLE3 engines only")
    ap.add_argument("--skip-control", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-vllm-grid-"))
    models = build_spec_models(work / "models")
    eagle, eagle3 = (str(p) for p in vllm_heads(models))
    oracle = Oracle(models)
    chunked = {"max_num_batched_tokens": 64, "max_model_len": 1024}
    engines = [
        Engine("plain final,eagle3,b0,b3,b8", None, "final,eagle3,b0,b3,b8", chunked),
        Engine("EAGLE3 final,eagle3", "EAGLE3", "final,eagle3", {}, eagle3),
        Engine("plain final,b8 unchunked", None, "final,b8",
               {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024, "max_model_len": 1024}),
        Engine("plain final small-kv", None, "final,b4",
               {"block_size": 32, "num_gpu_blocks_override": 12, "max_model_len": 256}),
        Engine("EAGLE final", "EAGLE", "final", chunked, eagle),
        Engine("NGRAM final,b2", "NGRAM", "final,b2", {}),
    ]
    if args.quick:
        engines = engines[:2]
    cells, control = [], []
    for i, engine in enumerate(engines):  # the control runs in the EAGLE3 engine (a second EAGLE3 start in
        # one process fails inside vLLM)
        cells += run_engine(oracle, models, engine, seed=1000 * i, keep_rules=i == 0,
                            control=None if args.skip_control or engine.algorithm != "EAGLE3" else control)
    print_table(cells)
    acc = accept_by_regime(cells)
    print("\nmean accept length (tokens per verify step):")
    for (algorithm, regime), v in acc.items():
        print(f"  {algorithm:<7} {regime:<7} {v:.2f}")
    problems = [f"{c.engine} / {c.name}" for c in cells if not c.ok]
    problems += regimes_as_designed(acc, {e.algorithm for e in engines if e.algorithm})
    control_ok = True if args.skip_control else control_detected(control[0] if control else None)
    total_rows = sum(c.rows for c in cells)
    print(f"\n[grid] {len(cells)} cells, {total_rows} rows checked, worst {max(c.worst for c in cells):.2e} relative "
          f"(tolerance {TOLERANCE:g}), negative control {'detected' if control_ok else 'NOT detected'}"
          f"{' (skipped)' if args.skip_control else ''}, {time.perf_counter() - t0:.0f} s")
    for p in problems:
        print(f"[grid] FAIL {p}")
    ok = not problems and control_ok
    print(f"[grid] {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
