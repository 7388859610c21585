"""Figure builders for the app: Plotly figures and small HTML snippets, with no Streamlit import (unit-testable).

Every builder takes plain numbers (lists, numpy arrays, torch tensors, pandas frames) and returns a figure or an
HTML string; the pages only place them. One module per page's figures, one for the HTML snippets; pages read
them all from here (``plots.X``).
"""

from kvviz_app.plots.attention import (
    HEATMAP_MAX,
    attention_heatmap,
    downsample,
    head_gallery,
    kept_fraction,
    kept_heatmap,
    received_attention,
    sink_mass_figure,
)
from kvviz_app.plots.common import MiB, as_array, integer_ticks
from kvviz_app.plots.comparison import (
    axis_factors_figure,
    key_channel_figure,
    kl_figure,
    kv_growth_figure,
    layouts_figure,
    memory_figure,
    reconstruction_figure,
)
from kvviz_app.plots.planning import gpu_budget_figure, measured_vs_formula_figure, planner_context_figure
from kvviz_app.plots.prefix import BLOCK_COLORS, block_table_figure, context_cost_figure, jaccard_figure, ttft_figure
from kvviz_app.plots.snippets import divergence_html, kept_map_html, tail_context_html, token_shading_html
from kvviz_app.plots.studies import (
    TAIL_ORDER,
    needle_eviction_figure,
    needle_heatmaps,
    tail_contrast_figure,
    tail_heatmap,
)
from kvviz_app.plots.tradeoffs import (
    allocation_figure,
    budget_label,
    outcome_cells,
    outcome_grid,
    prompt_outcomes,
    tradeoff_figure,
)

__all__ = [
    "allocation_figure",
    "BLOCK_COLORS",
    "HEATMAP_MAX",
    "MiB",
    "TAIL_ORDER",
    "as_array",
    "attention_heatmap",
    "axis_factors_figure",
    "block_table_figure",
    "budget_label",
    "context_cost_figure",
    "divergence_html",
    "downsample",
    "gpu_budget_figure",
    "head_gallery",
    "integer_ticks",
    "jaccard_figure",
    "kept_fraction",
    "kept_heatmap",
    "kept_map_html",
    "key_channel_figure",
    "kl_figure",
    "kv_growth_figure",
    "layouts_figure",
    "measured_vs_formula_figure",
    "memory_figure",
    "needle_eviction_figure",
    "needle_heatmaps",
    "outcome_cells",
    "outcome_grid",
    "planner_context_figure",
    "prompt_outcomes",
    "received_attention",
    "reconstruction_figure",
    "sink_mass_figure",
    "tail_context_html",
    "tail_contrast_figure",
    "tail_heatmap",
    "token_shading_html",
    "tradeoff_figure",
    "ttft_figure",
]
