"""`python -m graphgrow.cli`: the `graphgrow` command."""

from .commands import main

if __name__ == "__main__":
    main()
