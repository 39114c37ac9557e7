"""`python -m imagerl ...`, e.g. under torchrun: `torchrun --nproc_per_node 8 -m imagerl train --recipe ...`."""

import sys

from imagerl.cli import main

sys.exit(main())
