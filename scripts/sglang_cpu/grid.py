"""The real-SGLang grid: hsx's SGLang engine under EAGLE / EAGLE3, every row checked against an oracle.

Run inside the lane (``bash scripts/sglang_cpu_check.sh`` = ``scripts/sglang_cpu.sh python
scripts/sglang_cpu/grid.py``). It builds the target and drafts of :mod:`hsx.demo.spec_models`, starts
one real ``sglang.Engine`` per (algorithm, tree shape) through hsx's own ``SGLangRunner``, and runs
every cell of {EAGLE, EAGLE3} x {topk 1 / 4 draft tokens, topk 2 / 6, topk 4 / 8} x {follow, mixed,
miss} x {batch 1, 5, 16}, plus per engine a stop-token cell (one request ends on ``eos`` inside an
accepted run while the others continue) and a prefill-mode cell, and the non-speculative final and
aux-capture columns. ``max_new_tokens`` is 12 with at most 4 tokens per verify step (1 + 4 + 4 + 4 > 12),
so the last step overshoots and must be trimmed. fp32, greedy.

By default (``--capture tensors``) every engine runs hsx's capture with every column it can take from
one forward (EAGLE ``final``; EAGLE3 ``final,eagle3,b4``; plain ``final`` and ``final,eagle3,b5``),
with SGLang's float-list builders made to raise (``HSX_LANE_FORBID_LISTS=1``); ``--capture lists``
runs SGLang's lists, one column per engine.

Each cell checks, per request and column, against an independent teacher-forced forward
(``tests/oracle.py``): with the capture, an empty float list and ``accept_lens`` (int16, one per
``spec_verify_ct``, covering the completion); with lists, ``len(hidden_states) ==
completion_tokens``; the tokens are plain greedy (every completion token is
the argmax of the oracle's logits at the previous position, and the run ends on eos or at
max_new_tokens); P + C - 1 rows (P + C in prefill mode) at positions 0..; every row within 1e-4 of
the oracle relative to the largest oracle value; under EAGLE3 the columns are boundaries 2, 4, 6 for
the draft's ids [1, 3, 5], and not boundaries 1, 3, 5 (ids read without SGLang's +1). Mean accept
lengths per regime must be ordered as built: follow > mixed > miss ~ 1.

Then a negative control: the same kind of engine with one of the lane's kernels left as the silent
stand-in (``HSX_LANE_STANDIN``) must be reported as misaligned. Exit 0 only if every cell passes
and the control fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from oracle import oracle_sources  # noqa: E402

from hsx.align import AlignedSample  # noqa: E402
from hsx.config import ExtractConfig  # noqa: E402
from hsx.data.render import Prompt  # noqa: E402
from hsx.demo.spec_models import REGIMES, SpecModels, build_spec_models  # noqa: E402
from hsx.engine.sglang.runner import SGLangRunner  # noqa: E402

TOLERANCE = 1e-4  # max |row - oracle| / max |oracle|, fp32
OFF_BY_ONE_MIN = 1e-2  # rows compared with the wrong boundaries must be at least this far off
MAX_NEW_TOKENS = 12
BATCHES = {1: [37], 5: [1, 9, 64, 180, 300], 16: [2 + 4 * i for i in range(16)]}  # prompt lengths
TREES = [(1, 4), (2, 6), (4, 8)]  # (topk, draft tokens), 3 draft steps each
CPU_ENGINE_ARGS = {"attention_backend": "torch_native", "sampling_backend": "pytorch", "disable_cuda_graph": True,
                   "mem_fraction_static": 0.05, "max_total_tokens": 16384, "context_length": 1024,
                   "sleep_on_idle": True}  # the scheduler otherwise polls a core while the oracle runs


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
    failures: list[str] = field(default_factory=list)

    @property
    def accept(self) -> float | None:
        return (self.tokens / self.verify_steps) if self.verify_steps else None

    @property
    def ok(self) -> bool:
        return not self.failures and self.rows > 0


class EngineSpy:
    """Keeps each raw SGLang output so the grid can check it before hsx converts it."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, **kwargs):
        outs = self.engine.generate(**kwargs)
        self.calls.append(outs if isinstance(outs, list) else [outs])
        return outs

    def shutdown(self):
        self.engine.shutdown()

    def __getattr__(self, name):
        return getattr(self.engine, name)


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

    def check(self, cell: Cell, prompt: Prompt, sample, raw: dict, groups, mode: str, capture: str,
              algorithm: str | None) -> None:
        sid = prompt.sample_id
        meta = raw["meta_info"]
        hs, completion = meta.get("hidden_states") or [], int(meta["completion_tokens"])
        if capture == "lists" and len(hs) != completion:
            cell.failures.append(f"{sid}: {len(hs)} hidden-state entries for completion_tokens {completion}")
        if capture == "tensors" and hs:
            cell.failures.append(f"{sid}: SGLang returned {len(hs)} float-list entries under hsx's capture")
        if not isinstance(sample, AlignedSample):
            cell.failures.append(f"{sid}: hsx refused the output: {sample.reason}")
            return
        if capture == "tensors" and algorithm is not None and mode == "generate":
            a = sample.accept_lens
            if a is None or a.dtype != torch.int16 or a.numel() != int(meta.get("spec_verify_ct", -1)):
                cell.failures.append(f"{sid}: accept_lens {None if a is None else a.tolist()} for spec_verify_ct "
                                     f"{meta.get('spec_verify_ct')}")
                return
            decoded = len(sample.input_ids) - len(prompt.input_ids) - 1
            if int(a.sum()) < decoded or int(a.sum()) - int(a[-1]) >= max(decoded, 1):
                cell.failures.append(f"{sid}: accept lengths {a.tolist()} for {decoded} decoded tokens")
        for group in groups:
            # under EAGLE3 the draft's ids [1, 3, 5] must be read with SGLang's +1: not boundaries 1, 3, 5
            off_by_one = tuple(s - 1 for s in group.sources) if algorithm == "EAGLE3" and group.name == "eagle3" else None
            self._check_rows(cell, prompt, sample, group, mode, off_by_one)
        if mode == "generate" and (sample.verify_steps or sample.accept_lens is not None):
            cell.tokens += len(sample.input_ids) - len(prompt.input_ids) - 1
            cell.verify_steps += sample.accept_lens.numel() if sample.accept_lens is not None else sample.verify_steps

    def _check_rows(self, cell: Cell, prompt: Prompt, sample, group, mode: str, off_by_one=None) -> None:
        sid = prompt.sample_id
        ids, P = sample.input_ids, len(prompt.input_ids)
        if ids[:P].tolist() != prompt.input_ids:
            cell.failures.append(f"{sid}: stored prompt differs from the request")
        src = oracle_sources(self.model, ids)
        logits = self.model.lm_head(src["final"])  # [N, V]
        self._check_greedy(cell, sid, ids, P, logits, mode)
        rows = sample.hidden[group.name].float()
        want_rows = len(ids) if mode == "prefill" else len(ids) - 1
        if rows.shape[0] != want_rows or sample.first_position != 0:
            cell.failures.append(f"{sid}: {rows.shape[0]} rows from position {sample.first_position}, "
                                 f"expected {want_rows} from 0 (P={P}, C={len(ids) - P})")
            return
        ref = torch.cat([src[s] for s in group.sources], -1)[:want_rows]
        scale = float(ref.abs().max())
        err = float((rows - ref).abs().max()) / scale
        cell.worst, cell.rows = max(cell.worst, err), cell.rows + rows.shape[0]
        if err > TOLERANCE:
            bad = int(((rows - ref).abs().amax(-1) > TOLERANCE * scale).nonzero()[0])
            cell.failures.append(f"{sid}: column {group.name}: rows off by {err:.2e} (relative) from position {bad}")
        if off_by_one is not None:
            shifted = torch.cat([src[s] for s in off_by_one], -1)[:want_rows]
            miss = float((rows - shifted).abs().max()) / scale
            cell.off_by_one = miss if cell.off_by_one is None else min(cell.off_by_one, miss)
            if miss < OFF_BY_ONE_MIN:
                cell.failures.append(f"{sid}: rows also match boundaries {list(off_by_one)} ({miss:.2e})")

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


def start(models: SpecModels, algorithm: str | None, topk: int, draft_tokens: int, layers: str,
          capture: str) -> SGLangRunner:
    draft = {"EAGLE": models.eagle, "EAGLE3": models.eagle3}.get(algorithm)
    # with hsx's capture, SGLang's float-list builders raise in the scheduler (read there at start);
    # HSX_LANE_FORBID_LISTS_FOR_LISTS=1 arms them for the list path too (the tripwire's own test)
    forbid = capture == "tensors" or os.environ.get("HSX_LANE_FORBID_LISTS_FOR_LISTS") == "1"
    os.environ["HSX_LANE_FORBID_LISTS"] = "1" if forbid else "0"
    cfg = ExtractConfig(model=str(models.target), engine="sglang", device="cpu", model_dtype="float32",
                        dtype="float32", layers=layers, max_new_tokens=MAX_NEW_TOKENS, seed=0, sglang_capture=capture,
                        eagle3_layer_ids=[1, 3, 5] if "eagle3" in layers else None,
                        spec_algorithm=algorithm, draft_model=str(draft) if draft else None,
                        spec_num_steps=3 if algorithm else None, spec_topk=topk if algorithm else None,
                        spec_num_draft_tokens=draft_tokens if algorithm else None, engine_args=dict(CPU_ENGINE_ARGS))
    runner = SGLangRunner(cfg)
    runner.engine = EngineSpy(runner.engine)
    return runner


def run_cell(oracle: Oracle, runner: SGLangRunner, cell: Cell, prompts: list[Prompt], mode: str = "generate") -> Cell:
    if mode != runner.cfg.mode:
        runner = copy.copy(runner)
        runner.cfg = dataclasses.replace(runner.cfg, mode=mode)
    runner.engine.calls.clear()
    samples = runner.run(prompts)
    if len(runner.engine.calls) != 1:  # hsx re-runs retracted requests; the grid's memory settings never retract
        cell.failures.append(f"{len(runner.engine.calls)} generate calls for one batch (a request was retracted)")
        return cell
    for prompt, sample, raw in zip(prompts, samples, runner.engine.calls[0], strict=True):
        oracle.check(cell, prompt, sample, raw, runner.groups, mode, runner.cfg.sglang_capture, runner.plan.algorithm)
    return cell


def engine_cells(oracle, models, label, runner, stop_tail: int, seed: int) -> list[Cell]:
    cells = []
    for r, regime in enumerate(REGIMES):
        for batch, lengths in BATCHES.items():
            prompts = make_prompts(models, regime, lengths, seed + 100 * r + batch, f"{regime}{batch}")
            cells.append(run_cell(oracle, runner, Cell(label, f"{regime} b{batch}", regime), prompts))
    stop = make_prompts(models, "follow", BATCHES[5], seed + 7, "stop")
    stop[0].input_ids[-1] = stop_tail  # p -> q -> z -> eos: eos inside the first accepted run
    cells.append(run_cell(oracle, runner, Cell(label, "stop+continue b5"), stop))
    prefill = make_prompts(models, "mixed", BATCHES[5], seed + 9, "prefill")
    cells.append(run_cell(oracle, runner, Cell(label, "prefill b5"), prefill, mode="prefill"))
    return cells


def run_engine(oracle, models, algorithm, topk, draft_tokens, layers, seed, capture) -> list[Cell]:
    label = f"{algorithm or 'plain'} {layers}" + (f" topk{topk}/{draft_tokens}" if algorithm else "")
    t0 = time.perf_counter()
    runner = start(models, algorithm, topk, draft_tokens, layers, capture)
    started = time.perf_counter() - t0
    try:
        if algorithm:
            cells = engine_cells(oracle, models, label, runner, models.stop_prompt_tail, seed)
        else:
            cells = [run_cell(oracle, runner, Cell(label, f"b{b}"), make_prompts(models, "mixed", BATCHES[b], seed + b,
                                                                                 f"plain{b}")) for b in (5, 16)]
    finally:
        runner.engine.shutdown()
    print(f"[grid] {label}: engine start {started:.1f} s, cells {time.perf_counter() - t0 - started:.1f} s, "
          f"{sum(c.ok for c in cells)}/{len(cells)} cells OK", flush=True)
    return cells


def print_table(cells: list[Cell]) -> None:
    print(f"\n{'engine':<26} {'cell':<18} {'accept':>6} {'rows':>6} {'max rel err':>11} {'off-by-one':>10}  result")
    for c in cells:
        acc = f"{c.accept:.2f}" if c.accept is not None else "-"
        obo = f"{c.off_by_one:.2e}" if c.off_by_one is not None else "-"
        print(f"{c.engine:<26} {c.name:<18} {acc:>6} {c.rows:>6} {c.worst:>11.2e} {obo:>10}  "
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
    """Accept lengths of each speculative algorithm that ran, ordered as the models were built."""
    problems = []
    for algorithm in sorted(algorithms):
        f, m, x = (acc.get((algorithm, r), float("nan")) for r in REGIMES)
        if not (f > m + 0.3 and m > x + 0.3 and x < 1.15 and f > 2.5):
            problems.append(f"{algorithm}: accept lengths follow {f:.2f}, mixed {m:.2f}, miss {x:.2f} are not "
                            "ordered as the models were built (follow > 2.5, mixed in between, miss ~ 1)")
    return problems


def negative_control(oracle, models, seed) -> bool:
    """A lane kernel left as the silent stand-in must show up as misaligned rows or wrong tokens."""
    op = "assign_req_to_token_pool_cpu"
    os.environ["HSX_LANE_STANDIN"] = op  # read by the scheduler subprocess at start
    import cpu_lane.stubs
    import cpu_lane.kernels

    cpu_lane.stubs.provide(cpu_lane.kernels.OPS)  # this process too, in case SGLang forks
    try:
        runner = start(models, "EAGLE", 1, 4, "final", "lists")
        try:
            cell = run_cell(oracle, runner, Cell("EAGLE final topk1/4", f"control: {op} silent", "follow"),
                            make_prompts(models, "follow", BATCHES[5], seed + 55, "control"))
        finally:
            runner.engine.shutdown()
    except Exception as e:  # a crash also means the lane saw the wrong engine, but it is not the designed outcome
        print(f"[grid] negative control: the engine failed instead of running wrong: {type(e).__name__}: {e}")
        return False
    finally:
        os.environ.pop("HSX_LANE_STANDIN", None)
        cpu_lane.stubs.provide(cpu_lane.kernels.OPS)
    print_table([cell])
    if cell.failures:
        print(f"[grid] negative control: {len(cell.failures)} fault(s) reported with {op} left silent -> "
              "fails as designed")
        return True
    print(f"[grid] negative control: NOT detected: {op} left silent gave no fault; the grid cannot see this stand-in")
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="where to build the models (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="one EAGLE and one EAGLE3 engine (topk 2 / 6) only")
    ap.add_argument("--skip-control", action="store_true")
    ap.add_argument("--engines", help="comma-separated ALGORITHM:TOPK to run (e.g. EAGLE:1,None:1), default all")
    ap.add_argument("--capture", choices=["tensors", "lists"], default="tensors",
                    help="hsx's capture in SGLang's scheduler (default; several columns, accept lengths) or "
                         "SGLang's float lists (one column per engine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-grid-"))
    models = build_spec_models(work / "models")
    oracle = Oracle(models)
    if args.capture == "tensors":  # every column hsx can take from one forward
        engines = [(a, t, d, "final,eagle3,b4" if a == "EAGLE3" else "final") for a in ("EAGLE", "EAGLE3") for t, d in TREES]
        engines += [(None, 1, 1, "final"), (None, 1, 1, "final,eagle3,b5")]
    else:
        engines = [(a, t, d, "eagle3" if a == "EAGLE3" else "final") for a in ("EAGLE", "EAGLE3") for t, d in TREES]
        engines += [(None, 1, 1, "final"), (None, 1, 1, "eagle3")]
    if args.quick:
        engines = [(a, 2, 6, layers) for a, _, _, layers in engines[::3][:2]]
    if args.engines:
        engines = [e for e in engines if f"{e[0]}:{e[1]}" in args.engines.split(",")]
    cells = []
    for i, (algorithm, topk, draft_tokens, layers) in enumerate(engines):
        cells += run_engine(oracle, models, algorithm, topk, draft_tokens, layers, seed=1000 * i, capture=args.capture)
    print_table(cells)
    acc = accept_by_regime(cells)
    print("\nmean accept length (tokens per verify step):")
    for (algorithm, regime), v in acc.items():
        print(f"  {algorithm:<7} {regime:<7} {v:.2f}")
    problems = [f"{c.engine} / {c.name}" for c in cells if not c.ok]
    problems += regimes_as_designed(acc, {e[0] for e in engines if e[0]})
    control_ok = True if args.skip_control else negative_control(oracle, models, seed=77)
    total_rows = sum(c.rows for c in cells)
    print(f"\n[grid] {len(cells)} cells, {total_rows} rows checked, worst {max(c.worst for c in cells):.2e} relative "
          f"(tolerance {TOLERANCE:g}), {time.perf_counter() - t0:.0f} s")
    for p in problems:
        print(f"[grid] FAIL {p}")
    ok = not problems and control_ok
    print(f"[grid] {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
