"""`python -m mlafleet.patchset build ...`: the same as `mlafleet patchset build ...`."""

import sys

from mlafleet.patchset.builder import main

sys.exit(main())
