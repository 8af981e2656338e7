"""``python -m cxlkv ...``: the same as the ``cxlkv`` console script."""

from cxlkv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
