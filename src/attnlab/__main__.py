"""``python -m attnlab`` runs the command line, :func:`attnlab.lab.cli.main` (a shim: the lab lives in ``attnlab.lab``)."""

from attnlab.lab.cli import main

if __name__ == "__main__":
    main()
