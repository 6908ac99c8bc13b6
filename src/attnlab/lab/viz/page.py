"""What every attnlab page and inline view is made of: inlined assets, escaping, colours, ids.

A page (the report written by ``attnlab explain``) and an inline view (a notebook output, from
``_repr_html_``) are built from the same parts: the CSS (``report.css``, every rule under
``.attnlab``), the scripts (``report.js``, ``headview.js``, ``modelview.js``) and the data as
JSON. Nothing is fetched from the network.

Several views can share one notebook page, so each view gets its own **prefix** for the ids it
holds (:func:`new_prefix`); the scripts find a view's elements through its root element's
``data-prefix`` and initialise each root once, so repeating a script is harmless. The report
uses the empty prefix: its ids are the plain names (``head-select``, ``hv-layer``).

Example:
    >>> view = fragment("<p>hi</p>", prefix="attnlab-x-", roles=("walk",))
    >>> view.startswith('<div class="attnlab inline" data-prefix="attnlab-x-" data-attnlab-walk')
    True
    >>> "http" in view
    False
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
import secrets
from importlib import resources
from pathlib import Path

from attnlab.lab.viz.picture import VIRIDIS as _VIRIDIS
from attnlab.lab.viz.picture import save_picture

__all__ = ["View", "SAVE_FORMATS", "asset", "escape", "visible", "to_json", "viridis", "format_value", "new_prefix", "fragment", "document"]

_SESSION = secrets.token_hex(3)  # views of two kernels pasted into one page still differ
_COUNTER = itertools.count()


def asset(name: str) -> str:
    """The text of one of ``attnlab.lab.viz``'s files (``report.css``, ``report.js``, ...).

    Example:
        >>> asset("report.css").count(".attnlab") > 10
        True
    """
    return resources.files("attnlab.lab.viz").joinpath(name).read_text(encoding="utf-8")


# Control characters have no glyph: a NUL in a page is a parse error (the browser drops it or shows
# U+FFFD) and the others are invisible, so a token made of one would vanish. Each is shown as its
# Unicode control picture (U+2400 + code, DEL as U+2421). Tab, newline and carriage return stay: they
# are whitespace, the text's own layout.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_PICTURES = {code: 0x2400 + code for code in (*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20))} | {0x7F: 0x2421}


def visible(text: str) -> str:
    """``text`` with each control character but tab, newline and carriage return as its control picture.

    Example:
        >>> visible("a\\x00b\\x1b"), visible("line\\nnext")
        ('a␀b␛', 'line\\nnext')
    """
    return text.translate(_PICTURES) if _CONTROL.search(text) else text


def escape(text) -> str:
    """``text`` as HTML text or an attribute value (quotes escaped, control characters :func:`visible`).

    Example:
        >>> escape('<b a="1">'), escape("\\x00")
        ('&lt;b a=&quot;1&quot;&gt;', '␀')
    """
    return html.escape(visible(str(text)), quote=True)


# Characters a <script> element's content must not hold raw: "<!--" then "<script" switches the
# HTML parser into a state where "</script>" no longer ends the element (the payload swallows the
# page); U+2028/2029 end a line in older JavaScript. JSON's \u escapes read back as the same text.
_SCRIPT_SAFE = {ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"}


def to_json(data) -> str:
    """``data`` as compact JSON that can sit inside a ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 are written as JSON ``\\u`` escapes, so no text (a
    token holding ``<!--`` and ``<script``, say) can end or hide the element; every string's
    control characters arrive as their pictures (:func:`visible`), as the page's HTML shows them.

    Example:
        >>> to_json({"a": "<!--<script></script>"})
        '{"a":"\\\\u003c!--\\\\u003cscript\\\\u003e\\\\u003c/script\\\\u003e"}'
        >>> json.loads(to_json(["a\\x00b"]))
        ['a␀b']
    """
    return json.dumps(_visible_strings(data), separators=(",", ":")).translate(_SCRIPT_SAFE)


def _visible_strings(data):
    """``data`` (JSON-ready) with :func:`visible` applied to every string, keys included."""
    if isinstance(data, str):
        return visible(data)
    if isinstance(data, dict):
        return {_visible_strings(key): _visible_strings(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_visible_strings(value) for value in data]
    return data


def viridis(t: float) -> str:
    """The viridis colour for ``t`` in [0, 1] (linear between 9 anchors), as ``#rrggbb``.

    Example:
        >>> viridis(0.0), viridis(1.0)
        ('#440154', '#fde725')
    """
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    mix = [round(int(a[k:k + 2], 16) * (1 - (t - i)) + int(b[k:k + 2], 16) * (t - i)) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def format_value(value: float | int | bool) -> str:
    """How every number is printed, in the terminal, the report and the views alike.

    Example:
        >>> [format_value(v) for v in (3, 0.31023, float("-inf"), True, False)]
        ['3', '0.3102', '-inf', '1', '0']
    """
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return f"{value:.4f}"


def new_prefix() -> str:
    """A prefix for one view's ids, different at every call (the same object shown twice too).

    Example:
        >>> a, b = new_prefix(), new_prefix()
        >>> a != b and a.startswith("attnlab-") and a.endswith("-")
        True
    """
    return f"attnlab-{_SESSION}{next(_COUNTER)}-"


def fragment(body: str, *, prefix: str, roles=(), scripts: str = "") -> str:
    """One inline view: a root ``<div class="attnlab inline">`` holding the CSS, ``body`` and ``scripts``.

    Args:
        body: the view's HTML, its ids starting with ``prefix``.
        prefix: from :func:`new_prefix`; the scripts read it from the root's ``data-prefix``.
        roles: which scripts own this root (``"walk"``, ``"heads"``, ``"model"``): each
            becomes a ``data-attnlab-<role>`` attribute the script looks for.
        scripts: the data and scripts, placed after the body so they run once it exists.

    Example:
        >>> fragment("<p>hi</p>", prefix="attnlab-a-", roles=("model",)).count("data-attnlab-model")
        1
    """
    marks = "".join(f" data-attnlab-{role}" for role in roles)
    return (f'<div class="attnlab inline" data-prefix="{escape(prefix)}"{marks}>'
            f"<style>{asset('report.css')}</style>{body}{scripts}</div>")


def document(title: str, body: str, *, roles=(), scripts: str = "") -> str:
    """A whole self-contained page: ``<body class="attnlab">`` is the root of its one view (empty prefix).

    Example:
        >>> page = document("t", "<p>hi</p>")
        >>> page.startswith("<!DOCTYPE html>"), '<body class="attnlab" data-prefix=""' in page
        (True, True)
    """
    marks = "".join(f" data-attnlab-{role}" for role in roles)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{escape(title)}</title><style>{asset('report.css')}</style></head>\n"
        f'<body class="attnlab" data-prefix=""{marks}>\n{body}\n{scripts}</body></html>\n'
    )


SAVE_FORMATS = (".html", ".htm", ".png", ".svg")  # what View.save writes, chosen by the path's extension


class View:
    """One rendered view: shown inline by a notebook, or saved as a page (HTML) or a picture (PNG, SVG).

    Args:
        render: returns the inline HTML (called at each display: every copy gets ids of its own).
        title: what the page is called when saved.
        picture: returns the :class:`~attnlab.lab.viz.picture.Picture` of what the page shows (its
            cells in the page's colours), drawn when the view is saved as PNG or SVG.

    Example:
        >>> import tempfile, torch
        >>> view = View(lambda: fragment("<p>hi</p>", prefix=new_prefix()), title="toy")
        >>> page = view.save(Path(tempfile.mkdtemp()) / "toy.html").read_text()
        >>> page.startswith("<!DOCTYPE html>"), page.count('data-prefix="attnlab-')
        (True, 1)
    """

    def __init__(self, render, *, title: str, picture=None):
        self._render = render
        self._picture = picture
        self.title = title

    def _repr_html_(self) -> str:
        return self._render()  # rendered at each display: every copy gets ids of its own

    def picture(self):
        """What the view draws as a PNG or SVG (:class:`~attnlab.lab.viz.picture.Picture`).

        Raises:
            ValueError: the view has no picture (it saves as HTML only).
        """
        if self._picture is None:
            raise ValueError(f"the view {self.title!r} has no picture: save it as .html or .htm")
        return self._picture()

    def save(self, path: str | Path) -> Path:
        """Write the view to ``path`` by its extension and return the path.

        ``.html``/``.htm``: the self-contained page (UTF-8, nothing fetched); ``.png``/``.svg``: a
        picture of what the page shows, drawn with matplotlib (:mod:`attnlab.lab.viz.picture`).

        Raises:
            ValueError: another extension (nothing is written), naming ``path``.
            FileNotFoundError: the folder ``path`` names does not exist.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in SAVE_FORMATS:
            raise ValueError(f"path must end in one of {', '.join(SAVE_FORMATS)} (the format is chosen by the "
                             f"extension), got {str(path)!r}")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"path {str(path)!r}: the folder {str(path.parent)!r} does not exist")
        if suffix in (".html", ".htm"):
            path.write_text(document(self.title, self._render()), encoding="utf-8")
            return path
        return save_picture(self.picture().with_text(visible), path)  # control characters as the page shows them

    def __repr__(self) -> str:
        return f"<attnlab view: {self.title}>"
