"""Execute notebooks with nbclient on an ipykernel of this interpreter, and export their HTML outputs.

The kernel is ipykernel's own "python3" spec, which runs ``sys.executable`` (the venv's python),
with this process's environment (PYTHONPATH included). A cell that raises fails the run:
``CellExecutionError`` names the cell and shows its traceback. :func:`export_html` writes the
executed notebook as one page: each cell's source, then its outputs (HTML as the notebook would
render it, text in ``<pre>``), which is what a browser test opens.
"""

from __future__ import annotations

import html
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="the notebook tests need the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="the notebook tests need the test extra: pip install -e '.[test]'")

CellExecutionError = nbclient.exceptions.CellExecutionError


def execute(notebook, *, timeout: float, cwd: Path | None = None):
    """Run every cell of ``notebook`` (a path or a NotebookNode) in a fresh kernel; return the executed node.

    The kernel inherits this process's environment (PYTHONPATH: the attnlab under test).

    Raises:
        CellExecutionError: a cell raised (the notebook's error, with its traceback).
        CellTimeoutError: a cell ran longer than ``timeout`` seconds.
    """
    node = nbformat.read(notebook, as_version=4) if isinstance(notebook, (str, Path)) else notebook
    client = nbclient.NotebookClient(node, timeout=timeout, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(cwd or Path.cwd())}})
    client.execute()
    return node


def export_html(node) -> str:
    """The executed notebook as one HTML page: sources in ``<pre>``, outputs as a notebook renders them."""
    parts = []
    for cell in node.cells:
        if cell.cell_type != "code":
            parts.append(f'<div class="markdown"><pre>{html.escape(cell.source)}</pre></div>')
            continue
        parts.append(f'<pre class="source">{html.escape(cell.source)}</pre>')
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "text/html" in data:
                parts.append(f'<div class="output">{"".join(data["text/html"])}</div>')
            elif "text/plain" in data or output.get("output_type") == "stream":
                text = "".join(data.get("text/plain", "")) or "".join(output.get("text", ""))
                parts.append(f'<pre class="output">{html.escape(text)}</pre>')
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>notebook</title></head><body>"
            + "\n".join(parts) + "</body></html>")
