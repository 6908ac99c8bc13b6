"""docs/linear.md: every python block runs, in order, in one namespace (their asserts check the
page's claims against attnlab.linear_attention and its fp64 recurrence); the README links the page."""

from __future__ import annotations

import pathlib
import re

import torch

ROOT = pathlib.Path(__file__).parents[1]


def test_every_python_block_of_the_page_runs():
    text = (ROOT / "docs" / "linear.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 6
    torch.manual_seed(0)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/linear.md, python block {i + 1}", "exec"), namespace)


def test_the_readme_links_the_page():
    assert "(docs/linear.md)" in (ROOT / "README.md").read_text()
