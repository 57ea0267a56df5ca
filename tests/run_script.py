"""`python -m run_script PATH ARGS`: runs the script at PATH as `__main__`
with ARGS, as `python PATH ARGS` would (how `cluster_chief` runs a chief in
a process forked from a launcher)."""

import runpy
import sys

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")
