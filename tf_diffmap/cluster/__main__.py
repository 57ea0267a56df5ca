"""`python -m tf_diffmap.cluster`: serve one task, or try a cluster locally."""

import sys

from tf_diffmap.cluster.cli import main

sys.exit(main())
