"""Which runs decode together: the admission policy the engine (:mod:`kvviz.runtime.engine`) applies at every step,
for the app's runs, the bench's class, the command line and notebooks alike.

Decoding together pays where a decode step is bound by reading the weights: a run's rows added to the running batch
read the same weights and cost the others little, so every run finishes sooner. Where a step is bound by its
arithmetic (on a CPU, rows attending over long caches: attention and each method's bookkeeping are paid per row), a
run admitted beside others adds its whole work to every step of theirs, and its prefill runs between their steps:
nobody's result comes before the end. The bench's class (``python -m kvviz bench --sections classroom``; its figures,
dated, in docs/performance.md) measures both: many short comparisons finish sooner decoding together and every wait
shortens, while comparisons of six configurations on 2K-token uploads finish together only a little sooner and the
median student waits longer than one at a time. With four students, pairs could keep the median and the 95th
percentile only if two uploads together took at most 1.5 times one alone; the linear layers are the only part of a
step a batch shares.

So a run joins the runs in progress only while the positions their rows attend over at each step (each run's prompt
tokens times its configurations) stay within its device's bound. On a CPU that bound is 2,048 positions: a decode step
of SmolLM2 reads its weights in about 25 ms and spends about 20 us per cached position on per-row work (a 2K comparison
of six configurations: about 310 ms a step, 75 ms of it in the linear layers), so past some 2K positions a step is
mostly work a batch does not share. Short comparisons batch eight at a time; a 2K upload runs alone. An accelerator's
step stays bound by reading the weights far longer, so there the count of runs is the only bound. A step that holds
the model by itself (a study's item, decoded alone) is admitted only when nothing else runs; a study gives the model
back after each item (:class:`kvviz.runtime.jobs.Turn`), so other runs take turns with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RUNS_TOGETHER = 8  # runs the engine admits into one running batch at once; each holds its caches while it decodes
# (eight 2K-token comparisons of six configurations on SmolLM2 decoding together held 17.7 GB resident, measured on
# the CPU)
CPU_POSITIONS = 2048  # the most positions runs decoding together may hold on a CPU (a run alone always runs)


@dataclass(frozen=True)
class RunSize:
    """What one run puts on the model while it runs: the positions its rows attend over at each decode step (its
    prompt's tokens times its configurations), on which device, and whether it shares the model's forwards at all."""

    positions: int = 0
    device: str = ""
    shares: bool = True  # False: its step holds the model by itself (decodes alone), so it runs alone


@dataclass(frozen=True)
class Admission:
    """Whether a run may start beside the runs in progress: at most ``most_runs`` of them, holding at most
    ``cpu_positions`` positions together on a CPU (None: no bound). A run starts at once when nothing runs."""

    most_runs: int = RUNS_TOGETHER
    cpu_positions: int | None = CPU_POSITIONS

    def bound(self, device: str) -> int | None:
        """The most positions runs decoding together may hold on ``device``."""
        return self.cpu_positions if device.startswith("cpu") else None

    def admits(self, running: Sequence[RunSize], candidate: RunSize) -> bool:
        """Whether ``candidate`` may start now, beside ``running``."""
        if not running:
            return True
        if len(running) >= self.most_runs or not candidate.shares or not all(size.shares for size in running):
            return False
        bound = self.bound(candidate.device)
        return bound is None or sum(size.positions for size in running) + candidate.positions <= bound

    def describe(self, device: str) -> str:
        """The policy on ``device``, in words (for notes and logs)."""
        if self.most_runs == 1:
            return "one run at a time"
        bound = self.bound(device)
        return (f"up to {self.most_runs} runs at once" if bound is None
                else f"up to {self.most_runs} runs at once holding at most {bound:,} positions together")


ALONE = RunSize(shares=False)  # a step that holds the model by itself
ADMISSION = Admission()  # the engine's policy: the app's runs, the bench's class, the CLI and notebooks
ONE_AT_A_TIME = Admission(most_runs=1)  # what decoding together is compared with

