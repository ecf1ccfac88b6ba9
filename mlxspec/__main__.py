"""``python -m mlxspec``: the same as the ``mlxspec`` command."""

from .cli import main

if __name__ == "__main__":
    main()
