"""``python -m attnlab.lab.cli._cp_check``: the ``attnlab context-parallel`` check, for torchrun.

Run it as users run distributed jobs::

    torchrun --nproc-per-node 2 -m attnlab.lab.cli._cp_check --seq-len 4096
    python -m attnlab.lab.cli._cp_check --nproc 4        # starts 4 local gloo processes itself

It takes the options of ``attnlab context-parallel`` (``--help`` lists them).
"""

from __future__ import annotations

import sys

from attnlab.lab.cli import app


def main(argv: list[str] | None = None) -> None:
    """Run ``attnlab context-parallel`` with ``argv`` (default: the command line).

    Example (from a shell)::

        torchrun --nproc-per-node 4 -m attnlab.lab.cli._cp_check --method ring --dtype fp64
    """
    app(["context-parallel", *(sys.argv[1:] if argv is None else argv)], prog_name="attnlab.lab.cli._cp_check")


if __name__ == "__main__":
    main()
