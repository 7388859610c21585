"""Many prompts, many configurations, one running batch: what a sweep over items or a prompt set runs.

Each prompt is prefilled once and every configuration forks its cache from that prefill, as :func:`compare` does
for one prompt. The prompts then decode in *waves*: every configuration of every prompt in a wave is a row of the
same forward, one per step (the engine's running batch, :mod:`kvviz.runtime.engine`, which other users' runs may
join). A wave holds as many prompts as fit under a row cap and a memory budget, and is one step of the job the
engine admits: between waves the model goes back to the engine, so other users' runs take their turns. Prompts that
nobody's attention is recorded for (quantizers and fixed windows only) go through the engine's shared prefill,
several in one forward, after the whole blocks two or more of them begin with (a task's chat preamble, a prompt
set's shared document), prefilled once for the wave in a forward of their own: each prompt feeds only the rest.

Rows do exactly what they do alone (each its own cache; on a CPU the linear layers are padded to row counts that
give every row the same numbers whatever shares its forward: :mod:`kvviz.runtime.invariance`), so each prompt's
results equal :func:`compare` on that prompt alone, prefilled fresh (``reuse_prefix=False``). The wave's shared
blocks change no bit of that on a CPU: a prompt's keys, values and logits after them equal its whole prompt's
prefill (tests/test_batched.py, on the real model).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from kvviz.comparison.results import MethodResult
from kvviz.comparison.session import (
    BOTH,
    FORCED,
    PromptSession,
    capture_for,
    decode_group,
    fork_rows,
    group_results,
    reference_first,
)
from kvviz.methods import MethodStack
from kvviz.planning.memory import model_card
from kvviz.runtime.admission import RunSize
from kvviz.runtime.batch import Row
from kvviz.runtime.jobs import Decode, Job, SharedPrefill, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.prefix import PrefixCache, shared_prefixes
from kvviz.runtime.progress import Progress, share

# Rows one forward feeds at most. On the 2-core CPU a step's linear layers cost about the same for 12 rows as for
# 96 (they are bound by reading the weights) while each row's attention and cache updates are paid per row; on an
# accelerator rows are nearly free until memory runs out.
MAX_ROWS = {"cpu": 96}
MAX_ROWS_ACCELERATOR = 512
CPU_MEMORY_SHARE = 0.25  # of the machine's memory a wave's caches may take on a CPU (half the free memory on a GPU)


def memory_budget(device: str) -> int:
    """Bytes a wave's caches may hold on ``device``."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free // 2
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * CPU_MEMORY_SHARE)


def waves(loaded: LoadedModel, lengths: Sequence[int], rows_per_prompt: int, max_new_tokens: int) -> list[range]:
    """The prompts (by index, in order) of each wave: as many as the row cap and the memory budget allow, at least
    one. A prompt's bytes are counted as if every row held its whole cache (eviction only ever holds less)."""
    device = str(loaded.device)
    cap = MAX_ROWS.get(device.split(":")[0], MAX_ROWS_ACCELERATOR) // max(1, rows_per_prompt)
    budget = memory_budget(device)
    card = model_card(loaded)
    out, start, held = [], 0, 0
    for index, length in enumerate(lengths):
        size = card.stored_kv_bytes(length + max_new_tokens) * (rows_per_prompt + 1)  # the rows and the prefill
        if index > start and (index - start >= max(1, cap) or held + size > budget):
            out.append(range(start, index))
            start, held = index, 0
        held += size
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def decode_prompts(loaded: LoadedModel, prompts: Sequence[Sequence[int]], specs: list[str], max_new_tokens: int,
                   mode: str, progress: Progress | None = None, reuse_prefix: bool = False
                   ) -> list[list[MethodResult]]:
    """Every SPEC on every prompt (``full`` first, added if missing): per prompt, one result per configuration.

    ``mode`` says how the rows after full decode (:data:`kvviz.comparison.session.FREE`, ``FORCED`` or ``BOTH``).
    Prompts are prefilled fresh unless ``reuse_prefix``: a block the model's prefix cache kept from another run may
    have been computed under another attention path (explicit where a capture listened, SDPA elsewhere), which
    moves the last bits and, near a tie, a greedy token; a sweep's results must not depend on what ran before. What
    the prompts of a wave share is prefilled once, fresh, for that wave alone (module docstring).
    SpecError or PromptError before any model work; a configuration that fails on a prompt is that result's
    ``error``, and the others go on. One job on the model's engine (:func:`prompts_job`), whose result this waits for.
    """
    return loaded.engine.run(prompts_job(loaded, prompts, specs, max_new_tokens, mode, reuse_prefix), progress)


def prompts_job(loaded: LoadedModel, prompts: Sequence[Sequence[int]], specs: list[str], max_new_tokens: int,
                mode: str, reuse_prefix: bool = False) -> Job[list[list[MethodResult]]]:
    """:func:`decode_prompts` as a job: one step per wave, admitted wave by wave (each wave's size is its rows'
    prompt positions), so other users' runs join the running batch or take turns between waves."""
    stacks = reference_first(specs)
    sessions = [PromptSession(loaded, list(ids), reuse_prefix) for ids in prompts]  # PromptError first
    rows_per_prompt = len(stacks) * (2 if mode == BOTH else 1)  # BOTH: a teacher-forced twin per row at most
    planned = waves(loaded, [len(ids) for ids in prompts], rows_per_prompt, max_new_tokens)
    first = _wave_size(loaded, sessions, planned[0], stacks) if planned else RunSize(device=loaded.device)
    return Job(functools.partial(_waves_steps, loaded, sessions, stacks, planned, max_new_tokens, mode), first,
               "prompts")


def _wave_size(loaded: LoadedModel, sessions: list[PromptSession], wave: range, stacks: list[MethodStack]) -> RunSize:
    """What a wave puts on the model: every configuration of every prompt in it attends over that prompt."""
    return RunSize(sum(len(sessions[index].prompt_ids) for index in wave) * len(stacks), loaded.device)


def _waves_steps(loaded: LoadedModel, sessions_of: list[PromptSession], stacks: list[MethodStack],
                 planned: list[range], max_new_tokens: int, mode: str,
                 progress: Progress) -> Steps[list[list[MethodResult]]]:
    """Each wave: its prompts prefilled (together when nothing records them), every configuration forked, all
    rows decoded in the running batch, then scored; the model given back before the next wave."""
    capture = capture_for(stacks)
    results: list[list[MethodResult]] = []
    for number, wave in enumerate(planned):
        if number:
            yield Turn(_wave_size(loaded, sessions_of, wave, stacks))
        report = share(progress, number / len(planned), (number + 1) / len(planned),
                       f"prompts {wave.start + 1}-{wave.stop} of {len(sessions_of)}: ")
        sessions = [sessions_of[index] for index in wave]
        report(0.0, "prefilling")
        if capture is None:
            prompts = [session.prompt_ids for session in sessions]
            reuse = sessions[0].reuse_prefix
            shared = yield SharedPrefill(prompts, reuse, None if reuse else (yield from _prefilled_once(prompts)))
            for session, run in zip(sessions, shared, strict=True):
                session.adopt(run)
        else:
            for session in sessions:
                yield Stage.PREFILL
                session.prefill(capture)
        yield Stage.FORK
        rows = [fork_rows(session, stacks) for session in sessions]
        groups = [decode_group(session, prompt_rows, max_new_tokens, mode, progress=report if index == 0 else None)
                  for index, (session, prompt_rows) in enumerate(zip(sessions, rows, strict=True))]
        yield Decode(groups)
        yield Stage.SCORE
        results += [group_results(session, prompt_rows, mode) for session, prompt_rows in zip(sessions, rows,
                                                                                               strict=True)]
        _release(rows)
    progress(1.0, "done")
    return results


def _prefilled_once(prompts: list[list[int]]) -> Steps[PrefixCache | None]:
    """The whole blocks that two or more of ``prompts`` begin with (a task's chat preamble, a prompt set's shared
    document), prefilled fresh in one forward of their own and kept for these prompts only; None when they share
    none."""
    shared = shared_prefixes(prompts)
    if not shared:
        return None
    own = PrefixCache()  # these prompts' own blocks, dropped with the wave
    for ids, run in zip(shared, (yield SharedPrefill(shared, False)), strict=True):
        own.store(ids, run.cache)
    return own


def _release(rows: list[list[Row]]) -> None:
    """Drop a finished wave's caches before the next wave allocates its own (results keep bytes and ledgers)."""
    for prompt_rows in rows:
        for row in prompt_rows:
            row.cache = None
            if row.twin is not None:
                row.twin.cache = None


def teacher_forced(loaded: LoadedModel, prompt_ids: list[int], specs: list[str], max_new_tokens: int = 64,
                   progress: Progress | None = None, reuse_prefix: bool = True) -> list[MethodResult]:
    """Full free-running (greedy) and every other SPEC teacher-forced on full's tokens from the first step, all in
    one batch after one shared prefill: what a sweep measures on one prompt (no method's own continuation).

    Each result's agreement, KL and first divergence equal :func:`compare`'s for that SPEC; its text and tokens
    are full's, its bytes and ledger those of a cache fed full's tokens. ``full`` comes first (added if missing).
    """
    return decode_prompts(loaded, [prompt_ids], specs, max_new_tokens, FORCED, progress, reuse_prefix)[0]
