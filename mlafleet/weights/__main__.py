"""`python -m mlafleet.weights weights ...`: the same as `mlafleet weights ...`."""

import sys

from mlafleet.weights.shards import main

sys.exit(main())
