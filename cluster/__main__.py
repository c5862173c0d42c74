"""`python -m kvmesh.cluster` is the `kvmesh` command."""

import sys

from kvmesh.cluster.cli import main

sys.exit(main())
