"""`python -m benchmarks [--quick] [--out DIR]`: see `benchmarks.suite`."""

from benchmarks.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
