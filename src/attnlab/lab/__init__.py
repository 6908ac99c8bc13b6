"""The lab: attnlab's teaching, pictures, measurements and command line, above the library.

The library (``attnlab`` and its folders ``masks``, ``backends``, ``nn``, ``io``, ``models``,
``integrations``, ``distributed``) is what a model needs; the lab uses it to teach and to measure,
and the library never imports the lab (tests/test_layers.py checks both by path). Its parts:

* :mod:`attnlab.lab.tutorial` -- the tutorials' small modules, reproducing their printed numbers;
* :mod:`attnlab.lab.explain` -- one call explained: scores, weights, mask and output, step by step;
* :mod:`attnlab.lab.viz` -- heatmaps, head views, mask views and the HTML report;
* :mod:`attnlab.lab.train` -- a small GPT trained end to end (data, model, loop, checkpoints, report);
* :mod:`attnlab.lab.trained` and :mod:`attnlab.lab.lens` -- attention read from trained models;
* :mod:`attnlab.lab.verify` -- every backend checked against the fp64 reference;
* :mod:`attnlab.lab.zoo` -- the transformers model families run through attnlab;
* :mod:`attnlab.lab.bench` -- the benchmark suites and their reports;
* :mod:`attnlab.lab.cli` -- the ``attnlab`` command (``python -m attnlab`` runs it too).

``import attnlab`` loads none of it; ``attnlab.tutorial`` and ``attnlab.show`` are imported from
here on first use. This package imports nothing itself, so ``import attnlab.lab.cli`` loads only
what the command needs.

Example:
    >>> import attnlab.lab.tutorial as tutorial
    >>> import attnlab
    >>> attnlab.tutorial is tutorial
    True
"""
