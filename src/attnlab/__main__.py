"""``python -m attnlab`` runs the command-line tool."""

from attnlab.lab.cli import main

if __name__ == "__main__":
    main()
