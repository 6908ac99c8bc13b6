"""Pictures of attention: matplotlib heatmaps (PNG/SVG) and a self-contained HTML report.

matplotlib is imported only when a picture is drawn, so ``import attnlab.lab.viz`` stays cheap.

Example:
    >>> import torch
    >>> from attnlab.lab.viz import heatmap
    >>> fig = heatmap(torch.tensor([[0.7, 0.3], [0.2, 0.8]]), rows=["hi", "there"], cols=["hi", "there"])
    >>> len(fig.axes)  # one head and its colour bar
    2
"""

from attnlab.lab.viz.heatmap import MAX_TOKENS, aggregate_blocks, heatmap, masked_runs, save_figure

__all__ = ["MAX_TOKENS", "aggregate_blocks", "heatmap", "masked_runs", "save_figure"]
