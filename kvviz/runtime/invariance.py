"""Every row's numbers independent of the batch it runs in, on a CPU: a run decoding with other users' runs gives
the same logits, bit for bit, as the same run alone.

A CPU's matrix multiply picks its kernel by the number of rows. Measured on the 2-core CPU (MKL 2024.2, AVX-512,
every linear layer of SmolLM2-135M): a row multiplied alone, or in a batch of 2-3, 5-7 or 9-11 rows, differs in its
last bits from the same row in a batch of 4, 8 or any count from 12 on (checked up to 2,048), and a 2-bit cache near
a rounding edge then chooses another greedy token a few steps later. Everything else in a decoder step (attention
over each row's own keys, norms, rotary, activations, the log-softmax) is computed per row already. So on a CPU each
plain linear layer pads its input to the next row count whose results agree with a large batch's (probed on the
model's own weights when it loads): a few zero rows for a step of few rows, nothing for larger ones. The reference
is a batch of 256 rows because a kernel's regimes need not be monotone: on the CI machine's CPU (torch 2.13) the down
projection (1,536 inputs) agrees with large batches at 16-56 rows and from about 200 on, but not at 57-196.

A loop that feeds one row and never shares its forwards (the one-method-at-a-time decode, streaming perplexity) runs
its row as it comes (:func:`rows_as_they_come`): one row alone takes a faster kernel than any padded count (the
figures are in docs/performance.md, "Batched comparison"), and such a row is never compared bit for bit with a
batch's.

Accelerators are left alone: their libraries choose kernels (split reductions) in ways padding cannot pin.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from kvviz.runtime.threads import small_work, small_work_threads

PROBE_ROWS = 24  # counts up to this are candidates to pad to; it must agree itself, as must CHECKED_ROWS
CHECKED_ROWS = (32, 48)  # larger counts, which are never padded: where they disagree, padding cannot help
REFERENCE_ROWS = 256  # the batch every count's rows are compared with: a large one (see the docstring)

# Per thread (each user's run has its own). The loop that feeds its rows decides, but its decision cannot travel as
# an argument: transformers hands a model call's keywords to attention only, and nn.Linear.forward takes its input.
_padding = contextvars.ContextVar("kvviz_row_padding", default=True)  # no argument reaches nn.Linear.forward


@contextlib.contextmanager
def rows_as_they_come():
    """Inside this block (in this thread), linear layers multiply the rows they are given, unpadded: for loops of
    one row that never share a forward, where padding would only cost time."""
    token = _padding.set(False)
    try:
        yield
    finally:
        _padding.reset(token)


class RowPaddedLinear(torch.nn.Linear):
    """A linear layer whose input rows are padded to the next count of ``row_counts`` (agreeing with large
    batches): a row's result then does not depend on how many rows it was multiplied with."""

    row_counts: tuple[int, ...] = ()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own argument name
        rows = input.numel() // input.shape[-1]
        target = next((count for count in self.row_counts if count >= rows), rows) if _padding.get() else rows
        if target == rows:
            return super().forward(input)
        flat = input.reshape(rows, input.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(target - rows, flat.shape[1])])
        return super().forward(padded)[:rows].reshape(*input.shape[:-1], -1)


def agreeing_row_counts(linears: list[torch.nn.Linear]) -> tuple[int, ...] | None:
    """The row counts up to :data:`PROBE_ROWS` at which every layer's results equal, row by row, those of a batch of
    :data:`REFERENCE_ROWS` (one probe per weight shape), or None when :data:`PROBE_ROWS` or a larger count checked
    disagrees (padding small batches would not make rows agree)."""
    shapes: dict[tuple, torch.nn.Linear] = {}
    for linear in linears:
        shapes.setdefault((linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is None), linear)
    generator = torch.Generator().manual_seed(0)
    counts = list(range(1, PROBE_ROWS + 1))
    with torch.inference_mode():
        for linear in sorted(shapes.values(), key=lambda layer: layer.weight.numel()):  # cheap shapes rule out most
            rows = torch.randn(REFERENCE_ROWS, linear.in_features, generator=generator).to(linear.weight)
            reference = torch.nn.functional.linear(rows, linear.weight, linear.bias)
            agree = [n for n in (*counts, *CHECKED_ROWS)
                     if torch.equal(torch.nn.functional.linear(rows[:n], linear.weight, linear.bias), reference[:n])]
            if not {PROBE_ROWS, *CHECKED_ROWS} <= set(agree):
                return None
            counts = [n for n in counts if n in agree]
    return tuple(counts)


def install_row_invariance(model: torch.nn.Module, device: str) -> tuple[int, ...] | None:
    """On a CPU, make every plain ``nn.Linear`` of ``model`` a :class:`RowPaddedLinear` padding to the counts the
    probe found under both thread counts the engine computes with (a prefill's, a decode step's); returns them (None:
    not installed, on an accelerator or where no padding makes rows agree)."""
    if not device.startswith("cpu"):
        return None
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    counts = agreeing_row_counts(linears) if linears else None
    if counts is not None and small_work_threads(device) not in (None, torch.get_num_threads()):
        with small_work(device):  # a decode step's thread count (kvviz.runtime.threads)
            small = agreeing_row_counts(linears)
        counts = None if small is None else tuple(n for n in counts if n in small)  # both hold PROBE_ROWS
    if counts is None:
        return None
    for linear in linears:
        linear.__class__ = RowPaddedLinear
        linear.row_counts = counts
    return counts
