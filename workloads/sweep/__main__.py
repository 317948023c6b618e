"""`python -m workloads.sweep`: the sweep under torchrun (workloads.sweep.driver.main)."""

import sys

from workloads.sweep.driver import main

sys.exit(main())
