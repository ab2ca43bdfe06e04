"""``python -m moe_tune.launch``: the command's name; the launcher is ``moe_tune.cli.launch``."""

if __name__ == "__main__":
    import sys

    from moe_tune.cli.launch import main

    sys.exit(main())
